"""Hook equals CLI: a program run through `macrogen run` computes what `macrogen expand` makes of it.

The driver script runs under `macrogen run` (itself expanded by the hook) and, in
one process per rank, computes the program three ways: imported through the hook,
its `macrogen expand` output imported as a plain module, and the unexpanded
source (the serial reference, where markers are no-ops). On 1 rank, and on 2 gloo
ranks under torchrun with a cold cache (both ranks expand the module at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from macrogen.commands.expand import expand_files

PROGRAM = """\
import torch
import torch.distributed as dist
import macrogen as mg

N = mg.define(5)
SCALE = mg.tunable(2.0, choices=[1.0, 2.0])


def metrics(seed):
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(seed + rank)
    loss = torch.rand(3, generator=g) * SCALE
    correct = torch.arange(N, dtype=torch.int64) * (rank + 1)
    seen = torch.randn(2, 3, generator=g)
    if dist.is_initialized():
        with mg.fused_allreduce():
            dist.all_reduce(loss)
            dist.all_reduce(correct)
            dist.all_reduce(seen)
    if mg.target("cuda"):
        device = "cuda"
    else:
        device = "cpu"
    return {"loss": loss.tolist(), "correct": correct.tolist(), "seen": seen.tolist(), "device": device}
"""

DRIVER = """\
import importlib.machinery
import importlib.util
import json
import os
import sys

import torch.distributed as dist
import macrogen as mg
import macrogen.hook

import program  # through the hook

SEED = mg.define(1234)


def plain(name, path):
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


if "WORLD_SIZE" in os.environ:
    dist.init_process_group("gloo")
assert isinstance(program.__spec__.loader, macrogen.hook.MacroLoader)
assert hasattr(program, "_fused_allreduce_l16")  # really expanded
results = {
    "rank": int(os.environ.get("RANK", "0")),
    "hook": program.metrics(SEED),
    "cli": plain("program_cli", sys.argv[1]).metrics(SEED),
    "reference": plain("program_ref", program.__file__).metrics(SEED),
    "caches": [r.cache for r in macrogen.hook.records()],
}
with open(os.path.join(sys.argv[2], f"rank{results['rank']}.json"), "w") as f:
    json.dump(results, f)  # a file per rank: the ranks' stdout lines may interleave
if dist.is_initialized():
    dist.destroy_process_group()
"""


def _results(folder: Path) -> list[dict]:
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    return sorted(found, key=lambda r: r["rank"])


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) <= 1e-6 * max(1.0, abs(a))
    return a == b


def test_hook_equals_cli_on_one_rank_and_on_two_gloo_ranks(tmp_path):
    (tmp_path / "program.py").write_text(PROGRAM)
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    expanded = tmp_path / "cli" / "program_cli.py"
    expanded.parent.mkdir()
    assert expand_files([str(tmp_path / "program.py")], output=str(expanded)) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MACROGEN_CACHE_DIR": str(tmp_path / "c1")}
    env.pop("MACROGEN_DISABLE", None)
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    out1.mkdir(), out2.mkdir()
    run = [sys.executable, "-m", "macrogen", "run", "driver.py", str(expanded)]

    one = subprocess.run(
        [*run, str(out1)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert one.returncode == 0, one.stderr
    [serial] = _results(out1)
    assert serial["caches"] == ["missing", "missing"]  # driver and program, both expanded
    assert serial["hook"] == serial["cli"]
    assert _close(serial["hook"], serial["reference"])

    env["MACROGEN_CACHE_DIR"] = str(tmp_path / "c2")  # cold again: both ranks expand at once
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    two = subprocess.run(
        [*torchrun, "-m", *run[2:], str(out2)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert two.returncode == 0, two.stdout + two.stderr
    ranks = _results(out2)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["hook"] == r["cli"]
        assert _close(r["hook"], r["reference"])
        assert r["hook"]["correct"] == [3 * i for i in range(5)]  # summed over both ranks
    assert ranks[0]["hook"] == ranks[1]["hook"]  # all-reduced: the same on every rank
    assert ranks[0]["hook"] != serial["hook"]
    entries = list(Path(tmp_path / "c2").rglob("*.mgc"))
    assert sorted(p.name.split(".")[0] for p in entries) == ["driver", "program"]
