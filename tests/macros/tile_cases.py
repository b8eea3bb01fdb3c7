"""@tile parity cases: loop nests, their inputs, and the check against the unexpanded loop.

Shared by test_tile_parity.py (the torch path, in process) and tile_interpret.py
(the Triton kernel under TRITON_INTERPRET=1, in a subprocess). Sizes are small
(the reference is a Python loop) and never multiples of the tiles.
"""

from __future__ import annotations

import itertools
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from macrogen.expand import expand_source
from tests.helpers import load_module


@dataclass(frozen=True)
class Case:
    name: str  # the function's name in ``source``
    source: str
    inputs: dict  # parameter -> ("randn" | "randn_t" (a transposed view) | "nan", shape) | a number
    rtol: float = 1e-5
    atol: float = 1e-5
    dtype: torch.dtype = (
        torch.float32
    )  # of the tensors the tiled versions get; the loop runs in float32
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()  # per-tensor exceptions to ``dtype``

    def dtype_of(self, name: str) -> torch.dtype:
        return dict(self.dtypes).get(name, self.dtype)


HEADER = "import math\nimport torch\nimport macrogen as mg\n\n"

CASES = [
    Case(
        "bias_gelu",
        """
        @mg.tile(i=16, j=32)
        def bias_gelu(out, x, b):
            M, N = x.shape
            for i in range(M):
                for j in range(N):
                    v = x[i, j] + b[j]
                    out[i, j] = 0.5 * v * (1.0 + torch.tanh(0.79788456 * (v + 0.044715 * v * v * v)))
        """,
        {"out": ("nan", (37, 53)), "x": ("randn_t", (37, 53)), "b": ("randn", (53,))},
    ),
    Case(
        "softmax",
        """
        @mg.tile(i=4, j=16)
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
        {"out": ("nan", (37, 53)), "x": ("randn", (37, 53))},
    ),
    Case(
        "row_sum_max",
        """
        @mg.tile(i=8, j=16)
        def row_sum_max(total, biggest, x):
            M, N = x.shape
            for i in range(M):
                s = 0.0
                m = -math.inf
                for j in range(N):
                    s += x[i, j]
                    m = max(m, x[i, j])
                total[i] = s
                biggest[i] = m
        """,
        {"total": ("nan", (37,)), "biggest": ("nan", (37,)), "x": ("randn", (37, 53))},
    ),
    Case(
        "matmul",
        """
        @mg.tile(i=16, j=16, k=16)
        def matmul(out, a, b):
            M, K = a.shape
            _, N = b.shape
            for i in range(M):
                for j in range(N):
                    for k in range(K):
                        out[i, j] += a[i, k] * b[k, j]
        """,
        {"out": ("randn", (19, 23)), "a": ("randn", (19, 21)), "b": ("randn", (21, 23))},
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "scaled_matmul",
        """
        @mg.tile(i=4, j=8, k=8)
        def scaled_matmul(out, a, b, alpha):
            M, K = a.shape
            N = b.shape[1]
            for i in range(M):
                for j in range(N):
                    acc = 0.0
                    for k in range(K):
                        acc += a[i, k] * b[k, j]
                    out[i, j] = alpha * acc
        """,
        {"out": ("nan", (13, 11)), "a": ("randn", (13, 9)), "b": ("randn", (9, 11)), "alpha": 0.5},
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "batched_gate",
        """
        @mg.tile(b=2, i=8, j=16)
        def batched_gate(out, x, w, bias):
            B, M, N = x.shape
            for b in range(B):
                for i in range(M):
                    acc = 0.0
                    for j in range(N):
                        acc += x[b, i, j] * w[j]
                    out[b, i] = torch.sigmoid(acc + bias[i])
        """,
        {
            "out": ("nan", (5, 13)),
            "x": ("randn", (5, 13, 21)),
            "w": ("randn", (21,)),
            "bias": ("randn", (13,)),
        },
    ),
    Case(
        "stencil3d",
        """
        @mg.tile(b=2, i=4, j=8)
        def stencil3d(out, x, eps):
            B, M, N = x.shape
            for b in range(B):
                for i in range(1, M - 1):
                    for j in range(N):
                        d = x[b, i + 1, j] - 2.0 * x[b, i, j] + x[b, i - 1, j]
                        out[b, i, j] = torch.where(torch.abs(d) > eps, d, 0.0) + min(x[b, i, j], 0.0) ** 2
        """,
        {"out": ("nan", (3, 11, 19)), "x": ("randn", (3, 11, 19)), "eps": 0.25},
    ),
    Case(
        "row_norm_t",
        """
        @mg.tile(i=4, j=16)
        def row_norm_t(out, x, eps):
            M, N = x.shape
            for i in range(M):
                s = 0.0
                for j in range(N):
                    s += x[i, j]
                mean = s / N
                q = 0.0
                for j in range(N):
                    q += (x[i, j] - mean) ** 2
                rstd = 1.0 / torch.sqrt(q / N + eps)
                for j in range(N):
                    out[j, i] = torch.log(1.0 + torch.exp((x[i, j] - mean) * rstd))
        """,
        {"out": ("nan", (53, 37)), "x": ("randn", (37, 53)), "eps": 1e-5},
    ),
    Case(
        "row_min_diff",
        """
        @mg.tile(i=8, j=4)
        def row_min_diff(out, x):
            M, N = x.shape
            for i in range(M):
                m = float("inf")
                q = 1.0
                for j in range(1, N):
                    m = min(m, x[i, j] - x[i, j - 1])
                    q = q + x[i, j] * x[i, j]
                    q -= 0.5 * x[i, j - 1]
                out[i] = m - q
        """,
        {"out": ("nan", (13,)), "x": ("randn", (13, 11))},
    ),
    Case(
        "bias_gelu_half",
        """
        @mg.tile(i=16, j=32)
        def bias_gelu_half(out, x, b):
            M, N = x.shape
            for i in range(M):
                for j in range(N):
                    v = x[i, j] + b[j]
                    out[i, j] = 0.5 * v * (1.0 + torch.tanh(0.79788456 * (v + 0.044715 * v * v * v)))
        """,
        {"out": ("nan", (21, 37)), "x": ("randn", (21, 37)), "b": ("randn", (37,))},
        rtol=1e-2,
        atol=1e-2,
        dtype=torch.float16,
    ),
    Case(
        "matmul_half",
        """
        @mg.tile(i=16, j=16, k=16)
        def matmul_half(out, a, b):
            M, K = a.shape
            _, N = b.shape
            for i in range(M):
                for j in range(N):
                    for k in range(K):
                        out[i, j] += a[i, k] * b[k, j]
        """,
        {"out": ("randn", (19, 23)), "a": ("randn", (19, 21)), "b": ("randn", (21, 23))},
        rtol=1e-2,
        atol=2e-2,
        dtype=torch.float16,
    ),
    Case(
        "shape_bounds",
        """
        @mg.tile(i=8, j=16)
        def shape_bounds(out, x, b, n):
            for i in range(len(x)):
                s = 0.0
                for j in range(1, x.size(1) - 1):
                    s += x[i, j] * b[j]
                for j in range(n):
                    out[i, j] = s + x[i, j]
        """,
        {"out": ("nan", (37, 23)), "x": ("randn", (37, 53)), "b": ("randn", (53,)), "n": 20},
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "strided",
        """
        @mg.tile(i=4, j=8)
        def strided(out, x, total):
            M, N = x.shape
            for i in range(1, M, 2):
                s = 0.0
                for j in range(0, N - 1, 3):
                    s += x[i, j + 1]
                total[i] = s
                for j in range(2, N, 2):
                    out[i, j] = x[i - 1, j] * s
        """,
        {"out": ("nan", (22, 37)), "x": ("randn", (22, 37)), "total": ("nan", (22,))},
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "strided_matmul",
        """
        @mg.tile(i=16, j=16, k=16)
        def strided_matmul(out, a, b):
            M, K = a.shape
            _, N = b.shape
            for i in range(0, M, 2):
                for j in range(N):
                    for k in range(1, K, 2):
                        out[i, j] += a[i, k] * b[k, j]
        """,
        {"out": ("randn", (37, 23)), "a": ("randn", (37, 41)), "b": ("randn", (41, 23))},
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "causal",
        """
        @mg.tile(i=4, j=8)
        def causal(out, rows, x, alpha):
            M, N = x.shape
            for i in range(M):
                m = float("-inf")
                for j in range(N):
                    if j <= i:
                        m = max(m, x[i, j])
                s = 0.0
                for j in range(N):
                    if j <= i:
                        s += torch.exp(x[i, j] - m)
                for j in range(N):
                    if j <= i:
                        out[i, j] = torch.exp(x[i, j] - m) / s
                if s > alpha:
                    r = s
                elif m < 0.5:
                    r = -m
                else:
                    r = 0.0
                rows[i] = r
        """,
        {"out": ("nan", (21, 19)), "rows": ("nan", (21,)), "x": ("randn", (21, 19)), "alpha": 3.0},
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "three_way",
        """
        @mg.tile(i=8, j=8)
        def three_way(out, x, t):
            M, N = x.shape
            for i in range(M):
                for j in range(N):
                    v = x[i, j]
                    if v > t and j > 2:
                        w = v
                        out[i, j] = w * 2.0
                    elif v < -t:
                        v = -v
                        out[i, j] = v * 0.5
                    else:
                        out[i, j] = 0.0
        """,
        {"out": ("nan", (13, 11)), "x": ("randn", (13, 11)), "t": 0.3},
    ),
    Case(
        "gather",
        """
        @mg.tile(i=8, j=16)
        def gather(out, sums, table, idx, perm, x):
            M, N = out.shape
            for i in range(M):
                s = 0.0
                for j in range(N):
                    s += table[idx[i], j] * x[i, perm[j]]
                sums[i] = s
                for j in range(N):
                    out[i, j] = table[idx[i], j] + x[i, perm[j]]
        """,
        {
            "out": ("nan", (13, 21)),
            "sums": ("nan", (13,)),
            "table": ("randn", (7, 21)),
            "idx": ("randint", (13,), 7),
            "perm": ("randint", (21,), 21),
            "x": ("randn", (13, 21)),
        },
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "attention",
        """
        @mg.tile(i=4, e=8, j=8, k=8)
        def attention(out, q, kk, v, scale):
            M, D = q.shape
            N, E = v.shape
            for i in range(M):
                for e in range(E):
                    m = float("-inf")
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        m = max(m, s * scale)
                    l = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        l += torch.exp(s * scale - m)
                    acc = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        acc += torch.exp(s * scale - m) * v[j, e]
                    out[i, e] = acc / l
        """,
        {
            "out": ("nan", (13, 9)),
            "q": ("randn", (13, 11)),
            "kk": ("randn_t", (19, 11)),
            "v": ("randn", (19, 9)),
            "scale": 0.3,
        },
        rtol=1e-4,
        atol=1e-4,
    ),
    # the same nest with tiles tl.dot takes: a FlashAttention kernel (tile/flash.py); sizes
    # not multiples of 16 along any axis, kk a transposed view, three tiles of keys
    Case(
        "flash_attention",
        """
        @mg.tile(i=16, e=16, j=16, k=16)
        def flash_attention(out, q, kk, v, scale):
            M, D = q.shape
            N, E = v.shape
            for i in range(M):
                for e in range(E):
                    m = float("-inf")
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        m = max(m, s * scale)
                    l = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        l += torch.exp(s * scale - m)
                    acc = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        acc += torch.exp(s * scale - m) * v[j, e]
                    out[i, e] = acc / l
        """,
        {  # 2 x 2 programs, 3 tiles of keys, 2 of k: the loop's cost is M * E * N * D
            "out": ("nan", (19, 19)),
            "q": ("randn", (19, 20)),
            "kk": ("randn_t", (35, 20)),
            "v": ("randn", (35, 19)),
            "scale": 0.3,
        },
        rtol=1e-4,
        atol=1e-4,
    ),
    # float16 operands for both tl.dots (p is rounded to float16 for p @ v, as FlashAttention
    # does), float32 accumulation; against the float32 loop on the rounded inputs
    Case(
        "flash_attention_half",
        """
        @mg.tile(i=16, e=32, j=16, k=16)
        def flash_attention_half(out, q, kk, v, scale):
            M, D = q.shape
            N, E = v.shape
            for i in range(M):
                for e in range(E):
                    m = float("-inf")
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        m = max(m, s * scale)
                    l = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        l += torch.exp(s * scale - m)
                    acc = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        acc += torch.exp(s * scale - m) * v[j, e]
                    out[i, e] = acc / l
        """,
        {  # 2 x 2 programs, 3 tiles of keys, 2 of k (scale: scores spread as with D = 40)
            "out": ("nan", (18, 35)),
            "q": ("randn", (18, 20)),
            "kk": ("randn", (35, 20)),
            "v": ("randn", (35, 35)),
            "scale": 0.21,
        },
        rtol=1e-2,
        atol=2e-3,
        dtype=torch.float16,
    ),
    # the benchmark's form: an online softmax for m and l in the first pass, then p @ v
    # (v stored transposed, the factors in the other order)
    Case(
        "flash_attention_online",
        """
        @mg.tile(i=16, e=16, j=16, k=16)
        def flash_attention_online(out, q, kk, vt):
            M, D = q.shape
            E, N = vt.shape
            for i in range(M):
                for e in range(E):
                    m = float("-inf")
                    l = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += kk[j, k] * q[i, k]
                        m_new = max(m, s / 4.0)
                        l = l * torch.exp(m - m_new) + torch.exp(s / 4.0 - m_new)
                        m = m_new
                    acc = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += kk[j, k] * q[i, k]
                        acc += vt[e, j] * torch.exp(s / 4.0 - m)
                    out[i, e] = acc / l
        """,
        {
            "out": ("nan", (18, 17)),
            "q": ("randn_t", (18, 20)),
            "kk": ("randn", (33, 20)),
            "vt": ("randn", (17, 33)),
        },
        rtol=1e-4,
        atol=1e-4,
    ),
    # a causal mask (if j <= i in each pass) over a batch loop: M != N, two tiles of queries
    # and of keys, so that the kernel has whole steps, steps across the diagonal and skipped ones
    Case(
        "flash_causal",
        """
        @mg.tile(i=16, j=16)
        def flash_causal(out, q, kk, v, scale):
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
        {  # (the loop's cost is B * M * E * N * D per pass)
            "out": ("nan", (2, 21, 4)),
            "q": ("randn", (2, 21, 3)),
            "kk": ("randn", (2, 27, 3)),
            "v": ("randn", (2, 27, 4)),
            "scale": 0.4,
        },
        rtol=1e-4,
        atol=1e-4,
    ),
    # bfloat16 operands for both tl.dots, checked with the interpreter's dot reading them as
    # numbers (macrogen.macros.tile.interpret.faithful_bf16_dot: triton#11584)
    Case(
        "flash_bf16",
        """
        @mg.tile(i=16, j=16)
        def flash_bf16(out, q, kk, v):
            M, D = q.shape
            N, E = v.shape
            for i in range(M):
                for e in range(E):
                    m = float("-inf")
                    l = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        m_new = max(m, s * 0.25)
                        l = l * torch.exp(m - m_new) + torch.exp(s * 0.25 - m_new)
                        m = m_new
                    acc = 0.0
                    for j in range(N):
                        s = 0.0
                        for k in range(D):
                            s += q[i, k] * kk[j, k]
                        acc += torch.exp(s * 0.25 - m) * v[j, e]
                    out[i, e] = acc / l
        """,
        {
            "out": ("nan", (17, 3)),
            "q": ("randn", (17, 4)),
            "kk": ("randn_t", (33, 4)),
            "v": ("randn", (33, 3)),
        },
        rtol=2e-2,
        atol=2e-2,
        dtype=torch.bfloat16,
    ),
    Case(
        "scores_softmax",
        """
        @mg.tile(i=4, j=8, k=4)
        def scores_softmax(p, rows, p3, q, kk):
            M, D = q.shape
            N = kk.shape[0]
            for i in range(M):
                m = float("-inf")
                s = 0.0
                for j in range(N):
                    t = 0.0
                    for k in range(D):
                        t += q[i, k] * kk[j, k]
                    m_new = max(m, t)
                    s = s * torch.exp(m - m_new) + torch.exp(t - m_new)
                    m = m_new
                rows[i] = m + torch.log(s)
                for j in range(N):
                    t = 0.0
                    for k in range(D):
                        t += q[i, k] * kk[j, k]
                    p[i, j] = torch.exp(t - m) / s
                    for k in range(1, D):
                        p3[i, j, k] = q[i, k] - kk[j, k - 1] * t
        """,
        {
            "p": ("nan", (13, 17)),
            "rows": ("nan", (13,)),
            "p3": ("randn", (13, 17, 7)),
            "q": ("randn", (13, 7)),
            "kk": ("randn", (17, 7)),
        },
        rtol=1e-4,
        atol=1e-4,
    ),
    Case(
        "online_softmax",
        """
        @mg.tile(i=4, j=8)
        def online_softmax(out, lse, x):
            M, N = x.shape
            for i in range(M):
                m = float("-inf")
                s = 0.0
                for j in range(N):
                    m_new = max(m, x[i, j])
                    s = s * torch.exp(m - m_new) + torch.exp(x[i, j] - m_new)
                    m = m_new
                lse[i] = m + torch.log(s)
                for j in range(N):
                    out[i, j] = torch.exp(x[i, j] - m) / s
        """,
        {"out": ("nan", (21, 37)), "lse": ("nan", (21,)), "x": ("randn", (21, 37))},
        rtol=1e-5,
        atol=1e-5,
    ),
    Case(
        "online_logsumexp",
        """
        @mg.tile(i=8, j=16)
        def online_logsumexp(out, x, w):
            M, N = x.shape
            for i in range(M):
                m = -math.inf
                s = 0.0
                for j in range(N):
                    old = m
                    m = max(2.0 * x[i, j], m)
                    s = torch.exp(2.0 * x[i, j] + w[j] - m) + s * torch.exp(old - m)
                out[i] = m + torch.log(s)
        """,
        {"out": ("nan", (13,)), "x": ("randn", (13, 5)), "w": ("randn", (5,))},
        rtol=1e-5,
        atol=1e-5,
    ),
    Case(
        "long_row_half",
        """
        @mg.tile(i=4, j=64)
        def long_row_half(total, out, x):
            M, N = x.shape
            for i in range(M):
                s = 0.0
                for j in range(N):
                    s += x[i, j] * x[i, j]
                total[i] = s
                for j in range(N):
                    out[i, j] = x[i, j] / torch.sqrt(s / N)
        """,
        {"total": ("nan", (5,)), "out": ("nan", (5, 3001)), "x": ("randn", (5, 3001))},
        rtol=2e-3,
        atol=2e-3,
        dtype=torch.float16,  # summed in float16, the total would be off by far more than this
    ),
    Case(
        "stepped_rms",  # a persistent row over a stepped range, odd columns only; ragged rows
        """
        @mg.tile(i=2, j=16)
        def stepped_rms(out, x, w):
            M, N = x.shape
            for i in range(M):
                ss = 0.0
                for j in range(1, N, 2):
                    ss += x[i, j] * x[i, j]
                for j in range(1, N, 2):
                    out[i, j] = x[i, j] * w[j] / torch.sqrt(ss + 1.0)
        """,
        {"out": ("nan", (7, 301)), "x": ("randn", (7, 301)), "w": ("randn", (301,))},
    ),
    Case(
        "gelu_bf16_to_fp32",
        """
        @mg.tile(i=16, j=32)
        def gelu_bf16_to_fp32(out, x, b):
            M, N = x.shape
            for i in range(M):
                for j in range(N):
                    v = x[i, j] + b[j]
                    out[i, j] = v * torch.sigmoid(1.702 * v)
        """,
        {"out": ("nan", (21, 37)), "x": ("randn", (21, 37)), "b": ("randn", (37,))},
        rtol=1e-5,
        atol=1e-5,
        dtype=torch.bfloat16,
        dtypes=(("out", torch.float32),),  # bfloat16 inputs, a float32 output: no rounding
    ),
    Case(
        "online_softmax_bf16",
        """
        @mg.tile(i=4, j=16)
        def online_softmax_bf16(out, x):
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
        {"out": ("nan", (9, 45)), "x": ("randn", (9, 45))},
        rtol=1e-2,
        atol=1e-2,
        dtype=torch.bfloat16,
    ),
    Case(
        "row_floor",
        """
        @mg.tile(i=16, j=8)
        def row_floor(out, flags, x, like, lo):
            M = x.shape[0]
            N = like.shape[1]
            for i in range(M):
                m = lo
                for j in range(N):
                    m = max(m, x[i, j])
                flags[i] = 1.0
                for j in range(N):
                    out[i, j] = m
        """,
        {
            "out": ("nan", (21, 13)),
            "flags": ("nan", (21,)),
            "x": ("randn", (21, 13)),
            "like": ("randn", (21, 13)),
            "lo": 0.5,
        },
    ),
]


# kernels the interpreter also runs with 64-bit offsets forced on (tile_interpret.py)
WIDE_CASES = (
    "gather",
    "attention",
    "flash_attention",
    "flash_causal",
    "strided_matmul",
    "scores_softmax",
)


# -- the attention nest's gradients: the kernels' forward and backward against float64 ---------
ATTENTION = """
@mg.tile(i=32, j=32, backward_block=32, backward_step=16)
def {name}(out, q, kk, v, scale):
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
                    {mask}m = max(m, s * scale)
                l = 0.0
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[b, j, k]
                    {mask}l += torch.exp(s * scale - m)
                acc = 0.0
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[b, j, k]
                    {mask}acc += torch.exp(s * scale - m) * v[b, j, e]
                out[b, i, e] = acc / l
"""
# (causal, head dimension, dtype): ragged sizes (2 x 70 queries, 90 keys) against 32-tiles
ATTENTION_GRADS = [
    (causal, head, dtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for head in (64, 128)
    for causal in (False, True)
]
# measured: 3e-7, 5e-4 and 1.2e-2 (bfloat16: p rounded to 8 bits for p @ v, as FlashAttention does)
ATTENTION_TOLERANCE = {torch.float32: 2e-6, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def attention_name(causal: bool, head: int, dtype: torch.dtype) -> str:
    return f"attention_{'causal' if causal else 'full'}_{head}_{str(dtype).split('.')[-1]}"


def attention_source(name: str, causal: bool) -> str:
    mask = "if j <= i:\n                        " if causal else ""
    return HEADER + ATTENTION.format(name=name, mask=mask)


def attention_reference(q, kk, v, scale: float, causal: bool):
    """softmax(q kk^T * scale, masked) v in float64: what the nest computes."""
    z = q.double() @ kk.double().mT * scale
    if causal:
        keys = torch.arange(z.shape[-1])[None, :] > torch.arange(z.shape[-2])[:, None]
        z = z.masked_fill(keys, float("-inf"))
    return z.softmax(dim=-1) @ v.double()


def attention_gradients(
    module, name: str, causal: bool, head: int, dtype: torch.dtype
) -> str | None:
    """Run the expanded nest with q, kk and v requiring grad (the autograd function: the kernels
    when ``module.use_triton`` says so), backward from a random dout; a message when out or a
    gradient differs from float64 by more than the dtype's tolerance (relative to its largest
    value), None when all agree. out starts as NaN: every element must be written."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"q": (2, 70, head), "kk": (2, 90, head), "v": (2, 90, head)}
    leaves = {
        k: torch.randn(s, generator=gen).to(dtype).requires_grad_() for k, s in shapes.items()
    }
    scale = head**-0.5
    out = torch.full((2, 70, head), float("nan"), dtype=dtype)
    getattr(module, name)(out, leaves["q"], leaves["kk"], leaves["v"], scale)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(dout)
    refs = {k: t.detach().double().requires_grad_() for k, t in leaves.items()}
    want = attention_reference(refs["q"], refs["kk"], refs["v"], scale, causal)
    want.backward(dout.double())
    pairs = [("out", out.detach(), want.detach())]
    pairs += [(f"d{k}", leaves[k].grad, refs[k].grad) for k in leaves]
    for label, got, expected in pairs:
        error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        if not error <= ATTENTION_TOLERANCE[dtype]:
            return f"{name}: {label} is {error:.2e} off float64 (relative to its largest value)"
    return None


# -- random bodies: the hypothesis test (torch path) and the interpreter run (kernel) ----------
LEAVES = ["x[i, j]", "x[i, j + 1]", "r[j]", "c[i]", "alpha", "1.5", "-0.25", "N"]
RANDOM_CASES = 12  # random bodies the interpreter run checks besides CASES
_counter = itertools.count()


def body_case(expr: str, reduce: str | None) -> Case:
    """A 2-loop nest whose body stores (or sums or maxes over j) ``expr``."""
    name = f"prop{next(_counter)}"
    if reduce is None:
        body = f"out[i, j] = {expr}"
        loops = (
            "for i in range(M):\n                for j in range(N):\n                    " + body
        )
        out = ("nan", (6, 9))
    else:
        init = "0.0" if reduce == "sum" else 'float("-inf")'
        step = f"acc += {expr}" if reduce == "sum" else f"acc = max(acc, {expr})"
        loops = (
            f"for i in range(M):\n                acc = {init}\n"
            f"                for j in range(N):\n                    {step}\n"
            "                out[i] = acc"
        )
        out = ("nan", (6,))
    source = f"""
        @mg.tile(i=4, j=4)
        def {name}(out, x, r, c, alpha):
            M = c.shape[0]
            N = r.shape[0]
            {loops}
        """
    inputs = {
        "out": out,
        "x": ("randn", (6, 10)),
        "r": ("randn", (9,)),
        "c": ("randn", (6,)),
        "alpha": 0.75,
    }
    return Case(name, source, inputs, rtol=1e-4, atol=1e-4)


def random_expression(rng: random.Random, depth: int) -> str:
    """The same grammar as the hypothesis test's, drawn from ``rng``."""
    if depth == 0 or rng.random() < 0.25:
        return rng.choice(LEAVES)
    sub = lambda: random_expression(rng, depth - 1)  # noqa: E731
    kind = rng.randrange(6)
    if kind == 0:
        return f"({sub()} {rng.choice('+-*')} {sub()})"
    if kind == 1:
        return f"{sub()} / (1.0 + torch.abs({sub()} + r[j]))"
    if kind == 2:
        return f"{rng.choice(['torch.tanh', 'torch.sigmoid', 'torch.abs'])}({sub()} - c[i])"
    if kind == 3:
        return f"torch.where({sub()} > x[i, j], {sub()}, {sub()})"
    if kind == 4:
        return f"{rng.choice(['max', 'min'])}({sub()}, {sub()})"
    return f"({sub()}) ** 2"


def random_cases(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        reduce = rng.choice([None, "sum", "max"])
        expr = random_expression(rng, 3)
        if reduce is not None and "j" not in expr:
            expr = f"{expr} + x[i, j]"
        if "[" not in expr:
            expr = f"{expr} + r[j]"
        cases.append(body_case(expr, reduce))
    return cases


def make_inputs(case: Case, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in case.inputs.items():
        if not isinstance(spec, tuple):
            out[name] = spec
        elif spec[0] == "nan":  # poisoned: an element nobody writes stays NaN and shows
            out[name] = torch.full(spec[1], float("nan"))
        elif spec[0] == "randint":  # indices into another tensor: ("randint", shape, high)
            out[name] = torch.randint(0, spec[2], spec[1], generator=gen)
        elif spec[0] == "randn_t":  # not contiguous: strides matter
            out[name] = torch.randn(spec[1][::-1], generator=gen).t()
        else:
            out[name] = torch.randn(spec[1], generator=gen)
    return out


def source(case: Case) -> str:
    return HEADER + textwrap.dedent(case.source)


def modules(case: Case, directory: Path):
    """(the unexpanded module: the reference, the expanded module)."""
    src = source(case)
    reference = load_module(src, f"tile_ref_{case.name}", directory)
    code = expand_source(src, path=f"{case.name}.py").code
    expanded = load_module(code, f"tile_exp_{case.name}", directory)
    return reference, expanded


def compare(case: Case, reference, run) -> str | None:
    """Run the reference loop and ``run`` on the same inputs; a message when they differ.

    The loop runs in float32; a half-precision case gives ``run`` the inputs
    rounded to its dtype and compares with the loop's outputs rounded alike.
    """
    want = _loop_outputs(case, reference)
    got = make_inputs(case)
    got = {k: v.to(case.dtype_of(k)) if _floating(v) else v for k, v in got.items()}
    run(**got)
    for name, value in want.items():
        if not _floating(value):
            continue
        value = value.to(case.dtype_of(name)).float()
        if not torch.allclose(
            got[name].float(), value, rtol=case.rtol, atol=case.atol, equal_nan=True
        ):
            diff = (got[name].float() - value).abs().nan_to_num(float("inf")).max().item()
            return f"{case.name}: {name} differs from the loop (max abs diff {diff})"
    return None


# What the loop left in each argument, per case: a test compares several variants (the
# dispatcher, row blocks, looped, 64-bit offsets) with one loop, and the attention loops take
# seconds. Keyed by what the loop's results depend on: its source, inputs and roundings.
_LOOP_OUTPUTS: dict[tuple, dict] = {}


def _loop_outputs(case: Case, reference) -> dict:
    key = (source(case), repr(case.inputs), case.dtype, case.dtypes)
    if key not in _LOOP_OUTPUTS:
        want = make_inputs(case)
        with torch.inference_mode():  # the same values, less overhead per scalar operation
            getattr(reference, case.name)(
                **{k: _rounded(v, case.dtype_of(k)) for k, v in want.items()}
            )
        _LOOP_OUTPUTS[key] = want
    return _LOOP_OUTPUTS[key]


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _rounded(value, dtype: torch.dtype):
    """A float32 tensor holding ``value`` rounded to ``dtype`` (in place: the loop writes into it)."""
    if _floating(value):
        value.copy_(value.to(dtype))
    return value
