"""A model built on the meta device, given storage for this rank's shards and values.

    with torch.device("meta"):
        model = LlamaForCausalLM(config)                  # no storage, no values
    model = mg.parallelize(model, tp=2, dp="fsdp", init=mg.load(folder))   # or init="model"

``mg.parallelize``'s generated function cuts the meta model as it would a built one (tensor
parallel, then FSDP), then ``apply_init``: ``to_empty`` on the rank's device (CPU under gloo,
``cuda:LOCAL_RANK`` under NCCL: ``groups.placement``), so each rank allocates its shards only,
and the values come from

- ``init=mg.load(path)``: a checkpoint folder, each rank reading its slices (``runtime.load``);
- ``init="model"``: the model's own initializer, one module at a time: transformers'
  ``_init_weights`` (in ``initialize_weights``' order) or each module's ``reset_parameters()``.
  Each module's parameters are made whole for its initializer (one module at a time: the
  largest layer is the most a rank holds beyond its shards), drawn from the global generator
  as the serial program draws them, and this rank keeps its shard: the values are exactly the
  serial program's (the unexpanded file, whose ``mg.parallelize`` runs the same initializer on
  the whole model), for every layout.

Buffers the meta build left without values (a rotary embedding's ``inv_freq``) are computed
by their module's initializer in both cases; a checkpoint's saved buffers are then read.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from macrogen.runtime import groups
from macrogen.runtime.load import Load, kind, load_into

MODEL = "model"  # init="model": the model's own initializer
PENDING = "_mg_pending_init"  # on a meta model mg.parallelize took: the init it will run
LOADED = "_mg_loaded"  # on a model init=mg.load(path) filled: bytes read of each key, this rank


class MetaModelError(ValueError):
    """A model built on the meta device handed to ``mg.parallelize`` without ``init=``."""


def meta_parameters(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.is_meta]


def check_init(model: nn.Module, init: object, *, where: str) -> None:
    """The first step: a meta model needs ``init=``; ``init="model"`` needs a meta model."""
    if init is not None and init != MODEL and not isinstance(init, Load):
        raise ValueError(
            f'mg.parallelize at {where}: init={init!r}: expected mg.load(path) or "model"'
        )
    if isinstance(init, Load):
        kind(init.path)  # the folder's problem now, before any group or cut
    meta = meta_parameters(model)
    if meta and init is None:
        raise MetaModelError(
            f"mg.parallelize at {where}: {len(meta)} parameters are on the meta device"
            f" ({meta[0]}, ...): pass init=mg.load(path) (a save_pretrained or DCP folder) or"
            " init=\"model\" (the model's own initializer) to give each rank's shards values,"
            " or materialize it whole first (model.to_empty(device=...) and its own init)"
        )
    if init == MODEL and not meta:
        raise ValueError(
            f'mg.parallelize at {where}: init="model" initializes a model built on the meta'
            " device, and this one has its values already: drop init= (each rank cuts its"
            " shards of them), or build it under torch.device('meta')"
        )
    if meta:
        model.__dict__[PENDING] = init


def apply_init(model: nn.Module, init: Any, *, where: str) -> nn.Module:
    """Storage for this rank's shards on its device, and their values (see the module doc)."""
    if init is None:
        return model
    if not meta_parameters(model):  # built with values: mg.load reads over them
        model.__dict__[LOADED] = load_into(model, init, where)
        return model
    device = torch.device(groups.placement().device)
    empty = {id(m) for m in model.modules() if any(b.is_meta for b in m.buffers(recurse=False))}
    marks = _marks(model)
    _to_empty(model, device)
    for (owner, key), attributes in marks:  # (swapped contents lose the steps' marks)
        for name, value in attributes.items():
            setattr(owner._parameters[key], name, value)
    model.__dict__.pop(PENDING, None)
    with _init_context(model):
        if init == MODEL:
            with _other_stages(model):  # a pipeline's: drawn as the serial model draws, dropped
                for module, fn in _initializer(model, where):
                    _whole_for(module, fn, device)
        else:
            for module, fn in _initializer(model, where):
                if id(module) in empty:
                    _whole_for(module, fn, device)
            with _other_stages(model):  # for their names: a weight tied to another stage's part
                model.__dict__[LOADED] = load_into(model, init, where)  # saved under its name
    return model


