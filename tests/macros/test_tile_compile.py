"""Every generated @tile kernel compiles for a real GPU (sm_90 cubin), without one.

The interpreter runs kernels as numpy, so it forgives what the compiler does
not (types that change across a loop, tl.dot operand shapes and dtypes).
``triton.compile`` with an explicit target builds TTIR -> PTX -> cubin on this
machine; here for each parity case in float32 and float16, and for the
benchmark's CUDA configurations. What a kernel is compiled with is what the
generated module's launcher (``_<name>_triton``) passes it for the inputs: the
launcher runs on CPU tensors with the kernel replaced by a recorder.
"""

from __future__ import annotations

import os
import textwrap
import warnings

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.tile import HEADER, MATMUL_CONFIGS, PATTERNS, inputs
from macrogen.expand import expand_source
from tests.helpers import load_module
from tests.macros.tile_cases import CASES, make_inputs, source

TARGET = GPUTarget("cuda", 90, 32)  # H100
A100 = GPUTarget("cuda", 80, 32)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
POINTERS = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
}
OPTIONS = ("num_warps", "num_stages")


class Recorder:
    """Stands in for a generated kernel: records what its launcher passes, launches nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def launch(
    module, name: str, args: dict, kernel: str = "kernel", launcher: str = "triton", *first
) -> tuple[tuple, dict]:
    """The arguments ``_<name>_triton(**args)`` passes ``_<name>_kernel`` (CPU tensors: the
    launcher is told it runs under the interpreter, so it takes them); ``kernel`` and
    ``launcher`` name another pair (``backward_kernel``, ``backward_triton``), ``first`` the
    launcher's leading arguments."""
    saved, interpreting = getattr(module, f"_{name}_{kernel}"), module.interpreting
    recorder = Recorder()
    setattr(module, f"_{name}_{kernel}", recorder)
    module.interpreting = lambda: True
    try:
        getattr(module, f"_{name}_{launcher}")(*first, **args)
    finally:
        setattr(module, f"_{name}_{kernel}", saved)
        module.interpreting = interpreting
    (launched,) = recorder.launches
    return launched


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTERS[value.dtype]
    if isinstance(value, bool):
        return "i1"
    return "fp32" if isinstance(value, float) else "i32"


def compile_launch(
    module,
    name: str,
    launched: tuple[tuple, dict],
    target: GPUTarget = TARGET,
    kernel_name: str = "kernel",
    **overrides,
) -> None:
    """Compile ``_<name>_kernel`` with what its launcher passed (``overrides``: meta-parameters
    the launcher chooses from sizes these inputs do not have, as 64-bit offsets)."""
    kernel = getattr(module, f"_{name}_{kernel_name}")
    args, kwargs = launched
    constexprs = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    constexprs.update(overrides)
    runtime = [a for a in kernel.arg_names if a not in constexprs]
    assert len(runtime) == len(args), (runtime, len(args))
    signature = {arg: _type(value) for arg, value in zip(runtime, args)}
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton's notice about its FP-fusion default
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs), target=target, options=options
        )
    assert compiled.asm["cubin"]


def compile_both_variants(module, name: str, launched, target: GPUTarget = TARGET, **overrides):
    """The variant the launcher chose and, for a kernel with a persistent variant, the other."""
    compile_launch(module, name, launched, target, **overrides)
    if "PERSISTENT" in launched[1]:
        flipped = {**overrides, "PERSISTENT": not launched[1]["PERSISTENT"]}
        compile_launch(module, name, launched, target, **flipped)


