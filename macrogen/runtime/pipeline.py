"""Pipeline parallelism for ``@pipeline`` models, on ``torch.distributed.pipelining``.

A generated ``@pipeline`` class makes one ``Pipeline`` at the end of its
``__init__`` (the whole model is built first, initialized exactly as in the
serial run). The ``Pipeline``:

1. takes the model's ``forward`` as the expansion wrote it, one function per
   statement (``Forward``, ``macrogen/pipeline_units.py``), and cuts its units
   into ``stages`` stages, at the ``split`` names or, without them, at block
   boundaries of its ``nn.ModuleList`` loop, balanced by parameter count (no
   source is read here: the macro analysed forward at expansion);
2. lays the world out as the program's (pipeline x data x tensor) ``DeviceMesh``
   (``mesh.py``), pipeline outermost: rank r is stage ``r // (data_size *
   tensor_size)``; tensor-parallel layers inside the stages were built with
   their stage's tensor group (``declare``, before the model's ``__init__``)
   and are cut into shards here, before the stage cut;
3. keeps this stage's parts of the model (same attribute names, same state_dict
   keys) and puts an ``Elsewhere`` placeholder where another stage's parts
   were, so ``model.parameters()`` is this stage's parameters;
4. at the first ``pipeline_step``, wraps this stage's code in torch's
   ``PipelineStage`` and runs ``ScheduleGPipe`` or ``Schedule1F1B`` over
   ``microbatches`` micro-batches on every step;
5. keeps a tensor that parts on several stages share (nanoGPT's ``wte`` tied
   to ``lm_head``) on each of them, Megatron-LM's way, and after the backward
   sums its gradients over the pipeline ranks holding it.

Parts are paths through containers (``transformer.h.3``, ``transformer.wte``).
Without a ``loss_fn`` forward computes the loss: the last stage gets each
micro-batch's ``y`` as forward's targets parameter and sends on the loss.

Loss scaling: each micro-batch's loss is divided by the number of micro-batches
and the schedule does not rescale the gradients, so the gradients add to
whatever ``.grad`` held, exactly as the serial ``loss.backward()`` does (a
mean loss over equal micro-batches is the mean over the batch).

Run without a process group (or with world size 1) the model stays whole and
``pipeline_step`` is the serial step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from macrogen import pipeline_units as pf
from macrogen.pipeline_units import Forward as Forward  # the generated code's
from macrogen.pipeline_units import Statement as Statement
from macrogen.runtime import class_plans as apply_step
from macrogen.runtime import groups, mesh, tensor_parallel
from macrogen.vocabulary import SCHEDULES

if TYPE_CHECKING:
    from macrogen.runtime.data_parallel import GradientSync

ATTR = "_macrogen_pipeline"  # where a pipelined model keeps its Pipeline (markers look for it)


@dataclass(frozen=True)
class PipelineConfig:
    stages: int  # pipeline stages: the world is stages x data ranks
    microbatches: int = 4  # micro-batches per step: more shrink the bubble, fewer are larger
    schedule: str = "1f1b"  # "gpipe" (all forwards, then all backwards) or "1f1b"
    split: tuple[str, ...] | None = (
        None  # names that start stages 1..: ("blocks.3",); None: balanced
    )
    # "interleaved" (ScheduleInterleaved1F1B): each rank holds this many stages, rank r
    # stages r, r + P, r + 2P, ... (P = stages / stages_per_rank pipeline ranks)
    stages_per_rank: int = 1

    @property
    def ranks(self) -> int:
        """Pipeline ranks: the mesh's pipeline dimension."""
        return self.stages // self.stages_per_rank


@dataclass(frozen=True)
class Layout:
    """Where this rank sits on the program's (pipeline x data x tensor) mesh."""

    stages: int  # pipeline ranks (the stages, unless several stages per rank)
    data_size: int
    stage: int  # this rank's place on the pipeline: rank // (data_size * tensor_size)
    data_rank: int  # which share of the data this rank trains on
    pipeline_group: dist.ProcessGroup  # this rank and its peers of the other stages
    data_group: dist.ProcessGroup  # ranks holding the same stage and shards (one rank: its own)
    tensor_size: int = 1  # tensor-parallel ranks splitting this stage's layers


