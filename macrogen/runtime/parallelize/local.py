"""Local tensors in the parameters' places while a forward runs.

Tensor-parallel parameters are DTensors, so that whole-model tools see the serial
model; the forward computes on plain local tensors all the same. A forward
pre-hook on the model (under FSDP: on each unit, after FSDP gathered it;
pipelined: on each stage module) puts every DTensor parameter's local tensor in
its place (``to_local()``, through one autograd node for all of them) and a
forward hook puts the DTensors back. That node's backward, which runs once every
gradient of its parameters is computed:

1. sums over the tensor group, in one all-reduce, the gradients of the
   parameters an entry marked (``replicate_grad_allreduce``, ``sequence_parallel``:
   each rank's copy saw only its heads or its tokens);
2. hands the gradients to the replicated-gradient check, while it is pending;
3. wraps each gradient in its parameter's placements, as ``to_local()``'s own
   backward does (with the parameter's spec: ``DTensor.from_local`` builds and
   verifies a new spec per call, ~10x slower per parameter, measured).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from macrogen.runtime.blocks import repeated_layers
from macrogen.runtime.eager import eager

if TYPE_CHECKING:
    from macrogen.runtime.parallelize.checks import GradientCheck

LOCAL = "_mg_local_forward"  # on a swap owner: its LocalForward
SWAPPED = "_mg_swapped_parameters"  # (owner, name, DTensor parameter) while a forward runs
WATCHING = "_mg_watching"  # the first training forward's context while it runs
SUMMED = "_mg_summed_gradients"  # on a module: {parameter name: tensor group} summed in backward
TENSOR_PARALLEL = "_mg_tensor_parallel"  # on the model: apply_tensor_parallel sharded it
COLWISE = "_mg_colwise_layers"  # on the model: (name, layer) of each colwise layer (a slice out)
# on a module that swaps its own DTensor parameters as it is called (ep's experts: their
# gradients' reduction is theirs): a swap of the modules around it leaves it out
OWN_SWAP = "_mg_own_swap"


@dataclass
class LocalForward:
    """One swap owner's (the model's, an FSDP unit's, a pipeline stage's) swap."""

    scope: list[nn.Module]  # the modules whose parameters it swaps (found once, not per forward)
    check: GradientCheck | None  # the replicated-gradient check, while it is pending
    # a context around the first training forward (checks.NoDropout), until one passes
    watch: Callable[[], Any] | None = None
    hooks: tuple[Any, ...] = ()


@dataclass
class _Backward:
    """What one forward's local tensors need in backward."""

    summed: dict[int, dist.ProcessGroup]  # index of a parameter -> the group summing its gradient
    slots: list[tuple[nn.Module, str]]  # (module, name) of each parameter, by index
    check: GradientCheck | None
    specs: list[Any] = field(default_factory=list)


class LocalParameters(torch.autograd.Function):
    """Every DTensor parameter's local tensor, in one autograd node."""

    @staticmethod
    def forward(ctx: Any, job: _Backward, *params: Any) -> tuple[torch.Tensor, ...]:
        ctx.job = job
        # a parameter the forward did not use gets no gradient (None), as serially: a zero
        # gradient would make the optimizer step it (weight decay, momentum)
        ctx.set_materialize_grads(False)
        job.specs = [p._spec for p in params]
        # views: the DTensor's own local tensor must not take this node as its grad_fn.
        # ``_local_tensor`` (private, as ``_spec``: tests/test_parallelize_styles_dist.py checks
        # both) is what ``to_local()`` returns with grad off, without its per-call bookkeeping
        return tuple([t.view_as(t) for t in [p._local_tensor for p in params]])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        job: _Backward = ctx.job
        if job.check is not None or job.summed:
            out = list(grads)
            if job.check is not None and job.check.pending:
                job.check.run(job.slots, job.specs, job.summed, out,
                              lambda: _sum(out, job.summed))  # fmt: skip
            else:
                _sum(out, job.summed)
            grads = tuple(out)
        # ``DTensor.__new__``: DTensor(...) without its __init__, which does nothing but go
        # through a dynamo-disable wrapper (~1.4 us a parameter; checked by the same test)
        new = DTensor.__new__
        return (None, *[None if g is None else new(DTensor, g, spec, requires_grad=False)
                        for g, spec in zip(grads, job.specs)])  # fmt: skip


def _sum(grads: list[torch.Tensor | None], summed: Mapping[int, dist.ProcessGroup]) -> None:
    """The marked gradients summed over their group: one all-reduce per group (in place)."""
    by_group: dict[dist.ProcessGroup, list[int]] = {}
    for i, group in summed.items():
        if grads[i] is not None:
            by_group.setdefault(group, []).append(i)
    for group, indices in by_group.items():
        parts = [g for g in (grads[i] for i in indices) if g is not None]
        flat = torch.cat([g.reshape(-1) for g in parts])
        dist.all_reduce(flat, group=group)
        for i, g, piece in zip(indices, parts, flat.split([g.numel() for g in parts])):
            grads[i] = piece.view_as(g)


