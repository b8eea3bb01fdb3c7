"""The attention nest's FlashAttention kernels (flash.py, flash_output.py): when they are chosen,
what the loop nest states (causal masks, a batch, the logit), and what the code does with it.

Their parity with the loop runs with the other kernels under the interpreter
(tile_cases.py: flash_attention, flash_attention_half, flash_attention_online,
flash_causal, flash_bf16; the gradients in test_tile_parity.py), their sm_80 and
sm_90 builds in test_tile_compile.py, the gradients on the torch path in
test_tile_attention.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from macrogen.expand import expand_source
from macrogen.macros.tile.flash import match
from tests.helpers import expansion_errors, load_module
from tests.macros.tile_cases import CASES, source

HEADER = "import torch\nimport macrogen as mg\n\n"

THREE_PASSES = """
@mg.tile({tiles})
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
                {mask}m = max(m, {logit})
            l = 0.0
            for j in range(N):
                s = 0.0
                for k in range(D):
                    s += q[i, k] * kk[j, k]
                {mask}l += torch.exp({logit} - m)
            acc = 0.0
            for j in range(N):
                s = 0.0
                for k in range(D):
                    s += q[i, k] * kk[j, k]
                {mask}acc += {weighted}
            out[i, e] = {result}
"""

FLASH = " * alpha, input_precision=DOT_PRECISION)"  # acc += p @ v, rescaled


def _text(tiles: str = "i=16, e=16, j=16, k=16", **parts: str) -> str:
    mask = parts.get("mask", "")
    return THREE_PASSES.format(
        tiles=tiles,
        mask=f"if {mask}:\n                    " if mask else "",
        logit=parts.get("logit", "s * scale"),
        weighted=parts.get("weighted", "torch.exp({logit} - m) * v[j, e]").format(
            logit=parts.get("logit", "s * scale")
        ),
        result=parts.get("result", "acc / l"),
    )


def _expand(tiles: str = "i=16, e=16, j=16, k=16", **parts: str) -> str:
    return expand_source(HEADER + _text(tiles, **parts), path="att.py").code


def _kernel(code: str, name: str = "attention") -> str:
    return code.split(f"def _{name}_kernel(")[1].split("\n# tile at")[0]


@pytest.mark.parametrize(
    "name", ["flash_attention", "flash_attention_half", "flash_attention_online", "flash_causal"]
)
def test_parity_cases_get_the_flash_kernel(name: str) -> None:
    (case,) = [c for c in CASES if c.name == name]
    code = expand_source(source(case), path=f"{name}.py").code
    kernel = _kernel(code, name)
    # q's rows loaded once, before the keys; one dot per step over the whole head dimension
    assert kernel.count("q_tile = tl.load(") == 1
    assert kernel.index("q_tile = tl.load(") < kernel.index("for j_start")
    assert "for k_start" not in kernel and FLASH in kernel
    # two loops over the keys: whole steps without masks, then the masked rest
    unmasked, masked = kernel.split("for j_start in range(")[1:]
    assert "tl.where" not in unmasked and "tl.where" in masked
    # base 2, the logit's scale folded into one multiply per score
    assert "tl.exp2(z - m_next)" in kernel and "tl.exp(" not in kernel
    assert "if q.dtype != kk.dtype:" in code  # both operands of q @ kk.T in one dtype
    assert f"def _{name}_backward_kernel(" in code and f"class _{name}_autograd(" in code


def test_the_scale_is_folded_into_the_base_2_logit() -> None:
    kernel = _kernel(_expand())
    assert "qk_scale = scale * 1.4426950408889634" in kernel
    assert "z = s_2 * qk_scale" in kernel
    # s / c folds too; a logit that is not a scaled score is computed, then scaled to base 2
    assert "qk_scale = 0.125 * 1.4426950408889634" in _kernel(_expand(logit="s / 8.0"))
    capped = _kernel(_expand(logit="20.0 * torch.tanh(s / 20.0)"))
    assert "qk_scale" not in capped
    assert (
        "z = (20.0 * (2.0 * tl.sigmoid(2.0 * (s_2 / 20.0)) - 1.0)) * 1.4426950408889634" in capped
    )


def test_the_backward_multiplies_by_the_logits_derivative() -> None:
    code = _expand(logit="20.0 * torch.tanh(s / 20.0)")
    backward = code.split("def _attention_backward_kernel(")[1].split("\n# tile at")[0]
    tanh = "(2.0 * tl.sigmoid(2.0 * (s_2 / 20.0)) - 1.0)"
    assert f"ds = p * (dp - delta) * (20.0 * ((1.0 - {tanh} * {tanh}) * 0.05))" in backward
    linear = _expand().split("def _attention_backward_kernel(")[1].split("\n# tile at")[0]
    assert "ds = p * (dp - delta)\n" in linear  # times scale once, at the store
    assert "(dq_2 * scale).to(dq_ptr.dtype.element_ty)" in linear


@pytest.mark.parametrize(
    "mask, offset",
    [
        ("j <= i", 0),
        ("i >= j", 0),
        ("j < i + 1", 0),
        ("j - i <= 2", 2),
        ("j <= i - 3", -3),
        ("i > j", -1),
    ],
)
def test_a_causal_mask_is_read_as_the_nest_states_it(mask: str, offset: int) -> None:
    from macrogen.macros.tile.analysis import analyze
    from macrogen.macros.tile.ir import Binary, Const, Expr

    def value(e: Expr) -> int:
        if isinstance(e, Const):
            return int(e.value)
        assert isinstance(e, Binary)
        return value(e.left) + (value(e.right) if e.op == "+" else -value(e.right))

    import libcst as cst

    (fn,) = [
        s
        for s in cst.parse_module(textwrap.dedent(_text(mask=mask))).body
        if isinstance(s, cst.FunctionDef)
    ]
    flash = match(analyze(fn.with_changes(decorators=()), {}))
    assert flash is not None and flash.causal is not None
    assert value(flash.causal) == offset


def test_a_causal_kernel_skips_the_keys_past_the_diagonal() -> None:
    kernel = _kernel(_expand(mask="j <= i"))
    # the longest rows start first; keys a tile's queries all see are unmasked
    assert "pid_i = tiles - 1 - pid % tiles" in kernel
    assert "j_full = j_lo + tl.maximum(tl.minimum(j_hi, i_start + 1) - j_lo, 0)" in kernel
    assert "j_end = tl.minimum(j_hi, i_start + BLOCK_I)" in kernel  # no step past the diagonal
    assert 'z = tl.where((key < j_hi) & (key <= i_2), z, float("-inf"))' in kernel
    torch_path = _expand(mask="j <= i").split("def _attention_backward_torch(")[1]
    assert "masked_fill(torch.arange(j_lo, j_hi" in torch_path


@pytest.mark.parametrize(
    "parts",
    [
        {"mask": "j >= i"},  # keys after the query: no causal mask
        {"mask": "j <= 2 * i"},
        {"mask": "j <= i + scale"},  # a float offset
        {"weighted": "torch.exp(s * scale - m) * v[j, e] * 2.0"},  # not p * v
        {"weighted": "torch.exp(s * scale) * v[j, e]"},  # not shifted by the max
        {"weighted": "torch.exp(s * scale - m) * (v[j, e] * v[j, e])"},  # not a load of v
        {"result": "acc / l + 1.0"},
        {"result": "l / acc"},
    ],
)
def test_other_nests_keep_the_elementwise_kernel(parts: dict) -> None:
    code = _expand(**parts)
    assert FLASH not in code and "def _attention_kernel(" in code
    assert "_attention_autograd" not in code


def test_a_mask_in_some_passes_only_keeps_the_elementwise_kernel() -> None:
    text = _text(mask="j <= i").replace("if j <= i:\n                    m = max", "m = max", 1)
    assert text.count("if j <= i") == 2
    assert FLASH not in expand_source(HEADER + text, path="att.py").code


def test_a_pass_whose_scores_differ_keeps_the_elementwise_kernel() -> None:
    text = _text().replace(
        "s += q[i, k] * kk[j, k]\n                l +=",
        "s += q[i, k] * q[j, k]\n                l +=",
    )
    assert "q[j, k]" in text
    code = expand_source(HEADER + text, path="att.py").code
    assert FLASH not in code


def test_query_or_key_tiles_below_16_keep_the_elementwise_kernel() -> None:
    """tl.dot needs 16 along each axis; the head dimensions are taken whole (at least 16),
    so only the query and key tiles matter."""
    for tiles in ("i=8, e=16, j=16, k=16", "i=16, e=16, j=8, k=16"):
        code = _expand(tiles)
        assert FLASH not in code and "tl.dot" not in code, tiles
    assert FLASH in _expand("i=16, e=4, j=16, k=2")


def test_default_tiles_are_64_and_all_64_is_not_refused() -> None:
    """The flash kernels' blocks are 2-D, where the elementwise one would hold a 64x64x64x64
    block; an 8-row tile keeps that kernel, and its size limit."""
    code = _expand("")
    assert FLASH in code and "BLOCK_I=64," in code and "BLOCK_J=64," in code
    assert FLASH in _expand("i=64, e=64, j=64, k=64")
    errors = expansion_errors(HEADER + _text(tiles="i=8, e=64, j=64, k=64"))
    assert "more than Triton's 1048576" in errors[0]


def test_the_grid_loops_may_come_in_any_order() -> None:
    """The roles come from the loads (q has the queries), not from the loops' order."""
    text = _text().replace(
        "for i in range(M):\n        for e in range(E):",
        "for e in range(E):\n        for i in range(M):",
    )
    assert "for e in range(E):\n        for i in range(M):" in text
    assert FLASH in expand_source(HEADER + text, path="att.py").code


