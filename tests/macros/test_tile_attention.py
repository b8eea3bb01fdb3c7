"""The attention nest is differentiable: its gradients are the loop's (the autograd function).

The unexpanded loop runs under autograd as it is (a Python loop over 0-d
tensors, ``out[b, i, e] = acc / l`` an indexed store): its gradients are the
reference. The expanded function routes to its autograd function when a tensor
argument requires grad; on CPU tensors that is the torch path forward and the
torch backward, compared here in float64 to 1e-10. The kernels' forward and
backward run under the interpreter in test_tile_parity.py (against float64, in
float32, float16 and bfloat16).
"""

from __future__ import annotations

import pytest
import torch

from macrogen.expand import expand_source
from tests.helpers import load_module
from tests.macros.tile_cases import HEADER

CAUSAL = """
@mg.tile(i=16, j=16)
def attention(out, q, kk, v, scale):
    B, M, D = q.shape
    {sizes} = v.shape
    for b in range(B):
        for i in range({start}M):
            for e in range(E):
                m = float("-inf")
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[{kb}j, k]
                    if j <= i + 1:
                        m = max(m, {logit})
                l = 0.0
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[{kb}j, k]
                    if j <= i + 1:
                        l += torch.exp({logit} - m)
                acc = 0.0
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[{kb}j, k]
                    if j <= i + 1:
                        acc += torch.exp({logit} - m) * v[{kb}j, e]
                out[b, i, e] = acc / l
"""


def _modules(tmp_path, tag: str, **parts: str):
    text = HEADER + CAUSAL.format(
        start=parts.get("start", ""),
        sizes="_, N, E" if parts.get("kb", "b, ") else "N, E",
        kb=parts.get("kb", "b, "),
        logit=parts.get("logit", "s * scale"),
    )
    loop = load_module(text, f"attention_loop_{tag}", tmp_path)
    expanded = load_module(
        expand_source(text, path="a.py").code, f"attention_expanded_{tag}", tmp_path
    )
    return loop, expanded


def _run(fn, shapes: dict, base_grad: bool = False):
    """out, the gradients of q, kk and v (and of out's old values) after a backward."""
    gen = torch.Generator().manual_seed(0)
    leaves = {
        k: torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_()
        for k, s in shapes.items()
    }
    base = torch.randn(shapes["q"][:2] + shapes["v"][-1:], generator=gen, dtype=torch.float64)
    base.requires_grad_(base_grad)
    out = base.clone() if base_grad else torch.full(base.shape, float("nan"), dtype=torch.float64)
    fn(out, leaves["q"], leaves["kk"], leaves["v"], 0.7)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * weights).sum().backward()
    grads = [leaves[k].grad for k in ("q", "kk", "v")]
    return out.detach(), grads, base.grad


SHAPES = {"q": (2, 5, 3), "kk": (2, 7, 3), "v": (2, 7, 4)}


@pytest.mark.parametrize(
    "tag, parts, shapes",
    [
        ("causal", {}, SHAPES),
        ("softcap", {"logit": "3.0 * torch.tanh(s / 3.0)"}, SHAPES),  # f'(s) in the backward
        ("shared", {"kb": ""}, {"q": (2, 5, 3), "kk": (7, 3), "v": (7, 4)}),  # kk, v for every b
    ],
)
def test_gradients_are_the_loops(tmp_path, tag: str, parts: dict, shapes: dict) -> None:
    loop, expanded = _modules(tmp_path, tag, **parts)
    want_out, want, _ = _run(loop.attention, shapes)
    got_out, got, _ = _run(expanded.attention, shapes)
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_outs_old_values_keep_their_gradient_where_the_nest_does_not_write(tmp_path) -> None:
    """range(1, M): row 0 of out keeps its old value, so its gradient flows to what made it."""
    loop, expanded = _modules(tmp_path, "partial", start="1, ")
    want_out, want, want_base = _run(loop.attention, SHAPES, base_grad=True)
    got_out, got, got_base = _run(expanded.attention, SHAPES, base_grad=True)
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_base, want_base, rtol=1e-10, atol=1e-10)
    assert got_base[:, 0].abs().sum() > 0 and got_base[:, 1:].abs().sum() == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_without_grad_the_function_writes_in_place_as_before(tmp_path) -> None:
    _, expanded = _modules(tmp_path, "nograd")
    q, kk, v = torch.randn(2, 5, 3), torch.randn(2, 7, 3), torch.randn(2, 7, 4)
    out = torch.full((2, 5, 4), float("nan"))
    with torch.no_grad():
        expanded.attention(out, q.requires_grad_(), kk, v, 0.7)
    assert out.grad_fn is None and not out.isnan().any()
