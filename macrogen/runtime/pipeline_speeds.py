"""Each pipeline stage's relative speed, for ``mg.parallelize(pp=N, pp_split=...)``.

``pp_split=[2, 1]``: stage 0's devices are twice as fast as stage 1's, and the cut gives
each stage parameters in proportion (``macrogen.pipelining.units.balanced``: a stage's
load is its parameters over its speed). ``pp_split="measured"``: before the cut every
rank times the same matrix multiplies on its device, the ranks all-gather the rates
(one collective of two numbers each), and a stage runs at its slowest rank's rate (its
data replicas and tensor peers wait for each other). Every rank cuts from the same
numbers, so all cut alike. On a GPU each rank also reports the parameters its memory
holds (free memory plus the whole model's parameters it frees after the cut, over 16
bytes per parameter: weight, gradient, Adam's moments), and no stage takes more than its
smallest rank's (activations are not counted); a CPU's memory is not measured.
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
# A parameter's bytes in training: fp32 weight and gradient, Adam's two moments (activations
# are not counted: the limit is an upper bound, checked by the cut)
BYTES_PER_PARAMETER = 16


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


def stage_devices(
    split: str | Sequence[float] | None,
    stages: int,
    stage: int,
    model_bytes: int,
    device: torch.device,
    *,
    where: str,
) -> tuple[list[float] | None, list[float] | None]:
    """The stages' relative speeds (None: cut by parameters alone, evenly) and the most
    parameters each stage's memory holds (None: no limit known). ``stage``: this rank's;
    ``model_bytes``: the whole model's parameters on this device (freed but for its stage's
    after the cut). "measured" all-gathers every rank's probe (serially: nothing to measure)."""
    if split is None:
        return None, None
    if not isinstance(split, str):
        speeds = [float(s) for s in split]
        if len(speeds) != stages or not all(s > 0 and math.isfinite(s) for s in speeds):
            raise ValueError(
                f"mg.parallelize at {where}: pp_split={list(split)}: one positive speed per"
                f" stage ({stages})"
            )
        return speeds, None
    if split != "measured":
        raise ValueError(f"mg.parallelize at {where}: pp_split={split!r}: expected 'measured'")
    if not dist.is_initialized():
        return None, None
    held = math.inf  # a CPU's memory is not measured: no limit
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = (free + model_bytes) / BYTES_PER_PARAMETER
    mine = torch.tensor(
        [probe_speed(device), float(stage), held], dtype=torch.float64, device=device
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    speeds, limits = [math.inf] * stages, [math.inf] * stages
    for rate, at, most in (t.tolist() for t in every):
        speeds[int(at)] = min(speeds[int(at)], rate)
        limits[int(at)] = min(limits[int(at)], most)
    return speeds, (limits if any(math.isfinite(x) for x in limits) else None)
