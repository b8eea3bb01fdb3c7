"""Run every @tile parity case's Triton kernel under TRITON_INTERPRET=1 (a subprocess's main).

TRITON_INTERPRET must be set before triton is first imported, and the test
session imports triton early, so test_tile_parity.py runs this module as
``python -m tests.macros.tile_interpret DIR [cases|attention]``. It prints one JSON object:
case name -> null (matches the loop) or the mismatch / error message.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from macrogen.expand import expand_source  # noqa: E402
from macrogen.macros.tile.interpret import faithful_bf16_dot  # noqa: E402
from tests.helpers import load_module  # noqa: E402
from tests.macros.tile_cases import (  # noqa: E402
    ATTENTION_GRADS,
    CASES,
    RANDOM_CASES,
    WIDE_CASES,
    attention_gradients,
    attention_name,
    attention_source,
    compare,
    modules,
    random_cases,
)


def main(directory: str, part: str = "cases") -> None:
    """``cases``: every parity case and random body; ``attention``: the attention kernels'
    gradients (a process of its own: each part stays within the test's time limit)."""
    # bfloat16 kernels with a tl.dot run with the interpreter's dot reading bfloat16 as numbers
    with faithful_bf16_dot():
        results = cases(directory) if part == "cases" else attention(directory)
    print(json.dumps({"random": RANDOM_CASES, "results": results}))


def attention(directory: str) -> dict[str, str | None]:
    """The attention kernels forward and backward (the autograd function, its kernels forced
    on) against float64, per dtype, head dimension and mask: "<name>@grad" -> None or why."""
    results: dict[str, str | None] = {}
    for causal, head, dtype in ATTENTION_GRADS:
        name = attention_name(causal, head, dtype)
        try:
            code = expand_source(attention_source(name, causal), path=f"{name}.py").code
            module = load_module(code, f"tile_grad_{name}", Path(directory))
            module.use_triton = lambda device: True  # CPU tensors take the kernels here
            results[f"{name}@grad"] = attention_gradients(module, name, causal, head, dtype)
        except Exception:
            results[f"{name}@grad"] = traceback.format_exc(limit=4)
    return results


def cases(directory: str) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for case in CASES + random_cases(seed=0, count=RANDOM_CASES):
        try:
            reference, expanded = modules(case, Path(directory))
            results[case.name] = compare(case, reference, getattr(expanded, f"_{case.name}_triton"))
        except Exception:  # report, and go on with the other cases
            results[case.name] = traceback.format_exc(limit=4)
        # the looped variant of a reduction (the rows here are short: the persistent one ran)
        try:
            reference, expanded = modules(case, Path(directory))
            if hasattr(expanded, f"_{case.name}_persistent_max"):
                setattr(expanded, f"_{case.name}_persistent_max", 0)
                results[f"{case.name}@looped"] = compare(
                    case, reference, getattr(expanded, f"_{case.name}_triton")
                )
            else:
                results[f"{case.name}@looped"] = None  # (no inner loop: one variant)
        except Exception:
            results[f"{case.name}@looped"] = traceback.format_exc(limit=4)
    for case in CASES:  # the 64-bit-offset variant of some kernels, as if a tensor were huge
        if case.name not in WIDE_CASES:
            continue
        try:
            reference, expanded = modules(case, Path(directory))
            expanded.int64_offsets = lambda *tensors: True
            results[f"{case.name}@int64"] = compare(
                case, reference, getattr(expanded, f"_{case.name}_triton")
            )
        except Exception:
            results[f"{case.name}@int64"] = traceback.format_exc(limit=4)
    return results


if __name__ == "__main__":
    main(*sys.argv[1:])