BATCHED = """
@mg.tile(i=16, j=16)
def attention(out, q, kk, v):
    B, M, D = q.shape
    N, E = v.shape[{n}], v.shape[{e}]
    for b in range(B):
        for i in range(M):
            for e in range(E):
                m = float("-inf")
                l = 0.0
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[{kk}]
                    m_new = max(m, s * 0.125)
                    l = l * torch.exp(m - m_new) + torch.exp(s * 0.125 - m_new)
                    m = m_new
                acc = 0.0
                for j in range(N):
                    s = 0.0
                    for k in range(D):
                        s += q[b, i, k] * kk[{kk}]
                    acc += torch.exp(s * 0.125 - m) * v[{v}]
                out[b, i, e] = acc / l
"""


def test_a_batch_loop_is_one_program_per_element() -> None:
    text = BATCHED.format(n="1", e="2", kk="b, j, k", v="b, j, e")
    code = expand_source(
        HEADER + text.replace("N, E = v.shape[1], v.shape[2]", "_, N, E = v.shape"), path="a.py"
    ).code
    kernel = _kernel(code)
    assert "b_2 = b_lo + pid // tiles" in kernel
    assert "kk_base = kk_ptr + b_2 * stride_kk0" in kernel
    assert "lse_base = lse_ptr + (b_2 - b_lo) * stride_lse_batch" in kernel


