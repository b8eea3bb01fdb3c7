"""``python -m bench.probes``: the third round's hostile inputs (issue 43) and the second's
(issue 27) as one batch: every case in a process of its own with a time bound, judged as ok,
traceback, hang, silent wrong or failed (bench/probes/verdicts.py says how).

    python -m bench.probes                 # the whole battery (about 10-15 minutes on 2 cores)
    python -m bench.probes --fast          # only the cases that start no ranks (CLI, env)
    python -m bench.probes --only plan,env # categories
    python -m bench.probes -k MASTER       # cases whose category or name contains MASTER

It prints one row per case (category, case, outcome, the message's first line) and the
totals, and exits 1 when any case is not ok. Cheap cases run first.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path


def _preload(fast: bool) -> None:
    """What every child would import: once here, before the first fork."""
    import torch  # noqa: F401

    import macrogen.cli  # noqa: F401
    import macrogen.commands.autotune  # noqa: F401
    import macrogen.commands.expand  # noqa: F401
    import macrogen.commands.plan  # noqa: F401
    import macrogen.commands.run  # noqa: F401
    import macrogen.commands.verify  # noqa: F401
    import macrogen.expand.expansion  # noqa: F401
    import macrogen.runtime.checkpoint  # noqa: F401
    import macrogen.runtime.launch  # noqa: F401
    import macrogen.runtime.parallelize  # noqa: F401

    if not fast:
        import transformers  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401


def all_cases(fast: bool) -> list:
    from bench.probes import cli_cases, env_cases

    found = env_cases.cases() + cli_cases.cases()
    if not fast:
        from bench.probes import docs_cases, program_cases, second_round

        found += second_round.cases() + docs_cases.cases() + program_cases.cases()
    return [c for c in found if not (fast and c.ranks)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--fast", action="store_true", help="only the cases that start no ranks")
    parser.add_argument("--only", default="", help="categories, comma-separated")
    parser.add_argument("-k", default="", help="a substring of the category or the case")
    parser.add_argument(
        "--sample",
        type=int,
        default=0,
        help="only N cases, spread evenly over the selection (the fast test's)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="cases in flight (default: 2)")
    parser.add_argument("--keep", action="store_true", help="keep the cases' folders")
    args = parser.parse_args(argv)
    started = time.monotonic()
    _preload(args.fast)
    from bench.probes.runner import run_cases

    cases = all_cases(args.fast)
    if args.only:
        cases = [c for c in cases if c.category in args.only.split(",")]
    if args.k:
        cases = [c for c in cases if args.k.lower() in f"{c.category} {c.name}".lower()]
    if args.sample and len(cases) > args.sample:
        stride = len(cases) / args.sample
        cases = [cases[int(i * stride)] for i in range(args.sample)]
    cases.sort(key=lambda c: c.ranks)  # cheap first (stable: each file's order kept)
    print(f"{len(cases)} cases (preloaded in {time.monotonic() - started:.0f} s)", flush=True)
    print(f"{'category':<10} {'case':<44} {'outcome':<13} {'s':>5}  message", flush=True)

    def report(case, verdict, seconds) -> None:
        line = verdict.line.replace("\n", " ")[:150]
        print(
            f"{case.category:<10} {case.name[:44]:<44} {verdict.outcome:<13} {seconds:5.1f}  {line}",
            flush=True,
        )

    root = Path(tempfile.mkdtemp(prefix="macrogen_probes_"))
    done = run_cases(cases, root, args.jobs, report)
    totals = collections.Counter(v.outcome for _, v, _ in done)
    by_category = collections.defaultdict(collections.Counter)
    for case, verdict, _ in done:
        by_category[case.category][verdict.outcome] += 1
    print()
    for category, counts in by_category.items():
        print(f"{category:<10} " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    outcomes = ("ok", "traceback", "hang", "silent wrong", "failed")
    print("total      " + ", ".join(f"{k} {totals.get(k, 0)}" for k in outcomes)
          + f"; {len(done)} cases in {time.monotonic() - started:.0f} s")  # fmt: skip
    bad = [(c, v) for c, v, _ in done if v.outcome != "ok"]
    if bad:
        print("\nnot ok:")
        for case, verdict in bad:
            print(f"  {case.category} / {case.name}: {verdict.outcome}: {verdict.line[:300]}")
    if args.keep or bad:
        print(f"\nthe cases' folders: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
