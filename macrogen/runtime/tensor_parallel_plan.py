"""Applying a tensor-parallel plan: one style class per parallel style, cut on a built model.

    @tensor_parallel_class("MLP", None, {"fc": Colwise(), "proj": Rowwise()})
    class MLP(nn.Module): ...

is what ``@tensor_parallel`` expands to: the plan is data on the class, and
``macrogen.runtime.parallelize`` applies it (``apply``, here) once the
outermost decorated model's construction is complete, as torch's
``parallelize_module`` on a built model. So initialization a decorated parent
applies after building its children (nanoGPT's ``self.apply(self._init_weights)``
and re-draw of ``c_proj.weight`` by name) runs on the full serial layers and
draws the serial random numbers: a seeded parallel run starts from exactly the
serial weights. ``parallelize(module, name, group, plan)`` applies a plan to a
built module at once.

Each style (``Colwise``, ``Rowwise``, ``Vocab``, ``Divide``, ``Replicate``, ``Sequence``,
``FromSequence``)
owns its check, its layer and its declared layouts, as torch's ``style.py``.
Parameters tied between layers (an embedding and the LM head) stay tied: one
shard, shared; a plan that cannot keep a tie is an error naming both names.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from macrogen.runtime import environment, groups
from macrogen.runtime.collectives import gather_sequence, group_size, sum_gradients
from macrogen.runtime.mesh import SIZE_ENV
from macrogen.runtime.tensor_parallel import (
    ColwiseLinear,
    RowwiseLinear,
    VocabEmbedding,
    is_conv1d,
    local_count,
    make_shard,
)

# -- styles -----------------------------------------------------------------------------


class Shards:
    """Shards cut so far under one root, by the full parameter they come from (ties share one)."""

    def __init__(self) -> None:
        # id(full) -> (full, dim, blocks, shard, name of the first holder)
        self.cut: dict[int, tuple[nn.Parameter, int, int, nn.Parameter, str]] = {}

    def __call__(
        self,
        full: nn.Parameter | None,
        dim: int,
        blocks: int,
        group: dist.ProcessGroup | None,
        name: str,
    ) -> nn.Parameter | None:
        if full is None:
            return None
        hit = self.cut.get(id(full))
        if hit is not None:
            if (hit[1], hit[2]) != (dim, blocks) or hit[0].shape != full.shape:
                raise ValueError(
                    f"{name} is tied to {hit[4]}, but the plan splits them differently (dim"
                    f" {dim} vs {hit[1]}): a tie keeps one shard, so plan both with the same split"
                    " (a vocab embedding and a colwise head share rows) or untie them"
                )
            return hit[3]
        shard: nn.Parameter = make_shard(full, dim, group, blocks)
        self.cut[id(full)] = (full, dim, blocks, shard, name)
        return shard


class Style:
    """One parallel style; ``apply`` turns ``owner.attr`` into this rank's part of it."""

    input_layout = "any"  # what the layer's forward accepts on its last dim
    output_layout = "same"  # what it returns on its last dim

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _layer(owner: nn.Module, attr: str, name: str, kind: type, style: str) -> nn.Module:
    layer = getattr(owner, attr, None)
    if kind is nn.Linear and is_conv1d(layer):  # HF's Conv1D: an nn.Linear stored (in, out)
        assert isinstance(layer, nn.Module)
        return layer
    if not isinstance(layer, kind):  # subclasses too (torchtitan's Linear)
        raise TypeError(
            f"{name}: {style} needs an nn.{kind.__name__} (or a subclass), not {type(layer).__name__}"
            " (colwise/rowwise: nn.Linear or HF Conv1D, vocab: nn.Embedding, divide: an int"
            " attribute)"
        )
    assert isinstance(layer, nn.Module)
    return layer


