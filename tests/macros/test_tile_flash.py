"""The attention nest's FlashAttention kernel (macrogen/macros/tile/flash.py): when it is chosen.

Its parity with the loop runs with the other kernels under the interpreter
(tile_cases.py: flash_attention, flash_attention_half, flash_attention_online),
its sm_90 build in test_tile_compile.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from macrogen.expand import expand_source
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
                acc += {weighted}
            out[i, e] = {result}
"""

FLASH = "acc_run * alpha, input_precision=DOT_PRECISION)"  # acc += p @ v, rescaled


def _expand(tiles: str = "i=16, e=16, j=16, k=16", **parts: str) -> str:
    text = THREE_PASSES.format(
        tiles=tiles,
        weighted=parts.get("weighted", "torch.exp(s * scale - m) * v[j, e]"),
        result=parts.get("result", "acc / l"),
    )
    return expand_source(HEADER + text, path="att.py").code


@pytest.mark.parametrize(
    "name", ["flash_attention", "flash_attention_half", "flash_attention_online"]
)
def test_parity_cases_get_the_flash_kernel(name: str) -> None:
    (case,) = [c for c in CASES if c.name == name]
    code = expand_source(source(case), path=f"{name}.py").code
    kernel = code.split("def _" + name + "_kernel(")[1].split("\ndef ")[0]
    assert "s_tile = tl.dot(q_tile, kk_tile, s_tile, input_precision=DOT_PRECISION)" in kernel
    assert FLASH in kernel
    assert "tl.sum(s_tile" not in kernel  # no elementwise scores
    # one pass over the keys: a single loop over j's tiles, with the k loop inside it
    assert kernel.count("for j_start") == 1 and kernel.count("for k_start") == 1
    assert "if q.dtype != kk.dtype:" in code  # both operands of q @ kk.T in one dtype


def test_the_torch_path_is_unchanged_by_the_kernel_choice() -> None:
    small, flash = _expand("i=4, e=8, j=8, k=8"), _expand()
    assert small.split("def _attention_torch(")[1] == flash.split("def _attention_torch(")[1]


def test_tiles_below_16_keep_the_elementwise_kernel() -> None:
    """tl.dot needs 16 along each axis; one smaller tile and the kernel reduces elementwise."""
    for tiles in ("i=8, e=16, j=16, k=16", "i=16, e=16, j=16, k=8", "i=16, e=8, j=16, k=16"):
        code = _expand(tiles)
        assert FLASH not in code and "tl.dot" not in code, tiles


def test_default_tiles_are_flash_tiles() -> None:
    code = _expand("")
    assert FLASH in code
    assert "BLOCK_I=32," in code and "BLOCK_K=32," in code


def test_large_tiles_are_not_refused_as_one_4d_block() -> None:
    """The flash kernel's blocks are 2-D (64x64), where the elementwise one would hold a
    64x64x64x64 block; an 8-row tile keeps that kernel, and its size limit."""
    assert FLASH in _expand("i=64, e=64, j=64, k=64")
    errors = expansion_errors(
        HEADER
        + THREE_PASSES.format(
            tiles="i=8, e=64, j=64, k=64",
            weighted="torch.exp(s * scale - m) * v[j, e]",
            result="acc / l",
        )
    )
    assert "more than Triton's 1048576" in errors[0]


@pytest.mark.parametrize(
    "parts",
    [
        {"weighted": "torch.exp(s * scale - m) * v[j, e] * 2.0"},  # not p * v
        {"weighted": "torch.exp(s * scale) * v[j, e]"},  # not shifted by the max
        {"weighted": "torch.exp(s * scale - m) * v[j, e + 1]"},  # an offset
        {"result": "acc / l + 1.0"},
        {"result": "l / acc"},
    ],
)
def test_other_nests_keep_the_elementwise_kernel(parts: dict) -> None:
    code = _expand(**parts)
    assert FLASH not in code and "def _attention_kernel(" in code


def test_a_pass_whose_scores_differ_keeps_the_elementwise_kernel() -> None:
    text = THREE_PASSES.format(
        tiles="i=16, e=16, j=16, k=16",
        weighted="torch.exp(s * scale - m) * v[j, e]",
        result="acc / l",
    ).replace(
        "s += q[i, k] * kk[j, k]\n                l +=",
        "s += q[i, k] * q[j, k]\n                l +=",
    )
    assert "q[j, k]" in text
    code = expand_source(HEADER + text, path="att.py").code
    assert FLASH not in code


def test_launcher_refuses_q_and_kk_of_two_dtypes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the dtype checks
    module = load_module(_expand(), "flash_dtypes", tmp_path)
    out, q = torch.empty(3, 5), torch.randn(3, 4)
    kk, v = torch.randn(6, 4, dtype=torch.float16), torch.randn(6, 5)
    with pytest.raises(ValueError, match="the operands of a tl.dot must have one dtype: q and kk"):
        module._attention_triton(out, q, kk, v, 0.5)


def test_the_golden_case_is_the_flash_kernel() -> None:
    from pathlib import Path

    expected = Path(__file__).parents[1] / "golden" / "tile_attention" / "expected.py"
    assert FLASH in expected.read_text()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_benchmark_attention_compiles_in_half_precision(dtype: str, tmp_path) -> None:
    """bench/gpu.py runs the attention kernel in fp16 too: 64-tiles, for an H100 and an A100."""
    from bench.tile import HEADER as BENCH_HEADER
    from bench.tile import PATTERNS, inputs
    from tests.helpers import load_module
    from tests.macros.test_tile_compile import A100, DTYPES, TARGET, compile_launch, launch

    (p,) = [p for p in PATTERNS if p.name.startswith("attention")]
    code = expand_source(BENCH_HEADER + textwrap.dedent(p.source), path="attention.py").code
    assert FLASH in code
    module = load_module(code, f"tile_flash_attention_{dtype}", tmp_path)
    launched = launch(module, "attention", inputs(p.small, dtype=DTYPES[dtype]))
    assert launched[1]["BLOCK_J"] == 64
    for target in (TARGET, A100):
        compile_launch(module, "attention", launched, target)


def test_a_grid_with_the_columns_first_keeps_the_elementwise_kernel() -> None:
    """The kernel's query tile is the grid's first axis; ``for e: for i:`` is not matched."""
    text = THREE_PASSES.format(
        tiles="i=16, e=16, j=16, k=16",
        weighted="torch.exp(s * scale - m) * v[j, e]",
        result="acc / l",
    ).replace(
        "for i in range(M):\n        for e in range(E):",
        "for e in range(E):\n        for i in range(M):",
    )
    assert "for e in range(E):\n        for i in range(M):" in text
    code = expand_source(HEADER + text, path="att.py").code
    assert FLASH not in code and "def _attention_kernel(" in code