Slot = tuple[dict[str, Any], str, int]  # (a module's parameter table, key, index of the parameter)


def _find(
    scope: list[nn.Module],
) -> tuple[list[Any], list[Slot], list[tuple[nn.Module, str]], dict[int, dist.ProcessGroup]]:
    """The scope's DTensor parameters (a parameter under two names, tied, once), the table
    entries holding them, the (module, name) of each and the indices whose gradients are
    summed."""
    params: list[Any] = []
    slots: list[Slot] = []
    names: list[tuple[nn.Module, str]] = []
    summed: dict[int, dist.ProcessGroup] = {}
    index: dict[int, int] = {}
    for module in scope:
        table = module._parameters
        marked = module.__dict__.get(SUMMED)
        for key, p in table.items():
            if isinstance(p, DTensor):
                i = index.get(id(p))
                if i is None:
                    i = index[id(p)] = len(params)
                    params.append(p)
                    names.append((module, key))
                    if marked is not None and key in marked:
                        summed[i] = marked[key]
                slots.append((table, key, i))
    return params, slots, names, summed


@eager  # swaps entries of the modules' parameter tables: eager, outside a graph
def _to_local(owner: nn.Module, args: Any) -> None:
    _put_back(owner)  # a forward that raised may have left local tensors in place
    local: LocalForward = owner.__dict__[LOCAL]
    params, slots, names, summed = _find(local.scope)
    if not params:
        return
    if torch.is_grad_enabled() and any(map(_requires_grad, params)):
        check = local.check if local.check is not None and local.check.pending else None
        tensors = LocalParameters.apply(_Backward(summed, names, check), *params)  # type: ignore[no-untyped-call]
    else:
        tensors = [p.to_local() for p in params]
    for table, key, i in slots:
        table[key] = tensors[i]
    owner.__dict__[SWAPPED] = (slots, params)
    if local.watch is not None and owner.training:
        watching = local.watch()
        watching.__enter__()
        owner.__dict__[WATCHING] = watching


_requires_grad = operator.attrgetter("requires_grad")


def _put_back(owner: nn.Module) -> None:
    """The DTensor parameters back in their places (the swap's own, not a compiler boundary)."""
    swapped = owner.__dict__.pop(SWAPPED, None)
    if swapped is not None:
        slots, params = swapped
        for table, key, i in slots:
            table[key] = params[i]


@eager
def _restore(owner: nn.Module, *_: Any) -> None:
    _put_back(owner)


@eager
def _after(owner: nn.Module, args: Any, output: Any) -> None:
    """The forward's end (``output`` None: it raised): parameters back, the watch ended."""
    _put_back(owner)
    watching = owner.__dict__.pop(WATCHING, None)
    if watching is not None:
        watching.__exit__(None, None, None)
        if output is not None:  # the first training forward passed
            owner.__dict__[LOCAL].watch = None


def attach(
    owner: nn.Module,
    scope: list[nn.Module],
    check: GradientCheck | None,
    watch: Callable[[], Any] | None = None,
) -> None:
    """``owner``'s forward runs on the local tensors of ``scope``'s DTensor parameters."""
    detach(owner)
    local = LocalForward(scope, check, watch)
    owner.__dict__[LOCAL] = local
    local.hooks = (
        owner.register_forward_pre_hook(_to_local, prepend=False),
        owner.register_forward_hook(_after, prepend=True, always_call=True),
    )


def detach(owner: nn.Module) -> LocalForward | None:
    """``owner``'s swap removed (FSDP moves it into each unit); what it was."""
    local: LocalForward | None = owner.__dict__.pop(LOCAL, None)
    for handle in local.hooks if local is not None else ():
        handle.remove()
    return local


def mark_summed(module: nn.Module, name: str, group: dist.ProcessGroup) -> None:
    """``module.name``'s gradient is summed over ``group`` in the backward of every swap."""
    module.__dict__.setdefault(SUMMED, {})[name] = group


def is_tensor_parallel(model: nn.Module) -> bool:
    """``apply_tensor_parallel`` sharded ``model`` (its forward runs on local shards)."""
    return bool(model.__dict__.get(TENSOR_PARALLEL, False))


