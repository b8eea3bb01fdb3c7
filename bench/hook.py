"""Import-hook cost: cold and warm imports against a plain import of the pre-expanded module.

    python bench/hook.py [--repeat 9]

Every measurement is a fresh interpreter (subprocess). "import" is the wall time
of the import statements inside it (for the hook: importing macrogen.hook,
install() and the import), "import cpu" their CPU time (steadier on a busy
machine), "process" the subprocess's whole wall time. Nothing is subtracted. Variants run round-robin so machine load spreads over all of them.

- plain:      `import model_expanded` (the `macrogen expand` output, with its .pyc)
- hook cold:  the hook expands model.py (cache cleared before each run)
- hook warm:  the hook loads model.py from its cache
- torch only, without / with the hook installed: what the finder costs the
  ~1,000 modules of an `import torch`, none of which uses macrogen (torch's own
  are passed over by name, its dependencies' sources are read and pre-checked)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from macrogen.commands.expand import expand_files

MODEL = '''\
"""A training step's helpers, as a user writes them."""
import torch
import torch.distributed as dist
import torch.nn as nn
import macrogen as mg

D_MODEL = mg.define(256)
N_LAYER = mg.define(4)
BLOCK = mg.tunable(1024, choices=[256, 1024, 4096])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.proj = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


def sync_metrics(loss, correct, seen):
    with mg.fused_allreduce(block=BLOCK):
        dist.all_reduce(loss)
        dist.all_reduce(correct)
        dist.all_reduce(seen)


def device():
    if mg.target("cuda"):
        return torch.device("cuda")
    else:
        return torch.device("cpu")
'''

HOOK = "import macrogen.hook; macrogen.hook.install(cache_dir={cache!r}); "
VARIANTS = {
    "plain": "import model_expanded",
    "hook cold": HOOK + "import model",
    "hook warm": HOOK + "import model",
    "torch only": "import torch",
    "torch only, hook installed": HOOK + "import torch",
}
TIMED = (
    "import time; t0, c0 = time.perf_counter(), time.process_time(); {stmt}; "
    "print(time.perf_counter() - t0, time.process_time() - c0)"
)


def measure(stmt: str, folder: Path, env: dict[str, str]) -> tuple[float, float, float]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", TIMED.format(stmt=stmt)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wall, cpu = map(float, out.split()[-2:])
    return wall, cpu, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="runs per variant (median)")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="macrogen-bench-hook-"))
    cache = folder / "cache"
    (folder / "model.py").write_text(MODEL)
    assert expand_files([str(folder / "model.py")], output=str(folder / "model_expanded.py")) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACROGEN_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the plain import gets its .pyc, as usual
    env["OMP_NUM_THREADS"] = "1"
    for stmt in (VARIANTS["plain"], VARIANTS["hook warm"].format(cache=str(cache))):
        measure(stmt, folder, env)  # write the .pyc and the cache entry

    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeat):
        for name, stmt in VARIANTS.items():
            if name == "hook cold":
                shutil.rmtree(cache, ignore_errors=True)
            times[name].append(measure(stmt.format(cache=str(cache)), folder, env))
    shutil.rmtree(folder, ignore_errors=True)

    def median(name: str, i: int) -> float:
        return statistics.median(t[i] for t in times[name])

    print(
        f"macrogen import hook, {args.repeat} fresh processes per variant, medians"
        f" (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)"
    )
    columns = ("import s", "import cpu s", "process s")
    print(f"{'variant':<28}" + "".join(f"{c:>14}" for c in columns) + "  ratios vs peer")
    for name in VARIANTS:
        peer = "torch only" if name.startswith("torch") else "plain"
        values = [median(name, i) for i in range(3)]
        ratios = " ".join(f"{median(name, i) / median(peer, i):.2f}x" for i in range(3))
        print(f"{name:<28}" + "".join(f"{v:>14.3f}" for v in values) + f"  {ratios}")
    warm = [median("hook warm", i) / median("plain", i) for i in range(3)]
    print(
        "warm import vs plain import of the expanded module:"
        f" {warm[0]:.2f}x wall, {warm[1]:.2f}x cpu, {warm[2]:.2f}x process (goal <= 1.10x)"
    )


if __name__ == "__main__":
    main()
