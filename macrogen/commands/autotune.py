"""Time every tunable(...) of FILE through an entry factory and record the winners.

The winners go to a JSON tuning database (default: macrogen_tuning.json next to
FILE) that ``macrogen expand`` reads. See docs/autotune.md.
"""

from __future__ import annotations

import argparse
import sys

from macrogen.commands import HelpFormatter, describe
from macrogen.expand import ExpansionError, InternalError


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "autotune",
        help="measure the candidates of every tunable(...) and record the winners",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="the annotated source file to tune")
    p.add_argument(
        "--entry",
        required=True,
        metavar="MODULE:FACTORY",
        help="factory(module) -> step: builds one training step from the expanded module"
        " (:FACTORY for a factory in FILE itself)",
    )
    p.add_argument("--world-size", default="1", metavar="N", help="ranks per run (torchrun)")
    p.add_argument(
        "--target",
        choices=("cpu", "cuda"),
        help="device to tune for (default: cuda if present, else cpu)",
    )
    p.add_argument(
        "--tuning",
        metavar="DB",
        help="tuning database to update (default: macrogen_tuning.json next to FILE)",
    )
    p.add_argument(
        "--budget",
        metavar="SECONDS",
        help="stop measuring after this long (default: no limit)",
    )
    p.add_argument("--max-trials", default="32", metavar="N", help="candidates to look at")
    p.add_argument(
        "--steps",
        default="3",
        metavar="N",
        help="timed steps per candidate and round on several ranks",
    )
    p.add_argument(
        "--rounds",
        default="4",
        metavar="N",
        help="interleaved timing rounds over each group of candidates",
    )
    p.add_argument(
        "--group",
        default="8",
        metavar="N",
        help="candidates timed together, interleaved (1: one after another, each saved as it ends)",
    )
    p.add_argument("--warmup", default="2", metavar="N", help="untimed steps before timing")
    p.add_argument(
        "--min-time",
        default="0.2",
        metavar="SECONDS",
        help="timing per candidate on one rank (torch.utils.benchmark / do_bench)",
    )
    p.add_argument("--timeout", default="180.0", metavar="SECONDS", help="limit per candidate")
    p.add_argument(
        "--retry-failed", action="store_true", help="measure again candidates that failed before"
    )
    layout = p.add_argument_group('layouts (mg.parallelize\'s degrees, layout="auto")')
    layout.add_argument(
        "--memory-per-rank",
        metavar="SIZE",
        help="prune layouts predicted over this memory per rank (80GB, 512MiB)",
    )
    layout.add_argument(
        "--noise",
        default="0.05",
        metavar="FRACTION",
        help="stop when no layout left is predicted faster than the best by this much",
    )
    layout.add_argument(
        "--exhaustive", action="store_true", help="measure every feasible layout (no early stop)"
    )
    return p


def run(args: argparse.Namespace) -> int:
    from macrogen.autotune import units
    from macrogen.autotune.measure import Timing
    from macrogen.autotune.tuner import AutotuneError, autotune, check_entry

    try:
        check_entry(args.entry)
        world_size = units.count("--world-size", args.world_size)
        budget = None if args.budget is None else units.number("--budget", args.budget)
        max_trials = units.count("--max-trials", args.max_trials)
        timing = Timing(
            warmup=units.count("--warmup", args.warmup, minimum=0),
            steps=units.count("--steps", args.steps),
            rounds=units.count("--rounds", args.rounds),
            group=units.count("--group", args.group),
            min_time=units.number("--min-time", args.min_time),
            timeout=units.number("--timeout", args.timeout),
        )
        memory = (
            None
            if args.memory_per_rank is None
            else units.size("--memory-per-rank", args.memory_per_rank)
        )
        noise = units.number("--noise", args.noise, inclusive=True)
    except (units.UsageError, AutotuneError) as e:  # bad usage: one line, exit 2 (as plan)
        print(f"macrogen autotune: error: {e}", file=sys.stderr)
        return 2
    try:
        outcome = autotune(
            args.file,
            entry=args.entry,
            world_size=world_size,
            target=args.target,
            tuning=args.tuning,
            budget=budget,
            max_trials=max_trials,
            timing=timing,
            retry_failed=args.retry_failed,
            memory_per_rank=memory,
            noise=float("-inf") if args.exhaustive else noise,
        )
    except ExpansionError as e:
        print(e.report(), file=sys.stderr)
        return 1
    except (AutotuneError, OSError, ValueError, SyntaxError) as e:
        print(f"macrogen autotune: error: {e}", file=sys.stderr)
        return 1
    except InternalError as e:
        print(
            f"{args.file}: internal error (a macrogen bug, please report it): {e}", file=sys.stderr
        )
        return 3
    return 0 if outcome.winner is not None else 1
