"""``mg.parallelize``: parallelism applied to a built model, one named step at a time, on one mesh.

    model = LlamaForCausalLM(config)                       # any library, any constructor
    model = mg.parallelize(model, tp=2, tp_plan="hf", dp="replicate")

expands to a call of a generated function that runs, in torchtitan's order:

    mesh = device_mesh(tp=2, where=...)                    # one DeviceMesh, agreed by all ranks
    apply_tensor_parallel(model, mesh, plan, where=...)    # shards as DTensors, local forward
    apply_data_parallel(model, mesh, "replicate", where=...)

The model object keeps its class and identity (registries, ``isinstance`` and
``Config.build()`` see the user's classes), and nothing is deferred: the model
is built when it is handed over, so a parent's re-initialization has already
run and each rank cuts its shard of the serial weights.

Tensor-parallel parameters are DTensors (``DTensor.from_local``): whole-model
tools (``numel``, ``state_dict``, ``save_pretrained``, DCP, ``clip_grad_norm_``)
see the serial model. Every other parameter becomes a replicated DTensor too,
so that ``clip_grad_norm_``'s foreach norm gets one kind of tensor. The forward
computes on plain local tensors all the same: a forward pre-hook on the model
puts each parameter's local tensor (``to_local()``, one autograd node each) in
its place for the duration of the forward (pipelined: of each stage module's
forward; under FSDP: of each unit's), and each planned layer's ``forward`` (an
instance attribute: its class is untouched) runs the layer's math on the local
shard with the collective fused in, as ``@tensor_parallel``'s layers do. The
gradients land on the DTensor parameters with their placements.

    style                  layers                       weight shard              output
    colwise                nn.Linear, HF Conv1D         out features              sharded on the last dim
    ("colwise", k)         the same, k packed blocks    each block's out features sharded on the last dim
    colwise_gather_output  nn.Linear, HF Conv1D         out features              gathered (replicated)
    rowwise                nn.Linear, HF Conv1D         in features               all-reduced (bias once)
    vocab                  nn.Embedding                 rows (vocabulary)         all-reduced
    divide                 an int attribute             (divided by tp)
    replicate              anything                     (kept whole)

Subclasses count (``isinstance``: torchtitan's ``Linear``); HF ``Conv1D`` (an
``nn.Linear`` with its weight stored ``(in, out)``) is found by its ``nf``
attribute and its weight's shape. Every error of a plan is reported at once,
each naming its path.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from macrogen.runtime import groups
from macrogen.runtime.agreement import Fingerprint, check_agreement
from macrogen.runtime.class_plans import APPLIED
from macrogen.runtime.collectives import (
    colwise_linear,
    gather_last_dim,
    group_rank,
    group_size,
    rowwise_linear,
    scatter_last_dim,
)
from macrogen.runtime.eager import eager
from macrogen.runtime.mesh import SERIAL, Mesh, mesh
from macrogen.runtime.tensor_parallel import (
    split,
    vocab_lookup,
)
from macrogen.vocabulary import DP_MODES, HF_STYLES, STYLES


class PlanError(ValueError):
    """A plan that does not fit the model: every problem at once, one line each."""


@dataclass(frozen=True)
class Style:
    """One plan entry's style, parsed: ``kind`` of STYLES, ``blocks`` packed blocks."""

    kind: str
    blocks: int = 1

    @classmethod
    def parse(cls, value: Any, path: str) -> Style:
        if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == "colwise":
            blocks = value[1]
            if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
                raise PlanError(f"{path}: ('colwise', k) takes a positive int k, not {blocks!r}")
            return cls("colwise", blocks)
        if isinstance(value, str) and value in STYLES:
            return cls(value)
        raise PlanError(
            f"{path}: unknown style {value!r} (styles: {', '.join(STYLES)}, ('colwise', k) for k"
            " packed blocks)"
        )