def declare(ranks: int, *, where: str = "") -> None:
    """Before the model's layers are built: the mesh's pipeline dimension will be ``ranks``.

    ``ranks`` is the number of stages (over ``stages_per_rank``, interleaved). A
    generated ``@pipeline`` class calls this first, so that tensor-parallel
    layers inside its stages, built by the user's ``__init__``, take their
    tensor group within their stage (the mesh is P x D x T).
    """
    try:
        mesh.expect_pipeline(ranks)
    except ValueError as e:
        raise ValueError(f"{_at(where)}{e}") from None


def layout(stages: int, *, where: str = "") -> Layout | None:
    """This rank's place on the (pipeline x data x tensor) mesh; None when serial (no group, world 1)."""
    if not groups.ensure_initialized() or dist.get_world_size() == 1:
        return None
    declare(stages, where=where)
    try:
        m = mesh.mesh()
    except ValueError as e:
        raise ValueError(f"{_at(where)}{e}") from None
    assert m.pipeline_size == stages  # (declare refuses a mesh of other stages)
    assert m.pipeline_group is not None and m.data_group is not None
    return Layout(stages, m.data_size, m.pipeline_rank, m.data_rank, m.pipeline_group,
                  m.data_group, m.tensor_size)  # fmt: skip


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
    owners: dict[str, set[int]]  # part ("transformer.wte", "blocks.3", "pos") -> stages using it
    # parameters that parts on several stages share (nanoGPT's tied wte and lm_head weight):
    # (their first name, those stages); each stage holds it, its gradients are summed
    tied: list[tuple[str, frozenset[int]]] = field(default_factory=list)
    # the paths forward reads that name a part of the model (not self.config.block_size)
    placeable: frozenset[str] = frozenset()

    def bounds(self, stage: int) -> tuple[int, int]:
        edges = [0, *self.starts, len(self.units)]
        return edges[stage], edges[stage + 1]

    def describe(self) -> str:
        """``stage 0: wte, wpe, blocks.0-2 | stage 1: blocks.3-5, lm_head, ln_f`` (source order)."""
        stages = []
        for s in range(len(self.starts) + 1):
            a, b = self.bounds(s)
            parts = [
                part
                for u in self.units[a:b]
                for part in u.parts
                if u.block is not None or part in self.placeable
            ]
            stages.append(f"stage {s}: {pf.runs(parts)}")
        return " | ".join(stages)


def plan(model: nn.Module, stages: int, split: tuple[str, ...] | None, forward: pf.Forward) -> Plan:
    """Cut ``model``'s forward into ``stages`` stages (pure: the model is not changed)."""
    name = type(model).__name__
    blocks: dict[str, int] = {}
    for loop in forward.loops:
        seq = _get(model, loop)
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
    p.tied = _tied(model, p)
    paths = {a for u in units for a in u.statement.attrs}
    p.placeable = frozenset(a for a in paths if _placeable(model, a) is not None)
    return p


def _balance(model: nn.Module, forward: pf.Forward, units: list[pf.Unit], stages: int) -> list[int]:
    loops = forward.loops
    if not loops:
        raise pf.SplitError(
            f"forward has no `for block in self.<ModuleList>:` loop to balance over: give"
            f" split=[...] (the submodules that start stages 1..{stages - 1};"
            f" {pf.starts_text(units)})"
        )
    candidates = [k for k, u in enumerate(units) if u.block is not None and u.block > 0]
    total = sum(1 for u in units if u.block is not None)
    if stages > total:
        raise pf.SplitError(
            f"{stages} stages but forward's loop{'s' if len(loops) > 1 else ''} over"
            f" {', '.join('self.' + lp for lp in loops)} ha{'ve' if len(loops) > 1 else 's'}"
            f" {total} blocks: at most one stage per block"
        )
    weights = []
    for u in units:
        n = 0
        seen: set[int] = set()  # per unit: a tied tensor weighs on each stage that holds it
        for part in _parts(model, forward, u):
            for p in _part_params(model, part):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        weights.append(n)
    return pf.balanced(weights, candidates, stages)


