"""Backend and device choice (the pure function), timeouts, launch() and the mesh agreement.

The CUDA-host decisions are tested through ``choose_placement`` with made-up
machines; what runs is checked with real gloo process groups on CPU.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest

from macrogen.runtime import groups
from macrogen.runtime.groups import Placement, choose_placement, timeout
from tests.distributed import run_ranks


def place(cuda: bool, gpus: int, local_rank: int, local_world: int, requested=None) -> Placement:
    return choose_placement(
        cuda_available=cuda,
        device_count=gpus,
        local_rank=local_rank,
        local_world_size=local_world,
        requested=requested,
    )


def test_cpu_machine_uses_gloo_on_the_cpu():
    assert place(False, 0, 1, 2) == Placement("gloo", "cpu", None)
    assert place(True, 0, 0, 1) == Placement("gloo", "cpu", None)  # CUDA built, no GPU visible


def test_one_gpu_per_rank_uses_nccl_for_cuda_and_gloo_for_cpu_tensors():
    for r in range(8):
        assert place(True, 8, r, 8) == Placement("cpu:gloo,cuda:nccl", f"cuda:{r}", r)
    assert place(True, 8, 1, 2) == Placement("cpu:gloo,cuda:nccl", "cuda:1", 1)  # spare GPUs


def test_more_ranks_than_gpus_share_them_over_gloo_and_never_name_a_missing_gpu():
    for r in range(2):  # examples/run.py's 2-rank demo on a 1-GPU machine
        p = place(True, 1, r, 2)
        assert (p.backend, p.device, p.cuda_ordinal) == ("gloo", "cuda:0", 0)
        assert "2 ranks on this node share 1 GPU" in p.note
    ordinals = {place(True, 2, r, 4).cuda_ordinal for r in range(4)}
    assert ordinals == {0, 1}


def test_asking_for_nccl_with_too_few_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank, but 2 ranks on this node"):
        place(True, 1, 1, 2, requested="nccl")
    with pytest.raises(ValueError, match="--nproc-per-node 1"):
        place(True, 1, 0, 2, requested="cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="no usable GPU"):
        place(False, 0, 0, 1, requested="nccl")


def test_a_requested_backend_is_used_as_given():
    assert place(True, 2, 1, 2, requested="nccl").backend == "nccl"
    assert place(True, 1, 1, 2, requested="gloo").device == "cuda:0"
    assert place(False, 0, 0, 2, requested=" auto ").backend == "gloo"
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"):
        place(True, 2, 2, 2)


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("MACROGEN_TIMEOUT", raising=False)
    assert timeout() is None
    monkeypatch.setenv("MACROGEN_TIMEOUT", "2.5")
    assert timeout() == datetime.timedelta(seconds=2.5)
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("MACROGEN_TIMEOUT", bad)
        with pytest.raises(ValueError, match="expected a positive number of seconds"):
            timeout()


# ---- real gloo groups -------------------------------------------------------------------


def _initialized_from_torchrun_env(rank: int, world: int, backend: str | None):
    """Like a rank under torchrun: the group is made by the runtime, CPU collectives work."""
    import torch
    import torch.distributed as dist

    from macrogen.runtime import launch

    if backend is not None:
        os.environ["MACROGEN_BACKEND"] = backend
    os.environ["MACROGEN_TIMEOUT"] = "60"
    run = launch.launch()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return run.rank, run.world_size, str(run.device), run.backend, t.item()


def test_launch_under_torchrun_environment_initializes_gloo_and_reduces_cpu_tensors():
    results = run_ranks(_initialized_from_torchrun_env, 2, args=(None,), timeout=120, init=False)
    assert results == [(0, 2, "cpu", "gloo", 3.0), (1, 2, "cpu", "gloo", 3.0)]


def test_a_device_specific_backend_carries_cpu_tensors():
    # "cpu:gloo,cuda:nccl" on a GPU host; here the CPU half of it, the same code path
    results = run_ranks(
        _initialized_from_torchrun_env, 2, args=("cpu:gloo",), timeout=120, init=False
    )
    assert [r[3:5] for r in results] == [("cpu:gloo", 3.0), ("cpu:gloo", 3.0)]


def test_launch_without_torchrun_is_world_size_one_and_dist_calls_work(tmp_path):
    script = tmp_path / "serial.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "import macrogen as mg\n"
        "run = mg.launch()\n"
        "t = torch.arange(3.0)\n"
        "dist.all_reduce(t)\n"
        "assert mg.launch() == run\n"
        "print(run.rank, run.world_size, run.device, run.backend, t.tolist())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 1 cpu gloo [0.0, 1.0, 2.0]"


def _mesh_with_tp_size_on_rank_one_only(rank: int, world: int):
    from macrogen.runtime import mesh

    if rank == 1:
        os.environ["MACROGEN_TP_SIZE"] = "2"
    else:
        os.environ.pop("MACROGEN_TP_SIZE", None)
    try:
        mesh.mesh()
    except mesh.MeshMismatchError as e:
        return str(e)
    return "no error"


def test_tp_size_set_on_one_rank_only_is_the_same_clear_error_on_every_rank():
    results = run_ranks(_mesh_with_tp_size_on_rank_one_only, 2, timeout=120)
    for rank, message in enumerate(results):
        assert "ranks ask for different tensor-parallel sizes" in message
        assert "rank 0: MACROGEN_TP_SIZE unset; rank 1: MACROGEN_TP_SIZE=2" in message
        assert f"raised on rank {rank}" in message


def _mesh_layout(rank: int, world: int):
    import torch
    import torch.distributed as dist

    from macrogen.runtime import mesh

    os.environ["MACROGEN_TP_SIZE"] = "2"
    m = mesh.mesh()
    assert mesh.mesh(2) is m and mesh.mesh() is m  # the program's one mesh, made once
    # mg.mesh(model): the mesh a model carries, never the program's in place of a missing one
    with pytest.raises(ValueError, match=r"this Linear carries no mesh: it was not parallelized"):
        mesh.mesh_of(torch.nn.Linear(1, 1))
    model = torch.nn.Linear(1, 1)
    mesh.carry(model, m)
    assert mesh.mesh_of(model) is m and mesh.mesh_of() is m
    dm = m.device_mesh
    return (
        m.shape,
        m.data_rank,
        dist.get_process_group_ranks(m.tensor_group),
        dist.get_process_group_ranks(m.data_group),
        dm.mesh_dim_names,
        dm.mesh.tolist(),
        dm.get_group("tensor") is m.tensor_group,
    )


def test_the_mesh_is_a_device_mesh_whose_groups_the_runtime_uses():
    results = run_ranks(_mesh_layout, 2, timeout=120)
    assert results[0] == ((1, 1, 2), 0, [0, 1], [0], ("data", "tensor"), [[0, 1]], True)
    assert results[1] == ((1, 1, 2), 0, [0, 1], [1], ("data", "tensor"), [[0, 1]], True)


def _stopped_peer(rank: int, world: int):
    from macrogen.runtime import launch, mesh

    os.environ["MACROGEN_TIMEOUT"] = "3"
    launch.launch()  # both ranks: the group is made with the timeout
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead (the harness kills it at the end)
    mesh.mesh()  # rank 0: RankTimeoutError after 3 s, reported by the harness


def test_a_stopped_peer_is_a_clear_error_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed") as failed:
        run_ranks(_stopped_peer, 2, timeout=90, init=False)
    elapsed = time.monotonic() - start
    message = str(failed.value)
    assert "RankTimeoutError: macrogen: building the data x tensor mesh" in message
    assert "not every rank arrived within 3 s (MACROGEN_TIMEOUT)" in message
    assert "Ranks 1 failed to pass monitoredBarrier" in message  # torch names the missing rank
    assert elapsed < 60  # 3 s, plus process start-up on a loaded machine; not 30 minutes


def test_a_world_size_past_a_c_int_or_a_local_world_above_the_world_is_refused(monkeypatch):
    """WORLD_SIZE=99999999999999999999 reached torch's store as a pybind TypeError; a
    LOCAL_WORLD_SIZE above WORLD_SIZE was taken (the probes of issue 43)."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MACROGEN_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "9" * 20)
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE='9+': expected a whole number from 1 to 2147483647"
    ):
        groups.placement()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4 is above WORLD_SIZE=2"):
        groups.placement()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert groups.placement().backend == "gloo"
