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

from bench.tile import HEADER, MATMUL_CONFIGS, PATTERNS
from macrogen.expand import expand_source
from tests.helpers import load_module
from tests.macros.tile_cases import CASES, source

TARGET = GPUTarget("cuda", 90, 32)  # H100
A100 = GPUTarget("cuda", 80, 32)


def compile_kernel(
    code: str,
    name: str,
    scalars: dict,
    dtype: str,
    directory,
    indices: frozenset = frozenset(),
    wide: bool = False,
    persistent: bool = False,
    target: GPUTarget = TARGET,
    overrides: dict | None = None,
    num_warps: int | None = None,
) -> None:
    """Compile ``_<name>_kernel`` of the expanded ``code`` with the launcher's meta-parameters
    (a kernel with a persistent variant: that one or the looped one, at the default tiles)."""
    module = load_module(code, f"tile_compile_{name}_{dtype}", directory)
    kernel = getattr(module, f"_{name}_kernel")
    launcher = code.split(f"def _{name}_triton(")[1].split("\ndef ")[0]
    constexprs = {
        key: int(value) if value.isdigit() else value.strip("'")
        for key, value in re.findall(r"^\s+([A-Z_]+)=([0-9]+|'\w+'),$", launcher, re.M)
    }
    # a launcher that picks the variant names its defaults: block_i, block_j, warps = 4, 1024, 4
    defaults = re.search(r"^\s+((?:block_\w+, )+)warps = ([0-9, ]+)$", launcher, re.M)
    if defaults:
        names = [n.strip() for n in defaults.group(1).split(",") if n.strip()]
        values = [int(v) for v in defaults.group(2).split(",")]
        for local, value in zip(names, values):
            constexprs["BLOCK_" + local[len("block_") :].upper()] = value
    if "PERSISTENT" in kernel.arg_names:
        constexprs["PERSISTENT"] = persistent
    if "DOT_PRECISION" in kernel.arg_names:  # chosen at run time from torch's allow_tf32
        constexprs.setdefault("DOT_PRECISION", "ieee")
    constexprs["INDEX_64"] = wide  # chosen at launch from the tensors' sizes
    constexprs.update(overrides or {})
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
        options = {"num_warps": num_warps} if num_warps else None
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs), target=target, options=options
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
    if dtype == "fp32" and "PERSISTENT:" in code:  # the persistent variant too
        compile_kernel(code, case.name, scalars, "fp32", tmp_path, indices, persistent=True)


@pytest.mark.parametrize("target", [TARGET, A100], ids=["sm90", "sm80"])
def test_benchmark_kernels_compile(tmp_path, target: GPUTarget) -> None:
    """The benchmark's configurations (both variants of a reduction) for an H100 and an A100."""
    for p in PATTERNS:
        name = p.name.split()[0]
        code = expand_source(HEADER + textwrap.dedent(p.source), path=f"{name}.py").code
        dtype = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}.get(str(p.gpu_dtype), "fp32")
        for persistent in (False, True) if "PERSISTENT:" in code else (False,):
            compile_kernel(code, name, {}, dtype, tmp_path, persistent=persistent, target=target)


def test_matmul_configs_compile_for_sm90(tmp_path) -> None:
    """bench/gpu.py's matmul configurations (tunable values from a tuning database), in fp16."""
    (p,) = [p for p in PATTERNS if p.flops is not None]
    for config in MATMUL_CONFIGS:
        tuning = {f"matmul.{k}": v for k, v in config.items()}
        code = expand_source(HEADER + textwrap.dedent(p.source), path="m.py", tuning=tuning).code
        assert f"BLOCK_J={config['j']}," in code and f"num_warps={config['num_warps']}," in code
        compile_kernel(code, "matmul", {}, "fp16", tmp_path)


@pytest.mark.parametrize("name", ["softmax", "rms"])
def test_persistent_variant_at_its_longest_row_compiles_for_sm90(name: str, tmp_path) -> None:
    """A 16K row: the launcher's choice for it (one row per program, 16 warps)."""
    (p,) = [p for p in PATTERNS if p.name == name]
    code = expand_source(HEADER + textwrap.dedent(p.source), path=f"{name}.py").code
    assert f"_{name}_persistent_max = 16384" in code
    rows = {"BLOCK_I": 1, "BLOCK_J": 16384}
    compile_kernel(code, name, {}, "fp32", tmp_path, persistent=True, overrides=rows, num_warps=16)