def _parts(model: nn.Module, forward: pf.Forward, unit: pf.Unit) -> list[str]:
    """The parts of the model a unit uses: ``blocks.3`` for a block, ``transformer.wte``.

    A path the unit reads (``self.transformer.wte.weight``) is cut where it leaves the
    containers (ModuleDict, ModuleList, Sequential): the part is ``transformer.wte``.
    """
    parts = [unit.name] if unit.block is not None else []
    loops = set(forward.loops)
    for path in sorted(unit.statement.attrs):
        part = _placeable(model, path)
        if part is not None and part not in loops and part not in parts:
            parts.append(part)
    return parts


CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def _child(obj: Any, name: str) -> Any:
    if not isinstance(obj, nn.Module):
        return None
    for table in (obj._modules, obj._parameters, obj._buffers):
        if name in table:
            return table[name]
    return None


def _placeable(model: nn.Module, path: str) -> str | None:
    """``transformer.wte`` for ``transformer.wte.weight``: the path down to a non-container."""
    obj: Any = model
    kept: list[str] = []
    for name in path.split("."):
        obj = _child(obj, name)
        if obj is None:
            break
        kept.append(name)
        if not isinstance(obj, CONTAINERS):
            break
    return ".".join(kept) or None  # None: an int, a config, a method: nothing to place


def _part_params(model: nn.Module, part: str) -> list[nn.Parameter]:
    obj = _get(model, part)
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    if isinstance(obj, nn.Parameter):
        return [obj]
    return []


def _get(model: nn.Module, part: str) -> Any:
    """The module, parameter or buffer at a dotted path (``transformer.h.3``); None if none."""
    obj: Any = model
    for name in part.split("."):
        obj = _child(obj, name)
        if obj is None:
            return None
    return obj


def _owners(model: nn.Module, p: Plan, stages: int) -> dict[str, set[int]]:
    owners: dict[str, set[int]] = {}
    for s in range(stages):
        a, b = p.bounds(s)
        for u in p.units[a:b]:
            for part in _parts(model, p.forward, u):
                owners.setdefault(part, set()).add(s)

    # Parts forward never names (a head only a method uses, an unused layer) live on stage 0.
    def walk(module: nn.Module, prefix: str) -> None:
        for table in (module._modules, module._parameters, module._buffers):
            for name, value in table.items():
                path = f"{prefix}{name}"
                if value is None or any(path == q or path.startswith(q + ".") for q in owners):
                    continue
                if isinstance(value, nn.Module) and any(q.startswith(path + ".") for q in owners):
                    walk(value, path + ".")  # a container some of whose entries are placed
                else:
                    owners[path] = {0}

    walk(model, "")
    return owners


def _tied(model: nn.Module, p: Plan) -> list[tuple[str, frozenset[int]]]:
    """Parameters that parts on more than one stage share: each such stage keeps a copy."""
    names: dict[int, str] = {}
    users: dict[int, set[int]] = {}
    for part, stages in sorted(p.owners.items()):
        obj = _get(model, part)
        found: Any = [(part, obj)] if isinstance(obj, nn.Parameter) else []
        if isinstance(obj, nn.Module):
            found = obj.named_parameters(prefix=part)
        for name, param in found:
            names.setdefault(id(param), name)
            users.setdefault(id(param), set()).update(stages)
    return [(names[i], frozenset(users[i])) for i in names if len(users[i]) > 1]


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
    """This rank's stage for ``PipelineStage``: the stage's code over the model's own parts.

    The last stage sends one tensor to the schedule's loss: forward's output (the first
    element of a tuple), or, when forward computes the loss itself, that loss.
    """

    model: nn.Module
    code: Callable[..., Any]

    def __init__(
        self, model: nn.Module, code: Callable[..., Any], parts: list[Any], last: str | None = None
    ):
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: its parameters are not all ours
        self.__dict__["code"] = code
        self.parts = nn.ModuleList(p for p in parts if isinstance(p, nn.Module))
        self.params = nn.ParameterList(p for p in parts if isinstance(p, nn.Parameter))
        self.last = last  # None: not the last stage; "output" or "loss": what it sends on

    def forward(self, *args: Any, **targets: Any) -> Any:
        if self.last is None:  # the schedule gives every stage of a rank the same kwargs
            return self.code(self.model, *args)
        out = self.code(self.model, *args, **targets)
        return output_of(out) if self.last == "output" else loss_of(out, type(self.model))


