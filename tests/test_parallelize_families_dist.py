"""The family sweep: every transformers causal LM that ships a tensor-parallel plan, through
``mg.parallelize(tp=2, tp_plan="hf")`` beside its serial copy (``tests/hf_families.py``).

One spawn of 2 gloo ranks loops over every family that builds from a shrunk config. Each is
ok (losses, first gradients and final parameters within 1e-9 of serial in float64; 1e-5 where
the model computes parts in float32 on purpose) or refused with a named reason: none silently
wrong, none crashed, at least 90% ok. docs/parallelize.md's table is this sweep's output
(``python -m tests.hf_families --write-table`` rewrites it).
"""

from __future__ import annotations

import pytest

from tests import hf_families
from tests.distributed import run_ranks

pytest.importorskip("transformers")


@pytest.mark.timeout(1800)
def test_every_family_is_serial_equal_or_refused_with_a_reason(tmp_path):
    results = run_ranks(
        hf_families.sweep, 2, args=(hf_families.expanded(str(tmp_path)), None), timeout=1700
    )[0]
    built = [r for r in results if r[1] != "unbuilt"]
    by_status = {s: [r[0] for r in built if r[1] == s] for s in ("ok", "refused", "wrong", "crash")}
    assert not by_status["wrong"], [r for r in built if r[1] == "wrong"]
    assert not by_status["crash"], [r for r in built if r[1] == "crash"]
    assert len(by_status["ok"]) >= 0.9 * len(built), by_status["refused"]
    for name in ("llama", "gemma", "gemma2", "vaultgemma", "qwen3", "mixtral", "qwen2_moe"):
        assert name in by_status["ok"], name
    assert hf_families.docs_table() == hf_families.table(results), (
        "docs/parallelize.md's family table is stale: python -m tests.hf_families --write-table"
    )
