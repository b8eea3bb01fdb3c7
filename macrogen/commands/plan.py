"""Rank parallel layouts for machines this one is not: a program's, or a model's from its shapes.

    macrogen plan --model llama3_8b/config.json --devices 8xH100 --global-batch 16 --seq-len 8192
    macrogen plan --model mymodels:build_on_meta --devices 8xH100:80GB,8xA100:40GB \\
        --global-batch 64 --seq-len 4096
    macrogen plan train.py --entry :build --world-size 64 --gpu-memory 80GB \\
        --link nvlink:900GB/s,ib:50GB/s

--model: a transformers config.json (or its folder), or module:name naming a config
object or a model built on the meta device: its parameters, FLOPs and activations
come from its shapes (meta tensors, torch's FlopCounterMode); nothing is built or run.
The devices come from a table of common GPUs (--device-table adds or replaces rows).
FILE: the model of FILE's mg.parallelize is probed once here (a serial run through
--entry, or the probe macrogen autotune stored in the tuning database). Each
layout's step time and memory per rank are predicted (docs/autotune.md, "macrogen
plan"). Nothing is measured on the planned machines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from macrogen.commands import HelpFormatter, describe
from macrogen.expand import ExpansionError

if TYPE_CHECKING:
    from macrogen.autotune.devices import DeviceSet
    from macrogen.autotune.model_spec import ModelSpec
    from macrogen.autotune.planner import Row, ScaleRow

DEFAULT_LINKS = "nvlink:900GB/s,ib:50GB/s"


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="rank parallel layouts by predicted step time and memory",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", metavar="FILE", nargs="?", help="a source with mg.parallelize(...)")
    shapes = p.add_argument_group("a model from its shapes (--model)")
    shapes.add_argument("--model", metavar="SOURCE", help="config.json, its folder, or module:name")
    shapes.add_argument(
        "--devices",
        metavar="SET",
        help="COUNTxKIND[:MEMORY],... in rank order (8xH100,8xA100:40GB)",
    )
    shapes.add_argument(
        "--seq-len",
        metavar="TOKENS",
        help="tokens per sequence; several (4096,8192): each is planned, at the first's tokens"
        " per step",
    )
    shapes.add_argument(
        "--dp", metavar="MODES", help="data-parallel modes to consider (replicate,zero1,fsdp)"
    )
    shapes.add_argument("--device-table", metavar="JSON", help="device kinds to add or replace")
    shapes.add_argument(
        "--save-spec", metavar="JSON", help="write the model's measured spec (--model takes it)"
    )
    probed = p.add_argument_group("a program's model, probed here (FILE)")
    probed.add_argument(
        "--entry",
        default=":build",
        metavar="MODULE:FACTORY",
        help="factory returning (model, step), as for autotune",
    )
    probed.add_argument("--world-size", metavar="N", help="ranks planned for")
    probed.add_argument("--gpus-per-node", default="8", metavar="N", help="ranks on the fast link")
    probed.add_argument(
        "--speedup",
        default="1",
        metavar="X",
        help="how much faster a device runs the serial step than this machine's probe",
    )
    probed.add_argument("--tuning", metavar="DB", help="tuning database holding autotune's probe")
    probed.add_argument(
        "--meta",
        action="store_true",
        help="the program builds its model on the meta device (mg.parallelize's init=): each"
        " rank holds only its shards, no whole-model build",
    )
    p.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory per device (80GB, 512MiB; B bytes, b bits)"
    )
    p.add_argument(
        "--link",
        metavar="LINKS",
        help=f"within a node, across nodes: NAME:BANDWIDTH[,NAME:BANDWIDTH] (FILE's default:"
        f" {DEFAULT_LINKS}; --model's: the device table's)",
    )
    p.add_argument(
        "--global-batch",
        metavar="ROWS",
        help="sequences (rows) per step over all data ranks (FILE's default: the entry's batch)",
    )
    p.add_argument("--top", default="10", metavar="N", help="layouts to show")
    return p


def run(args: argparse.Namespace) -> int:
    from macrogen.autotune import units

    try:  # every value read one way (macrogen.autotune.units); bad usage is exit 2
        if (args.file is None) == (args.model is None):
            raise units.UsageError("name FILE (a program) or --model SOURCE (a model), one of them")
        args.top = units.count("--top", args.top)
        args.global_batch = (
            None
            if args.global_batch is None
            else units.count("--global-batch", args.global_batch, maximum=2**40)
        )
        memory = None if args.gpu_memory is None else units.size("--gpu-memory", args.gpu_memory)
        if args.model is not None:
            return _run_shapes(args, memory)
        return _run_probed(args, memory)
    except units.UsageError as e:
        print(f"macrogen plan: error: {e}", file=sys.stderr)
        return 2


# -- --model: a model from its shapes --------------------------------------------------------
def _run_shapes(args: argparse.Namespace, memory: float | None) -> int:
    from dataclasses import replace
    from pathlib import Path

    from macrogen.autotune import cost, devices, units
    from macrogen.autotune.planner import PlanError, plan_shapes
    from macrogen.vocabulary import LAYOUT_DP_MODES

    for option, value in (("--world-size", args.world_size), ("--tuning", args.tuning)):
        if value is not None:
            raise units.UsageError(f"{option} goes with FILE; --model plans for --devices")
    if args.devices is None or args.global_batch is None or args.seq_len is None:
        raise units.UsageError("--model needs --devices, --global-batch and --seq-len")
    # (2**31 tokens: past what any attention kernel indexes)
    seqs = tuple(units.count("--seq-len", p, maximum=2**31) for p in args.seq_len.split(","))
    table = devices.TABLE
    if args.device_table is not None:
        try:
            table = devices.load_table(Path(args.device_table), table)
        except ValueError as e:
            raise units.UsageError(f"--device-table {e}") from None
    found = devices.parse_devices(args.devices, table=table)
    if args.link is not None or memory is not None:  # the options override every kind's figures
        intra, inter = cost.parse_links(args.link) if args.link is not None else (None, None)
        groups = tuple(
            (
                n,
                replace(
                    k,
                    intra=intra.bandwidth if intra else k.intra,
                    inter=inter.bandwidth if inter else k.inter,
                    memory=memory or k.memory,
                ),
            )
            for n, k in found.groups
        )
        found = devices.DeviceSet(groups)
    modes = None
    if args.dp is not None:
        modes = tuple(m.strip() for m in args.dp.split(","))
        wrong = [m for m in modes if m not in LAYOUT_DP_MODES]
        if wrong:
            raise units.UsageError(f"--dp {wrong[0]!r}: the modes are {', '.join(LAYOUT_DP_MODES)}")
    try:
        rows, spec = plan_shapes(
            args.model, seqs=seqs, devices=found, global_batch=args.global_batch, modes=modes
        )
    except PlanError as e:
        print(f"macrogen plan: error: {e}", file=sys.stderr)
        return 1
    if args.save_spec is not None:
        from macrogen.files import write_atomic

        try:
            write_atomic(Path(args.save_spec), spec.to_json().encode("utf-8"))
        except OSError as e:
            print(f"macrogen plan: error: --save-spec: {e}", file=sys.stderr)
            return 1
    _print_shapes(rows, spec, found, args)
    if any(r.prediction is not None for r in rows):
        return 0
    print("no feasible layout", file=sys.stderr)
    return 1


def _print_shapes(
    rows: list[ScaleRow], spec: ModelSpec, found: DeviceSet, args: argparse.Namespace
) -> None:
    from macrogen.autotune.memory import format_bytes
    from macrogen.autotune.report import format_time

    world = found.world
    feasible = [r for r in rows if r.prediction is not None]
    print(
        f"{args.model}: {spec.params / 1e9:.2f}B parameters, {spec.layers} blocks, from its"
        f" shapes on the meta device; {args.global_batch} x {spec.seq} tokens per step"
    )
    print(f"devices: {found.describe()}")
    print(
        "memory: as if each rank builds only its own shards (a meta-device build, then"
        " materialized per rank: no whole-model copy); mixed-precision Adam (16 bytes/parameter)"
    )
    print(f"{len(feasible)} feasible layout(s) of {world} ranks, best first:")
    shown = feasible[: args.top]
    several = len({r.seq for r in rows}) > 1  # sequence lengths in the space

    def named(r: ScaleRow) -> str:
        rows_ = round(args.global_batch * spec.seq / r.seq)
        return r.layout.describe(world) + (f", {rows_} x {r.seq} tokens" if several else "")

    width = max([28] + [len(named(r)) for r in shown])
    hetero = not found.uniform
    extra = f" {'even split':>10} {'gain':>6}  split" if hetero else ""
    print(
        f"{'#':>3}  {'layout':<{width}} {'step':>10} {'MFU':>6} {'compute':>10} {'tp':>10}"
        f" {'pp':>10} {'dp':>10} {'memory/rank':>12}{extra}"
    )
    for i, r in enumerate(shown, 1):
        p = r.prediction
        assert p is not None
        s = p.step
        note = f"  (predicted only: {r.note})" if r.note else ""
        more = ""
        if hetero and r.even is not None:
            rows_ = _runs(p.split.rows)
            blocks = _runs(p.split.blocks)
            more = (
                f" {format_time(r.even.step.total):>10} {r.gain or 1:>5.2f}x"
                f"  rows {rows_}, blocks {blocks}"
            )
        print(
            f"{i:>3}  {named(r):<{width}} {format_time(s.total):>10}"
            f" {p.mfu:>6.1%} {format_time(s.compute):>10} {format_time(s.tensor):>10}"
            f" {format_time(s.pipeline):>10} {format_time(s.data):>10}"
            f" {format_bytes(p.memory.total):>12}{more}{note}"
        )
    _reasons(r.reason for r in rows)


# -- FILE: a program's model, probed here ----------------------------------------------------
def _run_probed(args: argparse.Namespace, memory: float | None) -> int:
    from macrogen.autotune import cost, layouts, units

    for option, value in (
        ("--devices", args.devices),
        ("--seq-len", args.seq_len),
        ("--dp", args.dp),
        ("--device-table", args.device_table),
        ("--save-spec", args.save_spec),
    ):
        if value is not None:
            raise units.UsageError(f"{option} goes with --model, not FILE")
    if args.world_size is None:
        raise units.UsageError("FILE needs --world-size")
    args.world_size = units.count("--world-size", args.world_size, maximum=layouts.MAX_WORLD)
    args.gpus_per_node = units.count("--gpus-per-node", args.gpus_per_node)
    speedup = units.number("--speedup", args.speedup)
    args.link = args.link or DEFAULT_LINKS
    intra, inter = cost.parse_links(args.link)
    machine = cost.Machine(args.gpus_per_node, intra, inter)
    from macrogen.autotune.planner import PlanError, plan

    try:
        rows, _ = plan(
            args.file,
            entry=args.entry,
            world_size=args.world_size,
            machine=machine,
            device_memory=memory,
            speedup=speedup,
            tuning=args.tuning,
            global_batch=args.global_batch,
            meta=args.meta,
        )
    except ExpansionError as e:
        print(e.report(), file=sys.stderr)
        return 1
    except (PlanError, OSError, SyntaxError) as e:
        print(f"macrogen plan: error: {e}", file=sys.stderr)
        return 1
    _print_probed(rows, args)
    if any(r.step is not None for r in rows):
        return 0
    print("no feasible layout", file=sys.stderr)
    return 1


def _print_probed(rows: list[Row], args: argparse.Namespace) -> None:
    from macrogen.autotune.memory import format_bytes
    from macrogen.autotune.report import format_time

    feasible = [r for r in rows if r.step is not None]
    print(
        f"{len(feasible)} feasible layout(s) of {args.world_size} ranks"
        f" ({args.gpus_per_node} per node, {args.link}), best first:"
    )
    shown = feasible[: args.top]
    # the layout column as wide as its longest ("pp2 (mb4) x dp32 (replicate) + recompute 1/2")
    width = max([28] + [len(r.layout.describe(args.world_size)) for r in shown])
    header = f"{'#':>3}  {'layout':<{width}} {'step':>10} {'compute':>10} {'tp':>10} {'dp':>10} {'pp':>10} {'memory/rank':>12}"
    # what each rank holds at the step's peak: parameters, gradients, optimizer state, activations
    header += f" {'params':>10} {'grads':>10} {'state':>10} {'activ.':>10}"
    routed = any(r.layout.ep > 1 for r in shown)  # a mixture of experts: the all-to-alls' time
    header += f" {'ep':>10}" if routed else ""
    if getattr(args, "meta", False):  # (--meta; a caller's own namespace may not have it)
        print("memory: the model built on the meta device, each rank materializing its shards")
    print(header)
    for i, r in enumerate(shown, 1):
        s = r.step
        assert s is not None  # feasible
        note = f"  (predicted only: {r.note})" if r.note else ""
        print(
            f"{i:>3}  {r.layout.describe(args.world_size):<{width}} {format_time(s.total):>10}"
            f" {format_time(s.compute):>10} {format_time(s.tensor):>10}"
            f" {format_time(s.data):>10} {format_time(s.pipeline):>10}"
            f" {format_bytes(r.memory.total):>12} {format_bytes(r.memory.params):>10}"
            f" {format_bytes(r.memory.grads):>10} {format_bytes(r.memory.state):>10}"
            f" {format_bytes(r.memory.activations):>10}"
            + (f" {format_time(s.experts):>10}" if routed else "")
            + note
        )
    _reasons(r.reason for r in rows)


def _runs(values: Iterable[float]) -> str:
    """``3/3/3/1/1`` as ``3 x3, 1 x2``: a share per data rank or stage, repeats counted."""
    runs: list[list[float]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return ", ".join(f"{v:g}" + (f" x{n:g}" if n > 1 else "") for v, n in runs)


def _reasons(reasons: Iterable[str | None]) -> None:
    """The infeasible layouts by reason (memory: by the stage and device over it)."""
    counted: dict[str, int] = {}
    for reason in reasons:
        if reason is not None:
            key = reason.split(" needs ")[0] if reason.startswith("over memory") else reason
            counted[key] = counted.get(key, 0) + 1
    for reason, n in counted.items():
        print(f"infeasible ({n}): {reason}")
