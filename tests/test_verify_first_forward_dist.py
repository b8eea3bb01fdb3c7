"""``mg.parallelize(..., verify=True)``: the first forward checked against a serial copy (issue 43).

One spawn of 2 gloo ranks runs both sites of one file: with the head count divided the
first forward matches (a line on rank 0's stderr), without it the first forward is an
error naming the site, on every rank.
"""

from __future__ import annotations

import pytest
import torch

from macrogen.expand import expand_source
from tests import verify_programs
from tests.distributed import run_ranks

SOURCE = verify_programs.HEADS.replace("tp=2, tp_plan={", "tp=2, verify=True, tp_plan={")


def _both_sites(rank: int, world_size: int, code: str) -> list[str]:
    from macrogen.runtime.first_forward import FirstForwardMismatch

    namespace: dict[str, object] = {"__name__": "heads_verified"}
    exec(compile(code, "heads_verified.py", "exec"), namespace)
    torch.manual_seed(0)
    model, x = namespace["divided"]()  # type: ignore[operator]
    model(x).sum().backward()
    model(x)  # the check ran once: the second forward is the model's alone
    torch.manual_seed(0)
    model, x = namespace["undivided"]()  # type: ignore[operator]
    with pytest.raises(FirstForwardMismatch) as caught:
        model(x)
    return [str(caught.value)]


def test_verify_true_checks_the_first_forward(capfd):
    code = expand_source(SOURCE, path="heads_verified.py").code
    assert "check_first_forward(model, reference" in code
    results = run_ranks(_both_sites, 2, (code,), timeout=120)
    for (message,) in results:
        assert message.startswith(
            "heads_verified.py:24: error: verify=True: the first forward's output 0 differs"
        ), message
    err = capfd.readouterr().err
    assert err.count("heads_verified.py:31: verify=True: the first forward matches") == 1, err
