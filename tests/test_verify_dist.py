"""macrogen verify on 2 gloo ranks: a plan checked against the serial function (issue 43).

The ranks are forked from the test suite's forkserver (tests/distributed.py: torch and
transformers imported once) through verify's ``launch`` hook; the serial step runs in
this process, as the command runs it in its own. One case goes through the command and
torchrun end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from macrogen.verify import VerifyError, verify
from macrogen.verify.rank import run_rank
from tests import verify_programs
from tests.distributed import run_ranks


class _Forked:
    """verify's ranks forked from the suite's server, at ``wait()`` (the serial step first)."""

    def __init__(self, job: Path, world_size: int, timeout: float, rank=run_rank):
        self.args, self.rank, self.results = (job, world_size, timeout), rank, []

    def wait(self) -> None:
        job, world_size, timeout = self.args
        self.results = run_ranks(self.rank, world_size, (str(job),), timeout=timeout)

    def stop(self) -> None:
        pass


def test_llama_with_the_plan_transformers_ships_passes(tmp_path):
    path = verify_programs.write(tmp_path, "llama_plan", verify_programs.LLAMA)
    report = verify(path, entry=":build", world_size=2, launch=_Forked, timeout=120)
    assert report.ok, report.table()
    names = [r.name for r in report.rows]
    assert names[0] == "loss" and "model.layers.0.self_attn.q_proj.weight" in names
    planned = {r.name: r.planned for r in report.rows}
    assert planned["model.layers.0.self_attn.o_proj.weight"].startswith("rowwise")
    assert report.verdict().startswith(f"{path}:9:13: ok: the step on 2 ranks matches")


def test_an_undivided_head_count_fails_naming_the_attention(tmp_path):
    path = verify_programs.write(tmp_path, "heads_plan", verify_programs.HEADS)
    report = verify(path, entry=":undivided", world_size=2, launch=_Forked, timeout=120)
    assert not report.ok
    failing = {r.name for r in report.rows if not r.ok}
    assert {"loss", "0.q.weight", "0.o.weight"} <= failing
    assert {r.name: r.planned for r in report.rows}["0.q.weight"] == "colwise  0.q"
    verdict = report.verdict()
    assert verdict.startswith(f"{path}:24:13: error: the step on 2 ranks differs")
    assert "(planned colwise at 0." in verdict or "(planned rowwise at 0." in verdict
    assert verdict.endswith("the plan does not divide 0.n_head (4): add '0.n_head': 'divide'?")


def _verify_and_recompute(rank: int, world_size: int, job_path: str) -> dict[str, torch.Tensor]:
    """verify's rank, then the same step again by this test's own means: the expansion
    executed here, its gradients gathered with DTensor's full_tensor()."""
    from torch.distributed.tensor import DTensor

    from macrogen.expand import expand_source

    assert run_rank(rank, world_size, job_path)
    source = Path(json.loads(Path(job_path).read_text())["source"])
    code = expand_source(source.read_text(), path=source.name).code
    namespace: dict[str, object] = {"__name__": "gemma_again"}
    exec(compile(code, str(source), "exec"), namespace)
    torch.manual_seed(0)
    model, ids, loss_fn = namespace["build"]()  # type: ignore[operator]
    loss_fn(model(ids)).backward()
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
        for name, p in model.named_parameters()
    }


def test_a_scaled_embedding_subclass_is_judged_as_the_gradients_say(tmp_path):
    """Gemma's embedding planned "vocab": whether the engine runs the subclass's own forward
    or not, verify's verdict is what an independent comparison of the gradients says."""
    path = verify_programs.write(tmp_path, "gemma_plan", verify_programs.GEMMA)
    ranks: list[_Forked] = []

    def launch(job: Path, world_size: int, timeout: float) -> _Forked:
        ranks.append(_Forked(job, world_size, timeout, rank=_verify_and_recompute))
        return ranks[0]

    report = verify(path, entry=":build", world_size=2, launch=launch, timeout=120)
    parallel = ranks[0].results
    namespace: dict[str, object] = {"__name__": "gemma_serial"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    torch.manual_seed(0)
    model, ids, loss_fn = namespace["build"]()  # type: ignore[operator]
    loss_fn(model(ids)).backward()
    same = all(
        torch.allclose(parallel[0][name], p.grad, rtol=1e-4, atol=1e-6)
        for name, p in model.named_parameters()
    )
    assert report.ok == same, report.table()
    if not same:
        assert not {r.name: r for r in report.rows}["0.weight"].ok


def test_the_command_runs_the_ranks_under_torchrun(tmp_path):
    path = verify_programs.write(tmp_path, "heads_cli", verify_programs.HEADS)
    done = subprocess.run(
        [sys.executable, "-m", "macrogen", "verify", str(path), "--entry", ":divided"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["parameter", "planned", "max", "abs", "max", "rel"]
    assert lines[-1].startswith(f"{path}:31:13: ok: the step on 2 ranks matches")
    assert done.stderr == ""


UNSEEDED = """\
import os
import pytest
import torch
import torch.nn as nn
import torch.distributed as dist
import macrogen as mg


def build():
    model = nn.Linear(4, 4)
    with torch.no_grad():  # weights from the process, not from torch's seed
        model.weight.add_(torch.randn(4, 4, generator=torch.Generator().manual_seed(os.getpid())))
    model = mg.parallelize(model, dp="replicate")
    return model, torch.randn(2, 4)


def fails_in_parallel():
    if dist.is_initialized():
        raise RuntimeError("no data on this rank")
    return nn.Linear(4, 4), torch.randn(2, 4)
"""


def test_weights_that_differ_before_the_step_are_said_to(tmp_path):
    path = verify_programs.write(tmp_path, "unseeded_plan", UNSEEDED)
    report = verify(path, entry=":build", world_size=2, launch=_Forked, timeout=120)
    assert not report.ok
    assert report.weights_differ[0].name == "weight"
    assert "error: the weights differ before the step (weight, max abs" in report.verdict()


def test_a_program_failing_on_the_ranks_is_one_line(tmp_path):
    path = verify_programs.write(tmp_path, "failing_ranks", UNSEEDED)
    with pytest.raises(VerifyError) as caught:
        verify(path, entry=":fails_in_parallel", world_size=2, launch=_Forked, timeout=120)
    assert str(caught.value) == (
        f"{path}: on rank 0 of 2, the entry :fails_in_parallel raised RuntimeError:"
        " no data on this rank"
    )
