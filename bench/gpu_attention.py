"""The attention patterns' kernels against SDPA's flash kernel: bench/gpu.py's ``attention`` section.

For float16 and bfloat16, head dimensions 64 and 128, causal and not: q, kk, v
and out of (batch 4 x heads 2048 / head, 4096, head), the pattern's layout,
which is SDPA's (4, heads, 4096, head) viewed with batch and heads as one axis.

- ``fwd``: the generated function without grad (the forward kernel) against
  ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
  (goal >= 0.8 of its speed);
- ``fwd+bwd``: the function on tensors that require grad (the autograd function:
  the forward kernel with its logsumexp, then the backward kernel) and
  ``out.backward(dout)``, against SDPA's forward and backward (goal >= 0.7).

Each of ATTENTION_CONFIGS is checked (out, and dq, dk, dv, against SDPA's: max
error over max value) and timed; the fastest is reported and named in the note,
(i/j/warps/stages, then the backward's block/step/warps/stages) with both sides' TFLOP/s (4·B·H·N²·D for a forward, half of it causal; 2.5 times
that for a backward). A dry run (``--dry-run``) takes the same paths on CPU at
tiny sizes, the kernels under TRITON_INTERPRET=1 (bfloat16 with the
interpreter's dot made faithful: macrogen.macros.tile.interpret), SDPA's
default backend as the reference; its times mean nothing.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.tile import PATTERNS, load

# Configurations tried on a GPU, within the patterns' tunable choices (bench/tile.py's
# ATTENTION_TILES): the forward's query and key tiles, warps, stages; the backward's block,
# step, warps, stages. `macrogen autotune` searches the whole product of the choices.
ATTENTION_CONFIGS = [
    {
        "i": 128,
        "j": 64,
        "num_warps": 4,
        "num_stages": 3,
        "backward_block": 128,
        "backward_step": 32,
        "backward_warps": 8,
        "backward_stages": 2,
    },
    {
        "i": 128,
        "j": 128,
        "num_warps": 8,
        "num_stages": 3,
        "backward_block": 64,
        "backward_step": 32,
        "backward_warps": 4,
        "backward_stages": 3,
    },
]
TOLERANCE = 2e-2  # of max |error| over max |SDPA|, in float16 and bfloat16


def attention_rows(directory: Path, device: str, dry: bool, bench, Row) -> list:
    """One row per (dtype, head dimension, mask, fwd or fwd+bwd); ``bench`` times a callable,
    ``Row`` is bench/gpu.py's table row."""
    rows = []
    faithful = contextlib.nullcontext()
    if dry:  # the interpreter's bfloat16 tl.dot multiplies bit patterns (triton#11584)
        from macrogen.macros.tile.interpret import faithful_bf16_dot

        faithful = faithful_bf16_dot()
    variants = [
        (dtype, head, causal)
        for dtype in (torch.float16, torch.bfloat16)
        for head in (64, 128)
        for causal in (False, True)
    ]
    if dry:  # every path once: both dtypes, both head dimensions, both masks
        variants = [(torch.float16, 64, False), (torch.bfloat16, 128, True)]
    with faithful:
        for dtype, head, causal in variants:
            rows += _variant(directory, device, dry, bench, Row, dtype, head, causal)
    return rows


def _variant(directory, device, dry, bench, Row, dtype, head, causal) -> list:
    name = "attention_causal" if causal else "attention"
    (pattern,) = [p for p in PATTERNS if p.name.split()[0] == name]
    batch, heads, n = (1, 2, 40) if dry else (4, 2048 // head, 4096)
    gen = torch.Generator().manual_seed(0)
    shape = (batch * heads, n, head)
    q, kk, v, dout = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
    scale = head**-0.5
    views = [t.view(batch, heads, n, head) for t in (q, kk, v, dout)]
    flops = 4 * batch * heads * n * n * head * (0.5 if causal else 1.0)
    label = f"{str(dtype).split('.')[-1]} d{head} {'causal' if causal else 'full'}"

    def sdpa(q4, k4, v4):
        backend = contextlib.nullcontext()
        if device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        with backend:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=scale)

    # the reference: SDPA's output and gradients
    leaves = [t.view(batch, heads, n, head).detach().requires_grad_() for t in (q, kk, v)]
    want = sdpa(*leaves)
    want.backward(views[3])
    want_grads = [t.grad.reshape(shape) for t in leaves]
    want = want.detach().reshape(shape)

    def sdpa_step():
        for t in leaves:
            t.grad = None
        sdpa(*leaves).backward(views[3])

    t_fwd_sdpa = bench(lambda: sdpa(*views[:3]), device)
    t_both_sdpa = bench(sdpa_step, device)
    results: dict[str, list[tuple[float, float, str]]] = {"fwd": [], "fwd+bwd": []}
    for config in ATTENTION_CONFIGS[: 1 if dry else None]:
        _, tiled = load(pattern, directory, config)
        if dry:  # CPU tensors take the kernels here (the interpreter)
            tiled.use_triton = lambda device: True
        tag = "/".join(str(value) for value in config.values())
        measured = _measure(tiled, name, device, bench, (q, kk, v, dout), scale)
        for mode, refs in (("fwd", [want]), ("fwd+bwd", want_grads)):
            seconds, got = measured[mode]
            results[mode].append((seconds, max(map(_error, got, refs)), tag))
    rows = []
    for mode, t_sdpa, work, goal in (
        ("fwd", t_fwd_sdpa, flops, ">=0.8"),
        ("fwd+bwd", t_both_sdpa, 3.5 * flops, ">=0.7"),
    ):
        seconds, _, tag = min(results[mode])
        error = max(e for _, e, _ in results[mode])  # every configuration must be right
        note = f"{work / seconds / 1e12:.1f} vs {work / t_sdpa / 1e12:.1f} TFLOP/s  {tag}"
        rows.append(
            Row(
                "attention",
                f"{label} {mode}",
                error,
                TOLERANCE,
                seconds,
                "SDPA flash" if device == "cuda" else "SDPA (dry run)",
                t_sdpa / seconds,
                goal if device == "cuda" else "",
                note,
            )
        )
    return rows


def _measure(tiled, name: str, device: str, bench, tensors: tuple, scale: float) -> dict:
    """mode -> (seconds, results) of the forward alone ([out]) and of forward and backward
    ([dq, dk, dv]) through the expanded pattern ``tiled``."""
    q, kk, v, dout = tensors
    fn, launcher = getattr(tiled, name), getattr(tiled, f"_{name}_triton")
    out = torch.empty_like(q)
    launcher(out, q, kk, v, scale)
    leaves = [t.detach().clone().requires_grad_() for t in (q, kk, v)]

    def step():
        for t in leaves:
            t.grad = None
        o = torch.empty_like(q)
        fn(o, *leaves, scale)
        o.backward(dout)

    step()
    grads = [t.grad for t in leaves]
    return {
        "fwd": (bench(lambda: launcher(out, q, kk, v, scale), device), [out]),
        "fwd+bwd": (bench(step, device), grads),
    }


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
