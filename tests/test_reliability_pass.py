"""Issue 27, the pass: comprehension scopes, the ``macrogen.markers`` import forms, a
macro decorator applied twice, form feeds in indentation, a decorator called on a
class or a built model, and the worked example of docs/macros.md run as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from macrogen import macros
from macrogen.expand import ExpansionError, expand_source
from tests.helpers import expansion_errors, strip_header

ROOT = Path(__file__).parent.parent

FUSED = """\
def f(a, b):
    with {mg}.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
"""


def fused_file(header: str, mg: str = "mg") -> str:
    return header + "import torch.distributed as dist\n\n\n" + FUSED.format(mg=mg)


def expanded(source: str) -> str:
    result = expand_source(source, path="test.py")
    assert result.changed, "the file came out as it went in"
    compile(result.code, "<expanded>", "exec")
    return result.code


# -- 3. a comprehension's for names are its own -------------------------------------------
@pytest.mark.parametrize(
    "comprehension",
    ["[mg for mg in ()]", "(mg for mg in ())", "{mg: 1 for mg in ()}", "{mg for mg in ()}",
     "[x for x in () for mg in x]", "[[mg for mg in y] for y in ()]"],
)  # fmt: skip
@pytest.mark.parametrize("where", ["module", "function"])
def test_a_comprehension_variable_named_like_the_alias_shadows_nothing(comprehension, where):
    if where == "module":
        source = fused_file(f"import macrogen as mg\n\nG = {comprehension}\n")
    else:
        source = fused_file("import macrogen as mg\n").replace(
            "def f(a, b):\n", f"def f(a, b):\n    G = {comprehension}\n"
        )
    assert "_fused_allreduce_l" in expanded(source)


def test_inside_its_comprehension_the_name_is_the_comprehension_variable():
    source = fused_file("import macrogen as mg\n\nG = [mg.tlie for mg in ()]\n")
    # no "no macro 'tlie'": mg is not macrogen there
    assert "_fused_allreduce_l" in expanded(source)


def test_the_outermost_iterable_is_evaluated_outside_the_comprehension():
    errors = expansion_errors("""\
        import macrogen as mg

        G = [mg for mg in mg.tlie]
        """)  # fmt: skip
    assert errors == [
        "test.py:3:22: error: macrogen has no macro 'tlie'; did you mean 'tile'?"
        " (macros: " + ", ".join(macros.names()) + ")"
    ]


def test_a_walrus_in_a_comprehension_binds_outside_it():
    source = fused_file("import macrogen as mg\n\nG = [(mg := x) for x in ()]\n")
    assert expand_source(source, path="test.py").changed is False  # mg is rebound: not macrogen


# -- 4. the macrogen.markers import forms ---------------------------------------------------
@pytest.mark.parametrize(
    "header, mg",
    [
        ("import macrogen.markers as mm\n", "mm"),
        ("import macrogen.markers\n", "macrogen.markers"),
        ("import macrogen.markers\n", "macrogen"),  # import macrogen.markers binds macrogen
        ("from macrogen import markers\n", "markers"),
        ("from macrogen import markers as mk\n", "mk"),
        ("import macrogen as mg\n", "mg.markers"),
    ],
)
def test_the_markers_module_imports_expand_like_import_macrogen(header, mg):
    reference = expanded(fused_file("import macrogen as mg\n"))
    code = expanded(fused_file(header, mg))
    assert code.replace(header, "") == reference.replace("import macrogen as mg\n", "")


def test_from_macrogen_markers_import_a_macro():
    code = expanded(fused_file("from macrogen.markers import fused_allreduce\n", "").replace(
        "with .fused_allreduce", "with fused_allreduce"))  # fmt: skip
    assert "_fused_allreduce_l" in code


def test_an_unknown_attribute_of_the_markers_module_is_an_error():
    errors = expansion_errors("""\
        import macrogen.markers as mm

        X = mm.defne(3)
        Y = mm.TARGETS
        """)  # fmt: skip
    assert len(errors) == 1 and "macrogen has no macro 'defne'; did you mean 'define'?" in errors[0]


# -- 5. the same macro decorator twice ------------------------------------------------------
TWICE = {
    "tile": """\
        import macrogen as mg

        @mg.tile(i=4)
        @mg.tile(i=4)
        def k(out, x):
            for i in range(x.shape[0]):
                out[i] = x[i] * 2.0
        """,
    "data_parallel": """\
        import torch.nn as nn
        import macrogen as mg
        from macrogen import data_parallel

        @mg.data_parallel()
        @data_parallel
        class Net(nn.Module):
            pass
        """,
    "tensor_parallel": """\
        import torch.nn as nn
        import macrogen as mg

        @mg.tensor_parallel(plan={"fc": "colwise"})
        @mg.tensor_parallel(plan={"fc": "colwise"})
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
        """,
}


@pytest.mark.parametrize("macro", sorted(TWICE))
def test_a_macro_decorator_applied_twice_is_an_error_at_the_second(macro):
    source = textwrap.dedent(TWICE[macro])
    with pytest.raises(ExpansionError) as e:
        expand_source(source, path="test.py")
    (diagnostic,) = e.value.diagnostics
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("@"))
    name = "k" if macro == "tile" else lines[first + 1].split()[1].split("(")[0]
    report = diagnostic.render().splitlines()
    assert report[0] == (
        f"test.py:{first + 1}:2: error: {macro}() is applied twice to {name} (first at line"
        f" {first}): a macro decorator goes on a definition once; remove one"
    )
    assert report[1].strip() == lines[first].strip() and report[2].strip().startswith("^")


def test_two_different_macros_still_stack():
    code = expanded(textwrap.dedent("""\
        import torch.nn as nn
        import macrogen as mg

        @mg.data_parallel()
        @mg.tensor_parallel(plan={"fc": "colwise"})
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
        """))  # fmt: skip
    assert "data_parallel at test.py:4" in code and "tensor_parallel at test.py:5" in code


# -- 18. form feeds in indentation --------------------------------------------------------
FORM_FEEDS = {
    "first line of the block": FUSED.replace("        dist.all_reduce(a)", "\f        dist.all_reduce(a)"),
    "a later line of the block": FUSED.replace("        dist.all_reduce(b)", "\f        dist.all_reduce(b)"),
    "the with line": FUSED.replace("    with", "\f    with"),
    "inside the indentation": FUSED.replace("        dist.all_reduce(b)", "    \f        dist.all_reduce(b)"),
    "a line of its own": FUSED.replace("        dist.all_reduce(b)", "\f\n        dist.all_reduce(b)"),
    "in a nested block": "def f(a, b):\n    if a:\n\f        with {mg}.fused_allreduce():\n"
    "            dist.all_reduce(a)\n            dist.all_reduce(b)\n",
}  # fmt: skip


@pytest.mark.parametrize("where", sorted(FORM_FEEDS))
def test_a_form_feed_at_the_start_of_a_line_expands_like_without(where):
    header = "import macrogen as mg\nimport torch.distributed as dist\n\n\n"
    source = header + FORM_FEEDS[where].format(mg="mg")
    python_reads = re.compile(r"^[ \t\f]*\f", re.M)  # the column restarts after a form feed
    without = expanded(python_reads.sub("", source))
    code = expanded(source)
    assert "_fused_allreduce_l6(a, b)" in code or "_fused_allreduce_l7(a, b)" in code
    assert python_reads.sub("", code) == without


def test_a_form_feed_inside_a_string_is_kept():
    source = (
        "import macrogen as mg\nimport torch.distributed as dist\n\n\n"
        'def f(a, b):\n    s = """\n\f    x\n"""\n'
        "    with mg.fused_allreduce():\n\f        dist.all_reduce(a)\n        dist.all_reduce(b)\n"
        "    return s\n"
    )
    namespace: dict = {}
    exec(compile(expanded(source), "<expanded>", "exec"), namespace)
    assert 's = """\n\f    x\n"""' in expanded(source)


def test_a_form_feed_that_dedents_reads_as_python_reads_it():
    # "    \fx" is at column 0 for Python: the second call is a module statement
    source = fused_file("import macrogen as mg\n").replace(
        "        dist.all_reduce(b)", "        \fdist.all_reduce(b)"
    )
    code = expanded(source)
    assert "_fused_allreduce_l6(a)\n" in code and "\n        \fdist.all_reduce(b)\n" in code


# -- 21. a decorator macro called on a class or a built model -------------------------------
def test_a_decorator_called_on_a_class_is_one_error_that_shows_the_subclass_form():
    errors = expansion_errors("""\
        import macrogen as mg
        from torchvision.models import ResNet, resnet18

        Net = mg.data_parallel()(ResNet)
        model = mg.data_parallel()(resnet18(num_classes=10))
        other = mg.data_parallel(ResNet)
        """)  # fmt: skip
    assert errors == [
        "test.py:4:7: error: data_parallel() decorates a class definition; it is not called on"
        " a class: write `@mg.data_parallel()` above `class MyResNet(ResNet): ...` (a subclass),"
        ' or for a built model `model = mg.parallelize(model, dp="replicate")`',
        "test.py:5:9: error: data_parallel() decorates a class definition; it is not called on"
        ' a built model: write `model = mg.parallelize(model, dp="replicate")`, or put'
        " `@mg.data_parallel()` above a subclass of its class (`class MyNet(ResNet): ...`)",
        "test.py:6:9: error: data_parallel() decorates a class definition; it is not called on"
        " a class: write `@mg.data_parallel` above `class MyResNet(ResNet): ...` (a subclass),"
        ' or for a built model `model = mg.parallelize(model, dp="replicate")`',
    ]


def test_a_decorator_macro_without_built_shows_the_decorator_form():
    errors = expansion_errors("""\
        from macrogen import tile

        k = tile(i=4)(kernel)
        """)  # fmt: skip
    assert errors == [
        "test.py:3:5: error: tile() is a decorator; it is not called on an object: write"
        f" `@tile(i=4)` above the definition of kernel ({macros.get('tile').USAGE})"
    ]


# -- docs: the worked example of docs/macros.md is the toy macro, and expands as shown --------
def _worked_example() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "macros.md").read_text()
    section = text[text.index("## Worked example") :]
    return re.findall(r"^```(\w+)\n(.*?)^```$", section, flags=re.S | re.M)


def test_the_worked_example_shows_the_toy_macro_files_as_they_are():
    blocks = _worked_example()
    module, template = blocks[0], blocks[1]
    assert module == ("python", (ROOT / "tests/toy_macros/toy_resumable.py").read_text())
    assert template == (
        "jinja",
        (ROOT / "tests/toy_macros/templates/toy_resumable.py.j2").read_text(),
    )
    for path in re.findall(r"`((?:tests|macrogen|templates)/[\w/.]+\.(?:py|j2))`", _section()):
        assert (ROOT / path).exists(), f"docs/macros.md names {path}, which does not exist"


def _section() -> str:
    text = (ROOT / "docs" / "macros.md").read_text()
    return text[text.index("## Worked example") :]


def test_the_worked_example_expands_as_shown(tmp_path):
    (_, register), (_, before), (_, after) = _worked_example()[2:5]
    namespace: dict = {}
    exec(register, namespace)  # the doc's registration, as written
    try:
        code = expand_source(before, path="train.py").code
        assert strip_header(code) == after
        from tests.helpers import load_module

        module = load_module(code, "worked_example", tmp_path)
        assert module.train(5) == [0, 1, 2, 3, 4] and module.CHECKPOINTS == [1, 3]
    finally:
        macros.unregister(namespace["toy_resumable"].NAME)


def test_the_tensor_parallel_doc_names_only_functions_that_exist():
    from macrogen.runtime import groups

    text = (ROOT / "docs" / "tensor_parallel.md").read_text()
    for name in re.findall(r"groups\.(\w+)", text):
        assert hasattr(groups, name), f"docs/tensor_parallel.md cites groups.{name}"


def test_a_form_feed_piece_reads_and_prints_as_libcst_is_given_it():
    """The pieces of a file with form feeds in indentation: libcst gets them without those
    (``Pieces.readable``); each is one statement, and ``source_text`` is what it prints."""
    import ast

    from macrogen.expand.fast.statements import Pieces, _OffsetExtents, code_and_positions

    source = "import macrogen as mg\n\x0c\n\ndef f(a, b):\n  if a:\n\x0c    x = 1\n\x0c  y = 2\n"
    pieces = Pieces(source, ast.parse(source))
    assert "".join(pieces.text(i) for i in range(pieces.count)) == source
    for i in range(pieces.count):
        assert pieces.module(i).code == pieces.readable(i)
        _, _, sure = code_and_positions(pieces._parsed[i])
        assert isinstance(sure, _OffsetExtents)
        assert pieces.source_text(i, pieces.node(i)) == sure.text(pieces.node(i))
    assert pieces.readable(1) == "\x0c\n\ndef f(a, b):\n  if a:\n    x = 1\n  y = 2\n"
