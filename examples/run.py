"""Train examples/gpt.py serially and data-parallel on 2 CPU ranks; show that they agree.

    python examples/run.py [--steps 5] [--nproc 2] [--tp 1]

``--tp 2`` runs 2-way tensor parallelism (``--nproc 2``) or, with ``--nproc 4``,
2 x 2 data x tensor parallelism: ranks of one tensor group see the same data.

1. ``macrogen expand examples/gpt.py`` into a temporary directory;
2. the serial reference: the unexpanded file, one process, the whole batch;
3. the expanded file under torchrun, each rank on its share of the batch: every
   rank calls ``mg.launch()`` for its rank, world size and device, and prints
   them with the backend (on a GPU machine each rank takes its own GPU with
   NCCL; with more ranks than GPUs they share the GPUs over gloo);
4. the losses side by side, and the largest parameter difference after training.

Exits 1 if they don't agree (fp32: within summation-order rounding).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

import macrogen as mg
from macrogen.runtime.tensor_parallel import full_state_dict

HERE = Path(__file__).resolve().parent
CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32)
BATCH = 8  # the global batch: each of N ranks trains on BATCH / N sequences
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def train(
    gpt: types.ModuleType, steps: int, rank: int, world: int, device: torch.device
) -> tuple[list[float], dict]:
    """The same loop for both runs: rank ``rank`` of ``world`` trains on its rows of the batch."""
    torch.manual_seed(0)
    config = gpt.GPTConfig(**CONFIG)
    model = gpt.GPT(config).to(device)  # built on the CPU (same initial weights), then moved
    # SGD keeps rounding differences at rounding size (Adam divides tiny gradients by tiny norms)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    idx, targets = gpt.batch(config, BATCH, seed=1)
    tp = int(os.environ.get("MACROGEN_TP_SIZE", "1")) if world > 1 else 1
    rank, world = rank // tp, world // tp  # the data rank: tensor-parallel peers share data
    share = BATCH // world
    idx, targets = (
        idx[rank * share : (rank + 1) * share].to(device),
        targets[rank * share : (rank + 1) * share].to(device),
    )
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    if world > 1:  # the loss on the whole batch: the mean of the ranks' (equal shares)
        stacked = torch.stack(losses)
        torch.distributed.all_reduce(stacked)
        losses = list(stacked / (world * tp))
    state = full_state_dict(model)  # tensor-parallel shards gathered
    return [float(x) for x in losses], {k: v.cpu() for k, v in state.items()}


def worker(expanded: Path, steps: int, out: Path) -> None:
    run = mg.launch()  # rank, world size and device; the process group from torchrun's env
    print(f"  {run.describe()}", flush=True)
    gpt = load(expanded, "gpt_data_parallel")
    losses, state = train(gpt, steps, run.rank, run.world_size, run.device)
    if run.rank == 0:
        torch.save(state, out / "state.pt")
        (out / "losses.json").write_text(json.dumps(losses))
    torch.distributed.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides --nproc)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.out)
        return 0
    if args.nproc % args.tp or BATCH % (args.nproc // args.tp):
        parser.error(f"--tp must divide --nproc, and --nproc / --tp the batch of {BATCH}")

    from macrogen.expand import expand_source

    source = (HERE / "gpt.py").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        expanded = out / "gpt.py"
        expanded.write_text(expand_source(source, path="examples/gpt.py").code)
        print(f"expanded examples/gpt.py -> {expanded}")

        torch.set_num_threads(1)
        # the reference on the kind of device the ranks use (cuda:0, or the CPU)
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        gpt = load(HERE / "gpt.py", "gpt_serial")
        serial_losses, serial_state = train(gpt, args.steps, 0, 1, device)
        print(f"serial reference on {device}")

        env = dict(os.environ, OMP_NUM_THREADS="1", MACROGEN_TP_SIZE=str(args.tp))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={free_port()}", __file__, "--worker", str(expanded), "--steps", str(args.steps),
               "--out", str(out)]  # fmt: skip
        print("$", " ".join(cmd[1:]))
        subprocess.run(cmd, env=env, check=True, timeout=120)
        parallel_losses = json.loads((out / "losses.json").read_text())
        parallel_state = torch.load(out / "state.pt")

    print(f"\n{'step':>4}  {'serial loss':>12}  {f'{args.nproc} ranks loss':>12}")
    for i, (a, b) in enumerate(zip(serial_losses, parallel_losses)):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}")
    same_names = list(serial_state) == list(parallel_state)
    worst = max((serial_state[k] - parallel_state[k]).abs().max().item() for k in serial_state)
    losses_agree = torch.allclose(
        torch.tensor(serial_losses), torch.tensor(parallel_losses), rtol=RTOL
    )
    params_agree = same_names and all(
        torch.allclose(serial_state[k], parallel_state[k], rtol=RTOL, atol=1e-6)
        for k in serial_state
    )
    print(f"\nstate_dict keys identical: {same_names}; largest parameter difference: {worst:.2e}")
    tp = max(1, args.tp)
    mode = f"{args.nproc // tp} x {tp} data x tensor parallel" if tp > 1 else "data-parallel"
    if losses_agree and params_agree:
        print(f"serial and {mode} training agree (rtol {RTOL})")
        return 0
    print(f"serial and {mode} training DISAGREE", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