@dataclass(repr=False)
class Colwise(Style):
    """nn.Linear, output features split (``blocks`` packed blocks each split on its own).

    ``sequence``: its input is this rank's slice of the sequence (torch's
    ``ColwiseParallel(input_layouts=Shard(1))``), all-gathered along T first.
    """

    blocks: int = 1
    sequence: bool = False
    output_layout = "shard(-1)"

    @property
    def input_layout(self) -> str:  # type: ignore[override]
        return "shard(1)" if self.sequence else "replicate"

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        full = cast(nn.Linear, _layer(owner, attr, name, nn.Linear, "colwise"))
        if group is not None:
            layer = ColwiseLinear(
                full, group, name, self.blocks, shard=shards, sequence=self.sequence
            )
            setattr(owner, attr, layer)

    def __repr__(self) -> str:
        args = [f"blocks={self.blocks}"] * (self.blocks > 1) + ["sequence=True"] * self.sequence
        return f"Colwise({', '.join(args)})"


@dataclass(repr=False)
class Rowwise(Style):
    """nn.Linear, input features split; partial outputs all-reduced, bias added once.

    ``sequence``: partial outputs reduce-scattered along T instead, so the output
    is this rank's slice of the sequence (torch's ``RowwiseParallel(output_layouts=Shard(1))``).
    """

    sequence: bool = False
    input_layout = "shard(-1) or replicate"

    @property
    def output_layout(self) -> str:  # type: ignore[override]
        return "shard(1)" if self.sequence else "replicate"

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        full = cast(nn.Linear, _layer(owner, attr, name, nn.Linear, "rowwise"))
        if group is not None:
            setattr(
                owner, attr, RowwiseLinear(full, group, name, shard=shards, sequence=self.sequence)
            )

    def __repr__(self) -> str:
        return "Rowwise(sequence=True)" if self.sequence else "Rowwise()"


class Vocab(Style):
    """nn.Embedding, vocabulary rows split; other ranks' tokens masked, output all-reduced."""

    input_layout = "replicate (token ids)"
    output_layout = "replicate"

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        full = cast(nn.Embedding, _layer(owner, attr, name, nn.Embedding, "vocab"))
        if group is not None:
            setattr(owner, attr, VocabEmbedding(full, group, name, shard=shards))


class Divide(Style):
    """An int attribute (heads, widths) divided by the tensor-parallel size."""

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        value = getattr(owner, attr)
        local = local_count(value, group, name)
        if group is not None:
            setattr(owner, attr, local)


class Replicate(Style):
    """Every rank holds all of it (the default; planned to document it)."""

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        getattr(owner, attr)  # it must exist


# Torch layers "sequence" may run on: per-token computations (others mix tokens, or are
# tensor-parallel layers of their own). A module of the user's is the user's to vouch for.
_NOT_PER_TOKEN = (nn.Linear, nn.Embedding, nn.MultiheadAttention, nn.Conv1d, nn.RNNBase)


class Sequence(Style):
    """A layer norm or dropout run on this rank's slice of the sequence (torch's ``SequenceParallel``).

    The module is kept as it is (its input is already ``(B, T / tp, C)``): only
    its replicated parameters' gradients, each a sum over this rank's tokens,
    are summed over the group.
    """

    input_layout = "shard(1)"
    output_layout = "shard(1)"

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        module = getattr(owner, attr, None)
        if not isinstance(module, nn.Module) or isinstance(module, _NOT_PER_TOKEN):
            raise TypeError(
                f"{name}: sequence runs a layer norm or dropout on this rank's slice of the"
                f" sequence, not {type(module).__name__} (nn.LayerNorm, nn.RMSNorm, nn.Dropout or"
                " a per-token module of yours)"
            )
        if group is not None:
            module.register_forward_pre_hook(_sum_parameter_gradients(group))
            module.register_forward_hook(_restore_parameters, always_call=True)


