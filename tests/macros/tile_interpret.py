"""Run every @tile parity case's Triton kernel under TRITON_INTERPRET=1 (a subprocess's main).

TRITON_INTERPRET must be set before triton is first imported, and the test
session imports triton early, so test_tile_parity.py runs this module as
``python -m tests.macros.tile_interpret DIR``. It prints one JSON object:
case name -> null (matches the loop) or the mismatch / error message.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from tests.macros.tile_cases import (  # noqa: E402
    CASES,
    RANDOM_CASES,
    WIDE_CASES,
    compare,
    modules,
    random_cases,
)


def main(directory: str) -> None:
    results = {}
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
    print(json.dumps({"random": RANDOM_CASES, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
