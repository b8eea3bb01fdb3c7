"""Pipeline parallelism for ``@pipeline`` models, on ``torch.distributed.pipelining``.

A generated ``@pipeline`` class makes one ``Pipeline`` at the end of its
``__init__`` (the whole model is built first, initialized exactly as in the
serial run). The ``Pipeline``:

1. reads the model's ``forward`` (``pipeline_forward``) and cuts its units into
   ``stages`` stages, at the ``split`` names or, without them, at block
   boundaries of its ``nn.ModuleList`` loop, balanced by parameter count;
2. lays the world out as a (pipeline x data) ``DeviceMesh``, pipeline outermost:
   rank r is stage ``r // data_size``; ranks of one stage form a data group;
3. keeps this stage's parts of the model (same attribute names, same state_dict
   keys) and puts an ``Elsewhere`` placeholder where another stage's parts
   were, so ``model.parameters()`` is this stage's parameters;
4. at the first ``pipeline_step``, wraps this stage's code in torch's
   ``PipelineStage`` and runs ``ScheduleGPipe`` or ``Schedule1F1B`` over
   ``microbatches`` micro-batches on every step.

Loss scaling: each micro-batch's loss is divided by the number of micro-batches
and the schedule does not rescale the gradients, so the gradients add to
whatever ``.grad`` held, exactly as the serial ``loss.backward()`` does (a
mean loss over equal micro-batches is the mean over the batch).

Run without a process group (or with world size 1) the model stays whole and
``pipeline_step`` is the serial step.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from macrogen.runtime import groups, mesh
from macrogen.runtime import pipeline_forward as pf

SCHEDULES = ("gpipe", "1f1b")
ATTR = "_macrogen_pipeline"  # where a pipelined model keeps its Pipeline (markers look for it)


@dataclass(frozen=True)
class PipelineConfig:
    stages: int  # pipeline stages: the world is stages x data ranks
    microbatches: int = 4  # micro-batches per step: more shrink the bubble, fewer are larger
    schedule: str = "1f1b"  # "gpipe" (all forwards, then all backwards) or "1f1b"
    split: tuple[str, ...] | None = (
        None  # names that start stages 1..: ("blocks.3",); None: balanced
    )


@dataclass(frozen=True)
class Layout:
    """Where this rank sits on the program's (pipeline x data) mesh."""

    stages: int
    data_size: int
    stage: int  # rank // data_size
    data_rank: int  # rank % data_size: which share of the data this rank trains on
    pipeline_group: dist.ProcessGroup  # this rank and its peers of the other stages
    data_group: dist.ProcessGroup  # ranks holding the same stage (one rank: its own group)


def layout(stages: int, *, where: str = "") -> Layout | None:
    """This rank's place on the (pipeline x data) mesh; None when serial (no group, world 1)."""
    if not groups.ensure_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    if world % stages:
        raise ValueError(
            f"{_at(where)}world size {world} does not divide into {stages} pipeline stages:"
            f" launch a multiple of {stages} processes (pipeline x data)"
        )
    try:
        m = mesh.install(lambda: build_mesh(world, stages), pipeline_size=stages)
    except ValueError as e:
        raise ValueError(f"{_at(where)}{e}") from None
    if m.tensor_size != 1:  # (install only makes pipeline x data meshes)
        raise ValueError(f"{_at(where)}tensor parallelism inside pipeline stages is not supported")
    assert m.pipeline_group is not None and m.data_group is not None
    rank = dist.get_rank()
    return Layout(stages, m.data_size, rank // m.data_size, m.data_rank, m.pipeline_group,
                  m.data_group)  # fmt: skip