def local_forward_per_unit(
    model: nn.Module,
    units: list[nn.Module],
    owners: Mapping[nn.Module, list[nn.Module]] | None = None,
) -> None:
    """Under FSDP, each unit's parameters are gathered (as tensor-parallel DTensors) only while
    the unit runs: swap them to local tensors there, after FSDP's gathering pre-hook and
    before its resharding post-hook, instead of once for the whole model.

    A pipeline's schedule runs its stages' modules, never the model's forward: each stage is a
    unit, and ``owners`` adds the modules holding its bare parameters (their own tables only)."""
    whole = detach(model)
    check = whole.check if whole is not None else None
    watch = whole.watch if whole is not None else None
    # the model's list of its colwise layers: a pipeline cut dropped some, and the list would
    # keep them (another stage's shards) alive (in place: the output checks' hooks hold it)
    if COLWISE in model.__dict__:
        kept = {id(m) for m in model.modules()}
        colwise = model.__dict__[COLWISE]
        colwise[:] = [(n, m) for n, m in colwise if id(m) in kept]
    for unit in units:  # a unit set up before (FSDP after a pipeline cut) had the check
        previous = unit.__dict__.get(LOCAL)
        if previous is not None and check is None:
            check, watch = previous.check, previous.watch
    boundaries = {id(u) for u in units}

    def scope(unit: nn.Module) -> list[nn.Module]:
        found, stack = [], [unit]
        while stack:
            module = stack.pop()
            found.append(module)
            stack += [c for c in module.children() if id(c) not in boundaries]
        return found

    for unit in units:  # each its own check: one small collective per unit, once
        fresh = check.fresh() if check is not None else None
        attach(unit, scope(unit) + list((owners or {}).get(unit, ())), fresh, watch)


def local_forward_per_block(model: nn.Module) -> None:
    """Tensor parallel under data parallel: each repeated block swaps its own parameters, so
    that its gradients leave autograd when its backward ends. One swap for the whole model hands
    every gradient over at the end of backward: the buckets' all-reduces could not start before
    it, and the gradients lived twice (autograd's and the buckets') at backward's peak.
    A pipeline's stages swap per block already (``parallelize_pipeline``: the model itself then
    has no swap), FSDP per unit; ep keeps one swap for the rest (its experts swap their own)."""
    if LOCAL not in model.__dict__ or any(OWN_SWAP in m.__dict__ for m in model.modules()):
        return
    blocks = [block for _, block in repeated_layers(model)]
    if blocks:
        local_forward_per_unit(model, [*blocks, model])


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """``module``'s tensor-parallel parameters as local tensors while it runs on its own,
    outside its model's forward (a block's forward recomputed in backward, a planned layer
    called by hand). Inside the model's forward they are local already, and nothing changes."""
    scope = _outside_own_swaps(module)
    if not any(isinstance(p, DTensor) for m in scope for p in m._parameters.values()):
        yield
        return
    if LOCAL in module.__dict__:
        _to_local(module, ())
    else:
        module.__dict__[LOCAL] = LocalForward(scope, None)
        try:
            _to_local(module, ())
        finally:
            del module.__dict__[LOCAL]
    try:
        yield
    finally:
        _restore(module)


def weakly_bound(fn: Callable[..., Any], module: nn.Module, *args: Any) -> Callable[..., Any]:
    """``fn(module, *args, ...)`` for ``module`` to hold (its own forward). It reaches the module
    weakly: a strong reference is a cycle, which keeps a layer that a pipeline cut dropped
    (another stage's, with its shards) alive until a gc pass."""
    return _WeaklyBound(fn, weakref.ref(module), args)


@dataclass(frozen=True)
class _WeaklyBound:
    fn: Callable[..., Any]
    ref: weakref.ref[nn.Module]
    args: tuple[Any, ...]

    def __call__(self, *more: Any, **kwargs: Any) -> Any:
        me = self.ref()
        assert me is not None, "a module's forward outlived its module"
        return self.fn(me, *self.args, *more, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _WeaklyBound:
        """A copy of the model (an EMA twin) runs its own module: the copy in ``memo``."""
        copied = memo.get(id(self.ref()))
        if copied is None:
            return self
        new = _WeaklyBound(self.fn, weakref.ref(copied), copy.deepcopy(self.args, memo))
        if WRAPPED in vars(self):
            stands_for(new, copied)
        return new


WRAPPED = "__wrapped__"


def stands_for(bound: Callable[..., Any], module: nn.Module) -> None:
    """``bound`` (the module's forward) reads as its class's forward to ``inspect.signature``
    (transformers' ``generate`` asks the forward's parameters), as ``functools.wraps`` does."""
    object.__setattr__(bound, WRAPPED, type(module).forward.__get__(module))


# A process group can't be copied: a deep copy of a model (its planned layers' specs, its
# tensor group) shares its groups, as copies of torch's DDP and TP modules do.
copy._deepcopy_dispatch[dist.ProcessGroup] = copy._deepcopy_atomic  # type: ignore[attr-defined]


def _outside_own_swaps(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules but those (below it) that swap their own (``OWN_SWAP``):
    a recomputed block's experts take their local tensors as they are called, again."""
    found: dict[int, nn.Module] = {}  # in modules()'s order; a module under two names once

    def visit(m: nn.Module) -> None:
        if id(m) not in found:
            found[id(m)] = m
            for child in m.children():
                if not child.__dict__.get(OWN_SWAP, False):
                    visit(child)

    visit(module)
    return list(found.values())
