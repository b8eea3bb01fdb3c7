"""Where ``@pipeline`` (and ``mg.parallelize(pp=N)`` on a model of the user's own) cuts a model:
its forward's statements, as the expansion generated them, shared out between the stages.

``forward_cut`` takes the model's ``forward`` as units (``macrogen/pipelining/units.py``: each
statement a function; each block of a ``for block in self.<ModuleList>:`` loop a unit of its
own) and cuts them at the ``split`` names or, without them, where the stages' parameter
counts come out most even. A stage holds the parts its units read (same attribute names,
same state_dict keys); parts forward never names live on stage 0. No source is read here:
the macro analysed forward at expansion.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from macrogen.pipelining.units import (
    Forward,
    SplitError,
    Unit,
    balanced,
    check_cuts,
    resolve_split,
    runs,
    split_count_message,
    starts_text,
)
from macrogen.runtime.pipeline_parts import (
    Elsewhere,
    numel,
    part_at,
    placeable,
    tied,
    unplaced,
)


@dataclass(frozen=True)
class StepInputs:
    """What the schedule gives the stages for one step (split into micro-batches)."""

    args: tuple[Any, ...]  # the first stage's positional arguments
    kwargs: dict[str, Any]  # every stage's keyword arguments
    last: dict[str, Any]  # the last stage's too: forward's targets, when it computes the loss
    divisor: int  # each micro-batch's loss is divided by it (their number: a mean of means)


@dataclass
class ForwardCut:
    """forward's units shared out between the stages; see the module docstring."""

    forward: Forward
    units: list[Unit]
    starts: list[int]  # unit index where each stage after the first starts
    carried: list[str]  # the value each cut sends on
    owners: dict[str, set[int]]  # part ("transformer.wte", "blocks.3", "pos") -> stages using it
    # parameters that parts on several stages share (nanoGPT's tied wte and lm_head weight):
    # (their first name, those stages); each stage holds it, its gradients are summed
    tied: list[tuple[str, frozenset[int]]] = field(default_factory=list)
    # the paths forward reads that name a part of the model (not self.config.block_size)
    placeable: frozenset[str] = frozenset()

    @property
    def stages(self) -> int:
        return len(self.starts) + 1

    @property
    def targets(self) -> str | None:
        """forward's parameter for ``y`` when it computes the loss (nanoGPT's ``targets``)."""
        return self.forward.targets

    def bounds(self, stage: int) -> tuple[int, int]:
        edges = [0, *self.starts, len(self.units)]
        return edges[stage], edges[stage + 1]

    def blocks(self, stage: int) -> list[str]:
        """The blocks of forward's loops that ``stage`` runs (``blocks.3``): FSDP's units."""
        a, b = self.bounds(stage)
        return [u.name for u in self.units[a:b] if u.block is not None]

    def describe(self) -> str:
        """``stage 0: wte, wpe, blocks.0-2 | stage 1: blocks.3-5, lm_head, ln_f`` (source order)."""
        stages = []
        for s in range(self.stages):
            a, b = self.bounds(s)
            parts = [
                part
                for u in self.units[a:b]
                for part in u.parts
                if u.block is not None or part in self.placeable
            ]
            stages.append(f"stage {s}: {runs(parts)}")
        return " | ".join(stages)

    def placeholder(self, part: str, stage: int) -> nn.Module:
        """What stands where stage ``stage``'s module part was, on a rank that runs others."""
        return Elsewhere(part, stage)

    def code(self, model: nn.Module, stage: int) -> Callable[..., Any]:
        return stage_code(model, self, stage)

    def inputs(
        self, x: Any, y: torch.Tensor, loss_fn: Any, microbatches: int, *, where: str
    ) -> StepInputs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{where}pipeline_step takes x as one tensor (forward's first argument), not"
                f" {type(x).__name__}"
            )
        if loss_fn is None and self.targets is None:
            raise ValueError(
                f"{where}pipeline_step without a loss_fn gives y to forward's second parameter,"
                " and forward has none with a default (nanoGPT's targets=None): give a loss_fn"
            )
        last = {self.targets: y} if loss_fn is None and self.targets else {}
        return StepInputs((x,), {}, last, microbatches)


