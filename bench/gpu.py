"""One command for a GPU machine: macrogen's CUDA paths checked and timed, one table.

    python bench/gpu.py              # on a GPU machine, under 5 minutes (docs/gpu.md: the recipe)
    python bench/gpu.py --dry-run    # anywhere: tiny sizes on CPU, kernels under TRITON_INTERPRET=1

Rows (each checked against a reference, then timed):

- ``tile``: every bench/tile.py pattern's generated kernel, its max error against
  eager torch, and its speed against ``torch.compile`` of the eager expression
  (goal >= 0.9) and eager; the matmul in fp16, bf16 and fp32 as TFLOP/s against
  cuBLAS (``torch.matmul``; goal >= 0.8 for fp16/bf16; the best of
  bench/tile.py's MATMUL_CONFIGS);
- ``attention``: the attention patterns' kernels against SDPA's flash kernel in
  fp16 and bf16, head dimensions 64 and 128, causal and not, at sequence 4096:
  forward (goal >= 0.8) and forward + backward (goal >= 0.7), bench/gpu_attention.py;
- ``kernels``: gradient compression (fp32 -> bf16 and back) and the fused
  all-reduce's pack/unpack, as a fraction of the device's copy bandwidth;
- ``fused_allreduce``: 16 small tensors, world size 1 (NCCL; gloo in a dry
  run): host time per call, and its time over 16 separate ``all_reduce`` calls
  (goal <= 0.5);
- ``training``: one training step of a GPT (8 blocks, d 1024, 8 x 1024 tokens) at
  world size 1 for each parallel wrapper (``@data_parallel``, ``shard_optimizer``,
  ``mg.parallelize`` TP and FSDP, the first two also under ``torch.compile``)
  against its torch peer from the same weights (bench/gpu_training.py): losses
  equal, and the peer's step time over ours (goal >= 0.95).

The exit status is 1 when any result is wrong (a goal missed is reported, not
an error: the table is the measurement); 0 otherwise. A dry run checks the
same code paths for correctness only: its times mean nothing.
"""

from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv[1:]
if DRY:  # before anything imports triton: the kernels run on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.* from a checkout

from bench.fused_allreduce import block_source  # noqa: E402
from bench.gpu_attention import attention_rows  # noqa: E402
from bench.gpu_training import training_rows  # noqa: E402
from bench.tile import MATMUL_CONFIGS, PATTERNS, Pattern, load  # noqa: E402
from macrogen.expand import expand_source  # noqa: E402


@dataclass
class Row:
    section: str
    name: str
    error: float  # max abs error over max abs reference (0 where exact)
    tolerance: float
    seconds: float  # ours
    reference: str  # what ``ratio`` compares against
    ratio: float  # reference time / our time: > 1 is faster (for host time: ours / theirs)
    goal: str
    note: str = ""

    @property
    def wrong(self) -> bool:
        return not self.error <= self.tolerance  # (NaN is wrong)


