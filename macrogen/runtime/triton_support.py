"""Triton when it is installed, and a stand-in that still imports when it is not.

Expanded files define ``@triton.jit`` kernels at module level; on a machine
without Triton (macOS, Windows) they must still import and take the torch path.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

    class _NoTriton:
        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = _NoTriton()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the Triton path (else the torch path)."""
    return HAS_TRITON and device.type == "cuda"