def forward_cut(
    model: nn.Module,
    stages: int,
    split: tuple[str, ...] | None,
    forward: Forward,
    speeds: list[float] | None = None,
    limits: list[float] | None = None,
) -> ForwardCut:
    """Cut ``model``'s forward into ``stages`` stages (pure: the model is not changed);
    ``speeds``: each stage's device's relative speed, its share of the parameters;
    ``limits``: the most parameters each stage's memory holds."""
    name = type(model).__name__
    blocks: dict[str, int] = {}
    for loop in forward.loops:
        seq = part_at(model, loop)
        if not isinstance(seq, (nn.ModuleList, nn.Sequential)):
            raise ValueError(
                f"{name}.forward loops over self.{loop}, which is a {type(seq).__name__}:"
                " a loop a stage can start inside is over an nn.ModuleList"
            )
        blocks[loop] = len(seq)
    units = forward.units(blocks)
    try:
        if split is not None:
            if len(split) != stages - 1:
                raise SplitError(split_count_message(stages, len(split)))
            starts = resolve_split(forward, units, list(split))
        else:
            starts = _balance(model, forward, units, stages, speeds, limits)
        carried = check_cuts(forward, units, starts, list(split) if split else None)
    except SplitError as e:
        raise ValueError(f"{name}: {e.message}") from None
    cut = ForwardCut(forward, units, starts, carried, {})
    cut.owners = _owners(model, cut)
    cut.tied = tied(model, cut.owners)
    paths = {a for u in units for a in u.statement.attrs}
    cut.placeable = frozenset(a for a in paths if placeable(model, a) is not None)
    return cut


def _balance(
    model: nn.Module,
    forward: Forward,
    units: list[Unit],
    stages: int,
    speeds: list[float] | None = None,
    limits: list[float] | None = None,
) -> list[int]:
    loops = forward.loops
    if not loops:
        raise SplitError(
            f"forward has no `for block in self.<ModuleList>:` loop to balance over: give"
            f" split=[...] (the submodules that start stages 1..{stages - 1};"
            f" {starts_text(units)})"
        )
    candidates = [k for k, u in enumerate(units) if u.block is not None and u.block > 0]
    total = sum(1 for u in units if u.block is not None)
    if stages > total:
        raise SplitError(
            f"{stages} stages but forward's loop{'s' if len(loops) > 1 else ''} over"
            f" {', '.join('self.' + lp for lp in loops)} ha{'ve' if len(loops) > 1 else 's'}"
            f" {total} blocks: at most one stage per block"
        )
    # per unit: a tied tensor weighs on each stage that holds it
    weights = [numel(model, _parts(model, forward, u)) for u in units]
    return balanced(weights, candidates, stages, speeds, limits)


def _parts(model: nn.Module, forward: Forward, unit: Unit) -> list[str]:
    """The parts of the model a unit uses: ``blocks.3`` for a block, ``transformer.wte``.

    A path the unit reads (``self.transformer.wte.weight``) is cut where it leaves the
    containers (ModuleDict, ModuleList, Sequential): the part is ``transformer.wte``.
    """
    parts = [unit.name] if unit.block is not None else []
    loops = set(forward.loops)
    for path in sorted(unit.statement.attrs):
        part = placeable(model, path)
        if part is not None and part not in loops and part not in parts:
            parts.append(part)
    return parts


def _owners(model: nn.Module, cut: ForwardCut) -> dict[str, set[int]]:
    owners: dict[str, set[int]] = {}
    for s in range(cut.stages):
        a, b = cut.bounds(s)
        for u in cut.units[a:b]:
            for part in _parts(model, cut.forward, u):
                owners.setdefault(part, set()).add(s)
    # Parts forward never names (a head only a method uses, an unused layer) live on stage 0.
    for part in unplaced(model, owners):
        owners[part] = {0}
    return owners


def stage_code(model: nn.Module, cut: ForwardCut, stage: int) -> Callable[..., Any]:
    """This stage's slice of forward: the generated functions of its units, in order.

    Stage 0 takes forward's arguments; a later stage the value the cut before it
    carries (the last one also forward's targets); each returns what the cut after it
    carries, the last forward's output.
    """
    a, b = cut.bounds(stage)
    units = cut.units[a:b]
    forward = cut.forward
    signature = inspect.signature(type(model).forward)  # the serial forward's
    given = None if stage == 0 else cut.carried[stage - 1]
    output = cut.carried[stage] if stage < len(cut.starts) else None
    targets = forward.targets if output is None else None
    found = signature.parameters.get(targets) if targets else None
    default = None if found is None else found.default

    def run(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if output is not None:  # forward's targets reach the last stage only
            kwargs = {}
        if given is None:
            bound = signature.bind(model, *args, **kwargs)
            bound.apply_defaults()
            env = dict(list(bound.arguments.items())[1:])
        else:
            env = {given: args[0]}
            if targets is not None:
                env[targets] = kwargs.get(targets, default)
        result = None
        for u in units:
            s = u.statement
            assert s.fn is not None, "a Forward of the expansion's: its functions"
            block = () if u.block is None else (part_at(model, u.name),)
            result = s.fn(model, *block, *(env[n] for n in s.reads))
            if s.writes:
                env.update(zip(s.writes, (result,) if len(s.writes) == 1 else result))
        return result if output is None else env[output]

    return run
