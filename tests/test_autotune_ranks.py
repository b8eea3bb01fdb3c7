"""Autotune of the GPT example's ``bucket_mb`` on 2 gloo ranks under torchrun, within a budget.

That the winner's step time is within 5% of the best of a separate
exhaustive sweep is a timing claim: ``bench/autotune_bucket.py`` shows it.
"""

from __future__ import annotations

import io
import json
import shutil
import textwrap
import time
from pathlib import Path

from rich.console import Console

from macrogen.autotune import database
from macrogen.autotune.measure import Timing
from macrogen.autotune.report import Reporter
from macrogen.autotune.tuner import autotune

GPT = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
BUDGET_S = 50.0

ENTRY = """\
def make_step(module):
    _, step = module.build(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4)
    return step, {"dtype": "float32", "batch_size": 4, "block_size": 16, "n_embd": 32}
"""


def test_bucket_size_on_two_gloo_ranks_within_budget(tmp_path: Path) -> None:
    src = tmp_path / "gpt.py"
    shutil.copy(GPT, src)
    (tmp_path / "gpt_entry.py").write_text(textwrap.dedent(ENTRY))
    out = io.StringIO()
    reporter = Reporter(Console(file=out, width=200), Console(file=io.StringIO()))
    timing = Timing(warmup=1, steps=2, rounds=2, timeout=60)
    started = time.monotonic()
    outcome = autotune(
        src,
        entry="gpt_entry:make_step",
        world_size=2,
        target="cpu",
        budget=BUDGET_S,
        timing=timing,
        reporter=reporter,
    )
    assert time.monotonic() - started < BUDGET_S + 5  # the budget, plus writing the table

    record = outcome.record
    assert record is not None and record["key"]["world_size"] == 2
    assert record["key"]["params"] == ["GPT.bucket_mb"]
    assert record["key"]["signature"]["n_embd"] == 32
    times = {c["values"]["GPT.bucket_mb"]: c.get("time_s") for c in record["candidates"]}
    assert outcome.stopped in ("complete", "budget")
    if outcome.stopped == "complete":
        assert sorted(times) == [1, 4, 16, 25, 64]
    assert all(t is not None and t > 0 for t in times.values()), record["candidates"]
    best = min(times, key=times.get)
    assert outcome.winner == {"GPT.bucket_mb": best}
    assert "GPT.bucket_mb" in out.getvalue() and "winner" in out.getvalue()

    # expand picks the winner up from macrogen_tuning.json next to the source
    values, stale = database.winners(
        database.default_path(src), src.read_text(), file="gpt.py", target="cpu"
    )
    assert values == {"GPT.bucket_mb": best} and stale == []
    assert json.loads(database.default_path(src).read_text())["format"] == "macrogen-tuning"