class FromSequence(Style):
    """A module whose input arrives as this rank's slice of the sequence: gathered whole on
    entry (torch's ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())``),
    so its ``forward`` sees the serial shapes (``B, T, C = x.size()``)."""

    input_layout = "shard(1)"

    def apply(
        self,
        owner: nn.Module,
        attr: str,
        name: str,
        group: dist.ProcessGroup | None,
        shards: Shards,
    ) -> None:
        module = getattr(owner, attr, None)
        if not isinstance(module, nn.Module) or type(module) is nn.Linear:
            raise TypeError(
                f"{name}: 'from sequence' gathers a module's input, not {type(module).__name__}'s"
                " (for an nn.Linear, plan 'colwise from sequence')"
            )
        if group is not None:
            module.register_forward_pre_hook(_gather_first_input(group, name))


def _sum_parameter_gradients(group: dist.ProcessGroup) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook running the module on views of its parameters whose gradients are
    summed over the group, all of them in one all-reduce (``sum_gradients``), rather than
    one gradient hook and one collective per parameter. ``_restore_parameters`` puts the
    parameters back after the forward. Set up at every forward, not at planning, so a
    ``copy.deepcopy`` of the model (its hooks are kept) sums its own parameters' gradients."""

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        _restore_parameters(module)  # a forward that raised may have left views in place
        if not torch.is_grad_enabled():
            return
        slots: list[tuple[nn.Module, str]] = []
        params: list[torch.Tensor] = []
        index: dict[int, int] = {}  # a parameter under two names gets one view
        for owner in module.modules():
            for name, param in owner._parameters.items():
                # not a Parameter: a view an enclosing "sequence" module put there (summed once)
                if isinstance(param, nn.Parameter) and param.requires_grad:
                    slots.append((owner, name))
                    if id(param) not in index:
                        index[id(param)] = len(params)
                        params.append(param)
        if not params:
            return
        views = sum_gradients(params, group)
        module.__dict__[_SWAPPED] = [
            (owner, name, owner._parameters[name]) for owner, name in slots
        ]
        for owner, name in slots:  # a plain tensor where a parameter was: what forward reads
            table: dict[str, Any] = owner._parameters
            table[name] = views[index[id(table[name])]]

    return hook


_SWAPPED = "_tensor_parallel_parameters"  # (owner, name, parameter) while a forward runs on views


def _restore_parameters(module: nn.Module, *_: Any) -> None:
    for owner, name, param in module.__dict__.pop(_SWAPPED, ()):
        owner._parameters[name] = param


def _gather_first_input(
    group: dist.ProcessGroup, name: str
) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...]]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args or not hasattr(args[0], "shape"):
            raise TypeError(f"{name}: 'from sequence' gathers the first positional input tensor")
        return (gather_sequence(args[0], group), *args[1:])

    return hook


# -- paths through the module tree ----------------------------------------------------------


def resolve(module: nn.Module, path: str, name: str) -> Iterator[tuple[nn.Module, str, str]]:
    """(owner, attribute, dotted name) for ``path``: through submodules, ModuleDict keys,
    ModuleList/Sequential indices and ``*`` (every child), as torch's plans."""
    parts = path.split(".")

    def walk(owner: nn.Module, i: int, prefix: str) -> Iterator[tuple[nn.Module, str, str]]:
        part = parts[i]
        if i == len(parts) - 1:
            if part == "*":
                for key in owner._modules:
                    yield owner, key, f"{prefix}.{key}"
            else:
                if not hasattr(owner, part):
                    raise AttributeError(
                        f"{prefix}.{part}: {type(owner).__name__} has no attribute {part!r}"
                        f" (children: {', '.join(owner._modules) or 'none'})"
                    )
                yield owner, part, f"{prefix}.{part}"
            return
        keys = list(owner._modules) if part == "*" else [part]
        for key in keys:
            child = owner._modules.get(key)
            if child is None:
                raise AttributeError(
                    f"{prefix}.{key}: {type(owner).__name__} has no submodule {key!r}"
                    f" (children: {', '.join(owner._modules) or 'none'})"
                )
            yield from walk(child, i + 1, f"{prefix}.{key}")

    yield from walk(module, 0, name)


# -- applying plans to built modules ----------------------------------------------------------


