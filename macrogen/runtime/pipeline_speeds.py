"""Each pipeline stage's relative speed, for ``mg.parallelize(pp=N, pp_split=...)``.

``pp_split=[2, 1]``: stage 0's devices are twice as fast as stage 1's, and the cut gives
each stage parameters in proportion (``macrogen.pipelining.units.balanced``: a stage's
load is its parameters over its speed). ``pp_split="measured"``: before the cut every
rank times the same matrix multiplies on its device, the ranks all-gather the rates
(one collective of two numbers each), and a stage runs at its slowest rank's rate (its
data replicas and tensor peers wait for each other). Every rank cuts from the same
numbers, so all cut alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

PROBE_SIZE = 256  # a square matrix multiply's side: large enough to run at the device's pace
PROBE_REPEATS = 8  # multiplies between two looks at the clock
# Seconds of multiplies timed: long enough that a device (a core) shared with another
# process shows the share it gets, not the few milliseconds a scheduler favours a process
# that just woke up with.
PROBE_SECONDS = 0.2


def probe_speed(device: torch.device) -> float:
    """Multiply-add FLOP per second of float32 matrix multiplies on ``device``, sustained over
    ``PROBE_SECONDS`` (after a quarter of that to warm up)."""
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device)
    rate = 0.0
    for seconds in (PROBE_SECONDS / 4, PROBE_SECONDS):
        done, start, elapsed = 0, time.perf_counter(), 0.0
        while elapsed < seconds:
            for _ in range(PROBE_REPEATS):
                a = a @ b / PROBE_SIZE  # (scaled: the values stay finite)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            done += PROBE_REPEATS
            elapsed = time.perf_counter() - start
        rate = 2 * PROBE_SIZE**3 * done / elapsed
    return rate


def stage_speeds(
    split: str | Sequence[float] | None,
    stages: int,
    stage: int,
    device: torch.device,
    *,
    where: str,
) -> list[float] | None:
    """The stages' relative speeds (None: cut by parameters alone, evenly). ``stage``: this
    rank's; "measured" all-gathers every rank's probe (serially: nothing to measure)."""
    if split is None:
        return None
    if not isinstance(split, str):
        speeds = [float(s) for s in split]
        if len(speeds) != stages or not all(s > 0 and math.isfinite(s) for s in speeds):
            raise ValueError(
                f"mg.parallelize at {where}: pp_split={list(split)}: one positive speed per"
                f" stage ({stages})"
            )
        return speeds
    if split != "measured":
        raise ValueError(f"mg.parallelize at {where}: pp_split={split!r}: expected 'measured'")
    if not dist.is_initialized():
        return None
    mine = torch.tensor([probe_speed(device), float(stage)], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    speeds = [math.inf] * stages
    for rate, at in (t.tolist() for t in every):
        speeds[int(at)] = min(speeds[int(at)], rate)
    return speeds
