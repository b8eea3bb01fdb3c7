"""The memory traffic of the generated @tile kernels, metered on CPU (issue 28).

``bench/tile.py --traffic --json`` runs each pattern's kernel under
TRITON_INTERPRET=1 with macrogen.macros.tile.traffic.Meter (a subprocess: the
variable must be set before triton is imported) at row lengths up to 16K and
one past the persistent bound. Pinned here: a row that fits one block moves
each byte once (traffic / compulsory <= 1.05; the persistent variant), a
longer one is walked a tile at a time (the three-pass softmax reads its input
three times, which the meter must see), and the matmul loads within 1.2x of
its tiles' ideal bytes per FLOP.
"""

from __future__ import annotations

import json

import pytest

from tests import background


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    # started in the background when the session began (tests/background.py)
    proc = background.result("tile_traffic", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(rows: list[dict], pattern: str, n: int) -> dict:
    return next(r for r in rows if r["pattern"] == pattern and r["shapes"]["x"][-1] == n)


@pytest.mark.parametrize(
    "pattern",
    [
        "bias_gelu",
        "softmax",
        "online_softmax",
        "row_sum_max",
        "rms",
        "silu_residual",
        "batched_gate",
    ],
)
def test_rows_up_to_16k_move_each_byte_once(rows: list[dict], pattern: str) -> None:
    metered = [r for r in rows if r["pattern"] == pattern and not r["looped"]]
    assert metered and max(r["shapes"]["x"][-1] for r in metered) >= 1000
    if pattern not in ("bias_gelu", "silu_residual", "batched_gate"):
        assert any(r["shapes"]["x"][-1] == 16384 for r in metered)
    for r in metered:
        assert r["ratio"] <= 1.05, r
        assert r["load_ratio"] <= 1.05, r


def test_the_meter_sees_a_looped_softmax_read_its_row_three_times(rows: list[dict]) -> None:
    looped = _row(rows, "softmax", 20000)  # past the persistent bound: max, sum, write passes
    assert looped["looped"]
    assert looped["load_ratio"] == pytest.approx(3.0)
    assert looped["ratio"] == pytest.approx(2.0)  # 3 reads + 1 write over 1 + 1
    assert _row(rows, "online_softmax", 20000)["load_ratio"] == pytest.approx(2.0)
    assert _row(rows, "softmax", 16384)["load_ratio"] == pytest.approx(1.0)


def test_broadcast_rows_count_once_per_launch_and_raw_counts_each_program(rows: list[dict]) -> None:
    """A norm's weight (every program reads it; L2 serves the later ones) is counted once in the
    traffic, and once per program in the raw count."""
    rms = _row(rows, "rms", 16384)  # 3 rows, one per program: w is read 3 times
    assert rms["ratio"] == pytest.approx(1.0)
    assert rms["raw_ratio"] == pytest.approx((3 * 16384 * 2 + 3 * 16384) / (3 * 16384 * 2 + 16384))


def test_matmul_loads_within_1_2x_of_its_tiles_ideal(rows: list[dict]) -> None:
    (matmul,) = [r for r in rows if r["pattern"] == "matmul"]
    assert matmul["reuse_ratio"] <= 1.2
    assert matmul["ideal"] == pytest.approx(4 * (64 + 64) / (2 * 64 * 64))


@pytest.mark.parametrize("pattern", ["attention", "attention_causal"])
def test_attention_moves_each_byte_once_forward_and_backward(
    rows: list[dict], pattern: str
) -> None:
    """The forward loads q's tile once and walks the keys it sees (K and V from L2 after the
    first program); the backward's programs each own a block of keys (dk, dv) or of queries
    (dq) and read nothing twice: the goals are 1.05 and 1.1, both meter at 1.0."""
    forward = next(r for r in rows if r["pattern"] == pattern)
    backward = next(r for r in rows if r["pattern"] == f"{pattern} backward")
    assert forward["ratio"] <= 1.05, forward
    assert backward["ratio"] <= 1.1, backward
    assert forward["shapes"]["q"] == [2, 333, 64 if pattern == "attention" else 128]


def test_short_rows_take_two_rows_a_program(rows: list[dict]) -> None:
    """batched_gate's 4 x 50 rows of 1000: two rows a program (100 programs), not eight; the
    weight row, read again by each program from L2, stays out of the traffic (1.0)."""
    gate = _row(rows, "batched_gate", 1000)
    assert gate["programs"] == 100 and gate["ratio"] == pytest.approx(1.0)
    # x once, the weight row once a program (from L2), bias and out per row
    raw = (200 * 1000 + 100 * 1000 + 200 + 200) / (200 * 1000 + 1000 + 50 + 200)
    assert gate["raw_ratio"] == pytest.approx(raw, rel=1e-6)
