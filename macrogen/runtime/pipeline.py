"""Pipeline parallelism on ``torch.distributed.pipelining``: a model cut into stages, each
rank running its own, and the step that trains it.

A model is pipelined once it is whole (built and initialized exactly as in the serial run):
a ``@pipeline`` class at the end of its ``__init__``, ``mg.parallelize(model, pp=N)`` on a
built model, or on one built on the meta device, whose stage ``init=`` materializes after
the cut (``materialize.py``: each rank allocates its own stage's parts only). What each
stage holds and runs is a *cut* of the model:

- ``pipeline_plan.ForwardCut``: forward's statements, as the ``@pipeline`` expansion (or
  ``mg.parallelize`` on a model of the user's own) generated them, shared out at the
  ``split`` names or balanced by parameter count over a ``nn.ModuleList`` loop's blocks;
- ``pipeline_transformers.TransformersCut``: a transformers model at the pipeline plan it
  ships (the embedding, the decoder layers, the final norm, the head).

The ``Pipeline``:

1. is given the program's (pipeline x data x tensor) mesh (``mesh.py``: a ``DeviceMesh``
   and its groups, made with the pipeline's stages), pipeline outermost: rank r is stage
   ``r // (data_size * tensor_size)``;
2. keeps this rank's stages' parts of the model (same attribute names, same state_dict
   keys) and puts a placeholder where another stage's parts were, so
   ``model.parameters()`` is this stage's parameters;
3. at the first ``pipeline_step``, wraps each of this rank's stages in torch's
   ``PipelineStage`` and runs ``ScheduleGPipe``, ``Schedule1F1B`` or
   ``ScheduleInterleaved1F1B`` over ``microbatches`` micro-batches on every step;
4. keeps a tensor that parts on several stages share (nanoGPT's ``wte`` tied to
   ``lm_head``) on each of them, Megatron-LM's way, and after the backward sums its
   gradients over the pipeline ranks holding it.

Without a ``loss_fn`` forward computes the loss: the last stage gets each micro-batch's
``y`` as forward's targets parameter (``labels`` for transformers) and sends on the loss.

Loss scaling: each micro-batch's loss is divided by the number of micro-batches (a
transformers causal LM's is its tokens' sum over the batch's count instead, see
``pipeline_transformers``) and the schedule does not rescale the gradients, so the
gradients add to whatever ``.grad`` held, exactly as the serial ``loss.backward()`` does.

Run without a process group (or with world size 1) the model stays whole and
``pipeline_step`` is the serial step.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from macrogen.pipelining.units import Forward as Forward  # the generated code's
from macrogen.pipelining.units import Statement as Statement
from macrogen.pipelining.units import interleaving_problem
from macrogen.runtime import groups, pipeline_state
from macrogen.runtime.mesh import Mesh
from macrogen.runtime.pipeline_parts import MetaParts, aliases, part_at
from macrogen.runtime.pipeline_plan import StepInputs
from macrogen.vocabulary import SCHEDULES

if TYPE_CHECKING:
    from macrogen.runtime.data_parallel import GradientSync

ATTR = "_macrogen_pipeline"  # where a pipelined model keeps its Pipeline (markers look for it)
_LOSS_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


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


def check_config(config: PipelineConfig, *, where: str = "") -> None:
    """A schedule torch runs, micro-batches it can run it with (a one-line error otherwise)."""
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
    problem = interleaving_problem(
        config.stages, config.microbatches, config.schedule, config.stages_per_rank
    )
    if problem:
        raise ValueError(f"{_at(where)}{problem}")


class Cut(Protocol):
    """Which parts of the model each stage holds and what it runs (``pipeline_plan``,
    ``pipeline_transformers``)."""

    owners: dict[str, set[int]]  # part -> the stages holding it
    tied: list[tuple[str, frozenset[int]]]  # parameters parts on several stages share

    @property
    def stages(self) -> int: ...

    @property
    def targets(self) -> str | None: ...  # forward's parameter for y when it computes the loss

    def describe(self) -> str: ...

    def blocks(self, stage: int) -> list[str]: ...  # the repeated blocks it runs (FSDP's units)

    def placeholder(self, part: str, stage: int) -> nn.Module: ...

    def code(self, model: nn.Module, stage: int) -> Callable[..., Any]: ...

    def inputs(
        self, x: Any, y: torch.Tensor, loss_fn: Any, microbatches: int, *, where: str
    ) -> StepInputs: ...


def _at(where: str) -> str:
    return f"pipeline at {where}: " if where else ""


class StageModule(nn.Module):
    """This rank's stage for ``PipelineStage``: the stage's code over the model's own parts.

    The last stage sends one tensor to the schedule's loss: forward's output (the first
    element of a tuple, a transformers output's logits), or, when forward computes the
    loss itself, that loss.
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

    def forward(self, *args: Any, **inputs: Any) -> Any:
        # the schedule gives every stage of a rank the same keyword inputs
        out = self.code(self.model, *args, **inputs)
        if self.last is None:
            return out
        return output_of(out) if self.last == "output" else loss_of(out, type(self.model))


class Pipeline:
    """Cuts ``model`` to this rank's stage and runs the schedule; see the module docstring."""

    def __init__(
        self, model: nn.Module, config: PipelineConfig, cut: Cut, mesh: Mesh, *, where: str = ""
    ):
        check_config(config, where=where)
        assert cut.stages == config.stages, (cut.stages, config.stages)
        self.model = model
        self.config = config
        self.cut = cut
        self.where = where
        # the program's (pipeline x data x tensor) mesh; None when serial (no group, world 1)
        self.layout = _pipelined(mesh, config, where)
        self.keys = list(model.state_dict().keys())  # the serial model's, in its order
        # a tied weight's further names -> its first (a stage may hold it under either)
        self.aliases = aliases(model)
        self.tied: list[tuple[nn.Parameter, Any]] = []  # shared parameters and their groups
        self._schedule: Any = None
        self._shape: Any = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._divisor = config.microbatches
        # each stage's module, made once (FSDP shards it when the model is built, before
        # the optimizer takes the parameters: @data_parallel(shard="full") on the class)
        self.stage_modules: dict[int, StageModule] = {}
        self.parts: dict[int, list[Any]] = {}
        self.code: dict[int, Callable[..., Any]] = {}
        self.fully_sharded = False
        self.warned_compiled = False  # pipeline_step was given torch.compile(model) (said once)
        self.elsewhere = MetaParts()  # a meta model's (init=) parts other stages hold
        if self.layout is not None:
            self._cut(self.stages)

    @property
    def stage(self) -> int:
        """This rank's (first) stage."""
        return 0 if self.layout is None else self.layout.pipeline_rank

    @property
    def stages(self) -> list[int]:
        """This rank's stages: r, r + P, ... (one unless interleaved)."""
        step = self.config.ranks
        return list(range(self.stage, self.config.stages, step))

    def describe(self) -> str:
        return self.cut.describe()

    def _cut(self, stages: list[int]) -> None:
        """Keep these stages' parts; a placeholder (or nothing, for a tensor) for the others'."""
        model = self.model
        self.tied = self._tie_groups(stages)  # on the whole model: every name resolves
        kept: dict[int, list[Any]] = {s: [] for s in stages}
        for part, users in self.cut.owners.items():
            if users & kept.keys():
                for s in users & kept.keys():
                    kept[s].append(part_at(model, part))
                continue
            owner = min(users)
            head, _, name = part.rpartition(".")
            parent = part_at(model, head) if head else model
            self.elsewhere.keep(parent, name)
            if name in parent._modules:
                parent._modules[name] = self.cut.placeholder(part, owner)
            else:
                parent._parameters.pop(name, None)
                parent._buffers.pop(name, None)
        self.parts = kept
        self.code = {s: self.cut.code(model, s) for s in stages}
        self.elsewhere.find_shared(model)

    def _tie_groups(self, stages: list[int]) -> list[tuple[nn.Parameter, Any]]:
        """The shared parameters this rank holds, each with the group of ranks holding it.

        Every rank makes every group (``new_group`` is collective), in the same order.
        """
        lay = self.layout
        assert lay is not None
        world = dist.get_world_size()
        grid = torch.arange(world).view(lay.pipeline_size, lay.data_size, lay.tensor_size)
        mine = dist.get_rank()
        out: list[tuple[nn.Parameter, Any]] = []
        for name, users in self.cut.tied:
            ranks = sorted({s % lay.pipeline_size for s in users})  # pipeline ranks holding it
            held = any(s in users for s in stages)
            if len(ranks) == 1:
                continue  # one rank holds every stage that uses it: one tensor, one gradient
            group = lay.pipeline_group if len(ranks) == lay.pipeline_size else None
            if group is None:
                for line in grid[ranks].reshape(len(ranks), -1).t().tolist():
                    g = dist.new_group(line, timeout=groups.timeout())
                    if mine in line:
                        group = g
            if held:
                param = part_at(self.model, name)
                assert isinstance(param, nn.Parameter), name
                out.append((param, group))
        return out

    # -- the step ---------------------------------------------------------------------
    def step(
        self, x: Any, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor] | None
    ) -> torch.Tensor:
        """One training step's forward and backward; the batch's mean loss on every rank.

        Without ``loss_fn``, forward computes the loss: the last stage gets ``y`` as
        forward's targets parameter and its (last) returned value is the loss.
        """
        if self.layout is None:
            return serial_step(self.model, x, y, loss_fn, targets=self.cut.targets)
        m = self.config.microbatches
        rows = _rows(x)
        if rows % m:
            raise ValueError(
                f"{_at(self.where)}a batch of {rows} does not split into {m} equal"
                " micro-batches (the mean loss over unequal ones is not the batch's mean)"
            )
        feed = self.cut.inputs(x, y, loss_fn, m, where=_at(self.where))
        last = "loss" if loss_fn is None else "output"
        shape = (_shapes(feed.args), _shapes(feed.kwargs), tuple(y.shape), last)
        if self._schedule is None or shape != self._shape:
            self._schedule, self._shape = self._build(last), shape  # new shapes: new p2p buffers
        self._loss_fn, self._divisor = loss_fn, feed.divisor
        # The schedule calls this stage's code, not the model: run the model's forward
        # pre-hooks once, as model(x) would (@data_parallel's start-up and buffer broadcast).
        for hook in list(self.model._forward_pre_hooks.values()):
            hook(self.model, feed.args)
        lay = self.layout
        here = getattr(self._schedule, "_stages", None) or [self._schedule._stage]
        first, last_here = any(s.is_first for s in here), any(s.is_last for s in here)
        losses: list[torch.Tensor] = []
        sync = _gradient_sync(self.model)
        # @data_parallel on the model averages in its buckets, once for all micro-batches
        with sync.averaged_once() if sync is not None else contextlib.nullcontext():
            self._schedule.step(
                *(feed.args if first else ()),
                target=y if last_here else None,
                losses=losses if last_here else None,
                return_outputs=False,
                **feed.kwargs,
                **(feed.last if last_here else {}),
            )
        if lay.data_size > 1 and sync is None:
            self._average_over_data()
        self._sum_tied()
        return self._loss_everywhere(losses)

    def _loss_everywhere(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The batch's loss, from the ranks of the last stage to every pipeline rank, in the
        dtype the last stage computed it in (HF's loss: float32 in a float64 model)."""
        lay = self.layout
        assert lay is not None
        sent = torch.zeros(2, dtype=torch.float64, device=self._device())  # (loss, its dtype)
        if losses:
            loss = torch.stack(losses).sum().detach()
            sent[0], sent[1] = loss.double(), float(_LOSS_DTYPES.index(loss.dtype))
        assert lay.pipeline_group is not None
        src = dist.get_global_rank(lay.pipeline_group, lay.pipeline_size - 1)  # the last stage
        dist.broadcast(sent, src=src, group=lay.pipeline_group)
        return sent[0].to(_LOSS_DTYPES[int(sent[1])])

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
            return output / self._divisor
        return self._loss_fn(output, target) / self._divisor

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
        group = None if self.layout is None else self.layout.pipeline_group
        return pipeline_state.gathered(self.model, self.keys, self._tensor_parallel(), group)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load a serial model's state dict: each stage keeps its own entries."""
        return pipeline_state.load(
            self.model, self.keys, state_dict, self._tensor_parallel(), strict, _at(self.where)
        )

    def _tensor_parallel(self) -> bool:
        """@tensor_parallel's shards (plain tensors) in the stages' layers."""
        return self.layout is not None and self.layout.tensor_size > 1


def _pipelined(mesh: Mesh, config: PipelineConfig, where: str) -> Mesh | None:
    """``mesh`` when it cuts the world into ``config``'s pipeline ranks; None when serial."""
    if mesh.device_mesh is None:  # one rank (or none): the model stays whole
        return None
    if mesh.pipeline_size != config.ranks or mesh.pipeline_group is None:
        raise ValueError(
            f"{_at(where)}the program's mesh (pipeline, data, tensor) = {mesh.shape} has"
            f" {mesh.pipeline_size} pipeline stage(s), and the model is cut into"
            f" {config.ranks}: one mesh per program, made with the pipeline's stages"
        )
    assert mesh.data_group is not None
    return mesh


def _rows(x: Any) -> int:
    """The batch's size: x's first dimension (a dict of inputs: its input ids')."""
    first = x.get("input_ids", next(iter(x.values()), None)) if isinstance(x, Mapping) else x
    if not isinstance(first, torch.Tensor):
        raise TypeError(
            f"pipeline_step takes x as a tensor (or a dict of them), not {type(x).__name__}"
        )
    return first.shape[0]


def _shapes(tensors: Any) -> tuple[Any, ...]:
    """What the schedule's point-to-point buffers depend on: each input's shape and dtype."""
    items = tensors.items() if isinstance(tensors, Mapping) else enumerate(tensors)
    return tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, v) for k, v in items
    )


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
    x: Any,
    y: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    targets: str | None = None,
) -> torch.Tensor:
    """The serial step: ``loss_fn(model(x), y)``, or forward's own loss: ``model(x, y)``
    (``y`` as forward's ``targets`` parameter, a transformers model's ``labels``)."""
    if loss_fn is None:  # forward computes its loss: nanoGPT's `logits, loss = model(x, y)`
        name = targets or _labels(model)
        out = _call(model, x, **{name: y}) if name else _call(model, x, y)
        loss = loss_of(out, type(model))
    else:
        loss = loss_fn(output_of(_call(model, x)), y)
    loss.backward()
    return loss


