"""One rank of verify's parallel step: ``python -m macrogen.verify.rank JOB.json`` (torchrun).

Every rank loads FILE expanded, builds the model and the batch with the job's seed,
runs one forward and backward and gathers every weight and gradient whole (a collective
per DTensor, in ``named_parameters`` order on every rank); rank 0 writes them to the
job's ``out`` file for the parent to compare. A rank whose program fails writes the one
line why to ``error-rank<N>.txt`` beside the job and exits 1 (torchrun then ends the
others).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from macrogen.verify import program

ERROR_FILE = "error-rank{rank}.txt"  # in the job's folder: a rank's one-line failure


def run_rank(rank: int, world_size: int, job_path: str) -> bool:
    """The step on this rank (the process group is up); False when the program failed."""
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    for entry in reversed(job["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        module = program.load(Path(job["source"]), expanded=True, seed=job["seed"])
        model, batch, loss_fn = program.build(module, job["entry"], seed=job["seed"])
        snapshot = program.step(model, batch, loss_fn, seed=job["seed"])
    except (program.ProgramError, program.EntryError) as e:
        error = Path(job_path).parent / ERROR_FILE.format(rank=rank)
        error.write_text(str(e), encoding="utf-8")
        return False
    if rank == 0:
        torch.save(
            {
                "world_size": world_size,
                "loss": snapshot.loss,
                "weights": snapshot.weights,
                "grads": snapshot.grads,
                "placements": snapshot.placements,
            },
            job["out"],
        )
    return True


def main(job_path: str) -> int:
    from macrogen.autotune.worker import PID_SUFFIX
    from macrogen.runtime import environment
    from macrogen.runtime.groups import ensure_initialized

    # the launcher ends a rank that outlives its torchrun by this pid (autotune's _end)
    rank = environment.whole("RANK", 0, low=0)
    (Path(job_path).parent / f"rank{rank}{PID_SUFFIX}").write_text(str(os.getpid()))
    ensure_initialized()
    ok = run_rank(dist.get_rank(), dist.get_world_size(), job_path)
    if ok:
        dist.barrier()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
