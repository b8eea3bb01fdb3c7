"""The pass's shortcuts agree with the slow, obvious way (issue 15's speed work).

- Generated classes kept as text (``expand/fast/rendered.py``) print what libcst's parse of
  that text prints: the same output with the plain-text path on and off, on every
  golden case and on files where the text must go through libcst (tabs, CRLF, a
  nested class, stacked decorators, no final newline).
- ``@tile``'s generated expressions are text; the names ``drop_dead_stores`` reads
  from them are libcst's ``Name`` nodes of their parse.
- ``walk.nodes`` meets the nodes in the order libcst's ``visit`` does.
- ``Context.source_text`` gives a definition's words as printing it would.
"""

from __future__ import annotations

import libcst as cst
import pytest

from macrogen.expand import ExpansionError, codegen, expand_source, fast
from macrogen.expand.walk import find, leaf, nodes
from macrogen.macros.tile.code import Parsed
from tests.test_golden import CASES, GOLDEN, expand_case

MODEL = """\
import torch.nn as nn

import macrogen as mg


@mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"})
class MLP(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(self.fc(x))


@mg.data_parallel(bucket_mb=1)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(x).sum()
"""

STACKED = (
    MODEL.replace(
        "class Net(nn.Module):",
        "@mg.tensor_parallel(plan={'fc': 'rowwise'})\nclass Net(nn.Module):",
    )
    .replace("        self.mlp = MLP()", "        self.fc = nn.Linear(8, 8)")
    .replace("self.mlp(x)", "self.fc(x)")
)

NESTED = (
    MODEL
    + """

def build():
    @mg.data_parallel(bucket_mb=4)
    class Inner(nn.Module):
        def forward(self, x):
            return x

    return Inner()
"""
)

TILED = """\
import macrogen as mg


class Ops:
    @staticmethod
    @mg.tile(i=4)
    def add(out, x, y):
        \"\"\"out = x + y\"\"\"
        for i in range(x.shape[0]):
            out[i] = x[i] + y[i]


@mg.tile(i=4)
def scale(out, x):
    for i in range(x.shape[0]):
        out[i] = 2.0 * x[i]
"""

SOURCES = {
    "plain": MODEL,
    "tabs": MODEL.replace("    ", "\t"),
    "two spaces": MODEL.replace("    ", "  "),
    "crlf": MODEL.replace("\n", "\r\n"),
    "no final newline": MODEL.rstrip("\n"),
    "stacked": STACKED,
    "nested": NESTED,
    "tile": TILED,
    "tile, two spaces": TILED.replace("    ", "  "),
    "tile, tabs": TILED.replace("    ", "\t"),
    "tile, crlf": TILED.replace("\n", "\r\n"),
}


def _both(expand: object) -> tuple[object, object]:
    outputs = []
    for plain in (True, False):
        saved, fast.ENABLED = fast.ENABLED, plain
        try:
            outputs.append(expand())  # type: ignore[operator]
        finally:
            fast.ENABLED = saved
    return outputs[0], outputs[1]


@pytest.mark.parametrize(
    "name", [c for c in CASES if "parallel" in c or "pipeline" in c or c.startswith("tile")]
)
def test_golden_cases_print_the_same(name: str) -> None:
    plain, parsed = _both(lambda: expand_case(GOLDEN / name))
    assert plain == parsed


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_files_print_the_same(name: str) -> None:
    def expand() -> str:
        try:
            return expand_source(SOURCES[name], path="model.py").code
        except ExpansionError as e:  # the same errors either way
            return e.report()

    plain, parsed = _both(expand)
    assert plain == parsed
    assert "@tensor_parallel_class('MLP', None, {" in str(plain) or "def scale(out, x):" in str(
        plain
    )


