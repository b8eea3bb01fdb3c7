"""``mg.parallelize(model, pp=N, microbatches=M)``: a built model cut into pipeline stages.

    model = GPT(config)                                     # any class; its forward as @pipeline needs
    model = mg.parallelize(model, pp=2, microbatches=4)     # this rank keeps its stage
    loss = mg.pipeline_step(model, x, y, loss_fn)           # the schedule: forward, loss, backward

A transformers model is cut at the pipeline plan it ships (``pipeline_transformers.py``:
the embedding, the decoder layers, the final norm, the head; every stage runs the model's
own forward). Any other model is cut as ``@mg.pipeline`` would cut its class, at run time:
forward's source (``inspect.getsource``) is analysed by the macro's own analysis
(``macrogen/pipelining/analysis.py``), each statement becomes a function
(``macrogen/pipelining/code.py``), compiled in forward's module (its globals, and
the values of its closure), and the model is ``attach``-ed to a ``Pipeline``
exactly as a ``@pipeline`` class's ``__init__`` does: stage balance, tied weights,
schedules, FSDP per stage and full state dicts are the decorator's. The copied
lines keep their line numbers in the user's file, so a traceback in a stage shows
the user's line.

Tensor parallel goes first (``tp > 1``: the layers are DTensors on the mesh's tensor
dim, sharded on the whole model before the cut). The schedule runs this rank's stage
modules, never ``model.forward``, so the swap of DTensor parameters for their local
shards moves from the model's forward to each stage module's (``local_forward_per_stage``;
under FSDP, into each sharded block too). A weight tied across stages (a vocab-sharded
embedding and a ``colwise_gather_output`` head share rows) is held by both stages, each
rank its tensor shard, and its gradient summed over the pipeline ranks of that shard.

This is the one runtime module that reads source: ``@pipeline``'s runtime
(``pipeline.py``) takes the units the expansion wrote, while a built model's class
was never expanded.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from macrogen.pipelining.analysis import parse
from macrogen.pipelining.code import unit_function
from macrogen.pipelining.units import Forward, SplitError
from macrogen.runtime import groups, parallelize, pipeline
from macrogen.runtime.mesh import Mesh, carry
from macrogen.runtime.pipeline_parts import part_at
from macrogen.runtime.pipeline_plan import forward_cut
from macrogen.runtime.pipeline_speeds import stage_devices
from macrogen.runtime.pipeline_transformers import shipped_plan, transformers_cut
from macrogen.vocabulary import SCHEDULES

DOCS = "docs/pipeline.md (what @mg.pipeline can cut)"


def forward_of(cls: type, *, where: str) -> Forward:
    """``cls.forward`` as units, each statement a function: the ``Forward`` that
    ``@pipeline``'s expansion would write for ``cls``. A forward that can't be cut is a
    one-line ``ValueError`` naming the class and why."""
    forward = getattr(cls, "forward", None)
    fn = inspect.unwrap(forward) if callable(forward) else None
    at = f"mg.parallelize at {where}: pp > 1 cuts {cls.__name__}.forward into pipeline stages"
    if not isinstance(fn, types.FunctionType):
        raise ValueError(f"{at}, and it is no Python function ({type(forward).__name__})")
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or f"<{cls.__name__}.forward>"
    except (OSError, TypeError):
        raise ValueError(
            f"{at}, and its source can't be read (defined in exec or a REPL?)"
        ) from None
    if "__class__" in fn.__code__.co_freevars:
        raise ValueError(
            f"{at}, and it calls super() (or names __class__): a stage runs forward's statements"
            f" as functions outside the class; call the parent's layers directly. See {DOCS}"
        )
    try:
        a = parse(textwrap.dedent("".join(lines)))
    except SplitError as e:
        raise ValueError(f"{at}, and it can't be: {e.message}. See {DOCS}") from None
    except SyntaxError as e:  # a lambda's or a one-line method's source: not a whole def
        raise ValueError(f"{at}, and its source does not parse alone ({e.msg})") from None
    if not a.forward.loops:
        raise ValueError(
            f"{at}, and it has no `for block in self.<ModuleList>:` loop whose blocks the"
            " stages could share (a model whose blocks run in a submodule's forward is cut at"
            " the pipeline plan transformers models ship, model.pp_plan: it has none)."
            f" See {DOCS}"
        )
    namespace = fn.__globals__
    if fn.__code__.co_freevars:  # a class defined in a function: forward's closure, by value
        cells = zip(fn.__code__.co_freevars, fn.__closure__ or ())
        namespace = {**namespace, **{name: cell.cell_contents for name, cell in cells}}
    statements = []
    for k, s in enumerate(a.forward.statements):
        name = f"_{cls.__name__}_forward_{k}"
        node = a.nodes[k]
        body = node.body[0] if s.loop is not None else node  # type: ignore[attr-defined]
        # blank lines first: the copied lines keep their line numbers in the user's file
        code = "\n" * max(0, first + body.lineno - 3) + unit_function(a, k, name)
        local: dict[str, Any] = {}
        exec(compile(code, filename, "exec"), namespace, local)
        statements.append(dataclasses.replace(s, fn=local[name]))
    return dataclasses.replace(a.forward, statements=tuple(statements))


def apply_pipeline(
    model: nn.Module,
    mesh: Mesh,
    *,
    pp: int,
    microbatches: int,
    schedule: str,
    where: str,
    pp_split: str | Sequence[float] | None = None,
) -> nn.Module:
    """Cut ``model`` into the mesh's pipeline stages (in place; returns ``model``): this rank
    keeps its stage, and ``mg.pipeline_step`` runs the schedule. Serially (no process
    group) the model stays whole and ``pipeline_step`` is the serial step. ``pp_split``:
    the stages' relative speeds, given or "measured" (``pipeline_speeds``): uneven stages."""
    at = f"mg.parallelize at {where}"
    if schedule not in SCHEDULES:
        raise ValueError(f"{at}: schedule={schedule!r}: expected one of {SCHEDULES}")
    if pipeline.pipeline_of(model) is not None:
        raise ValueError(f"{at}: this model is pipelined already (@mg.pipeline or mg.parallelize)")
    assert mesh.device_mesh is None or mesh.pipeline_size == pp  # (device_mesh made it so)
    carry(model, mesh)  # (mg.mesh(model))
    per_rank = 2 if schedule == "interleaved" else 1
    config = pipeline.PipelineConfig(
        stages=pp * per_rank,
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=per_rank,
    )
    pipeline.check_config(config, where=where)
    if pp_split is not None and per_rank != 1:
        raise ValueError(f"{at}: pp_split takes one stage per rank, not schedule={schedule!r}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":  # built on meta (init=): the device its stage will be on
        device = torch.device(groups.placement().device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    speeds, limits = stage_devices(
        pp_split, pp, mesh.pipeline_rank, model_bytes, device, where=where
    )
    if shipped_plan(model):  # a transformers model: its own plan (pipeline_transformers.py)
        cut: pipeline.Cut = transformers_cut(
            model, config.stages, where=at, speeds=speeds, limits=limits
        )
    else:
        forward = forward_of(type(model), where=where)
        try:
            cut = forward_cut(model, config.stages, None, forward, speeds, limits)
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from None
    pipe = pipeline.attach(model, config, cut, mesh, where=where)
    if parallelize.is_tensor_parallel(model) and pipe.layout is not None:
        _stages_on_local_shards(model, pipe, where=at)
    # the serial model's state dict, as a @pipeline class's methods give it
    model.__dict__["full_state_dict"] = functools.partial(pipeline.full_state_dict, model)
    model.__dict__["load_full_state_dict"] = functools.partial(pipeline.load_full_state_dict, model)
    return model


def _stages_on_local_shards(model: nn.Module, pipe: pipeline.Pipeline, *, where: str) -> None:
    """Tensor parallel first (its DTensors swapped for their local shards by a pre-hook on the
    model's forward): the schedule runs this rank's stage modules, never ``model.forward``, so
    each stage swaps the parameters of its own parts while it runs (per micro-batch)."""
    # each stage's repeated blocks swap their own: a block's gradients leave autograd when its
    # backward ends (a stage's single swap would hold every fresh gradient to the end of each
    # micro-batch's backward, beside the ones accumulated from the micro-batches before)
    blocks = [part_at(model, name) for s in pipe.stages for name in pipe.cut.blocks(s)]
    local_forward_per_stage(model, pipe, blocks)
    last = pipe.config.stages - 1
    if last in pipe.stages:  # a colwise layer's output sent to the loss: a slice of it
        parallelize.check_outputs(model, pipe.stage_module(last), where=where)


def local_forward_per_stage(
    model: nn.Module, pipe: pipeline.Pipeline, units: list[nn.Module] | None = None
) -> None:
    """Each of this rank's stage modules (and ``units`` inside them: FSDP's, each swapping
    its own) runs on local shards; a stage's bare parameter parts are swapped in the module
    holding them."""
    stages = [pipe.stage_module(s) for s in pipe.stages]
    owners: dict[nn.Module, list[nn.Module]] = {}
    for stage, s in zip(stages, pipe.stages):
        for part, users in pipe.cut.owners.items():
            head = part.rpartition(".")[0]
            if s in users and isinstance(part_at(model, part), nn.Parameter):
                owners.setdefault(stage, []).append(part_at(model, head) if head else model)
    parallelize.local_forward_per_unit(model, [*(units or ()), *stages], owners)