def _cast(args: dict, dtype: torch.dtype) -> dict:
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in args.items()
    }


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16-int64"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_kernels_compile_for_sm90(case, dtype: str, tmp_path) -> None:
    """float32 and float16 with 32-bit offsets; bfloat16 with the 64-bit ones."""
    code = expand_source(source(case), path=f"{case.name}.py").code
    module = load_module(code, f"tile_compile_{case.name}_{dtype}", tmp_path)
    args = _cast(make_inputs(case), DTYPES[dtype.split("-")[0]])
    launched = launch(module, case.name, args)
    wide = {"INDEX_64": True} if dtype.endswith("-int64") else {}
    if dtype == "fp32":
        compile_both_variants(module, case.name, launched, **wide)
    else:  # the looped variant (a reduction's; the persistent one in float32 above)
        looped = {"PERSISTENT": False} if "PERSISTENT" in launched[1] else {}
        compile_launch(module, case.name, launched, **wide, **looped)


@pytest.mark.parametrize("target", [TARGET, A100], ids=["sm90", "sm80"])
def test_benchmark_kernels_compile(tmp_path, target: GPUTarget) -> None:
    """The benchmark's configurations (both variants of a reduction) for an H100 and an A100."""
    for p in PATTERNS:
        name = p.name.split()[0]
        code = expand_source(HEADER + textwrap.dedent(p.source), path=f"{name}.py").code
        module = load_module(code, f"tile_compile_bench_{name}_{target.arch}", tmp_path)
        launched = launch(module, name, inputs(p.small, dtype=p.gpu_dtype))
        compile_both_variants(module, name, launched, target)


def test_matmul_configs_compile_for_sm90(tmp_path) -> None:
    """bench/gpu.py's matmul configurations (tunable values from a tuning database), in fp16."""
    (p,) = [p for p in PATTERNS if p.flops is not None]
    for i, config in enumerate(MATMUL_CONFIGS):
        tuning = {f"matmul.{k}": v for k, v in config.items()}
        code = expand_source(HEADER + textwrap.dedent(p.source), path="m.py", tuning=tuning).code
        module = load_module(code, f"tile_compile_matmul_{i}", tmp_path)
        launched = launch(module, "matmul", inputs(p.small, dtype=torch.float16))
        assert launched[1]["BLOCK_J"] == config["j"], (config, launched[1])
        assert launched[1]["num_warps"] == config["num_warps"], (config, launched[1])
        compile_launch(module, "matmul", launched)


LONGEST_ROW = {
    "softmax": {"out": (1, 16384), "x": (1, 16384)},
    "rms": {"out": (1, 16384), "x": (1, 16384), "w": (16384,)},
}


@pytest.mark.parametrize("name", ["softmax", "rms"])
def test_persistent_variant_at_its_longest_row_compiles_for_sm90(name: str, tmp_path) -> None:
    """A 16K row: the launcher's choice for it (one row per program, 16 warps)."""
    (p,) = [p for p in PATTERNS if p.name == name]
    code = expand_source(HEADER + textwrap.dedent(p.source), path=f"{name}.py").code
    module = load_module(code, f"tile_compile_longest_{name}", tmp_path)
    assert getattr(module, f"_{name}_persistent_max") == 16384
    launched = launch(module, name, inputs(LONGEST_ROW[name]))
    kwargs = launched[1]
    assert kwargs["PERSISTENT"] and kwargs["BLOCK_I"] == 1 and kwargs["BLOCK_J"] == 16384
    assert kwargs["num_warps"] == 16
    compile_launch(module, name, launched)


def attention_launches(name: str, config: dict | None, dtype: str, head: int, tmp_path):
    """(module, forward launch, backward launch) of a bench/tile.py attention pattern at
    ``config`` (its tunables' values; None: the defaults), 2 x 200 queries and keys."""
    from bench.tile import _attention_shapes

    (p,) = [p for p in PATTERNS if p.name.split()[0] == name]
    tuning = {f"{name}.{k}": v for k, v in (config or {}).items()}
    code = expand_source(HEADER + textwrap.dedent(p.source), path=f"{name}.py", tuning=tuning).code
    tag = "_".join(map(str, (config or {}).values()))
    module = load_module(code, f"tile_compile_{name}_{dtype}_{head}_{tag}", tmp_path)
    args = inputs(_attention_shapes(2, 200, head), dtype=DTYPES[dtype])
    forward = launch(module, name, args)
    lse, dout = torch.zeros(2, 200), torch.zeros_like(args["out"])
    backward = launch(module, name, args, "backward_kernel", "backward_triton", dout, lse)
    return module, forward, backward