def build_mesh(world: int, stages: int) -> mesh.Mesh:
    """The (pipeline x data) groups, pipeline outermost, and torch's DeviceMesh over them.

    Rank r holds stage r // data_size. Every rank makes every group, in the same order.
    A data size of 1 still gets its one-rank groups: the default group would mix stages.
    """
    data_size, rank = world // stages, dist.get_rank()
    grid = torch.arange(world).view(stages, data_size)  # (pipeline, data)
    pipeline_group = data_group = None
    for line in grid.t().tolist():
        g = dist.new_group(line, timeout=groups.timeout())
        if rank in line:
            pipeline_group = g
    for line in grid.tolist():
        g = dist.new_group(line, timeout=groups.timeout())
        if rank in line:
            data_group = g
    from torch.distributed.device_mesh import DeviceMesh

    device_type = torch.device(groups.placement().device).type
    assert pipeline_group is not None and data_group is not None  # every rank is in one line
    device_mesh = DeviceMesh.from_group(
        [pipeline_group, data_group], device_type, mesh=grid, mesh_dim_names=("pipeline", "data")
    )
    return mesh.Mesh(data_size, 1, None, data_group, rank % data_size, stages, pipeline_group,
                     device_mesh)  # fmt: skip


def reset() -> None:
    """Forget the mesh (tests that build several programs in one process)."""
    mesh.reset()


def _at(where: str) -> str:
    return f"pipeline at {where}: " if where else ""


# -- the plan: which units and which parts of the model each stage holds -------------------


@dataclass
class Plan:
    forward: pf.Forward
    units: list[pf.Unit]
    starts: list[int]  # unit index where each stage after the first starts
    carried: list[str]  # the value each cut sends on
    owners: dict[str, set[int]]  # part ("wte", "blocks.3", "pos") -> stages that use it

    def bounds(self, stage: int) -> tuple[int, int]:
        edges = [0, *self.starts, len(self.units)]
        return edges[stage], edges[stage + 1]

    def describe(self) -> str:
        """``stage 0: wte, wpe, blocks.0-2 | stage 1: blocks.3-5, lm_head, ln_f`` (source order)."""
        stages = []
        for s in range(len(self.starts) + 1):
            a, b = self.bounds(s)
            stages.append(
                f"stage {s}: {pf.runs([part for u in self.units[a:b] for part in u.parts])}"
            )
        return " | ".join(stages)


def forward_of(model: nn.Module) -> tuple[pf.Forward, Callable[..., Any]]:
    fn = type(model).forward
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        raise ValueError(
            f"can't read {type(model).__name__}.forward's source to cut it into stages: {e}"
        ) from None
    try:
        return pf.parse(source), fn
    except pf.SplitError as e:
        first = inspect.getsourcelines(fn)[1]
        line = f" (line {first + e.line - 1})" if e.line else ""
        raise ValueError(f"{type(model).__name__}.forward{line}: {e.message}") from None


def plan(model: nn.Module, stages: int, split: tuple[str, ...] | None) -> Plan:
    """Cut ``model``'s forward into ``stages`` stages (pure: the model is not changed)."""
    forward, _ = forward_of(model)
    name = type(model).__name__
    blocks: dict[str, int] = {}
    for loop in forward.loops:
        seq = getattr(model, loop, None)
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
                raise pf.SplitError(pf.split_count_message(stages, len(split)))
            starts = pf.resolve_split(forward, units, list(split))
        else:
            starts = _balance(model, forward, units, stages)
        carried = pf.check_cuts(forward, units, starts, list(split) if split else None)
    except pf.SplitError as e:
        raise ValueError(f"{name}: {e.message}") from None
    p = Plan(forward, units, starts, carried, {})
    p.owners = _owners(model, p, stages)
    return p


