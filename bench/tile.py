"""@tile: the generated CPU path against eager torch and the unexpanded loop; the kernel on CUDA.

    python bench/tile.py [--threads 1] [--rounds 7] [--min-run-time 0.3] [--only softmax ...]
    python bench/tile.py --traffic [--json]   # memory traffic of each kernel, on CPU

CPU, per pattern (medians of torch.utils.benchmark):
  * the expanded function's torch path over eager torch written as the same
    expression (goal: <= 1.0);
  * the unexpanded loop over the torch path, both on a small input (the loop
    is Python; goal: >= 100x).
Path and eager are measured in alternating rounds and the median ratio is
reported, so that load from other processes hits both alike.
CUDA (only where a GPU exists): the generated Triton kernel and
torch.compile of the eager expression, timed with triton.testing.do_bench, as
GB/s (TFLOP/s for the matmul) and as a fraction of the device's measured copy
bandwidth.
Traffic (``--traffic``, no GPU needed): each pattern's kernel under
TRITON_INTERPRET=1 with macrogen.macros.tile.traffic's meter, as bytes moved
over compulsory bytes (each input read once, each output written once) at
row lengths up to 16K; for the matmul, bytes loaded per FLOP over its tile
sizes' ideal.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark

from macrogen.expand import expand_source

HEADER = "import torch\nimport macrogen as mg\n\n"
CLOCK = "cpu"  # or "wall" (--clock)


@dataclass(frozen=True)
class Pattern:
    name: str
    source: str
    eager: object  # the same computation written in eager torch, in place
    shapes: dict  # parameter -> shape, for the timed run
    small: dict  # parameter -> shape, for the loop comparison
    gpu: dict  # parameter -> shape, for the CUDA section
    flops: object = None  # (shapes) -> floating-point operations, for TFLOP/s
    gpu_dtype: torch.dtype = torch.float32
    outputs: tuple = ("out",)  # the parameters the nest writes
    traffic: tuple = ()  # shapes (parameter -> shape) at which --traffic meters the kernel


def _bias_gelu(out, x, b):
    v = x + b
    out.copy_(0.5 * v * (1.0 + torch.tanh(0.79788456 * (v + 0.044715 * v * v * v))))


def _softmax(out, x):
    m = x.amax(dim=1, keepdim=True)
    s = torch.exp(x - m).sum(dim=1, keepdim=True)
    out.copy_(torch.exp(x - m) / s)


def _row_sum_max(total, biggest, x):
    total.copy_(x.sum(dim=1))
    biggest.copy_(x.amax(dim=1))


def _matmul(out, a, b):
    out += a @ b


def _batched_gate(out, x, w, bias):
    out.copy_(torch.sigmoid((x * w).sum(dim=2) + bias))


def _rms(out, x, w):
    out.copy_(x * torch.rsqrt((x * x).sum(dim=1, keepdim=True) / x.shape[1] + 1e-6) * w)


def _silu_residual(out, x, y):
    out.copy_(x * torch.sigmoid(x) + y)


def _attention(out, q, kk, v, scale):
    s = (q @ kk.mT) * scale
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    out.copy_((e @ v) / e.sum(dim=-1, keepdim=True))


def _causal_attention(out, q, kk, v, scale):
    s = (q @ kk.mT) * scale
    keys = torch.arange(s.shape[-1], device=s.device)
    s = s.masked_fill(keys[None, :] > keys[: s.shape[-2], None], float("-inf"))
    out.copy_(torch.softmax(s, dim=-1) @ v)


# The attention patterns' tunables: the forward's query and key tiles, warps and stages, the
# backward's blocks, step, warps and stages (macrogen autotune searches them; bench/gpu.py times
# ATTENTION_CONFIGS, bench/gpu_attention.py)
ATTENTION_TILES = """
        @mg.tile(
            i=mg.tunable(128, choices=[64, 128]),
            j=mg.tunable(64, choices=[32, 64, 128]),
            num_warps=mg.tunable(4, choices=[4, 8]),
            num_stages=mg.tunable(3, choices=[2, 3, 4]),
            backward_block=mg.tunable(64, choices=[64, 128]),
            backward_step=mg.tunable(32, choices=[16, 32, 64]),
            backward_warps=mg.tunable(4, choices=[4, 8]),
            backward_stages=mg.tunable(2, choices=[1, 2, 3]),
        )"""


def _attention_shapes(batch: int, n: int, head: int) -> dict:
    """(batch x heads, n, head) for q, kk, v and out, and the scale 1/sqrt(head)."""
    shape = (batch, n, head)
    return {"out": shape, "q": shape, "kk": shape, "v": shape, "scale": head**-0.5}


PATTERNS = [
    Pattern(
        "bias_gelu",
        """
        @mg.tile(i=32, j=64)
        def bias_gelu(out, x, b):
            M, N = x.shape
            for i in range(M):
                for j in range(N):
                    v = x[i, j] + b[j]
                    out[i, j] = 0.5 * v * (1.0 + torch.tanh(0.79788456 * (v + 0.044715 * v * v * v)))
        """,
        _bias_gelu,
        {"out": (2048, 2048), "x": (2048, 2048), "b": (2048,)},
        {"out": (48, 64), "x": (48, 64), "b": (64,)},
        {"out": (8192, 8192), "x": (8192, 8192), "b": (8192,)},
    ),
    Pattern(
        "softmax",
        """
        @mg.tile(i=4, j=1024)
        def softmax(out, x):
            M, N = x.shape
            for i in range(M):
                m = float("-inf")
                for j in range(N):
                    m = max(m, x[i, j])
                s = 0.0
                for j in range(N):
                    s += torch.exp(x[i, j] - m)
                for j in range(N):
                    out[i, j] = torch.exp(x[i, j] - m) / s
        """,
        _softmax,
        {"out": (2048, 2048), "x": (2048, 2048)},
        {"out": (32, 64), "x": (32, 64)},
        {"out": (16384, 4096), "x": (16384, 4096)},
    ),
    Pattern(
        "online_softmax",
        """
        @mg.tile(i=4, j=1024)
        def online_softmax(out, x):
            M, N = x.shape
            for i in range(M):
                m = float("-inf")
                s = 0.0
                for j in range(N):
                    m_new = max(m, x[i, j])
                    s = s * torch.exp(m - m_new) + torch.exp(x[i, j] - m_new)
                    m = m_new
                for j in range(N):
                    out[i, j] = torch.exp(x[i, j] - m) / s
        """,
        _softmax,
        {"out": (2048, 2048), "x": (2048, 2048)},
        {"out": (32, 64), "x": (32, 64)},
        {"out": (16384, 4096), "x": (16384, 4096)},
    ),
    Pattern(
        "row_sum_max",
        """
        @mg.tile(i=16, j=256)
        def row_sum_max(total, biggest, x):
            M, N = x.shape
            for i in range(M):
                s = 0.0
                m = float("-inf")
                for j in range(N):
                    s += x[i, j]
                    m = max(m, x[i, j])
                total[i] = s
                biggest[i] = m
        """,
        _row_sum_max,
        {"total": (2048,), "biggest": (2048,), "x": (2048, 2048)},
        {"total": (48,), "biggest": (48,), "x": (48, 64)},
        {"total": (16384,), "biggest": (16384,), "x": (16384, 4096)},
        outputs=("total", "biggest"),
    ),
    Pattern(
        "rms",
        """
        @mg.tile(i=4, j=1024)
        def rms(out, x, w):
            M, N = x.shape
            for i in range(M):
                ss = 0.0
                for j in range(N):
                    ss += x[i, j] * x[i, j]
                r = 1.0 / torch.sqrt(ss / N + 1e-6)
                for j in range(N):
                    out[i, j] = x[i, j] * r * w[j]
        """,
        _rms,
        {"out": (2048, 2048), "x": (2048, 2048), "w": (2048,)},
        {"out": (32, 64), "x": (32, 64), "w": (64,)},
        {"out": (16384, 4096), "x": (16384, 4096), "w": (4096,)},
    ),
    Pattern(
        "silu_residual (1-D)",
        """
        @mg.tile(i=1024)
        def silu_residual(out, x, y):
            N = x.shape[0]
            for i in range(N):
                out[i] = x[i] * torch.sigmoid(x[i]) + y[i]
        """,
        _silu_residual,
        {"out": (1 << 22,), "x": (1 << 22,), "y": (1 << 22,)},
        {"out": (4096,), "x": (4096,), "y": (4096,)},
        {"out": (1 << 26,), "x": (1 << 26,), "y": (1 << 26,)},
    ),
    Pattern(
        "matmul",
        """
        @mg.tile(
            i=mg.tunable(64, choices=[64, 128]),
            j=mg.tunable(64, choices=[64, 128, 256]),
            k=mg.tunable(32, choices=[32, 64]),
            num_stages=mg.tunable(3, choices=[3, 4]),
            num_warps=mg.tunable(4, choices=[4, 8]),
        )
        def matmul(out, a, b):
            M, K = a.shape
            _, N = b.shape
            for i in range(M):
                for j in range(N):
                    for k in range(K):
                        out[i, j] += a[i, k] * b[k, j]
        """,
        _matmul,
        {"out": (512, 512), "a": (512, 512), "b": (512, 512)},
        {"out": (16, 16), "a": (16, 16), "b": (16, 16)},
        {"out": (4096, 4096), "a": (4096, 4096), "b": (4096, 4096)},
        flops=lambda s: 2 * s["a"][0] * s["a"][1] * s["b"][1],
        gpu_dtype=torch.float16,
    ),
    Pattern(
        "batched_gate (3 loops)",
        """
        @mg.tile(b=2, i=8, j=64)
        def batched_gate(out, x, w, bias):
            B, M, N = x.shape
            for b in range(B):
                for i in range(M):
                    acc = 0.0
                    for j in range(N):
                        acc += x[b, i, j] * w[j]
                    out[b, i] = torch.sigmoid(acc + bias[i])
        """,
        _batched_gate,
        {"out": (16, 512), "x": (16, 512, 512), "w": (512,), "bias": (512,)},
        {"out": (4, 16), "x": (4, 16, 32), "w": (32,), "bias": (16,)},
        {"out": (64, 4096), "x": (64, 4096, 1024), "w": (1024,), "bias": (4096,)},
    ),
    Pattern(
        "attention (batch, online softmax)",
        ATTENTION_TILES
        + """
        def attention(out, q, kk, v, scale):
            B, M, D = q.shape
            _, N, E = v.shape
            for b in range(B):
                for i in range(M):
                    for e in range(E):
                        m = float("-inf")
                        l = 0.0
                        for j in range(N):
                            s = 0.0
                            for k in range(D):
                                s += q[b, i, k] * kk[b, j, k]
                            m_new = max(m, s * scale)
                            l = l * torch.exp(m - m_new) + torch.exp(s * scale - m_new)
                            m = m_new
                        acc = 0.0
                        for j in range(N):
                            s = 0.0
                            for k in range(D):
                                s += q[b, i, k] * kk[b, j, k]
                            acc += torch.exp(s * scale - m) * v[b, j, e]
                        out[b, i, e] = acc / l
        """,
        _attention,
        _attention_shapes(4, 512, 64),
        _attention_shapes(1, 8, 8),
        _attention_shapes(32, 4096, 64),
        gpu_dtype=torch.float16,
    ),
    Pattern(
        "attention_causal (batch, if j <= i)",
        ATTENTION_TILES
        + """
        def attention_causal(out, q, kk, v, scale):
            B, M, D = q.shape
            _, N, E = v.shape
            for b in range(B):
                for i in range(M):
                    for e in range(E):
                        m = float("-inf")
                        for j in range(N):
                            s = 0.0
                            for k in range(D):
                                s += q[b, i, k] * kk[b, j, k]
                            if j <= i:
                                m = max(m, s * scale)
                        l = 0.0
                        for j in range(N):
                            s = 0.0
                            for k in range(D):
                                s += q[b, i, k] * kk[b, j, k]
                            if j <= i:
                                l += torch.exp(s * scale - m)
                        acc = 0.0
                        for j in range(N):
                            s = 0.0
                            for k in range(D):
                                s += q[b, i, k] * kk[b, j, k]
                            if j <= i:
                                acc += torch.exp(s * scale - m) * v[b, j, e]
                        out[b, i, e] = acc / l
        """,
        _causal_attention,
        _attention_shapes(4, 512, 64),
        _attention_shapes(1, 8, 8),
        _attention_shapes(32, 4096, 64),
        gpu_dtype=torch.float16,
    ),
]

# The matmul's configurations worth trying on a GPU (Triton's matmul tutorial's list for
# CUDA, within the pattern's tunable choices): bench/gpu.py times each and reports the best;
# `macrogen autotune` searches the whole product of the choices.
MATMUL_CONFIGS = [
    {"i": i, "j": j, "k": k, "num_stages": stages, "num_warps": warps}
    for i, j, k, stages, warps in (
        (64, 64, 32, 3, 4),  # the default
        (128, 256, 64, 3, 8),
        (64, 256, 32, 4, 4),
        (128, 128, 32, 4, 4),
        (128, 64, 32, 4, 4),
        (64, 128, 32, 4, 4),
        (128, 128, 64, 3, 8),
    )
]


def _function_name(p: Pattern) -> str:
    return p.name.split()[0]


def load(p: Pattern, directory: Path, config: dict | None = None):
    """(the unexpanded module, the expanded module) of one pattern; ``config``: tunable
    values (argument -> value), as a tuning database would give them."""
    src = HEADER + textwrap.dedent(p.source)
    fn = _function_name(p)
    tuning = {f"{fn}.{k}": v for k, v in (config or {}).items()}
    tag = "_".join(f"{k}{v}" for k, v in (config or {}).items())
    modules = []
    expanded = expand_source(src, path=f"{p.name}.py", tuning=tuning).code
    for kind, code in (("loop", src), ("tiled", expanded)):
        path = directory / f"bench_tile_{fn}_{kind}{'_' + tag if tag else ''}.py"
        path.write_text(code)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def inputs(shapes: dict, device: str = "cpu", dtype=torch.float32) -> dict:
    """A random tensor per shape (a tuple); other values (a scale) are passed as they are."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        k: torch.randn(s, generator=gen, device=device, dtype=dtype) if isinstance(s, tuple) else s
        for k, s in shapes.items()
    }


