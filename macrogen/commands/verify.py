"""Check a parallel plan against the serial program: one step, every gradient compared.

    macrogen verify train.py --entry :build --world-size 2

The entry is a factory: ``build()`` in FILE (``:build``), or ``build(module)`` in another
module (``mymodels:build``, given FILE's module), returning ``(model, batch)`` or
``(model, batch, loss_fn)``, the model after its mg.parallelize(...) call. verify runs one
forward and backward serially here (FILE unexpanded) and on N local ranks (FILE
expanded), from the same seed, and prints the loss's and each parameter's gradient's
worst difference with the plan entry its layer belongs to. Exit 0: every row within
tolerance; 1: a row differs (the last line names the worst), or the program failed; 2:
bad usage. See docs/verify.md.
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
        "verify",
        help="check one parallel step against the serial program, gradient by gradient",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="the annotated source (its mg.parallelize)")
    p.add_argument(
        "--entry",
        required=True,
        metavar="MODULE:FACTORY",
        help="factory returning (model, batch[, loss_fn]) (:FACTORY for one in FILE)",
    )
    p.add_argument("--world-size", default="2", metavar="N", help="ranks of the parallel step")
    p.add_argument(
        "--rtol", metavar="X", help="relative tolerance (default: by dtype, float32 1e-4)"
    )
    p.add_argument(
        "--atol", metavar="X", help="absolute tolerance (default: by dtype, float32 1e-6)"
    )
    p.add_argument("--seed", default="0", metavar="N", help="torch's seed for model and batch")
    p.add_argument("--timeout", default="300", metavar="SECONDS", help="limit for the ranks")
    return p


def run(args: argparse.Namespace) -> int:
    from macrogen.autotune import units
    from macrogen.verify import UsageError, VerifyError, verify

    try:
        world_size = units.count("--world-size", args.world_size, minimum=1)
        seed = units.count("--seed", args.seed, minimum=0)
        timeout = units.number("--timeout", args.timeout)
        rtol = None if args.rtol is None else units.number("--rtol", args.rtol, inclusive=True)
        atol = None if args.atol is None else units.number("--atol", args.atol, inclusive=True)
        report = verify(
            args.file,
            entry=args.entry,
            world_size=world_size,
            rtol=rtol,
            atol=atol,
            seed=seed,
            timeout=timeout,
        )
    except (units.UsageError, UsageError) as e:  # bad usage: one line, exit 2 (as plan)
        print(f"macrogen verify: error: {e}", file=sys.stderr)
        return 2
    except ExpansionError as e:
        print(e.report(), file=sys.stderr)
        return 1
    except VerifyError as e:
        print(f"macrogen verify: error: {e}", file=sys.stderr)
        return 1
    except InternalError as e:
        print(
            f"{args.file}: internal error (a macrogen bug, please report it): {e}", file=sys.stderr
        )
        return 3
    print(report.table())
    if report.ok:
        print(report.verdict())
        return 0
    print(report.verdict(), file=sys.stderr)
    return 1