def stage_code(model: nn.Module, p: Plan, stage: int) -> Callable[..., Any]:
    """This stage's slice of forward: the generated functions of its units, in order.

    Stage 0 takes forward's arguments; a later stage the value the cut before it
    carries (the last one also forward's targets); each returns what the cut after it
    carries, the last forward's output.
    """
    a, b = p.bounds(stage)
    units = p.units[a:b]
    forward = p.forward
    signature = inspect.signature(type(model).forward)  # the serial forward's
    given = None if stage == 0 else p.carried[stage - 1]
    output = p.carried[stage] if stage < len(p.starts) else None
    targets = forward.targets if output is None else None
    found = signature.parameters.get(targets) if targets else None
    default = None if found is None else found.default

    def run(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
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
            block = () if u.block is None else (_get(model, u.name),)
            result = s.fn(model, *block, *(env[n] for n in s.reads))
            if s.writes:
                env.update(zip(s.writes, (result,) if len(s.writes) == 1 else result))
        return result if output is None else env[output]

    return run


class Pipeline:
    """Cuts ``model`` to this rank's stage and runs the schedule; see the module docstring."""

    def __init__(
        self, model: nn.Module, config: PipelineConfig, forward: pf.Forward, *, where: str = ""
    ):
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
        problem = pf.interleaving_problem(
            config.stages, config.microbatches, config.schedule, config.stages_per_rank
        )
        if problem:
            raise ValueError(f"{_at(where)}{problem}")
        self.model = model
        self.config = config
        self.where = where
        self.layout = layout(config.ranks, where=where) if config.ranks > 1 else None
        try:  # on the serial layers: balanced by serial parameter counts, as the expansion says
            self.plan = plan(model, config.stages, config.split, forward)
        except ValueError as e:
            raise ValueError(f"{_at(where)}{e}") from None
        self.keys = list(model.state_dict().keys())  # the serial model's, in its order
        # Tensor-parallel layers inside the stages are cut into shards (in their stage's
        # tensor group) now, not when the outermost __init__ returns: the stage cut below
        # must see the sharded layers, and every rank still holds every layer, so the
        # tensor-parallel rank-agreement check runs on the same modules everywhere.
        apply_step.materialize(model)
        self.tied: list[tuple[nn.Parameter, Any]] = []  # shared parameters and their groups
        self._schedule: Any = None
        self._shape: Any = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        # each stage's module, made once (FSDP shards it when the model is built, before
        # the optimizer takes the parameters: @data_parallel(shard="full") on the class)
        self.stage_modules: dict[int, StageModule] = {}
        self.fully_sharded = False
        if self.layout is not None:
            self._cut(self.stages)

    @property
    def stage(self) -> int:
        """This rank's (first) stage."""
        return 0 if self.layout is None else self.layout.stage

    @property
    def stages(self) -> list[int]:
        """This rank's stages: r, r + P, ... (one unless interleaved)."""
        step = self.config.ranks
        return list(range(self.stage, self.config.stages, step))

    def describe(self) -> str:
        return self.plan.describe()

    def _cut(self, stages: list[int]) -> None:
        """Keep these stages' parts; an ``Elsewhere`` (or nothing, for a tensor) for the others'."""
        model = self.model
        self.tied = self._tie_groups(stages)  # on the whole model: every name resolves
        kept: dict[int, list[Any]] = {s: [] for s in stages}
        for part, users in self.plan.owners.items():
            if users & kept.keys():
                for s in users & kept.keys():
                    kept[s].append(_get(model, part))
                continue
            owner = min(users)
            head, _, name = part.rpartition(".")
            parent = _get(model, head) if head else model
            if name in parent._modules:
                parent._modules[name] = Elsewhere(part, owner)
            else:
                parent._parameters.pop(name, None)
                parent._buffers.pop(name, None)
        self.parts = kept
        self.code = {s: stage_code(model, self.plan, s) for s in stages}

    def _tie_groups(self, stages: list[int]) -> list[tuple[nn.Parameter, Any]]:
        """The shared parameters this rank holds, each with the group of ranks holding it.

        Every rank makes every group (``new_group`` is collective), in the same order.
        """
        lay = self.layout
        assert lay is not None
        world = dist.get_world_size()
        grid = torch.arange(world).view(lay.stages, lay.data_size, lay.tensor_size)
        mine = dist.get_rank()
        out: list[tuple[nn.Parameter, Any]] = []
        for name, users in self.plan.tied:
            ranks = sorted({s % lay.stages for s in users})  # pipeline ranks holding it
            held = any(s in users for s in stages)
            if len(ranks) == 1:
                continue  # one rank holds every stage that uses it: one tensor, one gradient
            group = lay.pipeline_group if len(ranks) == lay.stages else None
            if group is None:
                for line in grid[ranks].reshape(len(ranks), -1).t().tolist():
                    g = dist.new_group(line, timeout=groups.timeout())
                    if mine in line:
                        group = g
            if held:
                param = _get(self.model, name)
                assert isinstance(param, nn.Parameter), name
                out.append((param, group))
        return out

    # -- the step ---------------------------------------------------------------------
    def step(
        self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor] | None
    ) -> torch.Tensor:
        """One training step's forward and backward; the batch's mean loss on every rank.

        Without ``loss_fn``, forward computes the loss: the last stage gets ``y`` as
        forward's targets parameter and its (last) returned value is the loss.
        """
        if self.layout is None:
            return serial_step(self.model, x, y, loss_fn)
        targets = self.plan.forward.targets
        if loss_fn is None and targets is None:
            raise ValueError(
                f"{_at(self.where)}pipeline_step without a loss_fn gives y to forward's second"
                f" parameter, and {type(self.model).__name__}.forward has none with a default"
                " (nanoGPT's targets=None): give a loss_fn"
            )
        m = self.config.microbatches
        if x.shape[0] % m:
            raise ValueError(
                f"{_at(self.where)}a batch of {x.shape[0]} does not split into {m} equal"
                " micro-batches (the mean loss over unequal ones is not the batch's mean)"
            )
        last = "loss" if loss_fn is None else "output"
        shape = (tuple(x.shape), x.dtype, tuple(y.shape), last)
        if self._schedule is None or shape != self._shape:
            self._schedule, self._shape = self._build(last), shape  # new shapes: new p2p buffers
        self._loss_fn = loss_fn
        # The schedule calls this stage's code, not the model: run the model's forward
        # pre-hooks once, as model(x) would (@data_parallel's start-up and buffer broadcast).
        for hook in list(self.model._forward_pre_hooks.values()):
            hook(self.model, (x,))
        lay = self.layout
        here = getattr(self._schedule, "_stages", None) or [self._schedule._stage]
        first, last_here = any(s.is_first for s in here), any(s.is_last for s in here)
        losses: list[torch.Tensor] = []
        given = {targets: y} if loss_fn is None and last_here and targets else {}
        sync = _gradient_sync(self.model)
        # @data_parallel on the model averages in its buckets, once for all micro-batches
        with sync.averaged_once() if sync is not None else contextlib.nullcontext():
            self._schedule.step(
                *((x,) if first else ()),
                target=y if last_here else None,
                losses=losses if last_here else None,
                return_outputs=False,
                **given,
            )
        if lay.data_size > 1 and sync is None:
            self._average_over_data()
        self._sum_tied()
        device = self._device()
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
        src = dist.get_global_rank(lay.pipeline_group, lay.stages - 1)  # holds the last stage
        dist.broadcast(loss, src=src, group=lay.pipeline_group)
        return loss

    def _sum_tied(self) -> None:
        """A parameter stages share gets the sum of their gradients, as the serial one does."""
        for param, group in self.tied:
            if param.grad is None:  # this stage's use got no gradient: it adds zero
                param.grad = torch.zeros_like(param)
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard
            dist.all_reduce(local, group=group)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._loss_fn is None:  # the last stage's output is forward's own loss
            return output / self.config.microbatches
        return self._loss_fn(output, target) / self.config.microbatches

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _build(self, last: str) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        lay = self.layout
        assert lay is not None
        stages: list[Any] = [
            PipelineStage(
                self.stage_module(s, last),
                s,
                self.config.stages,
                self._device(),
                group=lay.pipeline_group,
            )
            for s in self.stages
        ]
        m = self.config.microbatches
        # scale_grads=False: each micro-batch's loss is already divided by their number
        if self.config.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, m, loss_fn=self._scaled_loss, scale_grads=False)
        kind = ScheduleGPipe if self.config.schedule == "gpipe" else Schedule1F1B
        return kind(stages[0], m, loss_fn=self._scaled_loss, scale_grads=False)

    def stage_module(self, s: int, last: str | None = None) -> StageModule:
        """Stage ``s``'s module, made on first use and kept (FSDP may have sharded it)."""
        module = self.stage_modules.get(s)
        if module is None:
            module = self.stage_modules[s] = StageModule(self.model, self.code[s], self.parts[s])
        module.last = last if s == self.config.stages - 1 else None
        return module

    def _average_over_data(self) -> None:
        """Average this stage's gradients over the ranks that hold the same stage (FSDP's
        sharded parameters, DTensors, were averaged by FSDP's reduce-scatter)."""
        lay = self.layout
        assert lay is not None
        params = [p for p in self.model.parameters() if p.requires_grad and not _is_dtensor(p)]
        if not params:
            return
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
        local = self._local_state_dict()
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
        current = self.model.state_dict()
        mine = {k: v for k, v in state_dict.items() if k in current}
        # DTensors (FSDP's, mg.parallelize's tensor-parallel ones): this rank's shard of each
        # (FSDP's shard of a packed colwise shard cut by hand: torch permutes its rows)
        from torch.distributed.tensor import DTensor

        from macrogen.runtime.dtensor_whole import restride

        for k, v in mine.items():
            now = current[k]
            if isinstance(now, DTensor):
                mine[k] = restride(v.to(now.device, now.dtype), now)
        if self.layout is not None and self.layout.tensor_size > 1:  # each keeps its shard
            return tensor_parallel.load_full_state_dict(self.model, mine, strict=strict)
        return self.model.load_state_dict(mine, strict=strict)

    def _local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries at serial shapes (tensor-parallel shards gathered in the stage)."""
        if self.layout is not None and self.layout.tensor_size > 1:
            state = tensor_parallel.full_state_dict(self.model)  # @tensor_parallel's shards
        else:
            state = self.model.state_dict()
        # DTensors (FSDP's, mg.parallelize's tensor-parallel ones): every rank of the stage
        # gathers each, in the same order (FSDP's shard of a packed colwise shard by hand)
        from torch.distributed.tensor import DTensor

        from macrogen.runtime.dtensor_whole import full_tensor

        return {k: full_tensor(v) if isinstance(v, DTensor) else v for k, v in state.items()}


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _gradient_sync(model: nn.Module) -> GradientSync | None:
    """The model's @data_parallel averaging, if it has one."""
    from macrogen.runtime.data_parallel import GradientSync

    return next((v for v in vars(model).values() if isinstance(v, GradientSync)), None)


