"""The gradient compress/decompress Triton kernels under the interpreter, against torch.

Run in its own process with TRITON_INTERPRET=1 set before triton is imported
(``tests/test_data_parallel_kernels.py`` does that):

    TRITON_INTERPRET=1 python -m tests.grad_compress_check

Ragged sizes (not multiples of the block, smaller than one block, one element),
outputs poisoned with NaN first, bf16 and fp16, several scales. fp16 must match
torch exactly; bf16 within one ulp (the interpreter rounds bf16 its own way).
"""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from macrogen.kernels import grad_compress  # noqa: E402

SIZES = (1, 7, 1023, 1024, 1025, 3 * 1024 + 17)
SCALES = (1.0, 0.5, 1.0 / 3.0)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at ``x`` (as float32)."""
    finfo = torch.finfo(x.dtype)
    mag = x.float().abs().clamp_min(finfo.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * finfo.eps


def check(n: int, dtype: torch.dtype, scale: float) -> None:
    g = torch.Generator().manual_seed(n)
    grads = torch.randn(n, generator=g) * 10.0
    comm = torch.full((n,), float("nan"), dtype=dtype)
    grad_compress.compress(grads, comm, scale)
    want = torch.mul(grads, scale).to(dtype)
    assert not comm.isnan().any(), f"compress left NaN (n={n}, {dtype})"
    tol = ulp(want) if dtype == torch.bfloat16 else torch.zeros(n)
    err = (comm.float() - want.float()).abs()
    assert (err <= tol).all(), f"compress n={n} {dtype} scale={scale}: max error {err.max()}"

    back = torch.full((n,), float("nan"))
    grad_compress.decompress(comm, back)
    assert torch.equal(back, comm.float()), f"decompress n={n} {dtype}"


def main() -> None:
    cases = 0
    for dtype in (torch.bfloat16, torch.float16):
        for n in SIZES:
            for scale in SCALES:
                check(n, dtype, scale)
                cases += 1
    # the interpreter path is the Triton path: prove it was taken, not the torch fallback
    assert grad_compress._triton_path(torch.empty(1))
    print(f"ok: {cases} cases")


if __name__ == "__main__":
    main()
