"""The optimizer's step on the local tensors of the engine's DTensor parameters.

An optimizer over DTensor parameters runs each of its ops through DTensor's dispatch (SGD on
CPU: one ``add_`` per parameter; Adam: about ten), which costs more than the arithmetic at the
sizes a tensor-parallel shard has. For SGD, Adam and AdamW every op of the step is elementwise,
so the step on each parameter's local tensor, with its gradient's and its state's local tensors,
computes exactly what the step on the DTensors computes (DTensor runs the same op on the same
local tensors). So around ``step()`` (torch's optimizer step hooks: the engine never sees the
user's optimizer) each group's marked parameters are replaced by their local tensors, and their
state by its local tensors; after the step the parameters are put back and the state is
DTensors again (a state tensor made by this step is wrapped in its parameter's placements), so
``state``, ``state_dict()`` and checkpoints see what they see without this.

Not kept (the commit after this one reverts it): torch runs the global step pre-hooks before
an optimizer's own and its own post-hooks before the global ones, so an optimizer's own step
hooks (and a global pre-hook registered after ours, as local SGD's) would see local tensors in
``param_groups``. It needs a step the engine owns (an optimizer wrapper, as ZeRO's).

Anything else steps on the DTensors as before: another optimizer class, a ``closure`` (it may
run a backward between our swap and the step), ``differentiable=True``, a gradient or a state
tensor whose placements are not its parameter's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from macrogen.runtime.eager import eager

LOCAL_STEP = "_mg_local_step"  # on a DTensor parameter the engine made: its step may run locally
_SWAP = "_mg_local_step_swap"  # on an optimizer while its step runs on local tensors
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # every op elementwise
_PLAIN = frozenset({"step"})  # state entries that are plain tensors on DTensor parameters too


def mark(param: torch.Tensor) -> None:
    """``param`` (a DTensor the engine made) may be stepped on its local tensor."""
    setattr(param, LOCAL_STEP, True)
    _install()


@functools.cache
def _install() -> None:
    """Once per process: torch's global optimizer step hooks (a hook per optimizer would need
    the optimizer, which the user builds after the engine ran)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(_to_local)
    register_optimizer_step_post_hook(_back)


def _marked(p: Any) -> bool:
    return isinstance(p, DTensor) and getattr(p, LOCAL_STEP, False)


def _steppable(p: DTensor, state: dict[str, Any] | None) -> bool:
    """The local step computes what the DTensor step does: the gradient and every DTensor state
    tensor laid out as the parameter (a Partial gradient, say, would be summed by DTensor)."""
    grad = p.grad
    if grad is not None and (not isinstance(grad, DTensor) or grad.placements != p.placements):
        return False
    for key, value in (state or {}).items():
        if isinstance(value, DTensor) and value.placements != p.placements:
            return False
        if key not in _PLAIN and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return False
    return True


@eager  # edits the optimizer's tables: eager, outside a graph
def _to_local(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _back(opt, args, kwargs)  # a step that raised left its swap: undo it first
    if type(opt) not in ELEMENTWISE or args[1:] or kwargs:  # (args[0]: opt) a closure
        return
    groups = opt.param_groups
    if any(g.get("differentiable") for g in groups):
        return
    marked = [p for g in groups for p in g["params"] if _marked(p)]
    if not marked or not all(_steppable(p, opt.state.get(p)) for p in marked):
        return
    swapped_groups: list[tuple[dict[str, Any], list[Any]]] = []
    swapped: list[tuple[DTensor, torch.Tensor, dict[str, Any] | None, dict[str, Any]]] = []
    with torch.no_grad():
        for group in groups:
            params = group["params"]
            local: list[Any] = []
            for p in params:
                if not _marked(p):
                    local.append(p)
                    continue
                view = p.to_local()  # a fresh view of the shard (to_local of a parameter)
                if p.grad is not None:
                    view.grad = p.grad.to_local()
                before = opt.state.pop(p, None)
                views: dict[str, Any] = {}
                if before is not None:
                    views = {k: v.to_local() if isinstance(v, DTensor) else v
                             for k, v in before.items()}  # fmt: skip
                    opt.state[view] = dict(views)
                swapped.append((p, view, before, views))
                local.append(view)
            swapped_groups.append((group, params))
            group["params"] = local
    opt.__dict__[_SWAP] = (swapped_groups, swapped)


@eager
def _back(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The parameters back in their groups, their state DTensors again."""
    swap = opt.__dict__.pop(_SWAP, None)
    if swap is None:
        return
    swapped_groups, swapped = swap
    for group, params in swapped_groups:
        group["params"] = params
    for p, view, before, views in swapped:
        view.grad = None
        state = opt.state.pop(view, None)
        if state is None:
            if before is not None:
                opt.state[p] = before
            continue
        opt.state[p] = {k: _dtensor(p, k, v, before, views) for k, v in state.items()}


def _dtensor(
    p: DTensor, key: str, value: Any, before: dict[str, Any] | None, views: dict[str, Any]
) -> Any:
    """A state entry as the DTensor step leaves it: the DTensor it was (updated in place through
    its local tensor), or one the step made, in the parameter's placements."""
    if before is not None and key in views and value is views[key]:
        return before[key]
    if key in _PLAIN or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    return DTensor.from_local(
        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