def test_keys_shared_by_the_batch_get_one_gradient_per_element_summed() -> None:
    """kk[j, k] and v[j, e] without b (one set of keys for every query head): the backward's
    programs of different b would race on dk; each b writes its own, summed after."""
    text = BATCHED.format(n="0", e="1", kk="j, k", v="j, e").replace(
        "N, E = v.shape[0], v.shape[1]", "N, E = v.shape"
    )
    code = expand_source(HEADER + text, path="a.py").code
    assert "kk_base = kk_ptr\n" in _kernel(code)
    launcher = code.split("def _attention_backward_triton(")[1]
    assert (
        "dkk = torch.zeros((batch, *kk.shape), dtype=torch.float32, device=kk.device)" in launcher
    )
    assert "return dq, dkk.sum(0).to(kk.dtype), dv.sum(0).to(v.dtype)" in launcher


def test_backward_options_belong_to_the_attention_nest() -> None:
    code = _expand("i=16, j=16, backward_block=32, backward_step=16, backward_warps=8")
    assert "BLOCK=32," in code and "STEP=16," in code and "num_warps=8," in code
    errors = expansion_errors(HEADER + _text(tiles="backward_step=24"))
    assert "backward_step must be a power of two of at least 16" in errors[0]
    other = """
    @mg.tile(i=16, backward_block=64)
    def double(out, x):
        (N,) = x.shape
        for i in range(N):
            out[i] = 2.0 * x[i]
    """
    errors = expansion_errors(HEADER + textwrap.dedent(other))
    assert "backward_block is an option of the attention nest's backward kernel" in errors[0]


def test_launcher_refuses_q_and_kk_of_two_dtypes_and_too_wide_heads(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the dtype checks
    module = load_module(_expand(), "flash_dtypes", tmp_path)
    out, q = torch.empty(3, 5), torch.randn(3, 4)
    kk, v = torch.randn(6, 4, dtype=torch.float16), torch.randn(6, 5)
    with pytest.raises(ValueError, match="the operands of a tl.dot must have one dtype: q and kk"):
        module._attention_triton(out, q, kk, v, 0.5)
    wide = torch.randn(3, 300), torch.randn(6, 300)
    with pytest.raises(
        ValueError, match="whole head dimensions up to 256 .k and e., not 300 and 5"
    ):
        module._attention_triton(out, wide[0], wide[1], v, 0.5)


def test_the_torch_path_is_unchanged_by_the_kernel_choice() -> None:
    small, flash = _expand("i=4, e=8, j=8, k=8"), _expand()
    path = [
        code.split("def _attention_torch(")[1].split("\n# tile at")[0] for code in (small, flash)
    ]
    assert path[0] == path[1]


def test_the_golden_case_is_the_flash_kernel() -> None:
    from pathlib import Path

    expected = Path(__file__).parents[1] / "golden" / "tile_attention" / "expected.py"
    assert FLASH in expected.read_text()


def test_autotune_accepts_the_attention_patterns_own_candidates() -> None:
    """The pre-filter refused @tile(i=64, e=64, j=64, k=64) as one 64^4 block (16M elements);
    the attention kernels hold 2-D blocks. Every candidate of the benchmark's tunables is kept,
    the matmul's 128x256 tile too; two tiles no kernel holds together are still refused."""
    from macrogen.autotune import space
    from macrogen.autotune.space import TuningEnv

    cuda = TuningEnv("cuda", 1, "gpu")
    text = _text(
        tiles="i=mg.tunable(64, choices=[64, 128]), e=64, j=mg.tunable(64, choices=[32, 64]),"
        " k=64, num_warps=mg.tunable(4, choices=[4, 8])"
    )
    params = space.parameters(expand_source(HEADER + text, path="a.py"))
    built = space.build(params, cuda)
    assert len(built.candidates) == 8 and not built.excluded
    from macrogen.macros.tile import tuning_constraint

    assert tuning_constraint({"i": 128, "j": 256, "k": 64}, cuda) is None
    assert "a 2048x1024 tile" in str(tuning_constraint({"i": 2048, "j": 1024, "k": 1}, cuda))
