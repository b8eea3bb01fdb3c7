"""What the Triton interpreter computes wrongly, put right for the checks that run on CPU.

The interpreter holds bfloat16 values as their 16-bit patterns (numpy has no
bfloat16) and its ``tl.dot`` multiplies those patterns as if they were the
numbers (triton-lang/triton#11584): a bfloat16 kernel with a ``tl.dot``
cannot be checked under it as it is. ``faithful_bf16_dot`` widens a bfloat16
operand to float32 with the interpreter's own cast before the product, so the
dot computes the products of the bfloat16 values accumulated in float32, what
the tensor cores compute (up to the order of the sum). Everything else in the
kernel (the bfloat16 loads, ``p.to(v.dtype)``, the stores' rounding) runs as
the interpreter runs it::

    with faithful_bf16_dot():          # TRITON_INTERPRET=1 set before triton is imported
        _attention_triton(out, q, kk, v, 0.125)   # bfloat16 tensors
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def faithful_bf16_dot() -> Iterator[None]:
    """Within the block, the interpreter's ``tl.dot`` reads bfloat16 operands as numbers."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, *rest)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original