def hf_plan(model: nn.Module) -> dict[str, Any]:
    """The plan a transformers model ships, in our style names (``tp_plan="hf"``).

    ``model._tp_plan`` holds the full plan of a built model (the base model's
    ``config.base_model_tp_plan`` under its prefix, and the head's own entries).
    """
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        config = getattr(model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        inner = getattr(model, prefix, None) if prefix else None
        lead = f"{prefix}." if isinstance(inner, nn.Module) and inner is not model else ""
        plan = {f"{lead}{k}": v for k, v in base.items()}
    if not plan:
        raise PlanError(
            f"tp_plan='hf': {type(model).__name__} ships no tensor-parallel plan (no _tp_plan,"
            " no config.base_model_tp_plan); write the plan: tp_plan={'path.to.layer': 'colwise', ...}"
        )
    out: dict[str, Any] = {}
    problems = []
    for path, style in plan.items():
        ours = HF_STYLES.get(style)
        if ours is None:
            problems.append(
                f"{path}: the model's plan uses HF style {style!r}, which mg.parallelize does not"
                f" support (supported: {', '.join(sorted(HF_STYLES))}); write the plan yourself"
            )
        else:
            out[path] = ours
    if problems:
        raise PlanError("\n".join(problems))
    return out


# -- the mesh --------------------------------------------------------------------------------


def device_mesh(*, tp: int = 1, pp: int = 1, planned: bool = False, where: str) -> Mesh:
    """The program's (pipeline x) data x tensor mesh, agreed by every rank before any group.

    A product of degrees that does not divide the world size is an error on every rank
    before any group is made; ``tp=1`` with a plan in a job of several ranks is a warning
    (the plan would leave every layer whole). ``pp > 1`` tells the mesh its pipeline dim
    first (``@mg.pipeline``'s order: pipeline outermost, tensor innermost).
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mg.parallelize at {where}: {name}={value!r}: expected an int >= 1")
    if not groups.ensure_initialized():
        return SERIAL
    world = dist.get_world_size()
    if world % (tp * pp):  # the same inputs on every rank: the same error, before any group
        what = f"tp={tp}" if pp == 1 else f"pp x tp = {pp} x {tp}"
        launch = "(data x tensor)" if pp == 1 else "(pipeline x data x tensor)"
        raise ValueError(
            f"mg.parallelize at {where}: {what} does not divide the world size {world}:"
            f" launch a multiple of {tp * pp} processes {launch}"
        )
    if planned and tp == 1 and world > 1:
        warnings.warn(
            f"mg.parallelize at {where}: a tensor-parallel plan with tp=1 in a job of {world}"
            " ranks leaves every layer whole; pass tp=N to shard it",
            stacklevel=3,
        )
    try:  # (pp=1 takes the program's mesh as it is)
        return mesh(tp, pipeline=pp if pp > 1 else None)
    except ValueError as e:
        raise ValueError(f"mg.parallelize at {where}: {e}") from None


# -- tensor parallel ---------------------------------------------------------------------------


def path_pattern(path: str) -> re.Pattern[str]:
    # "*" is one name segment (any child), as in torch's and HF's plans
    return re.compile(
        ".".join("[^.]+" if part == "*" else re.escape(part) for part in path.split("."))
    )


def _matches(model: nn.Module, path: str) -> Iterator[tuple[str, nn.Module | None, str]]:
    """(full name, owner, attribute) for every submodule or attribute ``path`` names."""
    pattern = path_pattern(path)
    owner_path, _, attr = path.rpartition(".")
    owner_pattern = path_pattern(owner_path) if owner_path else None
    for name, module in model.named_modules():
        if owner_pattern is None:
            if name == "":
                for key in [attr] if attr != "*" else list(module._modules):
                    if hasattr(module, key):
                        yield key, module, key
            continue
        if not owner_pattern.fullmatch(name):
            continue
        keys = list(module._modules) if attr == "*" else [attr]
        for key in keys:
            if hasattr(module, key):
                full = f"{name}.{key}"
                if pattern.fullmatch(full):
                    yield full, module, key


def _kind(layer: Any) -> str | None:
    """ "linear" (weight (out, in)), "conv1d" (HF's Conv1D: weight (in, out)), "embedding"."""
    if isinstance(layer, nn.Embedding):
        return "embedding"
    if isinstance(layer, nn.Linear):
        return "linear"
    weight = getattr(layer, "weight", None)
    nf = getattr(layer, "nf", None)
    if (
        isinstance(layer, nn.Module)
        and isinstance(nf, int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == nf
    ):
        return "conv1d"
    return None


@dataclass
class _Layer:
    name: str
    owner: nn.Module
    attr: str
    style: Style


def plan_layers(model: nn.Module, plan: Mapping[str, Any], tp: int) -> list[_Layer]:
    """Every planned layer and attribute, checked; all problems raised together (``PlanError``)."""
    problems: list[str] = []
    found: list[_Layer] = []
    seen: dict[int, str] = {}
    for path, value in plan.items():
        try:
            style = Style.parse(value, path)
        except PlanError as e:
            problems.append(str(e))
            continue
        hits = list(_matches(model, path))
        if not hits:
            problems.append(
                f"{path}: matches nothing in {type(model).__name__}{_near(model, path)}"
            )
            continue
        for name, owner, attr in hits:
            assert owner is not None
            target = getattr(owner, attr)
            problem = _check(name, target, style, tp)
            if problem:
                problems.append(problem)
                continue
            if isinstance(target, nn.Module):
                if id(target) in seen:
                    problems.append(f"{name}: already planned as {seen[id(target)]}")
                    continue
                seen[id(target)] = name
            found.append(_Layer(name, owner, attr, style))
    if problems:
        raise PlanError("\n".join(problems))
    return found


def _near(model: nn.Module, path: str) -> str:
    last = path.rsplit(".", 1)[-1]
    names = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == last][:3]
    return f" (modules named {last!r}: {', '.join(names)})" if names else ""


def _check(name: str, target: Any, style: Style, tp: int) -> str | None:
    kind = _kind(target)
    what = type(target).__name__
    if style.kind == "replicate":
        return None
    if style.kind == "divide":
        if not isinstance(target, int) or isinstance(target, bool):
            return f"{name}: divide needs an int attribute, not {what}"
        if target % tp:
            return f"{name} = {target} is not divisible by tp={tp}"
        return None
    if style.kind == "vocab":
        if kind != "embedding":
            return f"{name}: vocab needs an nn.Embedding (or a subclass), not {what}"
        if target.max_norm is not None or target.scale_grad_by_freq or target.sparse:
            return (
                f"{name}: vocab supports nn.Embedding without max_norm, scale_grad_by_freq, sparse"
            )
        rows = target.num_embeddings
        return f"{name}: {rows} rows are not divisible by tp={tp}" if rows % tp else None
    if kind not in ("linear", "conv1d"):
        return (
            f"{name}: {style.kind} needs an nn.Linear (or a subclass) or an HF Conv1D, not {what}"
            " (vocab: nn.Embedding; divide: an int attribute)"
        )
    weight = target.weight
    out_features, in_features = weight.shape if kind == "linear" else weight.shape[::-1]
    if style.kind == "rowwise":
        return (
            f"{name}: {in_features} in features are not divisible by tp={tp}"
            if in_features % tp
            else None
        )
    if style.blocks > 1 and style.kind == "colwise_gather_output":
        return f"{name}: colwise_gather_output takes no packed blocks"
    if out_features % (tp * style.blocks):
        blocks = f" in {style.blocks} blocks" if style.blocks > 1 else ""
        return f"{name}: {out_features} out features{blocks} are not divisible by tp={tp}"
    return None


def apply_tensor_parallel(
    model: nn.Module, mesh: Mesh, plan: Mapping[str, Any], *, where: str
) -> nn.Module:
    """Shard ``model``'s planned layers over the mesh's tensor dim (in place; returns ``model``)."""
    tp = mesh.tensor_size
    layers = plan_layers(model, plan, tp)  # the checks run serially too: a plan that can't fit
    _check_ranks(model, layers, mesh, where)
    if tp == 1:
        return model
    if getattr(model, _LOCAL_FORWARD, False):
        raise RuntimeError(f"mg.parallelize at {where}: this model is tensor-parallel already")
    cut = next((n for n, m in model.named_modules() if APPLIED in m.__dict__
                and "tp_size" in m.__dict__ and m.__dict__["tp_size"] > 1), None)  # fmt: skip
    if cut is not None:  # its layers are @tensor_parallel shards already (plain tensors)
        raise RuntimeError(
            f"mg.parallelize at {where}: {cut or type(model).__name__} is a @tensor_parallel class"
            " whose shards were cut when it was built: give the tensor-parallel plan in one place"
            " (the decorators, or tp_plan= on a model of undecorated classes)"
        )
    group, tensor_mesh = mesh.tensor_group, mesh.device_mesh["tensor"]
    assert group is not None  # tp > 1
    holders = _holders(model)
    for layer in layers:
        _shard(layer, group, tensor_mesh, holders)
    _replicate_the_rest(model, tensor_mesh)
    model.__dict__[_SCOPE] = list(model.modules())
    model.__dict__[_HOOKS] = (
        model.register_forward_pre_hook(_to_local),
        model.register_forward_hook(_restore, always_call=True),
    )
    object.__setattr__(model, _LOCAL_FORWARD, True)
    colwise = [(layer.name, getattr(layer.owner, layer.attr)) for layer in layers
               if layer.style.kind == "colwise"]  # fmt: skip
    if colwise:
        model.__dict__[_COLWISE] = colwise  # (a pipeline's last stage checks its output too)
        model.register_forward_hook(functools.partial(_no_sharded_outputs, colwise, where))
    _tell_transformers(model, tp)
    return model


def _no_sharded_outputs(
    colwise: list[tuple[str, nn.Module]], where: str, model: nn.Module, args: Any, output: Any
) -> None:
    """A colwise layer's output returned by the model is this rank's slice of the features (an
    LM head's logits: a slice of the vocabulary, so a loss or a sampler would silently differ
    from serial): an error naming the layer. Plan such a layer colwise_gather_output."""
    from torch.utils._pytree import tree_leaves

    if torch.compiler.is_compiling():
        return
    returned = {id(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
    for name, layer in colwise:
        ref = layer.__dict__.get(_LAST_OUTPUT)
        out = ref() if ref is not None else None
        if out is not None and id(out) in returned:
            raise PlanError(
                f"mg.parallelize at {where}: {name} is colwise, and the model returns its output,"
                " which holds this rank's slice of the features only: plan it"
                f" {{{name!r}: 'colwise_gather_output'}} (HF's colwise_gather_output) to return"
                " them whole"
            )


def check_outputs(model: nn.Module, module: nn.Module, *, where: str) -> None:
    """``module`` (a pipeline's last stage) must not send on a colwise layer's sharded output."""
    colwise = model.__dict__.get(_COLWISE)
    if colwise:
        module.register_forward_hook(functools.partial(_no_sharded_outputs, colwise, where))


def _tell_transformers(model: nn.Module, tp: int) -> None:
    """A transformers model's ``save_pretrained`` gathers DTensor shards into the serial weights
    when its config says it is tensor-parallel (called on every rank, as for HF's own TP)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained"):
        return
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:  # transformers < 5 has no such config: save with state_dict=
        return
    if getattr(config, "distributed_config", None) is None:
        config.distributed_config = DistributedConfig(tp_size=tp)


def _check_ranks(model: nn.Module, layers: list[_Layer], mesh: Mesh, where: str) -> None:
    """Every rank must plan the same: the plan, the serial shapes, and divided attributes' serial
    values (``n_head`` 8 on one rank and 4 on another gives equal shapes, different attention)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = tuple(f"{n} {tuple(p.shape)} {p.dtype}" for n, p in model.named_parameters())
    planned = tuple(
        f"{layer.name}: {layer.style}"
        + (f" = {getattr(layer.owner, layer.attr)}" if layer.style.kind == "divide" else "")
        for layer in layers
    )
    check_agreement(
        Fingerprint(params + planned, f"tp={mesh.tensor_size}"), group=None, where=where
    )


def _dtensor_parameter(
    full: nn.Parameter, dim: int | None, group: dist.ProcessGroup, tensor_mesh: Any, blocks: int = 1
) -> nn.Parameter:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placement: Any = Replicate()
    if dim is None:
        local = full.detach()
    else:
        local = split(full.detach(), dim, group, blocks)
        placement = Shard(dim) if blocks == 1 else _StridedShard(dim, split_factor=blocks)
    if local.device.type != tensor_mesh.device_type:
        raise RuntimeError(
            f"the model's parameters are on {local.device.type} and the mesh on"
            f" {tensor_mesh.device_type}: move the model to its device (model.to(run.device))"
            " before mg.parallelize"
        )
    dt = DTensor.from_local(
        local, tensor_mesh, [placement], run_check=False, shape=full.shape, stride=full.stride()
    )
    return nn.Parameter(dt, requires_grad=full.requires_grad)


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, name) holding it (a tied weight has several)."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in model.modules():
        for key, p in owner._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((owner, key))
    return found


def _shard(
    layer: _Layer, group: dist.ProcessGroup, tensor_mesh: Any, holders: dict[int, Any]
) -> None:
    owner, attr, style = layer.owner, layer.attr, layer.style
    if style.kind == "divide":
        object.__setattr__(owner, attr, getattr(owner, attr) // group_size(group))
        return
    if style.kind == "replicate":
        return
    module = getattr(owner, attr)
    kind = _kind(module)
    # the weight's out-features dim: 0 for nn.Linear (out, in) and nn.Embedding (rows), 1 for Conv1D
    out_dim = 1 if kind == "conv1d" else 0
    cut = functools.partial(_cut, layer.name, group, tensor_mesh, holders)
    if style.kind in ("colwise", "colwise_gather_output", "vocab"):
        cut(module, "weight", out_dim, style.blocks)
        if getattr(module, "bias", None) is not None:
            cut(module, "bias", 0, style.blocks)
    else:  # rowwise: the weight's in-features dim; the bias is added once, after the reduction
        cut(module, "weight", 1 - out_dim, 1)
    forward = {
        "colwise": _colwise_forward,
        "colwise_gather_output": _colwise_gather_forward,
        "rowwise": _rowwise_forward,
        "vocab": _vocab_forward,
    }[style.kind]
    module.__dict__["forward"] = weakly_bound(forward, module, group, kind)


def weakly_bound(fn: Any, module: nn.Module, *args: Any) -> Any:
    """``fn(module, *args, ...)`` for ``module`` to hold (its own forward). It reaches the module
    weakly: a strong reference is a cycle, which keeps a layer that a pipeline cut dropped
    (another stage's, with its shards) alive until a gc pass."""
    ref = weakref.ref(module)

    def forward(*more: Any, **kwargs: Any) -> Any:
        me = ref()
        assert me is not None, "a module's forward outlived its module"
        return fn(me, *args, *more, **kwargs)

    return forward


def _cut(
    name: str,
    group: dist.ProcessGroup,
    tensor_mesh: Any,
    holders: dict[int, Any],
    module: nn.Module,
    key: str,
    dim: int,
    blocks: int,
) -> None:
    """``module.key`` becomes this rank's shard, as a DTensor parameter, in every module holding it."""
    from torch.distributed.tensor import DTensor

    full = module._parameters[key]
    assert full is not None
    if isinstance(full, DTensor):  # tied to a layer cut already: it must be the same cut
        placement = full.placements[0]
        if (
            getattr(placement, "dim", None) != dim
            or getattr(placement, "split_factor", 1) != blocks
        ):
            raise PlanError(
                f"{name}.{key} is tied to a parameter the plan cuts as {placement}, and this entry"
                f" cuts it along dim {dim}: plan both with the same split (a vocab embedding and a"
                " colwise head share rows) or untie them"
            )
        return
    param = _dtensor_parameter(full, dim, group, tensor_mesh, blocks)
    for owner, held in holders.get(id(full), [(module, key)]):
        owner._parameters[held] = param


def _replicate_the_rest(model: nn.Module, tensor_mesh: Any) -> None:
    """Every parameter not sharded becomes a replicated DTensor (one kind for whole-model tools)."""
    from torch.distributed.tensor import DTensor

    made: dict[int, nn.Parameter] = {}
    for owner in model.modules():
        for key, p in list(owner._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in made:
                made[id(p)] = _dtensor_parameter(p, None, None, tensor_mesh)  # type: ignore[arg-type]
            owner._parameters[key] = made[id(p)]


_LOCAL_FORWARD = "_mg_local_forward"  # the model runs its forward on local tensors
_SWAPPED = "_mg_swapped_parameters"  # (owner, name, DTensor parameter) while a forward runs
_HOOKS = "_mg_local_hooks"  # the model's swap hooks (FSDP moves the swap into each unit)
_SCOPE = "_mg_local_scope"  # the modules a swap covers (found once, not per forward)
_COLWISE = "_mg_colwise_layers"  # (name, layer) of each colwise layer: its output is a slice


def is_tensor_parallel(model: nn.Module) -> bool:
    """``apply_tensor_parallel`` sharded ``model`` (its forward runs on local shards)."""
    return bool(getattr(model, _LOCAL_FORWARD, False))


def local_forward_per_unit(
    model: nn.Module,
    units: list[nn.Module],
    owners: Mapping[nn.Module, list[nn.Module]] | None = None,
) -> None:
    """Under FSDP, each unit's parameters are gathered (as tensor-parallel DTensors) only while
    the unit runs: swap them to local tensors there, after FSDP's gathering pre-hook (prepended)
    and back before its resharding post-hook (appended), instead of once for the whole model.

    A pipeline's schedule runs its stages' modules, never the model's forward: each stage is a
    unit, and ``owners`` adds the modules holding its bare parameters (their own tables only)."""
    for handle in model.__dict__.pop(_HOOKS, ()):
        handle.remove()
    # the model's own lists of every module it had (the swap's scope, the colwise layers): a
    # pipeline cut dropped some, and the lists would keep them (another stage's shards) alive
    model.__dict__.pop(_SCOPE, None)
    if _COLWISE in model.__dict__:  # in place: the output checks' hooks hold this list
        kept = {id(m) for m in model.modules()}
        colwise = model.__dict__[_COLWISE]
        colwise[:] = [(n, m) for n, m in colwise if id(m) in kept]
    boundaries = {id(u) for u in units}

    def scope(unit: nn.Module) -> list[nn.Module]:
        found, stack = [], [unit]
        while stack:
            module = stack.pop()
            found.append(module)
            stack += [c for c in module.children() if id(c) not in boundaries]
        return found

    for unit in units:
        for handle in unit.__dict__.pop(_HOOKS, ()):  # a unit's swap, set again (FSDP after pp)
            handle.remove()
        unit.__dict__[_SCOPE] = scope(unit) + list((owners or {}).get(unit, ()))
        unit.__dict__[_HOOKS] = (
            unit.register_forward_pre_hook(_to_local),
            unit.register_forward_hook(_restore, prepend=True, always_call=True),
        )


class _ToLocal(torch.autograd.Function):
    """Every DTensor parameter's local tensor in one autograd node (``to_local()`` is one node,
    and one DTensor built in backward, per parameter); backward wraps each gradient in its
    parameter's placements, which is what ``to_local()``'s backward gives."""

    @staticmethod
    def forward(ctx: Any, *params: Any) -> tuple[torch.Tensor, ...]:
        ctx.specs = [p._spec for p in params]
        return tuple(p._local_tensor.view_as(p._local_tensor) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor

        return tuple(
            None if g is None else DTensor(g, spec, requires_grad=False)
            for g, spec in zip(grads, ctx.specs)
        )


@eager  # swaps entries of the modules' parameter tables: eager, outside a graph
def _to_local(model: nn.Module, args: Any) -> None:
    from torch.distributed.tensor import DTensor

    _restore(model)  # a forward that raised may have left local tensors in place
    slots: list[tuple[nn.Module, str, Any]] = []
    index: dict[int, int] = {}  # a parameter under two names (tied) gets one local tensor
    params: list[Any] = []
    for owner in model.__dict__[_SCOPE]:
        for key, p in owner._parameters.items():
            if isinstance(p, DTensor):
                if id(p) not in index:
                    index[id(p)] = len(params)
                    params.append(p)
                slots.append((owner, key, p))
    if not params:
        return
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    if grad:
        local = _ToLocal.apply(*params)  # type: ignore[no-untyped-call]
    else:
        local = [p._local_tensor for p in params]
    for owner, key, p in slots:
        owner._parameters[key] = local[index[id(p)]]
    model.__dict__[_SWAPPED] = slots


@eager
def _restore(model: nn.Module, *_: Any) -> None:
    for owner, key, p in model.__dict__.pop(_SWAPPED, ()):
        owner._parameters[key] = p


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """``module``'s tensor-parallel parameters as local tensors while it runs on its own,
    outside its model's forward: a block's forward recomputed in backward. Inside the
    model's forward they are local already, and nothing changes."""
    if _SCOPE not in module.__dict__:
        module.__dict__[_SCOPE] = list(module.modules())
    _to_local(module, ())
    try:
        yield
    finally:
        _restore(module)


def _local(t: Any) -> torch.Tensor | None:
    """A planned layer called outside its model's forward still holds DTensors."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _weight(module: nn.Module, kind: str | None) -> torch.Tensor:
    w = _local(module.weight)
    assert w is not None
    return w.t() if kind == "conv1d" else w  # F.linear's (out, in)


_LAST_OUTPUT = "_mg_last_output"  # a colwise layer's last output (weakly): may the model return it?


def _colwise_forward(
    module: nn.Module, group: dist.ProcessGroup, kind: str | None, x: torch.Tensor
) -> torch.Tensor:
    out = colwise_linear(x, _weight(module, kind), _local(module.bias), group)
    if not torch.compiler.is_compiling():  # (an eager run checks it: no weakref of a traced value)
        module.__dict__[_LAST_OUTPUT] = weakref.ref(out)
    return out


def _colwise_gather_forward(
    module: nn.Module, group: dist.ProcessGroup, kind: str | None, x: torch.Tensor
) -> torch.Tensor:
    local = colwise_linear(x, _weight(module, kind), _local(module.bias), group)
    return gather_last_dim(local, group)


def _rowwise_forward(
    module: nn.Module, group: dist.ProcessGroup, kind: str | None, x: torch.Tensor
) -> torch.Tensor:
    w = _weight(module, kind)
    if x.shape[-1] != w.shape[1]:  # a full input: keep my slice
        x = scatter_last_dim(x, group)
    return rowwise_linear(x, w, group, bias=_local(module.bias))


def _vocab_forward(
    module: nn.Module, group: dist.ProcessGroup, kind: str | None, ids: torch.Tensor
) -> torch.Tensor:
    weight = _local(module.weight)
    assert weight is not None and isinstance(module, nn.Embedding)
    start = group_rank(group) * weight.shape[0]
    return vocab_lookup(ids, weight, start, module.padding_idx, group)


# -- data parallel -------------------------------------------------------------------------------


def apply_data_parallel(
    model: nn.Module, mesh: Mesh, mode: str, *, where: str, config: Any = None
) -> nn.Module:
    """Average ``model``'s gradients over the mesh's data dim (``replicate``), or leave the
    optimizer to (``zero1``: ``mg.shard_optimizer`` then reduce-scatters them)."""
    from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync

    if mode not in DP_MODES or mode == "fsdp":  # fsdp: macrogen.runtime.fully_sharded
        modes = tuple(m for m in DP_MODES if m != "fsdp")
        raise ValueError(f"mg.parallelize at {where}: dp={mode!r}: expected one of {modes}")
    if mode == "none":
        return model
    if mode == "zero1" and mesh.tensor_size > 1:
        raise ValueError(
            f"mg.parallelize at {where}: dp='zero1' with tp={mesh.tensor_size} is not supported yet"
            " (the sharded optimizer steps plain tensors, not DTensor shards): use dp='replicate'"
        )
    sync = GradientSync(model, config or DataParallelConfig(), where=where)
    model.__dict__["_mg_gradient_sync"] = sync
    return model
