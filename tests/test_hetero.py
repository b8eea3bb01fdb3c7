"""The shares' logic without processes or clocks: the split of a global batch, the memory
cap, the rebalance after a rank slows down (rates injected), and the macro's refusals."""

from __future__ import annotations

import pytest
import torch

from macrogen.runtime.shares import (
    ShareConfig,
    Shares,
    count_rows,
    slice_rows,
    split_gain,
    split_rows,
)
from tests.helpers import expand, expansion_errors


def test_split_is_proportional_exact_and_gives_every_rank_a_row():
    assert split_rows(8, [3, 1], [None, None]) == [6, 2]
    assert split_rows(7, [1, 1], [None, None]) == [4, 3]  # the leftover row: the lower rank
    assert split_rows(10, [2, 1, 1], [None] * 3) == [5, 3, 2]
    assert split_rows(4, [1000, 1], [None, None]) == [3, 1]  # never an empty rank
    for total in range(3, 40):
        rows = split_rows(total, [0.61, 0.27, 0.12], [None] * 3)
        assert sum(rows) == total and min(rows) >= 1


def test_the_cap_holds_and_its_rows_go_to_the_others_in_proportion():
    assert split_rows(12, [4, 1, 1], [3, None, None]) == [3, 5, 4]
    assert split_rows(8, [1, 1], [2, 16]) == [2, 6]
    with pytest.raises(ValueError, match="hold 5 rows, fewer than the global batch of 8"):
        split_rows(8, [1, 1], [2, 3])
    with pytest.raises(ValueError, match="cannot give each of 3 ranks a row"):
        split_rows(2, [1, 1, 1], [None] * 3)


def test_slices_of_a_nested_batch_cover_its_rows_once():
    batch = {"x": torch.arange(10).view(5, 2), "y": (torch.arange(5), "keep")}
    assert count_rows(batch, "here") == 5
    part = slice_rows(batch, 1, 4)
    assert part["x"].tolist() == [[2, 3], [4, 5], [6, 7]] and part["y"][1] == "keep"
    with pytest.raises(ValueError, match=r"tensors of \[3, 5\] rows"):
        count_rows((torch.zeros(5), torch.zeros(3)), "here")


def _measured(rank: int, rates_at, every: int = 5) -> tuple[Shares, list[list[int]]]:
    """40 steps of a 2-rank "measured" split of 30 rows; ``rates_at(step)`` the gathered rates."""
    shares = Shares(ShareConfig("measured", rebalance_every=every), None, 2, rank, "t.py:1")
    shares.gather_rates = lambda device: rates_at(shares.steps)  # type: ignore[method-assign]
    rows = []
    for _ in range(40):
        part = shares.take(torch.arange(30), torch.device("cpu"))
        shares.computed()
        rows.append(list(shares.rows))
        assert len(part) == shares.rows[rank]
    return shares, rows


def test_a_rank_that_slows_down_gets_fewer_rows_at_the_next_measurement():
    # rank 1 runs at 100 rows/s until step 12, then at 50 (a busy process took half its core)
    def rates(step: int) -> list[float]:
        return [100.0, 100.0 if step < 12 else 50.0]

    shares, rows = _measured(0, rates)
    assert rows[0] == [15, 15] and rows[14] == [15, 15]
    assert rows[15] == [20, 10]  # the first measurement after the slow-down: 2:1
    assert all(r == [20, 10] for r in rows[15:])
    assert [step for step, _ in shares.history] == [5, 10, 15, 20, 25, 30, 35]
    other, other_rows = _measured(1, rates)
    assert other_rows == rows  # every rank computes the same split from the same rates
    assert shares.weight == pytest.approx(20 / 30) and other.weight == pytest.approx(10 / 30)
    assert shares.gain == pytest.approx(1.5)  # even: 15 rows at 50/s; now 20 at 100/s


def test_the_predicted_gain_is_the_slowest_ranks_time_even_and_uneven():
    assert split_gain([100.0, 50.0], 30) == pytest.approx((0.3, 0.2))
    assert split_gain([100.0, 50.0], 30, fixed_s=0.1) == pytest.approx((0.4, 0.3))
    # a cap keeps the fast rank at 16 rows: 14 go to the slow one
    assert split_gain([100.0, 50.0], 30, [16, None]) == pytest.approx((0.3, 0.28))