@dataclass
class Planned:
    """One module's plan, with the tensor group its shards are cut in (None: kept whole)."""

    module: nn.Module
    name: str
    group: dist.ProcessGroup | None
    plan: dict[str, Style]


def parallelize(
    module: nn.Module, name: str, group: dist.ProcessGroup | None, plan: dict[str, Style]
) -> None:
    """Apply ``plan`` to the built ``module`` now (the decorators' plans go through
    ``macrogen.runtime.parallelize.apply_class_plans``, once the outermost model is built)."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        warn_whole(name)
    apply([Planned(module, name, group, plan)], module)


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


def apply(planned: list[Planned], root: nn.Module) -> None:
    """Cut every planned layer of ``planned`` (under ``root``) into this rank's shard, all at once."""
    shards = Shards()
    problems: list[Exception] = []  # every entry's problem, reported at once
    # divided attributes' serial values, before dividing: what every rank must agree on
    serial = {id(p): _divided(p) for p in planned if p.group is not None}
    for p in planned:
        for path, style in p.plan.items():
            try:
                for owner, attr, name in list(resolve(p.module, path, p.name)):
                    style.apply(owner, attr, name, p.group, shards)
            except (TypeError, ValueError, AttributeError) as e:
                problems.append(e)
        object.__setattr__(p.module, "tp_size", group_size(p.group))
    if problems:
        raise type(problems[0])("\n".join(str(e) for e in problems))
    _check_ties(root, planned, shards)
    _check_agreement(planned, serial)


def _divided(p: Planned) -> tuple[tuple[str, Any], ...]:
    found = []
    for path, style in p.plan.items():
        if isinstance(style, Divide):
            try:
                found += [(n, getattr(o, a, None)) for o, a, n in resolve(p.module, path, p.name)]
            except AttributeError:
                pass  # reported by the plan's own checks
    return tuple(found)


def _check_ties(root: nn.Module, planned: list[Planned], shards: Shards) -> None:
    """A full parameter that was sharded must not remain anywhere: it was tied to an unplanned layer."""
    trees = [root, *(p.module for p in planned)]
    for tree in trees:
        for key, param in tree.named_parameters(remove_duplicate=False):
            hit = shards.cut.get(id(param))
            if hit is not None and hit[0] is param:
                raise ValueError(
                    f"{type(tree).__name__}.{key} is tied to {hit[4]}, which the plan shards;"
                    " plan both with the same split (a vocab embedding and a colwise head share"
                    " rows) or untie them"
                )


def _check_agreement(planned: list[Planned], serial: dict[int, tuple[Any, ...]]) -> None:
    """Every rank must have planned the same: plan, divided counts and shard shapes.

    Divided attributes matter most: ``n_head`` 8 on one rank and 4 on another
    gives equal parameter shapes and silently different attention.
    """
    live = [p for p in planned if p.group is not None]
    if not live:
        return
    mine = tuple(
        (
            p.name,
            tuple((k, repr(v)) for k, v in p.plan.items()),
            tuple((n, tuple(t.shape)) for n, t in p.module.state_dict().items()),
            serial[id(p)],
        )
        for p in live
    )
    groups.barrier("tensor_parallel: the rank-agreement check")  # a stopped peer is named
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)  # every rank cuts the same roots in the same order
    for rank, other in enumerate(gathered):
        if other != gathered[0]:
            raise RuntimeError(
                f"tensor_parallel: rank {rank} built a different model than rank 0:"
                f" {_difference(gathered[0], other)} (raised on rank {dist.get_rank()};"
                " every rank must build the same model)"
            )


def _difference(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    labels = ("module", "plan", "parameter shapes", "divided attributes (serial values)")
    for one, two in zip(a, b):
        for label, x, y in zip(labels, one, two):
            if x != y:
                return f"{one[0]}'s {label}: {x!r} on rank 0 but {y!r}"
    return f"{len(a)} tensor-parallel modules on rank 0 but {len(b)}"
