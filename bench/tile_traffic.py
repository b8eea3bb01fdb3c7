"""Memory traffic of each @tile pattern's kernel, metered on CPU: ``bench/tile.py --traffic``.

Each pattern's kernel runs under TRITON_INTERPRET=1 with
macrogen.macros.tile.traffic's meter (docs/tile.md, *Memory traffic*): bytes
moved over compulsory bytes (each input read once, each output written once)
at row lengths up to 16K, and one past the persistent bound; for the matmul,
bytes loaded per FLOP over its tiles' ideal; for the attention patterns, the
forward and the backward (dq, dk, dv from q, kk, v, out, dout and the
forward's logsumexp).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.tile import PATTERNS, _attention_shapes, _function_name, inputs, load


def _rows(n: int, m: int, outputs: tuple[str, ...] = ("out",), extra: dict | None = None) -> dict:
    """Shapes of a row-wise pattern with ``m`` rows of ``n``."""
    shapes = {name: (m, n) if name == "out" else (m,) for name in outputs}
    return {**shapes, "x": (m, n), **(extra or {})}


# --traffic: the shapes each kernel is metered at (rows up to 16K, and one past the persistent
# bound, where the looped variant runs), sizes not multiples of the tiles
TRAFFIC: dict[str, list[dict]] = {
    "bias_gelu": [_rows(n, 37, extra={"b": (n,)}) for n in (1000, 16384)],
    "softmax": [_rows(n, m) for n, m in ((1000, 9), (16384, 3), (20000, 2))],
    "online_softmax": [_rows(n, m) for n, m in ((1000, 9), (16384, 3), (20000, 2))],
    "row_sum_max": [_rows(n, m, ("total", "biggest")) for n, m in ((1000, 9), (16384, 3))],
    "rms": [_rows(n, m, extra={"w": (n,)}) for n, m in ((1000, 9), (16384, 3), (20000, 2))],
    "silu_residual": [{"out": (n,), "x": (n,), "y": (n,)} for n in (1000, 100_003)],
    "matmul": [{"out": (256, 256), "a": (256, 512), "b": (512, 256)}],
    "batched_gate": [
        {"out": (4, m), "x": (4, m, n), "w": (n,), "bias": (m,)}
        for m, n in ((50, 1000), (5, 20000))
    ],
    # 2 x 333 queries and keys against the default 128- and 64-tiles, head dimensions 64, 128
    "attention": [_attention_shapes(2, 333, 64)],
    "attention_causal": [_attention_shapes(2, 333, 128)],
}


def traffic_rows(directory: Path, patterns: list | None = None) -> list[dict]:
    """Each pattern's kernel metered under the Triton interpreter (TRITON_INTERPRET=1 must be set
    before triton is imported): one row per shape."""
    import numpy as np

    from macrogen.macros.tile.traffic import Meter, compulsory, matmul_ideal_bytes_per_flop

    rows = []
    for p in PATTERNS if patterns is None else patterns:
        fn = _function_name(p)
        if fn not in TRAFFIC:
            continue
        _, tiled = load(p, directory)
        launcher = getattr(tiled, f"_{fn}_triton")
        for shapes in TRAFFIC[fn]:
            args = inputs(shapes)
            with Meter() as meter, np.errstate(all="ignore"):  # (masked lanes' inf - inf)
                launcher(**args)
            outs = [args[o] for o in p.outputs]
            ins = [t for k, t in args.items() if k not in p.outputs and torch.is_tensor(t)]
            row = {
                "pattern": fn,
                # the looped variant: a reduction's row past the persistent bound
                "looped": hasattr(tiled, f"_{fn}_persistent_max")
                and shapes["x"][-1] > getattr(tiled, f"_{fn}_persistent_max"),
                "shapes": {k: list(v) for k, v in shapes.items() if isinstance(v, tuple)},
                "loaded": meter.loaded,
                "raw_loaded": meter.raw_loaded,
                "stored": meter.stored,
                "programs": meter.launches[-1].grid[0],  # the launch grid
                "compulsory": compulsory(ins, outs),
                "ratio": meter.traffic / compulsory(ins, outs),
                "raw_ratio": (meter.raw_loaded + meter.stored) / compulsory(ins, outs),
                "load_ratio": meter.loaded / compulsory(ins, []),
            }
            if p.flops is not None:  # reuse: bytes loaded per FLOP against the tiles' ideal
                tiles = {"i": 64, "j": 64}  # the pattern's @mg.tile(i=64, j=64, ...)
                ideal = matmul_ideal_bytes_per_flop(tiles["i"], tiles["j"], 4)
                per_flop = meter.raw_loaded / p.flops(shapes)  # what each program loads
                row.update(bytes_per_flop=per_flop, ideal=ideal, reuse_ratio=per_flop / ideal)
            rows.append(row)
            if hasattr(tiled, f"_{fn}_backward_triton"):
                rows.append(_backward_row(tiled, fn, shapes))
    return rows


def _backward_row(tiled, fn: str, shapes: dict) -> dict:
    """The attention backward's one launch: it reads q, kk, v, out, dout and the forward's
    logsumexp and writes dq, dk and dv (its zeroed buffers are torch's, not the kernel's)."""
    import numpy as np

    from macrogen.macros.tile.traffic import Meter, compulsory

    args = inputs(shapes)
    lse = torch.empty(shapes["q"][0], shapes["q"][1])
    getattr(tiled, f"_{fn}_launch")(**args, lse=lse)
    dout = torch.randn(shapes["out"])
    with Meter() as meter, np.errstate(all="ignore"):
        grads = getattr(tiled, f"_{fn}_backward_triton")(dout, lse, **args)
    ins = [args["q"], args["kk"], args["v"], args["out"], dout, lse]
    total = compulsory(ins, list(grads))
    return {
        "pattern": f"{fn} backward",
        "looped": False,
        "shapes": {k: list(v) for k, v in shapes.items() if isinstance(v, tuple)},
        "loaded": meter.loaded,
        "raw_loaded": meter.raw_loaded,
        "stored": meter.stored,
        "programs": meter.launches[-1].grid[0],
        "compulsory": total,
        "ratio": meter.traffic / total,
        "raw_ratio": (meter.raw_loaded + meter.stored) / total,
        "load_ratio": meter.loaded / compulsory(ins, []),
    }


def traffic_section(directory: Path, as_json: bool, patterns: list | None = None) -> None:
    rows = traffic_rows(directory, patterns)
    if as_json:
        print(json.dumps(rows))
        return
    print("== memory traffic of each kernel (Triton interpreter; masked lanes excluded) ==")
    print("   traffic: bytes stored + bytes loaded that no earlier program of the launch loaded")
    print("   (those come from L2); raw: every load of every program; matmul: each program's loads")
    print(
        f"{'pattern':<26}{'shape':<16}{'traffic/compulsory':>20}{'loads/inputs':>14}{'raw':>12}"
        f"{'programs':>10}{'goal':>10}"
    )
    for r in rows:
        shapes = r["shapes"]
        shape = "x".join(map(str, shapes.get("x", shapes.get("a", shapes.get("q")))))
        if "reuse_ratio" in r:
            print(
                f"{r['pattern']:<26}{shape:<16}{'bytes/FLOP':>12}{r['bytes_per_flop']:>8.4f}"
                f"  ideal {r['ideal']:.4f} ({r['reuse_ratio']:.2f}x){'<=1.2x':>8}"
            )
            continue
        goal = "(looped)" if r["looped"] else "<=1.1" if "backward" in r["pattern"] else "<=1.05"
        print(
            f"{r['pattern']:<26}{shape:<16}{r['ratio']:>20.3f}{r['load_ratio']:>14.3f}"
            f"{r['raw_ratio']:>12.3f}{r['programs']:>10}{goal:>10}"
        )