def test_a_window_without_a_measurement_keeps_the_shares():
    shares, rows = _measured(0, lambda step: [100.0, 0.0])
    assert all(r == [15, 15] for r in rows) and shares.history == []


def test_fixed_shares_and_caps_are_checked_against_the_data_ranks():
    with pytest.raises(ValueError, match="gives 3 shares for 2 data ranks"):
        Shares(ShareConfig((1, 2, 3)), None, 2, 0, "t.py:1")
    with pytest.raises(ValueError, match="has 3 caps for 2"):
        Shares(ShareConfig("even", max_rows=(1, 2, 3)), None, 2, 0, "t.py:1")


def test_shard_is_the_batch_itself_serially():
    import macrogen as mg

    batch = (torch.zeros(4, 2), torch.zeros(4))
    assert mg.shard(torch.nn.Linear(2, 2), batch) is batch


def test_parallelize_renders_the_shares_into_the_data_parallel_config():
    code = expand(
        """
        import macrogen as mg
        model = mg.parallelize(model, dp="replicate", dp_shares="measured", dp_max_rows=64)
        """
    )
    assert "shares='measured'," in code and "rebalance_every=10," in code
    assert "max_rows=64," in code
    compile(code, "expanded.py", "exec")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ('dp="fsdp", dp_shares="measured"', 'dp_shares takes dp="replicate" or "zero1"'),
        ('dp_shares="fast"', '"even", "measured" or one positive share per data rank'),
        ("dp_shares=[1]", "one positive share per data rank"),
        ("dp_rebalance_every=5", 'dp_rebalance_every applies with dp_shares="measured"'),
        ('dp_shares="even", accumulate=2', "gradient accumulation (accumulate=2)"),
        ('dp_shares="even", pp=2, microbatches=2', "pipeline micro-batches (pp=2)"),
        (
            'dp_shares="measured", tp=2, tp_plan={"fc": "colwise"}',
            'dp_shares="measured" with tp=2 is not supported',
        ),
        ('dp_shares="even", dp_max_rows=0', "an int >= 1 or one int >= 1 per data rank"),
        ("pp_split=[2, 1]", "pp_split applies with pp=N > 1"),
        ("pp=2, microbatches=2, pp_split=[2, 1, 1]", "pp_split gives 3 speeds for pp=2"),
        (
            'pp=2, microbatches=4, schedule="interleaved", pp_split="measured"',
            "pp_split takes one stage per rank",
        ),
        ('pp=2, microbatches=2, pp_split="fast"', '"measured" or one positive speed per stage'),
    ],
)
def test_parallelize_refuses_what_shares_cannot_weight(call, message):
    errors = expansion_errors(
        f"""
        import macrogen as mg
        model = mg.parallelize(model, {call})
        """
    )
    assert len(errors) == 1 and message in errors[0], errors


def test_stage_speeds_weigh_the_cut():
    from macrogen.pipelining.units import balanced

    weights = [1, 10, 10, 10, 10, 1]  # the embedding, 4 blocks, the head
    assert balanced(weights, [2, 3, 4], 2) == [3]  # even: 2 blocks each
    assert balanced(weights, [2, 3, 4], 2, [3.0, 1.0]) == [4]  # 3x as fast: 3 blocks
    assert balanced(weights, [2, 3, 4], 2, [1.0, 3.0]) == [2]
    # stage 0's memory holds 25 parameters: 2 blocks, however fast it is
    assert balanced(weights, [2, 3, 4], 2, [3.0, 1.0], [25.0, 100.0]) == [3]
    with pytest.raises(ValueError, match="no cut into 2 stages fits their memory"):
        balanced(weights, [2, 3, 4], 2, None, [15.0, 15.0])


def test_data_parallel_class_takes_the_same_shares_and_refusals():
    code = expand(
        """
        import torch.nn as nn
        import macrogen as mg

        @mg.data_parallel(dp_shares=[2, 1], dp_max_rows=[64, 32])
        class Net(nn.Module):
            pass
        """
    )
    assert "shares=(2, 1)," in code and "max_rows=(64, 32)," in code
    errors = expansion_errors(
        """
        import torch.nn as nn
        import macrogen as mg

        @mg.data_parallel(dp_shares="measured", sync_every=4)
        class Net(nn.Module):
            pass
        """
    )
    assert len(errors) == 1 and "dp_shares weights one backward per step" in errors[0], errors
