"""Generated fused_allreduce pack/unpack kernels under the Triton interpreter, against torch.

Run in its own process with TRITON_INTERPRET=1 set before triton is imported
(``tests/test_fused_allreduce_kernels.py`` does that):

    TRITON_INTERPRET=1 python -m tests.fused_kernels_check DIR

Each case expands a block of K all_reduce calls, loads the generated kernels
from a real file, and for every flat buffer of ``runtime.fused.plan``: packs into
a NaN-poisoned buffer and compares with ``torch.cat``; unpacks into
NaN-poisoned tensors and compares with the buffer's slices; tensors of other
buffers (n = 0 in that launch) must stay untouched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from macrogen.expand import expand_source  # noqa: E402
from macrogen.runtime import fused  # noqa: E402
from tests.helpers import load_module  # noqa: E402

POISON_INT = -7_777


def poisoned(like: torch.Tensor) -> torch.Tensor:
    if like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"))
    return torch.full_like(like, POISON_INT)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def block_source(k: int, block: int) -> str:
    calls = "".join(f"        dist.all_reduce(t{i})\n" for i in range(k))
    params = ", ".join(f"t{i}" for i in range(k))
    return (
        "import torch.distributed as dist\nimport macrogen as mg\n\n\n"
        f"def sync({params}):\n    with mg.fused_allreduce(block={block}):\n{calls}"
    )


def check_case(name: str, tensors: list[torch.Tensor], block: int, directory: Path) -> int:
    code = expand_source(block_source(len(tensors), block), path=f"{name}.py").code
    module = load_module(code, name, directory)
    pack, unpack = module._fused_allreduce_l6_pack, module._fused_allreduce_l6_unpack
    launches = 0
    for flat in fused.plan(tensors):
        want = fused.pack_torch(tensors, flat)
        buf = poisoned(want)
        fused.launch(pack, buf, tensors, flat, block)
        assert torch.equal(buf, want), f"{name}: pack differs for {flat.dtype}"

        reduced = random_tensor(tuple(want.shape), flat.dtype, torch.Generator().manual_seed(1))
        outputs = [poisoned(t) for t in tensors]
        before = [t.clone() for t in outputs]
        fused.launch(unpack, reduced, outputs, flat, block)
        for out, size, offset in zip(flat.members, flat.sizes, flat.offsets):
            chunk = reduced[offset : offset + size].view(tensors[out].shape)
            assert torch.equal(outputs[out], chunk), f"{name}: unpack differs for t{out}"
        for i, out in enumerate(outputs):
            if i not in flat.members:  # not in this buffer: untouched (still poisoned)
                assert torch.equal(out.view(-1).isnan(), before[i].view(-1).isnan())
                if not out.dtype.is_floating_point:
                    assert torch.equal(out, before[i])
        launches += 1
    return launches


def main(directory: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    cases: list[tuple[str, list[torch.Tensor], int]] = [
        ("k1_single_element", [random_tensor((1,), torch.float32, gen)], 16),
        ("k1_ragged", [random_tensor((1000,), torch.float32, gen)], 64),
        ("k1_empty", [random_tensor((0,), torch.float32, gen)], 16),
        ("k1_scalar", [random_tensor((), torch.float64, gen)], 16),
        (
            "k3_ragged",
            [random_tensor(s, torch.float32, gen) for s in ((17,), (3, 43), (129,))],
            32,
        ),
        (
            "k4_with_empty_and_scalar",
            [random_tensor(s, torch.float32, gen) for s in ((0,), (), (65, 3), (0, 4))],
            16,
        ),
    ]
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.float16]
    mixed = []
    for i in range(7):
        n = int(torch.randint(0, 3000, (1,), generator=gen))
        mixed.append(random_tensor((n,), dtypes[i % len(dtypes)], gen))
    cases.append(("k7_mixed_dtypes", mixed, 128))
    cases.append(("k7_mixed_dtypes_big_block", mixed, 1024))
    launches = 0
    for name, tensors, block in cases:
        launches += check_case(name, tensors, block, directory)
    print(f"ok: {len(cases)} cases, {launches} buffers")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