@pytest.mark.timeout(900)  # (about 20 s of CPU each with a cold cache: minutes under load)
@pytest.mark.parametrize(
    "name, dtype, head, target",
    [("attention", "fp16", 128, TARGET), ("attention_causal", "bf16", 64, A100)],
    ids=["fp16-d128-full-sm90", "bf16-d64-causal-sm80"],
)
def test_attention_forward_and_backward_compile(name, dtype, head, target, tmp_path) -> None:
    """The benchmark's attention kernels at their default tiles: both dtypes, head dimensions,
    masks and targets once (the whole product: test_attention_kernels_compile_matrix)."""
    module, forward, backward = attention_launches(name, None, dtype, head, tmp_path)
    assert forward[1]["HEAD_K"] == head and backward[1]["HEAD_E"] == head
    compile_launch(module, name, forward, target)
    compile_launch(module, name, backward, target, "backward_kernel")


@pytest.mark.skipif(
    not os.environ.get("TILE_COMPILE_ALL"),
    reason="minutes of compiles: TILE_COMPILE_ALL=1 runs the whole product (bench/RESULTS.md)",
)
@pytest.mark.timeout(3600)  # (4 compiles a test; minutes each on shared cores)
@pytest.mark.parametrize("target", [TARGET, A100], ids=["sm90", "sm80"])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["attention", "attention_causal"])
def test_attention_kernels_compile_matrix(name, dtype, head, target, tmp_path) -> None:
    """Every configuration bench/gpu.py times (ATTENTION_CONFIGS), forward and backward."""
    from bench.gpu_attention import ATTENTION_CONFIGS

    for config in ATTENTION_CONFIGS:
        module, forward, backward = attention_launches(name, config, dtype, head, tmp_path)
        assert forward[1]["num_warps"] == config["num_warps"]
        assert backward[1]["num_warps"] == config["backward_warps"]
        compile_launch(module, name, forward, target)
        compile_launch(module, name, backward, target, "backward_kernel")


def test_short_rows_are_two_to_a_program_at_four_warps(tmp_path) -> None:
    """batched_gate on the GPU (64 x 4096 rows of 1024): 2 rows a program at 4 warps, where the
    launcher used to pack 8 rows at 16 warps (every row's sum across warps: 72 shuffles and 9
    barriers in the sm_90 PTX, against 15 and 1 now); rows of 4096 stay 2 at 16 warps."""
    (p,) = [p for p in PATTERNS if p.name.startswith("batched_gate")]
    code = expand_source(HEADER + textwrap.dedent(p.source), path="gate.py").code
    module = load_module(code, "tile_compile_gate_rows", tmp_path)
    args = inputs({"out": (4, 64), "x": (4, 64, 1024), "w": (1024,), "bias": (64,)})
    kwargs = launch(module, "batched_gate", args)[1]
    assert kwargs["PERSISTENT"] and kwargs["BLOCK_B"] * kwargs["BLOCK_I"] == 2
    assert kwargs["BLOCK_J"] == 1024 and kwargs["num_warps"] == 4
    (rms,) = [p for p in PATTERNS if p.name == "rms"]
    code = expand_source(HEADER + textwrap.dedent(rms.source), path="rms.py").code
    module = load_module(code, "tile_compile_rms_rows", tmp_path)
    kwargs = launch(module, "rms", inputs({"out": (8, 4096), "x": (8, 4096), "w": (4096,)}))[1]
    assert kwargs["BLOCK_I"] == 2 and kwargs["num_warps"] == 16