def test_tile_expression_names_are_libcst_names(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[codegen.Expression] = []
    init = codegen.Expression.__init__

    def record(self: codegen.Expression, text: str) -> None:
        init(self, text)
        made.append(self)

    monkeypatch.setattr(codegen.Expression, "__init__", record)
    for name in CASES:
        if name.startswith("tile"):
            expand_case(GOLDEN / name)
    made.append(Parsed('x.to(b"r" + rb"\\"") if not y else float("-inf") + 1e5 + 0x1f'))
    texts = {e.text for e in made if isinstance(e, Parsed)}
    assert len(texts) > 300
    for text in texts:
        expected = {n.value for n in find(cst.parse_expression(text), cst.Name)}
        assert Parsed(text).names == expected, text


class _Order(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.seen.append(node)
        return True


@pytest.mark.parametrize(
    "name", [c for c in CASES if c.startswith(("tile", "tensor_parallel"))][:12]
)
def test_walk_meets_nodes_in_libcst_order(name: str) -> None:
    module = cst.parse_module((GOLDEN / name / "input.py").read_text(encoding="utf-8"))
    order = _Order()
    module.visit(order)
    # libcst's visit rebuilds the nodes: compare the kinds met, leaves left out as walk does
    walked = [type(n).__name__ for n in nodes(module)]
    visited = [type(n).__name__ for n in order.seen]
    assert walked == [k for k, n in zip(visited, order.seen) if not leaf(type(n))]


def test_source_text_has_the_words_of_the_printed_node(monkeypatch: pytest.MonkeyPatch) -> None:
    import macrogen.macros.tile as tile
    from macrogen.macros.tile import analysis

    compared = []

    def words(fn: cst.FunctionDef, text: str | None = None) -> set[str]:
        assert text is not None
        assert analysis.words(fn, text) == analysis.words(fn)
        compared.append(fn)
        return analysis.words(fn, text)

    monkeypatch.setattr(tile, "words", words)
    for name in CASES:
        if name.startswith("tile"):
            expand_case(GOLDEN / name)
    source = "class K:\n  # a comment: comment_word\n  @mg.tile(i=4)\n  def f(out, x):  # tail_word\n    for i in range(x.shape[0]):\n      out[i] = x[i]\n"
    expand_source("import macrogen as mg\n\n\n" + source, path="k.py")
    assert len(compared) > 20


@pytest.mark.parametrize(
    ("text", "may"),
    [
        ("super().__init__()", False),
        ("super ().__init__()\nsuper()", False),
        ("super(Net, self).__init__()", True),
        ("super( ).__init__()", True),  # unsure: walk
        ("super \\\n(Net, self)", True),
        ("(super)(Net, self)", True),
        ("x = superb(1)", False),
        (None, True),
    ],
)
def test_super_prefilter_only_rules_out_plain_super_calls(text: str | None, may: bool) -> None:
    from macrogen.expand.sites import may_call_with_arguments

    assert may_call_with_arguments(text, "super") is may


# -- @tile's in-place rewrite reads its steps with ast where their text allows -----
_IN_PLACE_TEXTS = [
    "t - (m + 1)",
    "(t) - m",
    "t -  m",
    "t * m if c else t",
    "torch.exp(t)",
    "torch.exp( t )",
    "torch.exp(input=t)",
    "torch.exp(*t)",
    "torch.exp(x - m)",
    "torch.log(t) / 2",
    "t / -m",
    "lambda q: q + t",
    "f(k=v, w=True) + None",
    "(t - m)",
    "t - m.sum(-1, keepdim=True)",
    "t + m[:, None] - u",
]


def _in_place_texts(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    """(step text, torch's local name) of every step in_place reads in the tile goldens."""
    from macrogen.macros.tile import in_place

    seen: set[tuple[str, str]] = set()
    read = in_place.read

    def record(text: str, torch: str) -> in_place.Read:
        seen.add((text, torch))
        return read(text, torch)

    monkeypatch.setattr(in_place, "read", record)
    for name in CASES:
        if name.startswith("tile"):
            expand_case(GOLDEN / name)
    monkeypatch.undo()
    return seen | {(text, "torch") for text in _IN_PLACE_TEXTS}


def test_tile_in_place_reads_steps_as_libcst(monkeypatch: pytest.MonkeyPatch) -> None:
    from macrogen.macros.tile.in_place import read_ast, read_cst

    texts = _in_place_texts(monkeypatch)
    by_ast = {(text, torch): read_ast(text, torch) for text, torch in texts}
    assert len(texts) > 50 and sum(r is not None for r in by_ast.values()) > 40
    assert sum(r is not None and r.kind == "in place" for r in by_ast.values()) > 5
    for (text, torch), read in by_ast.items():
        assert read is None or read == read_cst(text, torch), text


def test_tile_in_place_prints_as_libcst(monkeypatch: pytest.MonkeyPatch) -> None:
    """in_place's text for ``t.sub_(m) if flag else t - m`` is libcst's print of that IfExp."""
    from macrogen.macros.tile.in_place import read_cst

    texts = _in_place_texts(monkeypatch)
    checked = 0
    for text, torch in texts:
        value = cst.parse_expression(text)
        read = read_cst(text, torch)
        if read.kind != "in place":
            continue
        if isinstance(value, cst.BinaryOperation):
            a, args = value.left, [cst.Arg(value.right)]
        else:
            assert isinstance(value, cst.Call)
            a, args = value.args[0].value, []
        call = cst.Call(cst.Attribute(a, cst.Name(read.fn)), args)
        want = cst.Module([]).code_for_node(cst.IfExp(cst.Name("flag"), call, value))
        other = read.other if read.other is not None else ""
        assert f"{read.a_code}.{read.fn}({other}) if flag else {read.code}" == want
        checked += 1
    assert checked > 5


@pytest.mark.parametrize("name", [c for c in CASES if c.startswith("tile") and "err" not in c])
def test_tile_goldens_the_same_read_by_libcst(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from macrogen.macros.tile import in_place

    by_ast = expand_case(GOLDEN / name)
    monkeypatch.setattr(in_place, "READ_WITH_AST", False)
    assert expand_case(GOLDEN / name) == by_ast


# -- blocks kept as parsed print as their source lines (expand/fast/printing.py) ---------------
KEPT_BLOCKS = {
    "if else": "import macrogen as mg\nA = mg.define(1)\nif mg.target('cuda'):\n    y = 1\nelse:\n    y = 2\n",
    "if": "import macrogen as mg\n\nif mg.target('cuda'):  # why\n\n    # first\n    y = 1\n\n        # deeper\n# last\n",
    "for": "import macrogen as mg\n\nfor i in range(3):\n    if mg.target('cuda'):\n        y = 1\n",
    "while": "import macrogen as mg\n\nwhile mg.target('cuda'):\n    y = 1\n    # in\n",
    "try": "import macrogen as mg\n\ntry:\n    x = 1\nexcept ValueError:\n    if mg.target('cuda'):\n        x = 2\n",
    "trailing comments": MODEL.replace(
        "        return self.proj(self.fc(x))\n",
        "        return self.proj(self.fc(x))\n        # inside forward\n    # inside the class\n# after it\n",
    ),
    "last, no final newline": MODEL + "\n    # the class's\n  # odd\n# the module's",
    "header comment": MODEL.replace(
        "class Net(nn.Module):", "class Net(nn.Module):  # the net:\n    # first line"
    ),
    "one-line class": MODEL + "\n\n@mg.data_parallel(bucket_mb=2)\nclass One(nn.Module): pass\n",
    "decorated method first": MODEL.replace(
        "    def __init__(self, d: int = 8):",
        "    # c\n\n    @staticmethod\n    # d\n    def g():\n        pass\n\n    def __init__(self, d: int = 8):",
    ),
}


# -- the oracle: the goldens and the odd files expand the same without the fast paths
# (expand/fast/: libcst's parse validated, its visit, its printing of every statement,
# every template checked)
@pytest.mark.parametrize("name", CASES)
def test_goldens_the_same_without_the_fast_paths(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_way = expand_case(GOLDEN / name)
    monkeypatch.setattr(fast, "ENABLED", False)
    assert expand_case(GOLDEN / name) == fast_way


@pytest.mark.parametrize("name", sorted({**SOURCES, **KEPT_BLOCKS}))
def test_files_the_same_without_the_fast_paths(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def expand() -> str:
        try:
            return expand_source({**SOURCES, **KEPT_BLOCKS}[name], path="model.py").code
        except ExpansionError as e:
            return e.report()

    fast_way = expand()
    monkeypatch.setattr(fast, "ENABLED", False)
    assert expand() == fast_way


# -- literal values without ast.literal_eval (expand/literals.py) --------------------------
@pytest.mark.parametrize(
    "text",
    [
        "1",
        "0x1F",
        "0o17",
        "0b101",
        "1_000",
        "00",
        "1e5",
        "1.",
        ".5",
        "1_0.5e-3",
        "3j",
        "'abc'",
        '"a b"',
        "'''x\ny'''",
        'r"raw"',
        'u"u"',
        "b'x'",
        "rb'x'",
        "BR'x'",
        "'a\\nb'",
        '""',
        "''''''",
        "'é'",
        '"""a"b"""',
        "'\"'",
        "'a' 'b'",
        "9" * 5000,
    ],
)
def test_literal_values_are_libcsts(text: str) -> None:
    from macrogen.expand.literals import evaluated

    node = cst.parse_expression(text)
    try:
        expected: object = node.evaluated_value  # type: ignore[attr-defined]
    except Exception as e:  # (too many digits for int(): the same error)
        with pytest.raises(type(e)):
            evaluated(node)
    else:
        assert evaluated(node) == expected and type(evaluated(node)) is type(expected)


def test_a_template_that_renders_invalid_python_is_named_with_its_line(tmp_path: object) -> None:
    from pathlib import Path

    from macrogen.expand.errors import InternalError

    folder = Path(str(tmp_path))
    (folder / "bad_check.py.j2").write_text("x = {{ v|py }}\ndef f(:\n    pass\n")
    (folder / "twice_check.py.j2").write_text("def f(a, a):\n    pass\n")
    saved = list(codegen._extra_dirs)
    codegen.add_templates(folder)
    try:
        for render in (codegen.render, codegen.render_statements):
            with pytest.raises(
                InternalError,
                match=r"template bad_check.py.j2 rendered invalid Python \(line 2\): ",
            ):
                render("bad_check.py.j2", v=1)
        with pytest.raises(InternalError, match="duplicate argument 'a'"):  # as compile() says
            codegen.render("twice_check.py.j2")
    finally:
        codegen._extra_dirs[:] = saved
        codegen.environment.cache_clear()


# -- pieces parsed without libcst re-validating its parser's nodes (expand/fast/parsing.py) ------
@pytest.mark.parametrize("name", [c for c in CASES if "error" not in c][:40])
def test_pieces_parse_to_libcsts_tree(name: str) -> None:
    from macrogen.expand.fast.parsing import parse_module

    text = (GOLDEN / name / "input.py").read_text(encoding="utf-8", errors="replace")
    assert parse_module(text).deep_equals(cst.parse_module(text))


def test_nodes_are_validated_outside_the_parse() -> None:
    import threading

    from macrogen.expand.fast import parsing

    validate = cst.CSTNode.__post_init__
    parsing.parse_module("x = (1)\n")
    assert cst.CSTNode.__post_init__ is validate
    with pytest.raises(cst.CSTValidationError):
        cst.Name("x", lpar=[cst.LeftParen()])  # unbalanced: libcst refuses it

    # another thread's nodes, built while a parse runs, are validated
    errors: list[BaseException] = []
    started, go = threading.Event(), threading.Event()

    def build() -> None:
        started.set()
        go.wait(5)
        try:
            cst.Name("x", lpar=[cst.LeftParen()])
        except cst.CSTValidationError as e:
            errors.append(e)

    thread = threading.Thread(target=build)
    thread.start()
    started.wait(5)
    original = cst.parse_module

    def parse_then_let_it_build(text: str) -> cst.Module:
        go.set()
        thread.join(5)
        return original(text)

    parsing.cst.parse_module = parse_then_let_it_build  # type: ignore[assignment]
    try:
        parsing.parse_module("y = 2\n")
    finally:
        parsing.cst.parse_module = original  # type: ignore[assignment]
    assert len(errors) == 1


# -- codegen.text: the fast path for text with nothing to escape ---------------------------
@pytest.mark.parametrize(
    "value",
    [
        "",
        "dense.py:20",
        "a b/c.py",
        "é ü",
        'q"',
        "back\\slash",
        "new\nline",
        "\r",
        "\x00",
        "\u2028",
        "\udcff",
        3,
    ],
)
def test_text_is_the_character_loop(value: object) -> None:
    def escaped(ch: str) -> str:
        if ch in '\\"':
            return "\\" + ch
        return ch if ch.isprintable() else repr(ch)[1:-1]

    assert codegen.text(value) == "".join(map(escaped, str(value)))


# -- _lines_with: the names' literals searched, their start checked as \b checks it --------
@pytest.mark.parametrize(
    "names",
    [
        {"mg"},
        {"mg", "tile", "define"},
        {"a", "ba"},
        {"é"},
        {"x\u0301"},
    ],  # (the last ends in a mark)
)
def test_lines_with_is_the_word_boundary_search(names: set[str]) -> None:
    import ast
    import re

    from macrogen.expand import Options
    from macrogen.expand.expansion import _NON_ASCII_WORD, _FileExpansion, nfkc
    from macrogen.expand.fast.statements import Pieces

    source = (
        "import macrogen as mg\nx = mg.define(1)  # mg\nomg = 1\nmg_x = 2\nmgx = 3\n"
        "y = _mg + mg\nba = a + ba\naba = 1\né = 1\nxé = 2\nx\u0301 = 3\nx\u0301y = 4\n"
        "s = 'tile define'\n"
    )
    expansion = _FileExpansion(source, Options(path="t.py"))
    expansion.statements = Pieces(source, ast.parse(source))
    pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(names))) + r")\b")
    want = {source.count("\n", 0, m.start()) + 1 for m in pattern.finditer(source)}
    for m in _NON_ASCII_WORD.finditer(source):  # (as before: identifiers read NFKC-normalized)
        if nfkc(m.group()) in names:
            want.add(source.count("\n", 0, m.start()) + 1)
    assert expansion._lines_with(names) == want