# -- what users and generated code call ------------------------------------------------------


def serial_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    if loss_fn is None:  # forward computes its loss: nanoGPT's `logits, loss = model(x, y)`
        loss = loss_of(model(x, y), type(model))
    else:
        loss = loss_fn(output_of(model(x)), y)
    loss.backward()
    return loss


def output_of(out: Any) -> Any:
    """What goes on to the loss: forward's output, or the first element of its tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


def loss_of(out: Any, cls: type) -> torch.Tensor:
    """forward's own loss: what it returns, or the last element of its tuple."""
    loss = out[-1] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"pipeline_step without a loss_fn calls {cls.__name__}(x, y) for its loss, and got"
            f" {type(loss).__name__}: return the loss (or (output, loss)), or give a loss_fn"
        )
    return loss


def pipeline_of(model: nn.Module) -> Pipeline | None:
    found = getattr(model, "__dict__", {}).get(ATTR)
    return found if isinstance(found, Pipeline) else None


def pipeline_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """``loss = loss_fn(model(x), y); loss.backward(); return loss``, or the model's schedule.

    A tuple from forward gives its first element to ``loss_fn``. Without ``loss_fn``
    forward computes the loss: ``model(x, y)`` returns it, or ``(output, loss)``.
    """
    pipe = pipeline_of(model)
    return serial_step(model, x, y, loss_fn) if pipe is None else pipe.step(x, y, loss_fn)


def attach(
    model: nn.Module, config: PipelineConfig, forward: pf.Forward, *, where: str = ""
) -> Pipeline:
    """Make ``model`` (fully built) pipelined: this rank keeps its stage.

    ``forward`` is the model's forward as the expansion generated it, one function per
    statement: the stages run those.
    """
    pipe = Pipeline(model, config, forward, where=where)
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
