"""Every @tile parity case's torch path against the loop (a subprocess's main).

The reference loops of the attention cases take seconds of pure Python each, so
test_tile_parity.py runs this module in the background from the session's start, on the
core the other tests leave idle (tests/background.py), as
``python -m tests.macros.tile_torch_paths DIR``. It prints one JSON object: case name ->
null (every variant matches the loop) or the first mismatch / error message.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from tests.macros.tile_cases import CASES, compare, modules


def torch_paths(directory: str) -> dict[str, str | None]:
    """Per case: the torch path, the dispatcher (CPU tensors take the torch path) and, where
    the path works in blocks of rows, one row per block (several blocks, the last ragged)."""
    results: dict[str, str | None] = {}
    for case in CASES:
        try:
            reference, expanded = modules(case, Path(directory))
            name = case.name
            found = compare(case, reference, getattr(expanded, f"_{name}_torch"))
            found = found or compare(case, reference, getattr(expanded, name))
            if found is None and hasattr(expanded, f"_{name}_torch_block"):
                setattr(expanded, f"_{name}_torch_block", 1)
                found = compare(case, reference, getattr(expanded, f"_{name}_torch"))
            results[name] = found
        except Exception:  # report, and go on with the other cases
            results[case.name] = traceback.format_exc(limit=4)
    return results


if __name__ == "__main__":
    print(json.dumps({"results": torch_paths(sys.argv[1])}))
