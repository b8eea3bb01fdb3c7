"""What a ``resumable`` checkpoint holds for each of macrogen's parallel kinds.

The model and optimizers go to DCP as ``get_state_dict`` gives them (keys: the
serial parameter names), the optimizer state flattened per parameter (below), with two
changes, because DCP takes plain tensors that have the same key on every rank for
copies of one tensor and stores one of them:

- Tensor-parallel parameters (``mg.parallelize``'s and ``@tensor_parallel``'s) are
  DTensors, and DCP
  saves and reshards them as they are (FSDP's too), with one exception: a packed
  colwise layer (``("colwise", k)``) is a ``_StridedShard`` DTensor, whose pieces
  DCP's planner takes for contiguous chunks (it reports them overlapping). Such a
  tensor (and its optimizer state) is gathered to the serial tensor for the save
  (``full_tensor()``, stored once) and redistributed to its placements on load.
  Under FSDP x TP (a (data, tensor) mesh) FSDP shards each TP-local tensor along
  dim 0, and a colwise layer's placements become strided on the data dim too
  (packed: two nested strided shards, which torch's ``full_tensor`` and
  ``redistribute`` get wrong, rows permuted): those are gathered and split one
  mesh dim at a time, FSDP's dim by hand.
- A ZeRO ``ShardedOptimizer`` keeps no state in ``optimizer.state``, so
  ``get_state_dict`` would see an empty optimizer (and step it with lr 0 to
  "initialize" it). Its ``state_dict()`` is the serial optimizer's (consolidated
  on every rank), which is saved under the parameter names, exactly as
  ``get_state_dict`` saves the serial optimizer: the two load each other's.

Local SGD's outer optimizer (``@data_parallel(outer=..., overlap=...)``) keeps its
state outside ``optimizer.state``: it rides along in the optimizer state under
``_mg_local_sgd`` (``LocalSGD.state_dict``), so a checkpoint of such a model is
resumed by such a model.

The optimizer state is stored flattened per parameter, the layout torch's
``StateDictOptions(flatten_optimizer_state_dict=True)`` gives (torch's way for MPMD
resharding, torchtitan's for pipeline stages): ``state.{name}.{key}`` and
``param_groups.{name}.{setting}``, every name the serial model's. A rank of a pipelined
model (``@pipeline``, ``mg.parallelize(pp=N)``) holds its stage's parameters only, under
their serial names, so each stage saves its own entries and the checkpoint holds the
union, which loads into any stage count, and serially. A weight tied across stages (a
tied embedding and head) is the same tensor on each stage that holds it: its optimizer
state goes under the serial model's first name for it on every stage, so DCP stores it
once. Checkpoints in the older layout (the optimizers' ``param_groups`` as a list) are
read as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from macrogen.runtime.data_parallel import outer_states
from macrogen.runtime.dtensor_whole import full_tensor, restride
from macrogen.runtime.zero import ShardedOptimizer

Optimizers = Sequence[torch.optim.Optimizer]
# (container, key, shard dim, packed blocks, group): an entry handed to DCP in serial form;
# blocks 0: a strided DTensor, and the last item is the DTensor it is loaded back into
Globalized = list[tuple[dict[str, Any], str, int, int, Any]]


# the key an older checkpoint (optimizer state not flattened) has and a flattened one can't
NESTED_KEY = "optim.param_groups.0.params"


class UnsupportedModel(RuntimeError):
    """A model whose state a checkpoint can't hold correctly (refused, never saved partially)."""


@dataclass
class Loading:
    """What ``set_state`` needs, beyond what DCP read, to put a load's values in place."""

    globalized: Globalized  # entries handed to DCP in serial form (of ``nested``, ``model``)
    # the optimizers' state as get_optimizer_state_dict keys it (this rank's names), which
    # the flattened entries DCP filled are put back into
    nested: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # this rank's name -> serial name


def get_state(
    model: nn.Module, optimizers: Optimizers, *, load: bool, flat: bool = True
) -> tuple[dict[str, Any], dict[str, Any], Loading]:
    """The model's and optimizers' state as DCP should see it, and what ``set_state`` needs.

    ``load``: the state is a buffer to load into (nothing is gathered, and a ZeRO
    optimizer without state is given some, so that its keys are there to load).
    ``flat``: the optimizer state flattened per parameter (False: as a checkpoint in the
    older layout holds it, to load one).
    """
    model_sd = get_model_state_dict(model)
    optim_sd: dict[str, Any] = {"state": {}, "param_groups": []}
    for opt in optimizers:
        if isinstance(opt, ShardedOptimizer):
            osd = _zero_state(model, opt, load)
        else:
            osd = get_optimizer_state_dict(model, opt)
        optim_sd["state"].update(osd["state"])
        optim_sd["param_groups"].extend(osd["param_groups"])
    loading = Loading(_unstride(model_sd, optim_sd, load), optim_sd, serial_names(model))
    if flat:
        optim_sd = _flatten(optim_sd, loading.aliases)
    for i, local in enumerate(outer_states(model)):
        optim_sd[f"_mg_local_sgd.{i}"] = local.state_dict(load=load)
    return model_sd, optim_sd, loading


