"""The macro protocol: every site form works for a macro the pass has never heard of.

The toy macros of ``tests/toy_macros`` are modules plus templates registered here
(nothing in ``macrogen/expand`` or ``macrogen/autotune`` names them): an assign
and a call form (the sharded optimizer's), a loop form (the resumable loop's), a
decorator stacked with ``data_parallel`` (pipeline's), and a with form with ``as``.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
import torch
import torch.nn as nn

from macrogen import macros
from macrogen.expand import ExpansionError, InternalError, codegen, expand_source
from macrogen.expand.protocol import Expanded
from macrogen.markers import MACRO_NAMES
from tests import toy_macros
from tests.helpers import assert_expands, expansion_errors, load_module, strip_header


@pytest.fixture
def toys():
    codegen.add_templates(toy_macros.TEMPLATES)
    for toy in toy_macros.ALL:
        macros.register(toy)
    yield
    for toy in toy_macros.ALL:
        macros.unregister(toy.NAME)


def test_the_registry_finds_every_macro_module():
    assert set(MACRO_NAMES) <= set(macros.names())
    for name in MACRO_NAMES:
        macro = macros.get(name)
        assert macro.NAME == name and macro.FORMS and macro.USAGE


def test_assign_form(toys):
    assert_expands(
        """\
        import torch
        import macrogen as mg

        def train(model):
            opt = mg.toy_shard(torch.optim.SGD(model.parameters(), lr=0.1), tag="zero")  # why
            return opt
        """,
        """\
        import torch
        import macrogen as mg

        # ---- macrogen: generated from test.py; edit the source, not this block ----


        # macrogen: toy_shard at test.py:5
        def _toy_shard_l5(optimizer):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError("toy_shard() wraps a torch optimizer")
            optimizer.toy_tag = 'zero'
            return optimizer


        def train(model):
            # macrogen: toy_shard at test.py:5
            opt = _toy_shard_l5(torch.optim.SGD(model.parameters(), lr=0.1))  # why
            opt.toy_name = 'opt'
            return opt
        """,
    )


def test_call_form_and_its_run(toys, tmp_path):
    code = expand_source(
        textwrap.dedent(
            """\
            import torch
            import macrogen as mg

            def make(p):
                return [mg.toy_shard(torch.optim.SGD([p], lr=0.1))]
            """
        ),
        path="test.py",
    ).code
    assert (
        "    # macrogen: toy_shard at test.py:5\n    return [_toy_shard_l5(torch.optim.SGD([p], lr=0.1))]\n"
        in code
    )
    module = load_module(code, "toy_call_form", tmp_path)
    (opt,) = module.make(nn.Parameter(torch.ones(2)))
    assert opt.toy_tag == "toy" and isinstance(opt, torch.optim.SGD)


def test_loop_form_and_its_run(toys, tmp_path):
    source = """\
        import macrogen as mg

        CHECKPOINTS = []

        def train(n):
            seen = []
            for step in mg.toy_resumable(range(n), every=2):
                seen.append(step)
            return seen
        """
    code = expand_source(textwrap.dedent(source), path="test.py").code
    assert (
        "    # macrogen: toy_resumable at test.py:7\n    for step in _toy_resumable_l7(range(n)):\n"
        in code
    )
    module = load_module(code, "toy_loop_form", tmp_path)
    assert module.train(5) == [0, 1, 2, 3, 4] and module.CHECKPOINTS == [1, 3]


def test_with_form_keeps_its_as_target(toys, tmp_path):
    source = """\
        import macrogen as mg

        SPANS = []

        def step(x):
            with mg.toy_span("fwd") as span:
                y = x + 1
            return y, span
        """
    code = expand_source(textwrap.dedent(source), path="test.py").code
    assert "from contextlib import contextmanager\n" in code
    assert "    with _toy_span_l6('fwd') as span:\n" in code
    module = load_module(code, "toy_with_form", tmp_path)
    assert module.step(1) == (2, {"name": "fwd", "entered": True}) and len(module.SPANS) == 1


STACKED = """\
    import torch.nn as nn
    import macrogen as mg

    @mg.{outer}
    @mg.{inner}
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x)
    """


def test_stacked_decorators_expand_bottom_up(toys):
    code = strip_header(
        expand_source(
            textwrap.dedent(STACKED.format(outer="data_parallel", inner="toy_pipeline(stages=3)")),
            path="test.py",
        ).code
    )
    # the pipeline (nearest the class) first; data_parallel decorates the class it leaves
    assert "# macrogen: toy_pipeline at test.py:5\nclass _Net_stage(nn.Module):" in code
    assert "# macrogen: data_parallel at test.py:4\n" in code
    assert ")\nclass Net(_Net_stage):\n    toy_stages = 3\n" in code
    assert (
        code.index("class _Net_stage(")
        < code.index("@data_parallel_class(")
        < code.index("class Net(")
    )


@pytest.mark.parametrize(
    "outer, inner",
    [("data_parallel", "toy_pipeline(stages=3)"), ("toy_pipeline(stages=3)", "data_parallel")],
)
def test_stacked_decorators_run_like_the_serial_class(toys, tmp_path, outer, inner):
    """World size 1: the same parameters, outputs and gradients as the serial module."""
    code = expand_source(textwrap.dedent(STACKED.format(outer=outer, inner=inner))).code
    module = load_module(code, f"toy_stacked_{outer[:4]}", tmp_path)
    torch.manual_seed(0)
    net = module.Net()
    torch.manual_seed(0)
    serial = nn.Linear(3, 2)
    assert net.toy_stages == 3
    assert [n for n, _ in net.named_parameters()] == ["fc.weight", "fc.bias"]
    x = torch.randn(4, 3)
    net(x).sum().backward()
    serial(x).sum().backward()
    torch.testing.assert_close(net.fc.weight.grad, serial.weight.grad)


def test_a_form_the_macro_does_not_declare_shows_its_usage(toys):
    errors = expansion_errors(
        """\
        import macrogen as mg
        x = mg.toy_resumable(range(3))
        @mg.toy_span("x")
        def f():
            pass
        """
    )
    assert errors == [
        "test.py:2:5: error: toy_resumable() can't be used here: for step in toy_resumable(range(n), every=2): ...",
        'test.py:3:2: error: toy_span() can\'t be used here: with toy_span("name") as span: ...',
    ]


def test_a_call_form_macro_stands_anywhere_an_expression_does(toys):
    code = expand_source("import macrogen as mg\nwith mg.toy_shard(o):\n    pass\n").code
    assert "# macrogen: toy_shard at <string>:2\nwith _toy_shard_l2(o):\n" in code


def test_stacking_needs_the_definition_to_survive(toys):
    class Gone:
        NAME = "toy_gone"
        FORMS = frozenset({"decorator"})
        USAGE = "@toy_gone"

        @staticmethod
        def expand(site, ctx):
            return Expanded([])

    macros.register(Gone)
    try:
        errors = expansion_errors(
            "import macrogen as mg\n@mg.toy_pipeline\n@mg.toy_gone\nclass A:\n    pass\n"
        )
    finally:
        macros.unregister("toy_gone")
    assert errors == [
        "test.py:2:2: error: toy_pipeline() can't be stacked here: the macro below it leaves"
        " no definition named A"
    ]


def test_a_macro_that_breaks_the_protocol_is_an_internal_error():
    class Untyped:
        NAME = "toy_untyped"
        FORMS = frozenset({"call"})
        USAGE = "toy_untyped()"

        @staticmethod
        def expand(site, ctx):
            return cst.Name("x")

    macros.register(Untyped)
    try:
        with pytest.raises(InternalError, match="not Expanded"):
            expand_source(f"import macrogen as mg\nx = mg.{Untyped.NAME}()\n")
    finally:
        macros.unregister(Untyped.NAME)


def test_unregistered_toys_are_unknown_again():
    with pytest.raises(ExpansionError, match="macrogen has no macro 'toy_shard'"):
        expand_source("import macrogen as mg\nx = mg.toy_shard(o)\n")