def median(fn, args: dict, min_run_time: float) -> float:
    """Seconds per call: the median over blocks of calls of this thread's CPU time
    (``--clock cpu``, the default: time spent descheduled by other processes on a
    loaded machine does not count) or of wall time (``--clock wall``,
    torch.utils.benchmark's blocked_autorange)."""
    if CLOCK == "wall":
        timer = benchmark.Timer(stmt="fn(**args)", globals={"fn": fn, "args": args})
        return timer.blocked_autorange(min_run_time=min_run_time).median
    fn(**args)  # warm up
    start = time.thread_time()
    fn(**args)
    per_block = max(1, int(0.01 / max(time.thread_time() - start, 1e-6)))  # ~10 ms blocks
    blocks: list[float] = []
    spent = 0.0
    while spent < min_run_time or len(blocks) < 3:
        start = time.thread_time()
        for _ in range(per_block):
            fn(**args)
        elapsed = time.thread_time() - start
        blocks.append(elapsed / per_block)
        spent += elapsed
    return statistics.median(blocks)


def paired(a, b, args: dict, rounds: int, min_run_time: float) -> tuple[float, float, float]:
    """Medians of a and b, and of a/b, over ``rounds`` alternating measurements (drift hits both)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(median(a, args, min_run_time))
        tb.append(median(b, args, min_run_time))
    ratios = [x / y for x, y in zip(ta, tb)]
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)


def cpu_section(directory: Path, rounds: int, min_run_time: float) -> None:
    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"== CPU (torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} cores,"
        f" load average {loadavg:.1f}); {CLOCK} time, medians of {rounds} alternating rounds =="
    )
    head = f"{'pattern':<24}{'torch path':>12}{'eager':>12}{'path/eager':>12}{'goal':>7}"
    head += f"{'loop (small)':>15}{'path (small)':>14}{'speed-up':>11}{'goal':>8}"
    print(head)
    for p in PATTERNS:
        loop, tiled = load(p, directory)
        fn = _function_name(p)
        path = getattr(tiled, f"_{fn}_torch")
        t_path, t_eager, ratio = paired(path, p.eager, inputs(p.shapes), rounds, min_run_time)
        t_loop, t_small, speedup = paired(getattr(loop, fn), path, inputs(p.small), 1, min_run_time)
        print(
            f"{p.name:<24}{t_path * 1e3:>10.3f}ms{t_eager * 1e3:>10.3f}ms{ratio:>12.2f}"
            f"{'<=1.0':>7}{t_loop * 1e3:>13.2f}ms{t_small * 1e6:>12.1f}us{speedup:>10.0f}x{'>=100x':>8}"
        )


def do_bench(fn, args: dict) -> float:
    """Seconds per call: the median of triton.testing.do_bench."""
    import triton.testing

    return triton.testing.do_bench(lambda: fn(**args), return_mode="median") * 1e-3


def measured_bandwidth(device: str = "cuda", numel: int = 1 << 28) -> float:
    """GB/s of a 1 GiB device-to-device copy (it reads and writes every byte)."""
    src = torch.empty(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    # copy_'s argument is positional: its name differs across torch versions
    seconds = do_bench(lambda src: dst.copy_(src), {"src": src})
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def cuda_section(directory: Path) -> None:
    if not torch.cuda.is_available():
        print("== CUDA: skipped (no GPU on this machine) ==")
        return
    name = torch.cuda.get_device_name()
    peak = measured_bandwidth()
    print(
        f"== CUDA ({name}): measured copy bandwidth {peak:.0f} GB/s; triton.testing.do_bench medians =="
    )
    print(
        f"{'pattern':<24}{'kernel':>12}{'compiled':>12}{'kernel':>14}{'compiled':>14}{'kernel/peak':>13}"
    )
    for p in PATTERNS:
        _, tiled = load(p, directory)
        fn = _function_name(p)
        launcher = getattr(tiled, f"_{fn}_triton")
        args = inputs(p.gpu, "cuda", p.gpu_dtype)
        compiled = torch.compile(p.eager)
        t_kernel = do_bench(launcher, args)
        t_compiled = do_bench(compiled, args)
        if p.flops is not None:
            work = p.flops(p.gpu) / 1e12
            unit, fraction = "TFLOP/s", ""
        else:
            work = sum(t.numel() * t.element_size() for t in args.values()) / 1e9
            unit, fraction = "GB/s", f"{work / t_kernel / peak:>12.0%}"
        print(
            f"{p.name:<24}{t_kernel * 1e3:>10.3f}ms{t_compiled * 1e3:>10.3f}ms"
            f"{work / t_kernel:>8.1f} {unit:<5}{work / t_compiled:>8.1f} {unit:<5}{fraction:>13}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least noise)")
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=7, help="alternating path/eager rounds")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="CPU: this thread's CPU time"
    )
    parser.add_argument("--only", nargs="*", default=(), help="patterns whose names contain these")
    parser.add_argument(
        "--traffic", action="store_true", help="meter each kernel's memory traffic (interpreter)"
    )
    parser.add_argument("--json", action="store_true", help="--traffic: print the rows as JSON")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    if args.only:
        PATTERNS[:] = [p for p in PATTERNS if any(o in p.name for o in args.only)]
    torch.set_num_threads(args.threads)
    if args.traffic:
        os.environ["TRITON_INTERPRET"] = "1"  # (before triton is first imported: by the kernels)
        if "triton" in sys.modules:
            print(
                "--traffic: triton was imported before TRITON_INTERPRET=1 could be set",
                file=sys.stderr,
            )
            return 3
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.* from a checkout
        from bench.tile_traffic import traffic_section

        with tempfile.TemporaryDirectory(prefix="bench-tile-") as tmp:
            traffic_section(Path(tmp), args.json, PATTERNS)  # (this module's: --only)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-tile-") as tmp:
        cpu_section(Path(tmp), args.rounds, args.min_run_time)
        cuda_section(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
