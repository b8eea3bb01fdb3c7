"""Every generated @tile kernel compiles for a real GPU (sm_90 cubin), without one.

The interpreter runs kernels as numpy, so it forgives what the compiler does
not (types that change across a loop, tl.dot operand shapes and dtypes).
``triton.compile`` with an explicit target builds TTIR -> PTX -> cubin on this
machine; here for each parity case in float32 and float16, and for the
benchmark's CUDA configurations.
"""

from __future__ import annotations

import re
import textwrap
import warnings

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.tile import HEADER, PATTERNS
from macrogen.expand import expand_source
from tests.helpers import load_module
from tests.macros.tile_cases import CASES, source

TARGET = GPUTarget("cuda", 90, 32)  # H100


def compile_kernel(
    code: str,
    name: str,
    scalars: dict,
    dtype: str,
    directory,
    indices: frozenset = frozenset(),
    wide: bool = False,
) -> None:
    """Compile ``_<name>_kernel`` of the expanded ``code`` with the launcher's meta-parameters."""
    module = load_module(code, f"tile_compile_{name}_{dtype}", directory)
    kernel = getattr(module, f"_{name}_kernel")
    launcher = code.split(f"def _{name}_triton(")[1].split("\ndef ")[0]
    constexprs = {
        key: int(value) if value.isdigit() else value.strip("'")
        for key, value in re.findall(r"^\s+([A-Z_]+)=([0-9]+|'\w+'),$", launcher, re.M)
    }
    if "DOT_PRECISION" in kernel.arg_names:  # chosen at run time from torch's allow_tf32
        constexprs.setdefault("DOT_PRECISION", "ieee")
    constexprs["INDEX_64"] = wide  # chosen at launch from the tensors' sizes
    signature = {
        arg: "*i64"
        if arg.endswith("_ptr") and arg[: -len("_ptr")] in indices
        else f"*{dtype}"
        if arg.endswith("_ptr")
        else "fp32"
        if isinstance(scalars.get(arg), float)
        else "i32"
        for arg in kernel.arg_names
        if arg not in constexprs
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton's notice about its FP-fusion default
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs), target=TARGET
        )
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16-int64"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_kernels_compile_for_sm90(case, dtype: str, tmp_path) -> None:
    """float32 and float16 with 32-bit offsets; bfloat16 with the 64-bit ones."""
    code = expand_source(source(case), path=f"{case.name}.py").code
    scalars = {name: spec for name, spec in case.inputs.items() if not isinstance(spec, tuple)}
    indices = frozenset(
        n for n, s in case.inputs.items() if isinstance(s, tuple) and s[0] == "randint"
    )
    wide = dtype.endswith("-int64")
    compile_kernel(code, case.name, scalars, dtype.split("-")[0], tmp_path, indices, wide)


def test_benchmark_kernels_compile_for_sm90(tmp_path) -> None:
    for p in PATTERNS:
        name = p.name.split()[0]
        code = expand_source(HEADER + textwrap.dedent(p.source), path=f"{name}.py").code
        dtype = "fp16" if str(p.gpu_dtype) == "torch.float16" else "fp32"
        compile_kernel(code, name, {}, dtype, tmp_path)