def _call(model: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``model(x, ...)``; a dict of inputs (a tokenizer's batch) as keywords."""
    return model(**x, **kwargs) if isinstance(x, Mapping) else model(x, *args, **kwargs)


def _labels(model: nn.Module) -> str | None:
    """``labels`` when forward takes it (a transformers model), else None: y goes second."""
    forward = getattr(uncompiled(model), "forward", None)  # (a compiled wrapper's: *args)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        return None
    return "labels" if "labels" in params else None


def output_of(out: Any) -> Any:
    """What goes on to the loss: forward's output, the first element of its tuple, or a
    transformers output's logits."""
    if isinstance(out, Mapping):
        return out["logits"] if "logits" in out else next(iter(out.values()))
    return out[0] if isinstance(out, (tuple, list)) else out


def loss_of(out: Any, cls: type) -> torch.Tensor:
    """forward's own loss: what it returns, the last element of its tuple, or a transformers
    output's loss."""
    if isinstance(out, Mapping):
        loss = out.get("loss")
    else:
        loss = out[-1] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"pipeline_step without a loss_fn calls {cls.__name__}(x, y) for its loss, and got"
            f" {type(loss).__name__}: return the loss (or (output, loss)), or give a loss_fn"
        )
    return loss


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The model's pipeline, if it is pipelined (through ``torch.compile``'s wrapper too)."""
    found = getattr(uncompiled(model), "__dict__", {}).get(ATTR)
    return found if isinstance(found, Pipeline) else None


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` wraps (its ``OptimizedModule``), else ``model``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (loaded by any compile)
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return uncompiled(model._orig_mod)
    return model


def pipeline_step(
    model: nn.Module,
    x: Any,
    y: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """``loss = loss_fn(model(x), y); loss.backward(); return loss``, or the model's schedule.

    A tuple from forward gives its first element to ``loss_fn``. Without ``loss_fn``
    forward computes the loss: ``model(x, y)`` returns it, or ``(output, loss)`` (a
    transformers model: ``model(x, labels=y).loss``). A pipelined model under
    ``torch.compile(model)`` runs its schedule: the stages, not the compiled whole.
    """
    pipe = pipeline_of(model)
    if pipe is None or pipe.layout is None:  # serially, the (compiled) model is the step
        targets = None if pipe is None else pipe.cut.targets
        return serial_step(model, x, y, loss_fn, targets=targets)
    if model is not pipe.model:
        _warn_compiled_whole(pipe)
    return pipe.step(x, y, loss_fn)


def _warn_compiled_whole(pipe: Pipeline) -> None:
    """Once per model: a whole-model compile never runs under a schedule."""
    if pipe.warned_compiled:
        return
    pipe.warned_compiled = True
    warnings.warn(
        f"{_at(pipe.where)}torch.compile(model) compiles the model's forward, which a pipeline's"
        " schedule never calls (it runs this rank's stages): the stages run eagerly. Compile"
        " the blocks instead (for block in blocks: block.compile()), before pipeline_step",
        stacklevel=3,
    )


def attach(
    model: nn.Module, config: PipelineConfig, cut: Cut, mesh: Mesh, *, where: str = ""
) -> Pipeline:
    """Make ``model`` (fully built) pipelined at ``cut`` on ``mesh``, the program's (pipeline x
    data x tensor) mesh (``SERIAL`` without ranks): this rank keeps its stages."""
    pipe = Pipeline(model, config, cut, mesh, where=where)
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