def serial(model: nn.Module, init: Any) -> nn.Module:
    """The unexpanded ``mg.parallelize(model, init=...)``: the serial program's values, on this
    process's device (the reference a parallel run is compared with)."""
    if init is None:
        return model
    check_init(model, init, where="mg.parallelize")
    return apply_init(model, init, where="mg.parallelize")


def _marks(model: nn.Module) -> list[tuple[tuple[nn.Module, str], dict[str, Any]]]:
    """macrogen's attributes on parameters (``_mg_...``: expert parallelism's): ``_to_empty``
    swaps each parameter's contents, its ``__dict__`` too."""
    found = []
    for owner in model.modules():
        for key, p in owner._parameters.items():
            attributes = (
                {k: v for k, v in vars(p).items() if k.startswith("_mg_")} if p is not None else {}
            )
            if attributes:
                found.append(((owner, key), attributes))
    return found


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` keeping each parameter object (its contents swapped, as torch
    does for DTensors): tied weights stay tied, and what holds a parameter (a pipeline's tied
    weights, its stages' bare parameters) holds the materialized one."""
    if any(weakref.getweakrefcount(p) for p in model.parameters()):
        gc.collect()  # a swapped tensor has no weak references: a dead cycle may hold some (the
        # pipeline check's fake tensor mode, which ran the meta model)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def _other_stages(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A pipelined meta model's other stages' parts back in their places while ``init=`` runs
    (``pipeline_parts.MetaParts``): its initializer walks the serial model's modules, and a
    checkpoint's keys name the serial model's tensors (``load_into`` reads no meta tensor)."""
    from macrogen.runtime.pipeline import pipeline_of

    pipe = pipeline_of(model)
    return contextlib.nullcontext() if pipe is None else pipe.elsewhere.back()


def _initializer(
    model: nn.Module, where: str
) -> list[tuple[nn.Module, Callable[[nn.Module], Any]]]:
    """Each module with the initializer the serial program runs on it, in its order."""
    pretrained = _pretrained_class()
    if pretrained is not None and isinstance(model, pretrained):
        return list(_hf_order(model, model, pretrained))
    if callable(getattr(model, "init_weights", None)) and not hasattr(model, "reset_parameters"):
        raise ValueError(
            f'mg.parallelize at {where}: init="model" runs transformers\' _init_weights or each'
            f" module's reset_parameters(), one module at a time; {type(model).__name__}"
            ".init_weights() initializes the whole model at once: give the values with"
            " init=mg.load(path) (a checkpoint of the initialized model)"
        )
    return [(m, _reset) for m in model.modules() if callable(getattr(m, "reset_parameters", None))]


def _pretrained_class() -> type | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _hf_order(
    module: nn.Module, owner: Any, pretrained: type
) -> Iterator[tuple[nn.Module, Callable[[nn.Module], Any]]]:
    """transformers' ``initialize_weights`` order: children first, each module by the nearest
    ``PreTrainedModel`` holding it (``smart_apply``)."""
    for child in module.children():
        yield from _hf_order(child, child if isinstance(child, pretrained) else owner, pretrained)
    yield module, owner._initialize_weights


def _init_context(model: nn.Module) -> Any:
    """``torch.no_grad``, and transformers' guard of torch's init functions for its models."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    if hasattr(model, "_initialize_weights"):
        from transformers import initialization

        stack.enter_context(initialization.guard_torch_init_functions())
    return stack


def _whole_for(module: nn.Module, fn: Callable[[nn.Module], Any], device: torch.device) -> None:
    """``fn(module)`` on whole parameters on ``device``; this rank keeps its shard of each (of
    another pipeline stage's, still meta, nothing: it was drawn to draw as the serial model)."""
    held = {k: p for k, p in module._parameters.items() if p is not None}
    whole = {k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype,
                                         device=device if p.is_meta else p.device),
                             requires_grad=p.requires_grad) for k, p in held.items()}  # fmt: skip
    module._parameters.update(whole)
    try:
        fn(module)
    finally:
        module._parameters.update(held)
    for k, p in held.items():
        if not p.is_meta:
            _keep_shard(whole[k].detach(), p)


def _keep_shard(whole: torch.Tensor, param: torch.Tensor) -> None:
    if not isinstance(param, DTensor):
        param.detach().copy_(whole)
        return
    from macrogen.runtime.dtensor_whole import restride

    param.to_local().copy_(restride(whole, param).to_local())
