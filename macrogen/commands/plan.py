"""Rank the parallel layouts of FILE's mg.parallelize for a machine this one is not.

    macrogen plan train.py --entry :build --world-size 64 --gpu-memory 80GB \\
        --link nvlink:900GB/s,ib:50GB/s

The model is probed once here (a serial run through --entry, or the probe
``macrogen autotune`` stored in the tuning database); each layout's step time
and memory per rank are then predicted (docs/autotune.md, "Layouts"). Nothing
is measured on the planned machines.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from macrogen.commands import HelpFormatter, describe
from macrogen.expand import ExpansionError

if TYPE_CHECKING:
    from macrogen.autotune.planner import Row


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="rank parallel layouts by predicted step time and memory",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="the source with mg.parallelize(...)")
    p.add_argument(
        "--entry",
        default=":build",
        metavar="MODULE:FACTORY",
        help="factory returning (model, step), as for autotune",
    )
    p.add_argument("--world-size", required=True, metavar="N", help="ranks planned for")
    p.add_argument("--gpu-memory", metavar="SIZE", help="memory per device (80GB, 512MiB)")
    p.add_argument(
        "--link",
        default="nvlink:900GB/s,ib:50GB/s",
        metavar="LINKS",
        help="within a node, across nodes: NAME:BANDWIDTH[,NAME:BANDWIDTH]",
    )
    p.add_argument("--gpus-per-node", default="8", metavar="N", help="ranks on the fast link")
    p.add_argument(
        "--speedup",
        default="1",
        metavar="X",
        help="how much faster a device runs the serial step than this machine's probe",
    )
    p.add_argument(
        "--global-batch",
        metavar="ROWS",
        help="rows per step over all data ranks (default: the entry's batch, as probed)",
    )
    p.add_argument("--top", default="10", metavar="N", help="layouts to show")
    p.add_argument("--tuning", metavar="DB", help="tuning database holding autotune's probe")
    return p


def run(args: argparse.Namespace) -> int:
    from macrogen.autotune import cost, layouts, units

    try:  # every value read one way (macrogen.autotune.units); bad usage is exit 2
        args.world_size = units.count("--world-size", args.world_size, maximum=layouts.MAX_WORLD)
        args.gpus_per_node = units.count("--gpus-per-node", args.gpus_per_node)
        args.top = units.count("--top", args.top)
        global_batch = (
            None if args.global_batch is None else units.count("--global-batch", args.global_batch)
        )
        speedup = units.number("--speedup", args.speedup)
        intra, inter = cost.parse_links(args.link)
        device_memory = (
            None if args.gpu_memory is None else units.size("--gpu-memory", args.gpu_memory)
        )
    except units.UsageError as e:
        print(f"macrogen plan: error: {e}", file=sys.stderr)
        return 2
    machine = cost.Machine(args.gpus_per_node, intra, inter)
    from macrogen.autotune.planner import PlanError, plan

    try:
        rows, _ = plan(
            args.file,
            entry=args.entry,
            world_size=args.world_size,
            machine=machine,
            device_memory=device_memory,
            speedup=speedup,
            tuning=args.tuning,
            global_batch=global_batch,
        )
    except ExpansionError as e:
        print(e.report(), file=sys.stderr)
        return 1
    except (PlanError, OSError, SyntaxError) as e:
        print(f"macrogen plan: error: {e}", file=sys.stderr)
        return 1
    _print(rows, args)
    feasible = [r for r in rows if r.step is not None]
    return 0 if feasible else 1


def _print(rows: list[Row], args: argparse.Namespace) -> None:
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
    print(header)
    for i, r in enumerate(shown, 1):
        s = r.step
        assert s is not None  # feasible
        note = f"  (predicted only: {r.note})" if r.note else ""
        print(
            f"{i:>3}  {r.layout.describe(args.world_size):<{width}} {format_time(s.total):>10}"
            f" {format_time(s.compute):>10} {format_time(s.tensor):>10}"
            f" {format_time(s.data):>10} {format_time(s.pipeline):>10}"
            f" {format_bytes(r.memory.total):>12}{note}"
        )
    reasons: dict[str, int] = {}
    for r in rows:
        if r.reason is not None:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    for reason, n in reasons.items():
        print(f"infeasible ({n}): {reason}")
    if not feasible:
        print("no feasible layout", file=sys.stderr)