def _balance(model: nn.Module, forward: pf.Forward, units: list[pf.Unit], stages: int) -> list[int]:
    loops = forward.loops
    if not loops:
        raise pf.SplitError(
            f"forward has no `for block in self.<ModuleList>:` loop to balance over: give"
            f" split=[...] (the submodules that start stages 1..{stages - 1})"
        )
    candidates = [k for k, u in enumerate(units) if u.block is not None and u.block > 0]
    total = sum(1 for u in units if u.block is not None)
    if stages > total:
        raise pf.SplitError(
            f"{stages} stages but forward's loop{'s' if len(loops) > 1 else ''} over"
            f" {', '.join('self.' + lp for lp in loops)} ha{'ve' if len(loops) > 1 else 's'}"
            f" {total} blocks: at most one stage per block"
        )
    seen: set[int] = set()
    weights = []
    for u in units:
        n = 0
        for part in _parts(forward, u):
            for p in _part_params(model, part):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        weights.append(n)
    return pf.balanced(weights, candidates, stages)


def _parts(forward: pf.Forward, unit: pf.Unit) -> list[str]:
    """The parts of the model a unit uses: ``blocks.3`` for a block, ``wte`` for self.wte."""
    attrs = set(unit.statement.attrs)
    parts = []
    if unit.block is not None:
        attrs.discard(unit.statement.loop or "")
        parts.append(unit.name)
    loops = set(forward.loops)
    return parts + sorted(a for a in attrs if a not in loops)


def _part_params(model: nn.Module, part: str) -> list[nn.Parameter]:
    obj = _get(model, part)
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    if isinstance(obj, nn.Parameter):
        return [obj]
    return []


def _get(model: nn.Module, part: str) -> Any:
    head, _, index = part.partition(".")
    if index:
        return getattr(model, head)[int(index)]
    for table in (model._modules, model._parameters, model._buffers):
        if head in table:
            return table[head]
    return None  # an int, a config, a method: nothing to place


def _owners(model: nn.Module, p: Plan, stages: int) -> dict[str, set[int]]:
    owners: dict[str, set[int]] = {}
    for s in range(stages):
        a, b = p.bounds(s)
        for u in p.units[a:b]:
            for part in _parts(p.forward, u):
                if _get(model, part) is not None:
                    owners.setdefault(part, set()).add(s)
    loops = set(p.forward.loops)
    # Parts forward never names (a head only a method uses, an unused layer) live on stage 0.
    for table in (model._modules, model._parameters, model._buffers):
        for name, value in table.items():
            if value is not None and name not in loops and name not in owners:
                owners[name] = {0}
    # A parameter may live on one stage only (tied weights across stages would need a
    # collective of their own).
    where: dict[int, tuple[str, int]] = {}
    for part, users in sorted(owners.items()):
        for param in _part_params(model, part):
            for s in users:
                if id(param) in where and where[id(param)][1] != s:
                    other, t = where[id(param)]
                    raise ValueError(
                        f"{type(model).__name__}: stages {t} and {s} both use a parameter of"
                        f" {other!r} and {part!r} (tied weights or a layer used twice): a"
                        " parameter must live on one stage; move the cut or untie the weights"
                    )
                where[id(param)] = (part, s)
    return owners


# -- this rank's stage ------------------------------------------------------------------


class Elsewhere(nn.Module):
    """A part of the model that lives on another pipeline stage (this rank holds no copy)."""

    def __init__(self, part: str, stage: int):
        super().__init__()
        self.part = part
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.part} lives on pipeline stage {self.stage}, not on this rank: a pipelined"
            " model trains through mg.pipeline_step(model, x, y, loss_fn), which runs the schedule"
        )

    def extra_repr(self) -> str:
        return f"{self.part!r} on stage {self.stage}"


class StageModule(nn.Module):
    """This rank's stage for ``PipelineStage``: the stage's code over the model's own parts."""

    model: nn.Module
    code: Callable[..., Any]

    def __init__(self, model: nn.Module, code: Callable[..., Any], parts: list[Any]):
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: its parameters are not all ours
        self.__dict__["code"] = code
        self.parts = nn.ModuleList(p for p in parts if isinstance(p, nn.Module))
        self.params = nn.ParameterList(p for p in parts if isinstance(p, nn.Parameter))

    def forward(self, *args: Any) -> Any:
        return self.code(self.model, *args)


