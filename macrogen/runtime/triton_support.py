"""Triton when it is installed, and a stand-in that still imports when it is not.

Expanded files define ``@triton.jit`` kernels at module level; on a machine
without Triton (macOS, Windows) they must still import and take the torch path.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

    class _NoTriton:
        @staticmethod
        def jit(fn: Any = None, **kwargs: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = _NoTriton()  # type: ignore[assignment,unused-ignore]
    tl = None  # type: ignore[assignment,unused-ignore]


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_index() -> None:
    """Let Triton 3.6's interpreter use scalar kernel arguments as Python ints (``range(lo, N, B)``).

    The interpreter holds a scalar argument as a one-element 1-D array and
    converts it with ``int(array)``, which NumPy >= 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"); Triton >= 3.7
    squeezes first. Compiled kernels are unaffected. We install the same
    ``__index__`` as the newer interpreter, on top of the one it sets per call
    (its patch scope restores both, last first).
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - an interpreter without this module
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_macrogen_squeezes", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._macrogen_squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if HAS_TRITON and interpreting():
    _patch_interpreter_index()


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the Triton path (else the torch path)."""
    return HAS_TRITON and device.type == "cuda"


INT32_MAX = 2**31 - 1


def int64_offsets(*tensors: torch.Tensor) -> bool:
    """Whether a kernel must compute its element offsets in 64 bits: some tensor's farthest
    element lies more than 2^31 - 1 elements from its start (``index * stride`` would
    overflow int32). Decided per launch from the sizes and strides; reads no data, so a
    ``meta`` tensor or a broadcast view (stride 0) answers without memory behind it."""
    for t in tensors:
        if t.numel() == 0:
            continue
        farthest = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        if farthest > INT32_MAX:
            return True
    return False