def bench(fn, device: str) -> float:
    """Seconds per call: triton.testing.do_bench's median on CUDA; one timed call in a dry run."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    scale = want.abs().max().clamp_min(1e-30)
    return ((got - want).abs().max() / scale).item()


def _inputs(shapes: dict, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(s, generator=gen).to(device=device, dtype=dtype) for k, s in shapes.items()
    }


def tile_rows(directory: Path, device: str) -> list[Row]:
    rows = []
    for p in PATTERNS:
        name = p.name.split()[0]
        if name.startswith("attention"):  # the attention section times them against SDPA
            continue
        _, tiled = load(p, directory)
        launcher = getattr(tiled, f"_{name}_triton")
        shapes = p.small if DRY else p.gpu
        dtypes = [p.gpu_dtype]
        if p.flops is not None:  # the matmul in every dtype the kernel takes
            dtypes = [torch.float16, torch.bfloat16, torch.float32]
            if DRY:  # the interpreter multiplies bfloat16's bit patterns in tl.dot (triton#11584)
                dtypes.remove(torch.bfloat16)
        for dtype in dtypes:
            label = name if len(dtypes) == 1 else f"{name} {str(dtype).split('.')[-1]}"
            if p.flops is None:
                rows.append(_tile_row(p, label, launcher, shapes, device, dtype))
            else:
                rows.append(_best_matmul(p, label, directory, shapes, device, dtype))
    return rows


def _best_matmul(p: Pattern, label: str, directory: Path, shapes: dict, device: str, dtype) -> Row:
    """The matmul at each of MATMUL_CONFIGS (each one checked): the fastest, named in the note.
    A configuration the device cannot hold (shared memory for fp32 at 128x256x64) is skipped."""
    best: Row | None = None
    worst_error = 0.0
    for config in MATMUL_CONFIGS[: 2 if DRY else None]:
        _, tiled = load(p, directory, config)
        launcher = getattr(tiled, f"_{p.name.split()[0]}_triton")
        try:
            row = _tile_row(p, label, launcher, shapes, device, dtype)
        except Exception as e:
            if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
                continue
            raise
        worst_error = max(worst_error, row.error)
        row.note += "  " + "/".join(str(v) for v in config.values()) + " (i/j/k/stages/warps)"
        if best is None or row.seconds < best.seconds:
            best = row
    assert best is not None, "no matmul configuration fits this device"
    best.error = worst_error  # every configuration must be right
    return best


def _tile_row(p: Pattern, label: str, launcher, shapes: dict, device: str, dtype) -> Row:
    args = _inputs(shapes, device, dtype)
    ours = {k: v.clone() for k, v in args.items()}
    want = {k: v.float() for k, v in args.items()}  # eager in float32 on the rounded inputs
    launcher(**ours)
    p.eager(**want)
    error = max(rel_error(ours[o], want[o]) for o in p.outputs)
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    t_ours = bench(lambda: launcher(**args), device)
    if p.flops is not None:
        a, b = args["a"], args["b"]
        t_blas = bench(lambda: torch.matmul(a, b), device)
        flops = p.flops(shapes)
        note = f"{flops / t_ours / 1e12:.1f} vs {flops / t_blas / 1e12:.1f} TFLOP/s"
        goal = ">=0.8" if dtype != torch.float32 else ""
        return Row("tile", label, error, tolerance, t_ours, "cuBLAS", t_blas / t_ours, goal, note)
    eager_args = {k: v.clone() for k, v in args.items()}
    t_eager = bench(lambda: p.eager(**eager_args), device)
    if DRY:  # no torch.compile here: its CPU build needs a C++ toolchain and minutes
        return Row("tile", label, error, tolerance, t_ours, "eager (dry run)", t_eager / t_ours, "")
    compiled = torch.compile(p.eager)
    t_compiled = bench(lambda: compiled(**eager_args), device)
    note = f"eager {t_eager / t_ours:.2f}x"
    return Row(
        "tile", label, error, tolerance, t_ours, "torch.compile", t_compiled / t_ours, ">=0.9", note
    )


def copy_bandwidth(device: str, numel: int) -> float:
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench(lambda: dst.copy_(src), device)


def kernel_rows(device: str) -> list[Row]:
    from macrogen.kernels.grad_compress import compress, decompress

    from macrogen.runtime.fused import pack_torch, plan, unpack_torch

    numel = 4096 if DRY else 1 << 26
    peak = copy_bandwidth(device, numel)
    grads = torch.randn(numel, device=device)
    comm = torch.empty(numel, device=device, dtype=torch.bfloat16)
    back = torch.empty_like(grads)
    compress(grads, comm, 0.5)
    decompress(comm, back)
    rows = []
    error = rel_error(back, (grads * 0.5).to(torch.bfloat16))
    seconds = bench(lambda: compress(grads, comm, 0.5), device)
    gbs = numel * 6 / seconds
    rows.append(Row("kernels", "compress fp32->bf16", error, 1e-2, seconds, "copy", gbs / peak, ""))
    seconds = bench(lambda: decompress(comm, back), device)
    rows.append(
        Row(
            "kernels",
            "decompress bf16->fp32",
            error,
            1e-2,
            seconds,
            "copy",
            numel * 6 / seconds / peak,
            "",
        )
    )
    ts = [torch.randn(numel // 16, device=device) for _ in range(16)]
    (flat,) = plan(ts)
    buf = pack_torch(ts, flat)
    out = [torch.empty_like(t) for t in ts]
    unpack_torch(buf, out, flat)
    error = max(rel_error(o, t) for o, t in zip(out, ts))
    nbytes = 2 * 4 * flat.numel
    seconds = bench(lambda: pack_torch(ts, flat), device)
    rows.append(
        Row(
            "kernels",
            "fused pack 16 tensors",
            error,
            0.0,
            seconds,
            "copy",
            nbytes / seconds / peak,
            "",
        )
    )
    seconds = bench(lambda: unpack_torch(buf, out, flat), device)
    rows.append(
        Row(
            "kernels",
            "fused unpack 16 tensors",
            error,
            0.0,
            seconds,
            "copy",
            nbytes / seconds / peak,
            "",
        )
    )
    return rows


def _module(code: str, path: Path, name: str):
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def allreduce_rows(directory: Path, device: str) -> list[Row]:
    k = 16
    src = block_source(k)
    serial = _module(src, directory / "gpu_serial.py", "gpu_bench_serial").sync
    fused = _module(
        expand_source(src, path="sync.py").code, directory / "gpu_fused.py", "gpu_bench_fused"
    ).sync
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(0)
        ts = [
            torch.randn(int(n), generator=gen).to(device)
            for n in torch.randint(1, 1024, (k,), generator=gen)
        ]
        want = [t.clone() for t in ts]
        fused(*ts)
        serial(*want)
        error = max(rel_error(a, b) for a, b in zip(ts, want))
        t_fused = bench(lambda: fused(*ts), device)
        t_serial = bench(lambda: serial(*ts), device)
        iters = 3 if DRY else 200
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fused(*ts)
        host = (time.perf_counter() - start) / iters  # issued, not waited for
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    note = f"host {host * 1e6:.1f} us/call"
    return [
        Row(
            "fused_allreduce",
            f"{k} small fp32",
            error,
            0.0,
            t_fused,
            "separate",
            t_fused / t_serial,
            "<=0.5",
            note,
        )
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, no GPU needed")
    parser.add_argument(
        "--only",
        nargs="*",
        default=(),
        help="sections: tile attention kernels fused_allreduce training",
    )
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA device here; run with --dry-run to check it on CPU",
            file=sys.stderr,
        )
        return 2
    title = (
        "dry run on CPU (TRITON_INTERPRET=1; times mean nothing)"
        if DRY
        else torch.cuda.get_device_name()
    )
    print(f"== bench/gpu.py: {title}; torch {torch.__version__} ==")
    rows: list[Row] = []
    sections = args.only or ("tile", "attention", "kernels", "fused_allreduce", "training")
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        directory = Path(tmp)
        for section, run in (
            ("tile", lambda: tile_rows(directory, device)),
            ("attention", lambda: attention_rows(directory, device, DRY, bench, Row)),
            ("kernels", lambda: kernel_rows(device)),
            ("fused_allreduce", lambda: allreduce_rows(directory, device)),
            ("training", lambda: training_rows(directory, device, DRY, bench, Row, _module)),
        ):
            if section not in sections:
                continue
            try:
                rows += run()
            except Exception as e:  # a crash is a wrong result: report it in the table, go on
                traceback.print_exc()  # the table's cell holds 60 characters; the log, the cause
                rows.append(
                    Row(
                        section,
                        f"CRASH {type(e).__name__}: {e}"[:60],
                        float("nan"),
                        0.0,
                        0.0,
                        "",
                        0.0,
                        "",
                    )
                )
    head = f"{'section':<16}{'case':<28}{'max err':>10}{'ok':>5}{'time':>11}{'vs':>20}{'ratio':>8}{'goal':>7}  note"
    print(head)
    for r in rows:
        ok = "NO" if r.wrong else "ok"
        print(
            f"{r.section:<16}{r.name:<28}{r.error:>10.2e}{ok:>5}{r.seconds * 1e3:>9.3f}ms"
            f"{r.reference:>20}{r.ratio:>8.2f}{r.goal:>7}  {r.note}"
        )
    wrong = [r for r in rows if r.wrong]
    print(f"== {len(rows)} rows, {len(wrong)} wrong ==")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
