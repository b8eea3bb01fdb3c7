"""with fused_allreduce(): dist.all_reduce(t0) ... -> one generated call per block."""

import ast

import pytest

from macrogen.expand import expand_source
from tests.helpers import expansion_errors, strip_header


def site(body: str, args: str = "", imports: str = "import torch.distributed as dist") -> str:
    return (
        f"{imports}\n"
        "import macrogen as mg\n"
        "def sync(a, b, c, g):\n"
        f"    with mg.fused_allreduce({args}):\n"
        + "".join(f"        {line}\n" for line in body.splitlines())
    )


def call_line(code: str) -> str:
    """The statement that replaced the with block."""
    lines = code.splitlines()
    i = lines.index("def sync(a, b, c, g):")
    assert lines[i + 1].startswith("    # macrogen: fused_allreduce at test.py:4")
    return lines[i + 2].strip()


def generated(code: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)}


def test_k_calls_become_one_call_of_a_generated_function():
    code = expand_source(
        site("dist.all_reduce(a)\ndist.all_reduce(b)\ndist.all_reduce(c)"), path="test.py"
    ).code
    assert call_line(code) == "_fused_allreduce_l4(a, b, c)"
    # the helper is one runtime object per site, called as the K calls were
    assert "_fused_allreduce_l4 = FusedAllReduce(3, where='test.py:4')\n" in code
    assert "from macrogen.runtime import FusedAllReduce\n" in code


@pytest.mark.parametrize(
    "body, expected",
    [
        ("dist.all_reduce(a)", "_fused_allreduce_l4(a)"),
        ("dist.all_reduce(a, op=dist.ReduceOp.MAX)\ndist.all_reduce(b, op=dist.ReduceOp.MAX)",
         "_fused_allreduce_l4(a, b, op=dist.ReduceOp.MAX)"),
        ("dist.all_reduce(a, group=g)\ndist.all_reduce(b, group=g)", "_fused_allreduce_l4(a, b, group=g)"),
        ("dist.all_reduce(a, dist.ReduceOp.MIN, g)\ndist.all_reduce(tensor=b, group=g, op=dist.ReduceOp.MIN)",
         "_fused_allreduce_l4(a, b, op=dist.ReduceOp.MIN, group=g)"),
        ("dist.all_reduce(a, async_op=False)", "_fused_allreduce_l4(a)"),
        ("# a comment\ndist.all_reduce(a)\n\ndist.all_reduce(b)  # trailing", "_fused_allreduce_l4(a, b)"),
    ],
)  # fmt: skip
def test_call_forms(body, expected):
    assert call_line(expand_source(site(body), path="test.py").code) == expected


@pytest.mark.parametrize(
    "imports, body",
    [
        ("import torch.distributed as dist", "dist.all_reduce(a)\ndist.all_reduce(b)"),
        ("import torch", "torch.distributed.all_reduce(a)\ntorch.distributed.all_reduce(b)"),
        ("import torch.distributed", "torch.distributed.all_reduce(a)\ntorch.distributed.all_reduce(b)"),
        ("from torch.distributed import all_reduce", "all_reduce(a)\nall_reduce(b)"),
        ("from torch.distributed import all_reduce as ar", "ar(a)\nar(b)"),
        ("from torch import distributed as d", "d.all_reduce(a)\nd.all_reduce(b)"),
    ],
)  # fmt: skip
def test_calls_are_recognised_by_what_the_imports_make_them(imports, body):
    code = expand_source(site(body, imports=imports), path="test.py").code
    assert call_line(code) == "_fused_allreduce_l4(a, b)"


def test_a_function_local_import_counts_in_that_function():
    src = (
        "import macrogen as mg\n"
        "def sync(a):\n    import torch.distributed as dist\n"
        "    with mg.fused_allreduce():\n        dist.all_reduce(a)\n"
    )
    assert "_fused_allreduce_l4(a)" in expand_source(src, path="test.py").code


@pytest.mark.parametrize(
    "imports, body, error",
    [
        ("import torch.distributed as dist", "comm.all_reduce(a)",
         "test.py:5:9: error: comm.all_reduce is not torch.distributed.all_reduce (it is not reached"
         " through an import of torch.distributed): a fused_allreduce block holds only"
         " torch.distributed.all_reduce(tensor, ...) calls"),
        ("import torch.distributed as dist", "all_reduce(a)",
         "test.py:5:9: error: all_reduce is not torch.distributed.all_reduce"),
        ("import mycomm as dist", "dist.all_reduce(a)",
         "test.py:5:9: error: dist.all_reduce is mycomm.all_reduce, not torch.distributed.all_reduce"),
        ("from torch.distributed import all_reduce\nfrom torch.distributed import broadcast as all_reduce", "all_reduce(a)",
         "test.py:6:9: error: all_reduce is torch.distributed.broadcast, not"),
    ],
)  # fmt: skip
def test_an_all_reduce_of_something_else_is_refused(imports, body, error):
    (got,) = expansion_errors(site(body, imports=imports))
    assert got.startswith(error)


