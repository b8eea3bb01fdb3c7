"""``macrogen plan``: every layout of a world size, ranked by the cost and memory models.

Two sources of a model: a program's ``mg.parallelize`` probed on this machine (``plan``,
below), or a model known by its shapes alone (``rank_model``: a ``ModelSpec`` from a
transformers config or a meta-device model, on a table's devices, ``scale.py``).

The model is probed once on this machine (``probe.py``; or its probe is read
from the tuning database, when ``autotune`` made one for this source), then
every layout of ``world`` ranks is pruned (feasibility, memory per device) and
ranked by predicted step time on the given links. Nothing runs on the
machines planned for: compute is the probe's serial step divided by
``speedup`` (how much faster the target device runs it), at the entry's batch
or scaled to ``global_batch`` rows (``memory.with_batch``); a layout whose
data ranks x micro-batches do not divide the batch's rows is infeasible.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from macrogen.autotune import cost, database, layouts, memory, scale
from macrogen.autotune.devices import DeviceSet
from macrogen.autotune.layouts import Layout, ModelShape
from macrogen.autotune.model_spec import ModelSpec
from macrogen.expand import expand_source
from macrogen.files import read_source


class PlanError(Exception):
    """The request or the model cannot be planned (one line, for the user)."""


@dataclass(frozen=True)
class Row:
    layout: Layout
    step: cost.Step | None
    memory: memory.Breakdown
    reason: str | None  # infeasible, or over the memory
    note: str | None  # feasible, but mg.parallelize can't run it yet (predicted only)


def plan(
    path: str | os.PathLike[str],
    *,
    entry: str,
    world_size: int,
    machine: cost.Machine,
    device_memory: float | None = None,
    speedup: float = 1.0,
    tuning: str | os.PathLike[str] | None = None,
    global_batch: int | None = None,
    meta: bool = False,
) -> tuple[list[Row], memory.Profile]:
    """Every layout of ``world_size``: the feasible ones by predicted step time, then the rest;
    at ``global_batch`` rows per step (None: the entry's, as probed); ``meta``: the program
    builds its model on the meta device (``mg.parallelize(..., init=...)``): no build term."""
    from macrogen.autotune.tuner import AutotuneError, _probe

    source_path = Path(path)
    source = read_source(source_path.read_bytes())[0]
    expansion = expand_source(source, path=source_path.name)
    sites = [s for s in expansion.arguments if s.macro == "parallelize"]
    if not sites:
        raise PlanError(f"{source_path}: no mg.parallelize(...) to plan")
    module, _, _ = entry.partition(":")
    search_path = [str(source_path.parent.resolve()), os.getcwd()]
    db_path = Path(tuning) if tuning is not None else database.default_path(source_path)
    db = database.Database(db_path)
    try:
        probed = _probe(
            db,
            source,
            expansion.code,
            source_path,
            entry,
            not module,
            search_path,
            sites[0].values.get("tp_plan"),
            progress=lambda text: print(f"macrogen plan: {text}", file=sys.stderr, flush=True),
        )
    except AutotuneError as e:
        raise PlanError(str(e)) from None
    profile = memory.Profile(**probed["profile"])
    profile = replace(
        profile,
        step_s=profile.step_s / speedup,
        block_s=profile.block_s / speedup,
        block_call_s=profile.block_call_s / speedup,
        recompute_call_s=(
            None if profile.recompute_call_s is None else profile.recompute_call_s / speedup
        ),
        optimizer_s=profile.optimizer_s / speedup,
    )
    shape = ModelShape(**probed["shape"])
    if global_batch is not None:
        if not shape.rows:
            raise PlanError(
                f"{source_path}: --global-batch needs the batch's rows, and the probe saw no"
                " tensor passed to the model's forward"
            )
        profile = memory.with_batch(profile, global_batch / shape.rows)
        shape = replace(shape, rows=global_batch)
    arguments = dict(sites[0].values)
    return rank(profile, shape, world_size, machine, device_memory, arguments, meta=meta), profile


def rank(
    profile: memory.Profile,
    shape: ModelShape,
    world: int,
    machine: cost.Machine,
    device_memory: float | None = None,
    arguments: dict[str, object] | None = None,
    *,
    meta: bool = False,
) -> list[Row]:
    """Every layout of ``world`` ranks, the feasible by predicted step time first; feasible as
    ``layouts.problem`` decides for the site's ``arguments`` (None: the model's rules alone,
    and what mg.parallelize can't run yet is ranked, marked "predicted only")."""
    rows = []
    every = layouts.enumerate_layouts(
        world,
        max_tp=machine.per_node,
        max_pp=shape.blocks or None,
        rows=shape.rows,
        experts=shape.experts,
    )
    for layout in every:
        mem = memory.predict(profile, layout, world, meta=meta)
        reason = layouts.problem(layout, world, shape, arguments)
        if reason is None and device_memory is not None and mem.total > device_memory:
            reason = (
                f"predicted {memory.format_bytes(mem.total)} per rank, over"
                f" {memory.format_bytes(device_memory)}"
            )
        step = cost.predict(profile, layout, world, machine) if reason is None else None
        note = layouts.unsupported(layout) if arguments is None else None
        rows.append(Row(layout, step, mem, reason, note))
    rows.sort(key=lambda r: (r.step is None, r.step.total if r.step else 0.0, r.layout))
    return rows


@dataclass(frozen=True)
class ScaleRow:
    layout: Layout
    prediction: scale.Prediction | None  # None: infeasible
    reason: str | None  # infeasible, or over a device's memory
    note: str | None  # feasible, but mg.parallelize can't run it yet (predicted only)
    # heterogeneous device sets: the even split's prediction (the adapted one is ``prediction``)
    even: scale.Prediction | None = None
    seq: int = 0  # tokens per sequence

    @property
    def gain(self) -> float | None:
        """How much faster the adapted split is than the even one (heterogeneous sets)."""
        if self.even is None or self.prediction is None:
            return None
        return self.even.step.total / self.prediction.step.total


def plan_shapes(
    source: str,
    *,
    seqs: tuple[int, ...],
    devices: DeviceSet,
    global_batch: int,
    modes: tuple[str, ...] | None = None,
) -> tuple[list[ScaleRow], ModelSpec]:
    """``macrogen plan --model SOURCE``: the model's spec from its shapes (``meta_model``) at
    each sequence length, then every layout of the devices ranked (``rank_model``) together.
    ``global_batch`` sequences of the first length; the others keep its tokens per step (a
    length that does not divide them is an error). The spec returned is the first length's."""
    from macrogen.autotune import meta_model

    tokens = global_batch * seqs[0]
    rows: list[ScaleRow] = []
    specs = []
    for seq in seqs:
        if tokens % seq:
            raise PlanError(
                f"--seq-len {seq}: {global_batch} x {seqs[0]} tokens per step are no whole"
                f" number of {seq}-token sequences"
            )
        try:
            spec = meta_model.load_spec(source, seq, search_path=(os.getcwd(),))
        except meta_model.ShapeError as e:
            raise PlanError(str(e)) from None
        specs.append(spec)
        rows += rank_model(spec, devices, tokens // seq, modes=modes)
    rows.sort(key=_by_step)
    return rows, specs[0]


def rank_model(
    spec: ModelSpec,
    devices: DeviceSet,
    global_batch: int,
    arguments: dict[str, object] | None = None,
    modes: tuple[str, ...] | None = None,
) -> list[ScaleRow]:
    """Every layout of the device set for ``global_batch`` sequences of ``spec.seq`` tokens,
    the feasible (``layouts.problem``, and every rank within its device's memory) by predicted
    step time first; ``modes``: only these data-parallel modes (one data rank is always
    "replicate"). On a heterogeneous set each layout is predicted with rows and blocks in
    proportion to the devices' speed (``scale.adapted_split``) beside the even split."""
    world = devices.world
    shape = ModelShape(blocks=spec.layers, divisible=dict(spec.divisible), rows=global_batch,
                       experts=spec.experts)  # fmt: skip
    out = []
    every = layouts.enumerate_layouts(
        world, max_tp=devices.per_node, max_pp=spec.layers, rows=global_batch,
        experts=spec.experts,
    )  # fmt: skip
    for layout in every:
        if modes is not None and layout.dp not in modes and layout.dp_size(world) > 1:
            continue
        reason = layouts.problem(layout, world, shape, arguments)
        note = layouts.unsupported(layout) if arguments is None else None
        if reason is not None:
            out.append(ScaleRow(layout, None, reason, note, seq=spec.seq))
            continue
        even = scale.predict(spec, layout, devices, global_batch)
        found, before = even, None
        if not devices.uniform:
            split = scale.adapted_split(spec, layout, devices, global_batch)
            found, before = scale.predict(spec, layout, devices, global_batch, split), even
        if found.over is not None:
            out.append(ScaleRow(layout, None, f"over memory: {found.over}", note, seq=spec.seq))
            continue
        out.append(ScaleRow(layout, found, None, note, before, spec.seq))
    out.sort(key=_by_step)
    return out


def _by_step(row: ScaleRow) -> tuple[bool, float]:
    return row.prediction is None, row.prediction.step.total if row.prediction else 0.0
