"""@tile computes what the unexpanded loop computes, on both paths.

Every case of tile_cases.py (bias + GELU with broadcasting, row softmax, row
sum/max, matmul-shaped reductions with and without tl.dot, 3-loop nests, a
transposed row-wise normalisation) runs on random inputs with ragged sizes and
NaN-poisoned outputs: the torch path here, the Triton kernel under
TRITON_INTERPRET=1 in one subprocess (the variable must be set before triton
is imported, and this session has imported it already).
"""

from __future__ import annotations

import json

import pytest

from tests import background
from tests.macros.tile_cases import (
    ATTENTION_GRADS,
    CASES,
    RANDOM_CASES,
    WIDE_CASES,
    attention_name,
)

# The interpreter's cases take about 65 s of CPU (the attention part 30 s), all in the first
# test's setup: on a shared machine under load that is several minutes of wall time.
pytestmark = pytest.mark.timeout(900)

NAMES = [case.name for case in CASES]
WIDE = [f"{name}@int64" for name in WIDE_CASES]
LOOPED = [f"{name}@looped" for name in NAMES]  # _<name>_persistent_max = 0: rows a tile at a time
GRADS = [f"{attention_name(*case)}@grad" for case in ATTENTION_GRADS]


def _interpret(part: str) -> dict:
    # started in the background when the session began (tests/background.py); wall time on
    # a shared machine under load is several times the CPU time
    proc = background.result(f"tile_{part}", timeout=840)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["results"]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Each case's result from the Triton interpreter: None when it matches the loop."""
    return _interpret("cases")


@pytest.fixture(scope="module")
def gradients() -> dict:
    """The attention kernels' forward and backward from the interpreter: None when they match."""
    return _interpret("attention")


@pytest.mark.parametrize("name", NAMES + WIDE + LOOPED)
def test_triton_kernel_matches_loop(name: str, interpreted: dict) -> None:
    """Every case (a reduction's short rows take the persistent variant); some again with the
    kernel's 64-bit offsets (INDEX_64) forced on; each again with the looped variant."""
    assert interpreted[name] is None, interpreted[name]


def test_triton_kernel_matches_loop_on_random_bodies(interpreted: dict) -> None:
    random = {
        name: result for name, result in interpreted.items() if name not in NAMES + WIDE + LOOPED
    }
    assert len(random) == 2 * RANDOM_CASES  # each also @looped
    failures = [result for result in random.values() if result is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", GRADS)
def test_attention_kernels_forward_and_backward_match_float64(name: str, gradients: dict) -> None:
    """The autograd function with its kernels (2 x 70 queries, 90 keys, 32-tiles; NaN-poisoned
    out): out, dq, dk and dv in float32, float16 and bfloat16, head dimensions 64 and 128,
    causal and not."""
    assert gradients[name] is None, gradients[name]


@pytest.fixture(scope="module")
def torch_paths() -> dict:
    """Each case's torch path, dispatcher and row blocks against the loop (tile_torch_paths.py,
    in the background): None when all match."""
    return _interpret("torch")


@pytest.mark.parametrize("name", NAMES)
def test_torch_path_matches_loop(name: str, torch_paths: dict) -> None:
    """The torch path; the expanded function itself, which dispatches CPU tensors to it; and
    blocks of rows (the fewest, one row: several blocks, the last one ragged)."""
    assert torch_paths[name] is None, torch_paths[name]