def test_a_parameter_named_dist_is_not_torch_distributed():
    src = (
        "import torch.distributed as dist\nimport macrogen as mg\n"
        "def sync(a, dist):\n    with mg.fused_allreduce():\n        dist.all_reduce(a)\n"
    )
    (got,) = expansion_errors(src)
    assert got.startswith("test.py:5:9: error: dist.all_reduce is not torch.distributed.all_reduce")


def test_block_argument_is_accepted_and_has_no_effect():
    # the runtime packs with a foreach copy: there is no Triton block to size any more
    with_block = expand_source(site("dist.all_reduce(a)", "block=256"), path="test.py").code
    assert with_block == expand_source(site("dist.all_reduce(a)"), path="test.py").code


def test_the_statements_around_the_block_are_kept():
    src = (
        "import torch.distributed as dist\nimport macrogen as mg\n"
        "def sync(a):\n    a.mul_(2)  # before\n"
        "    with mg.fused_allreduce():\n        dist.all_reduce(a)\n    return a  # after\n"
    )
    out = strip_header(expand_source(src, path="test.py").code)
    assert out.endswith(
        "def sync(a):\n    a.mul_(2)  # before\n"
        "    # macrogen: fused_allreduce at test.py:5\n    _fused_allreduce_l5(a)\n    return a  # after\n"
    )


def test_module_level_block_has_its_helpers_defined_before_it():
    src = "import torch\nimport torch.distributed as dist\nimport macrogen as mg\nx = torch.ones(2)\nwith mg.fused_allreduce():\n    dist.all_reduce(x)\n"
    code = expand_source(src).code
    assert code.index("_fused_allreduce_l5 = ") < code.index("_fused_allreduce_l5(x)\n")


@pytest.mark.parametrize(
    "body, args, message",
    [
        ("dist.all_reduce(a)\ndist.all_reduce(b, op=dist.ReduceOp.MAX)", "",
         "test.py:6:31: error: every all_reduce in a fused_allreduce block must use the same op"),
        ("dist.all_reduce(a, group=g)\ndist.all_reduce(b)", "",
         "test.py:5:34: error: every all_reduce in a fused_allreduce block must use the same group"),
        ("dist.all_reduce(a, async_op=True)", "",
         "test.py:5:37: error: async_op=True is not supported in fused_allreduce"),
        ("dist.all_reduce(a, async_op=flag)", "",
         "test.py:5:37: error: async_op=True is not supported in fused_allreduce"),
        ("dist.all_reduce(a)\nx = 1", "",
         "test.py:6:9: error: a fused_allreduce block may hold only dist.all_reduce(tensor, ...) calls"),
        ("dist.all_gather(a, b)", "",
         "test.py:5:9: error: a fused_allreduce block may hold only dist.all_reduce(tensor, ...) calls"),
        ("dist.all_reduce()", "", "test.py:5:9: error: dist.all_reduce() needs the tensor to reduce"),
        ("dist.all_reduce(*a)", "", "test.py:5:25: error: dist.all_reduce() arguments can't be unpacked"),
        ("dist.all_reduce(a, b, c, d, e)", "", "test.py:5:37: error: dist.all_reduce() takes at most 4 positional"),
        ("dist.all_reduce(a, tensr=b)", "", "test.py:5:28: error: dist.all_reduce() has no argument 'tensr'"),
        ("dist.all_reduce(a, tensor=b)", "", "test.py:5:28: error: argument 'tensor' given twice"),
        ("dist.all_reduce(a)\ndist.all_reduce(a)", "", "test.py:6:25: error: a is all-reduced twice in this block"),
        ("dist.all_reduce(a)", "block=100", "test.py:4:35: error: block must be a power of two >= 16, not 100"),
        ("dist.all_reduce(a)", "block=8", "test.py:4:35: error: block must be a power of two >= 16, not 8"),
        ("dist.all_reduce(a)", "256", "test.py:4:29: error: this macro takes keyword arguments only (block)"),
        ("dist.all_reduce(a)", "block=g", "test.py:4:35: error: 'g' is not known at expansion time"),
    ],
)  # fmt: skip
def test_errors(body, args, message):
    (error,) = expansion_errors(site(body, args))
    assert error.startswith(message), error


def test_every_error_of_a_file_in_one_run():
    src = site("dist.all_reduce(a, async_op=True)") + (
        "    with mg.fused_allreduce(block=3):\n        dist.all_reduce(b)\n"
        "    with mg.fused_allreduce():\n        print(c)\n"
    )
    assert [e.split(": error:")[0] for e in expansion_errors(src)] == [
        "test.py:5:37",
        "test.py:6:35",
        "test.py:9:9",
    ]


def test_async_with_is_rejected():
    src = (
        "import torch.distributed as dist\nimport macrogen as mg\n"
        "async def sync(a):\n    async with mg.fused_allreduce():\n        dist.all_reduce(a)\n"
    )
    assert expansion_errors(src) == [
        "test.py:4:5: error: fused_allreduce() opens a plain with block, not async with"
    ]


def test_group_none_is_the_default_group():
    body = "dist.all_reduce(a, group=None)\ndist.all_reduce(b)"
    assert call_line(expand_source(site(body), path="test.py").code) == "_fused_allreduce_l4(a, b)"