def set_state(
    model: nn.Module,
    optimizers: Optimizers,
    model_sd: dict[str, Any],
    loaded: dict[str, Any],
    loading: Loading,
) -> None:
    """Load what DCP read (``loaded``: the optimizer state as DCP filled it) into the model's
    shards and the optimizers."""
    optim_sd = loading.nested
    if loaded is not optim_sd:  # flattened: the values DCP read put back in their places
        _unflatten(loaded, optim_sd, loading.aliases)
    for box, key, _, _, template in loading.globalized:  # strided DTensors, loaded whole
        box[key] = restride(box[key], template)
    for i, local in enumerate(outer_states(model)):
        outer = loaded.pop(f"_mg_local_sgd.{i}", None)  # (None: saved without an optimizer)
        if outer is not None:
            local.load_state_dict(outer)
    set_model_state_dict(model, model_sd)
    plain = [o for o in optimizers if not isinstance(o, ShardedOptimizer)]
    if plain:
        set_optimizer_state_dict(model, plain, optim_sd)
    for opt in optimizers:
        if isinstance(opt, ShardedOptimizer):
            opt.load_state_dict(_zero_from(model, opt, optim_sd))


# ---- the optimizer state flattened per parameter, under serial names -----------------------


def serial_names(model: nn.Module) -> dict[str, str]:
    """This rank's name for each parameter that the serial model knows by another first name
    (a pipeline stage that holds a tied weight under its second name); empty for a whole model."""
    from macrogen.runtime.pipeline import pipeline_of

    pipe = pipeline_of(model)
    return {} if pipe is None or pipe.layout is None else pipe.aliases


def _flatten(nested: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``{"state.{name}.{key}": value, "param_groups.{name}.{setting}": value}`` (torch's
    flattened layout), each name the serial one."""
    flat: dict[str, Any] = {}
    for name, entry in nested["state"].items():
        for key, value in entry.items():
            flat[f"state.{aliases.get(name, name)}.{key}"] = value
    for group in nested["param_groups"]:
        for name in group["params"]:
            for setting, value in group.items():
                if setting != "params":
                    flat[f"param_groups.{aliases.get(name, name)}.{setting}"] = value
    return flat


def _unflatten(flat: dict[str, Any], nested: dict[str, Any], aliases: dict[str, str]) -> None:
    """Put the flattened values DCP read back into ``nested`` (the state they were made from:
    its tensors DCP filled in place). A parameter group's setting is its first parameter's;
    the others' must agree (a group split differently when saved is refused)."""
    for name, entry in nested["state"].items():
        for key in entry:
            entry[key] = flat[f"state.{aliases.get(name, name)}.{key}"]
    for group in nested["param_groups"]:
        names = [aliases.get(name, name) for name in group["params"]]
        for setting in group:
            if setting == "params" or not names:
                continue
            values = [flat[f"param_groups.{name}.{setting}"] for name in names]
            differs = next((n for n, v in zip(names, values) if not _same(v, values[0])), None)
            if differs is not None:
                raise UnsupportedModel(
                    f"resumable(): the checkpoint has {setting}={values[0]!r} for {names[0]}"
                    f" and {setting}={values[names.index(differs)]!r} for {differs}, which"
                    " this run's optimizer holds in one parameter group"
                )
            group[setting] = values[0]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


# ---- mg.parallelize's packed colwise layers (_StridedShard DTensors) ----------------------


def _strided(t: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def _unstride(model_sd: dict[str, Any], optim_sd: dict[str, Any], load: bool) -> Globalized:
    """Every strided DTensor, as the serial tensor (saved once; DCP can't plan its pieces)."""
    boxes: list[tuple[dict[str, Any], str]] = [(model_sd, k) for k in model_sd]
    for name, entry in list(optim_sd["state"].items()):
        if any(_strided(v) for v in entry.values()):
            # a copy (the optimizer's own dict), made only here: an entry _globalize copied and
            # recorded must stay the one DCP fills
            entry = optim_sd["state"][name] = dict(entry)
            boxes += [(entry, k) for k in entry]
    done: Globalized = []
    for box, key in boxes:
        value = box[key]
        if not _strided(value):
            continue
        whole = (
            torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)
            if load
            else full_tensor(value)
        )
        box[key] = whole
        done.append((box, key, -1, 0, value))
    return done


# ---- ZeRO (shard_optimizer) ----------------------------------------------------------------


def _names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters' names, in its order (a tied parameter: its first name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    try:
        return [names[id(p)] for g in opt.param_groups for p in g["params"]]
    except KeyError:
        raise UnsupportedModel(
            "resumable(): a shard_optimizer optimizer holds a parameter that is not the model's"
        ) from None


def _zero_state(model: nn.Module, opt: ShardedOptimizer, load: bool) -> dict[str, Any]:
    """The serial optimizer's state_dict, keyed by parameter name as get_state_dict keys it."""
    osd = opt.state_dict()
    if load and not osd["state"]:  # no state yet: make its entries, to be overwritten
        _zero_lr_step(opt)
        osd = opt.state_dict()
    names = _names(model, opt)
    return {
        "state": {names[i]: s for i, s in osd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]
        ],
    }


def _zero_lr_step(opt: torch.optim.Optimizer) -> None:
    """A step with zero gradients and lr 0: the state entries exist, the parameters don't move
    (what get_state_dict does to an optimizer without state)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def _zero_from(model: nn.Module, opt: ShardedOptimizer, optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The serial optimizer's state_dict for ``opt``, out of the loaded one keyed by name."""
    names = _names(model, opt)
    index = {n: i for i, n in enumerate(names)}
    state = {index[n]: s for n, s in optim_sd["state"].items() if n in index}
    param_groups = []
    at = 0
    for g in opt.param_groups:
        want = names[at : at + len(g["params"])]
        found = next((s for s in optim_sd["param_groups"] if list(s["params"]) == want), None)
        if found is None:
            raise UnsupportedModel(
                f"resumable(): the checkpoint has no optimizer parameter group of {want}"
            )
        param_groups.append({**found, "params": list(range(at, at + len(want)))})
        at += len(want)
    return {"state": state, "param_groups": param_groups}
