"""Gradient compression kernels: the torch path here, the Triton kernels under the interpreter.

The interpreter is chosen when triton is imported, so the Triton check runs in
a fresh process with TRITON_INTERPRET=1 (see ``tests/grad_compress_check.py``).
"""

import pytest
import torch
from macrogen.kernels import grad_compress

from tests.helpers import run_interpreted


def test_triton_kernels_match_torch_under_the_interpreter():
    done = run_interpreted("tests.grad_compress_check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: 36 cases"), done.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_torch_path_scales_rounds_and_widens(dtype, n):
    if grad_compress._triton_path(torch.empty(1)):
        pytest.fail("CPU tensors must take the torch path outside the interpreter")
    grads = torch.randn(n) * 3
    comm = torch.full((n,), float("nan"), dtype=dtype)
    grad_compress.compress(grads, comm, 0.25)
    assert torch.equal(comm, (grads * 0.25).to(dtype))
    back = torch.full((n,), float("nan"))
    grad_compress.decompress(comm, back)
    assert torch.equal(back, comm.float())


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="flat tensors of one length"):
        grad_compress.compress(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="flat tensors of one length"):
        grad_compress.decompress(torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(4))
