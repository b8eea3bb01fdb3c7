"""The class decorators' plans: ``@tensor_parallel``'s plan as data on the user's class, applied
where the outermost decorated model's construction ends (a construction record in a context
variable: no profiler hook, no frame walking) by the engine ``mg.parallelize`` uses
(``macrogen.runtime.parallelize.apply_tensor_parallel``: DTensor parameters, each planned layer
running its own forward). ``@data_parallel`` and ``@pipeline`` classes
(``macrogen.runtime.class_macros``) enter the same record.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from macrogen.runtime import environment
from macrogen.runtime.eager import eager
from macrogen.runtime.mesh import SIZE_ENV, Mesh, carried, mesh
from macrogen.runtime.parallelize.engine import apply_tensor_parallel
from macrogen.runtime.tensor_parallel import (
    load_serial_state_dict,
    serial_state_dict,
)

# -- the class decorators' plans -----------------------------------------------------------------
#
# ``@tensor_parallel`` records its plan on the user's class (``ClassPlan``, the class keeps its
# name and identity) and wraps its ``__init__`` in ``construction``. The plans are applied by
# ``apply_class_plans`` where the outermost decorated model's construction ends: how deep we
# are is the construction record in a context variable (no profiler hook, no frame walking).
# ``@data_parallel`` and ``@pipeline`` classes enter the same record, so tensor-parallel layers
# built inside them are cut only once their own ``__init__`` (and its re-initialization) is done.

PLAN = "_mg_tensor_parallel"  # a @tensor_parallel class's ClassPlan, in its own __dict__
APPLIED = "_mg_plan_applied"  # an instance whose class plan has been applied
_GUARD = "_mg_plan_guard"  # the forward pre-hook of an instance whose plan is not applied yet


@dataclass(frozen=True, eq=False)
class ClassPlan:
    """A ``@tensor_parallel`` class's plan, as data: its name, size= and path -> style."""

    name: str
    size: int | None  # the tensor-parallel degree; None: the program's mesh, or $MACROGEN_TP_SIZE
    plan: dict[str, Any]  # path -> a style of macrogen.vocabulary.STYLES (the engine's)


def class_plan(cls: type) -> ClassPlan | None:
    for klass in cls.__mro__:
        plan = vars(klass).get(PLAN)
        if isinstance(plan, ClassPlan):
            return plan
    return None


def tensor_parallel_class(
    name: str, size: int | None, plan: dict[str, Any]
) -> Callable[[type], type]:
    """What ``@tensor_parallel`` expands to: the plan recorded on the class, its ``__init__``
    run inside ``construction`` (the class object itself is returned: registries, factories
    and ``isinstance`` that captured it see the tensor-parallel class)."""

    def decorate(cls: type) -> type:
        earlier = class_plan(cls)
        if earlier is not None:  # whose plan is meant?
            raise TypeError(
                f"{name} is a tensor_parallel class derived from another ({earlier.name}): put the"
                " plan on one of them, or derive both from an undecorated base class"
            )
        setattr(cls, PLAN, ClassPlan(name, size, dict(plan)))
        # what forward's rewritten code reads (set on the instance when cut): its local
        # widths (``C // self.tp_size``) and its collectives' group (``self.tp_group``)
        for attr, serial in (("tp_size", 1), ("tp_group", None)):
            setattr(cls, attr, serial)
        init = cls.__init__  # type: ignore[misc]  # its own or inherited: the one it runs

        @functools.wraps(init)
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            with construction(self):
                init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        for method in (full_state_dict, load_full_state_dict):
            if method.__name__ not in vars(cls):
                setattr(cls, method.__name__, method)
        return cls

    return decorate


def full_state_dict(self: nn.Module) -> dict[str, torch.Tensor]:
    """The serial module's state dict (same keys and shapes), gathered from every rank's shards."""
    return serial_state_dict(self)