def stage_code(model: nn.Module, p: Plan, stage: int) -> Callable[..., Any]:
    """Compile this stage's slice of forward, with the user's file and line numbers."""
    forward, fn = forward_of(model)
    a, b = p.bounds(stage)
    inputs = [] if stage == 0 else [p.carried[stage - 1]]
    output = p.carried[stage] if stage < len(p.starts) else None
    module = pf.stage_function(forward, p.units, a, b, inputs, output)
    first = inspect.getsourcelines(fn)[1]
    ast.increment_lineno(module, first - 1)
    filename = inspect.getsourcefile(fn) or "<forward>"
    namespace = fn.__globals__
    if fn.__closure__:  # a class defined in a function: its free names join the globals
        namespace = dict(namespace)
        namespace.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    local: dict[str, Any] = {}
    exec(compile(module, filename, "exec"), namespace, local)
    return local["forward"]


class Pipeline:
    """Cuts ``model`` to this rank's stage and runs the schedule; see the module docstring."""

    def __init__(self, model: nn.Module, config: PipelineConfig, *, where: str = ""):
        if config.schedule not in SCHEDULES:
            raise ValueError(
                f"{_at(where)}schedule must be one of {SCHEDULES}, not {config.schedule!r}"
            )
        if config.microbatches < 1 or config.stages < 1:
            raise ValueError(f"{_at(where)}stages and microbatches must be >= 1")
        if config.schedule == "1f1b" and config.microbatches < config.stages:
            raise ValueError(
                f"{_at(where)}1f1b needs at least as many micro-batches as stages"
                f" ({config.microbatches} < {config.stages})"
            )
        self.model = model
        self.config = config
        self.where = where
        self.layout = layout(config.stages, where=where) if config.stages > 1 else None
        try:
            self.plan = plan(model, config.stages, config.split)
        except ValueError as e:
            raise ValueError(f"{_at(where)}{e}") from None
        self.keys = list(model.state_dict().keys())  # the serial model's, in its order
        self._schedule: Any = None
        self._shape: Any = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        if self.layout is not None:
            self._cut(self.layout.stage)

    @property
    def stage(self) -> int:
        return 0 if self.layout is None else self.layout.stage

    def describe(self) -> str:
        return self.plan.describe()

    def _cut(self, stage: int) -> None:
        """Keep this stage's parts; an ``Elsewhere`` (or nothing, for a tensor) for the others'."""
        model = self.model
        kept = []
        for part, users in self.plan.owners.items():
            if stage in users:
                kept.append(_get(model, part))
                continue
            owner = min(users)
            head, _, index = part.partition(".")
            if index:
                getattr(model, head)[int(index)] = Elsewhere(part, owner)
            elif head in model._modules:
                setattr(model, head, Elsewhere(part, owner))
            else:
                model._parameters.pop(head, None)
                model._buffers.pop(head, None)
        self.parts = kept
        self.code = stage_code(model, self.plan, stage)

    # -- the step ---------------------------------------------------------------------
    def step(
        self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """One training step's forward and backward; the batch's mean loss on every rank."""
        if self.layout is None:
            return serial_step(self.model, x, y, loss_fn)
        m = self.config.microbatches
        if x.shape[0] % m:
            raise ValueError(
                f"{_at(self.where)}a batch of {x.shape[0]} does not split into {m} equal"
                " micro-batches (the mean loss over unequal ones is not the batch's mean)"
            )
        shape = (tuple(x.shape), x.dtype, tuple(y.shape))
        if self._schedule is None or shape != self._shape:
            self._schedule, self._shape = self._build(), shape  # new shapes: new p2p buffers
        self._loss_fn = loss_fn
        # The schedule calls this stage's code, not the model: run the model's forward
        # pre-hooks once, as model(x) would (@data_parallel's start-up and buffer broadcast).
        for hook in list(self.model._forward_pre_hooks.values()):
            hook(self.model, (x,))
        stage, lay = self._schedule._stage, self.layout
        losses: list[torch.Tensor] = []
        if stage.is_first:
            self._schedule.step(x, return_outputs=False)
        elif stage.is_last:
            self._schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self._schedule.step(return_outputs=False)
        if lay.data_size > 1 and not _has_gradient_sync(self.model):
            self._average_over_data()  # (@data_parallel on the model averages in its buckets)
        device = self._device()
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
        last = dist.get_global_rank(lay.pipeline_group, lay.stages - 1)
        dist.broadcast(loss, src=last, group=lay.pipeline_group)
        return loss

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target) / self.config.microbatches

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _build(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        lay = self.layout
        assert lay is not None
        module = StageModule(self.model, self.code, self.parts)
        stage = PipelineStage(
            module, lay.stage, lay.stages, self._device(), group=lay.pipeline_group
        )
        kind = ScheduleGPipe if self.config.schedule == "gpipe" else Schedule1F1B
        # scale_grads=False: each micro-batch's loss is already divided by their number
        return kind(stage, self.config.microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    def _average_over_data(self) -> None:
        """Average this stage's gradients over the ranks that hold the same stage."""
        lay = self.layout
        assert lay is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a flat buffer needs every gradient; unused ones add zeros
                p.grad = torch.zeros_like(p)
        grads = [g for p in params if (g := p.grad) is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=lay.data_group)
        flat /= lay.data_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- checkpoints ---------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The serial model's state dict (same keys, same order), gathered from every stage."""
        local = self.model.state_dict()
        if self.layout is None:
            return local
        gathered: list[Any] = [None] * self.layout.stages
        mine = {k: v.detach().cpu() for k, v in local.items()}
        dist.all_gather_object(gathered, mine, group=self.layout.pipeline_group)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            for k, v in part.items():
                merged.setdefault(k, v)
        return {k: merged[k] for k in self.keys if k in merged}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load a serial model's state dict: each stage keeps its own entries."""
        if strict:
            missing = [k for k in self.keys if k not in state_dict]
            unexpected = [k for k in state_dict if k not in self.keys]
            if missing or unexpected:
                raise RuntimeError(
                    f"{_at(self.where)}not a state dict of this model: missing {missing},"
                    f" unexpected {unexpected}"
                )
        local = self.model.state_dict().keys()
        return self.model.load_state_dict(
            {k: v for k, v in state_dict.items() if k in local}, strict=strict
        )


def _has_gradient_sync(model: nn.Module) -> bool:
    from macrogen.runtime.data_parallel import GradientSync

    return any(isinstance(v, GradientSync) for v in vars(model).values())


# -- what users and generated code call ------------------------------------------------------


def serial_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss


def pipeline_of(model: nn.Module) -> Pipeline | None:
    found = getattr(model, "__dict__", {}).get(ATTR)
    return found if isinstance(found, Pipeline) else None


def pipeline_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """``loss = loss_fn(model(x), y); loss.backward(); return loss``, or the model's schedule."""
    pipe = pipeline_of(model)
    return serial_step(model, x, y, loss_fn) if pipe is None else pipe.step(x, y, loss_fn)


def attach(model: nn.Module, config: PipelineConfig, *, where: str = "") -> Pipeline:
    """Make ``model`` (fully built) pipelined: this rank keeps its stage."""
    pipe = Pipeline(model, config, where=where)
    model.__dict__[ATTR] = pipe
    return pipe


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    pipe = pipeline_of(model)
    return model.state_dict() if pipe is None else pipe.full_state_dict()


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
    pipe = pipeline_of(model)
    if pipe is None:
        return model.load_state_dict(state_dict, strict=strict)
    return pipe.load_full_state_dict(state_dict, strict)