def load_full_state_dict(
    self: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> Any:
    """Load a serial module's state dict; each rank keeps its shards."""
    return load_serial_state_dict(self, state_dict, strict)


class _Record:
    """The decorated modules whose construction started under the outermost one's."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.started: list[nn.Module] = []
        self.finished: list[nn.Module] = []  # children before their parents

    def under(self, module: nn.Module) -> list[nn.Module]:
        """Those in ``module``'s tree whose plan is still to apply, finished ones first."""
        inside = {id(m) for m in module.modules()}
        done = {id(m) for m in self.finished}
        order = [*self.finished, *(m for m in self.started if id(m) not in done)]
        return [m for m in order if id(m) in inside and _waiting(m)]


_building: ContextVar[_Record | None] = ContextVar("macrogen_construction", default=None)


@contextlib.contextmanager
def construction(module: nn.Module) -> Iterator[None]:
    """The construction of a decorated ``module``; the outermost one applies the plans at its end."""
    record = _building.get()
    token = None
    if record is None:
        record = _Record(module)
        token = _building.set(record)
    if all(m is not module for m in record.started):
        record.started.append(module)
    try:
        yield
    finally:
        if token is not None:
            _building.reset(token)
    if all(m is not module for m in record.finished):
        record.finished.append(module)
        if _waiting(module):  # until its plan is applied, a forward is an error
            guard = functools.partial(_never_applied, type(record.root).__name__)
            module.__dict__[_GUARD] = module.register_forward_pre_hook(guard)
    if token is not None:
        waiting = record.under(module)
        if waiting:  # the class path's mesh step: made (or the program's) with their size=
            apply_class_plans(module, waiting, mesh(plans_size(module, waiting)))


def materialize(module: nn.Module, program: Mesh) -> None:
    """Apply now, on ``program`` (the caller's mesh), the plans waiting under ``module``
    (``@data_parallel`` and ``@pipeline`` call it before they collect or cut the parameters,
    inside an outer decorated construction)."""
    record = _building.get()
    if record is not None:
        waiting = record.under(module)
        if waiting:
            apply_class_plans(module, waiting, program)


def mesh_for(module: nn.Module, *, pipeline: int | None = None) -> Mesh:
    """A decorated model's mesh: the one its plans were applied on (it carries it), else the
    program's, made now with the size= of the plans waiting under ``module`` (and ``pipeline``
    stages). What ``@data_parallel`` and ``@pipeline`` hand on to what they set up."""
    found = carried(module)
    if found is not None and pipeline in (None, found.pipeline_size):
        return found
    record = _building.get()
    waiting = record.under(module) if record is not None else []
    return mesh(plans_size(module, waiting), pipeline=pipeline)


def plans_size(root: nn.Module, modules: list[nn.Module]) -> int | None:
    """The one size= of the plans of ``modules`` (None: none gives one)."""
    plans = [class_plan(type(m)) for m in modules]
    sizes = sorted({p.size for p in plans if p is not None and p.size is not None})
    if len(sizes) > 1:
        raise ValueError(
            f"tensor_parallel: the plans under {type(root).__name__} ask for sizes"
            f" {', '.join(map(str, sizes))}: one tensor-parallel size per model"
        )
    return sizes[0] if sizes else None


def _waiting(module: nn.Module) -> bool:
    return class_plan(type(module)) is not None and APPLIED not in module.__dict__


def _never_applied(root: str, module: nn.Module, args: Any) -> None:
    name = type(module).__name__
    raise RuntimeError(
        f"tensor_parallel: this {name} was built while {root} was being built, but was not one of"
        f" its submodules when {root}'s construction ended, so {name}'s plan never applied (its"
        f" layers would be whole on every rank): assign it in {root}.__init__ (self.x = ...), or"
        f" build it outside {root}'s construction"
    )


def apply_class_plans(root: nn.Module, modules: list[nn.Module], program: Mesh) -> None:
    """Tensor parallel for the decorated ``modules`` under ``root`` (children first): their
    plans, under their paths in ``root``, applied at once by the engine
    (``macrogen.runtime.parallelize.apply_tensor_parallel``) on ``program``, the mesh made for
    them, so the parameters are DTensors as under ``mg.parallelize``; every problem reported
    together."""
    plans = [(m, class_plan(type(m))) for m in modules]
    size = plans_size(root, modules)
    if size is not None and size != program.tensor_size and program.device_mesh is not None:
        raise ValueError(
            f"this program already uses tensor-parallel size {program.tensor_size}; the plans"
            f" under {type(root).__name__} ask for {size}: one mesh per program"
        )
    paths = {id(m): n for n, m in root.named_modules()}
    plan: dict[str, Any] = {}
    for module, p in plans:
        assert p is not None
        if program.tensor_size == 1 and p.size is None and dist.is_initialized():
            if dist.get_world_size() > 1:  # (size=1 in the plan is a choice: no warning)
                warn_whole(p.name)
        prefix = paths[id(module)]
        plan.update({f"{prefix}.{k}" if prefix else k: style for k, style in p.plan.items()})
    for module, _ in plans:  # applied or failed: never again (a failure raises out of __init__)
        module.__dict__[APPLIED] = True
        object.__setattr__(module, "tp_size", program.tensor_size)  # forward's local widths
        object.__setattr__(module, "tp_group", program.tensor_group)  # forward's collectives
        guard = module.__dict__.pop(_GUARD, None)
        if guard is not None:
            guard.remove()
    if plan:
        where = f"{type(root).__name__} (@tensor_parallel)"
        apply_tensor_parallel(root, program, plan, where=where)
        _watch(root)


@functools.cache
def warn_whole(name: str) -> None:
    """Once per plan: a plan in a job of several ranks at tensor-parallel size 1 shards nothing
    (said only where nothing asked for a size: a launch's MACROGEN_TP_SIZE=1 is a choice)."""
    if environment.text(SIZE_ENV) is not None:
        return
    warnings.warn(
        f"tensor_parallel plan {name}: the tensor-parallel size is 1 in a job of"
        f" {dist.get_world_size()} ranks (no size= in the plan, $MACROGEN_TP_SIZE unset), so every"
        " rank holds the full layers; set size= or MACROGEN_TP_SIZE, or use"
        " mg.parallelize(model, tp=N, ...)",
        stacklevel=_user_frame(),
    )


def _user_frame() -> int:
    """warn_whole's stacklevel for the first frame outside macrogen and contextlib: the
    user's line that built the model (a fixed level lands in contextlib's ``__exit__``)."""
    import sys

    inside = (os.path.dirname(os.path.dirname(__file__)), contextlib.__file__)
    frame, level = sys._getframe(2), 2  # (0: here, 1: warn_whole)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


# A parent that is not decorated and re-initializes its children after building them (HF's
# post_init, nanoGPT's self.apply(_init_weights)) runs after their shards were cut: it would
# draw other random numbers than the serial model. Nothing tells when an undecorated
# constructor ends, so that is found after the fact: the shards' values at the cut are
# compared at the model's first forward (one sum each), unless a state dict was loaded.
_WATCH = "_mg_shards_at_cut"


def _watch(root: nn.Module) -> None:
    shards = [  # this rank's pieces of the sharded parameters (a replicated one is whole)
        (name, p.to_local().detach())  # (a leaf: a copy.deepcopy of the model copies it)
        for name, p in root.named_parameters()
        if isinstance(p, DTensor) and not all(q.is_replicate() for q in p.placements)
    ]
    if not shards:
        return
    with torch.no_grad():
        sums = [p.detach().sum() for _, p in shards]
    root.__dict__[_WATCH] = [
        (name, p, p.data_ptr(), total) for (name, p), total in zip(shards, sums)
    ]
    hooks: list[Any] = []

    def done() -> None:
        root.__dict__.pop(_WATCH, None)
        for hook in hooks:
            hook.remove()

    def loaded(module: nn.Module, _incompatible: Any) -> None:
        done()  # a checkpoint's values replace the initialization: nothing to compare

    @eager
    def check(module: nn.Module, args: Any) -> None:
        marks = module.__dict__.pop(_WATCH, ())
        done()
        same_storage = [(n, p, t) for n, p, ptr, t in marks if p.data_ptr() == ptr]
        if not same_storage:  # moved or converted (.to(), .half()): values can't be compared
            return
        with torch.no_grad():
            now = torch.stack([p.detach().sum() for _, p, _ in same_storage])
            then = torch.stack([t for _, _, t in same_storage])
        if torch.equal(now, then):
            return
        changed = [
            n for (n, _, _), a, b in zip(same_storage, now.tolist(), then.tolist()) if a != b
        ]
        name = type(module).__name__
        raise RuntimeError(
            f"tensor_parallel: {name}'s shards ({', '.join(changed[:4])}"
            f"{', ...' if len(changed) > 4 else ''}) changed between their cut, where {name}'s"
            f" construction ended, and its first forward: a parent that is not decorated"
            " re-initialized them (HF's post_init, self.apply(_init_weights)), drawing other"
            " random numbers than the serial model. Decorate that parent too (@mg.tensor_parallel("
            "plan={}) if it has nothing to shard itself): shards are cut where the outermost"
            " decorated model's construction ends; or build the model serially and call"
            " mg.parallelize(model, ...)"
        )

    hooks.append(root.register_forward_pre_hook(check, prepend=True))
    hooks.append(root.register_load_state_dict_post_hook(loaded))
