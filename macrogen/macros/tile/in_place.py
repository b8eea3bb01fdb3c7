"""The torch path's in-place rewrite: ``t.sub_(m) if flag else t - m`` where ``t`` is a dead temporary.

``in_place`` asks a few read-only questions of each step's value (its outermost
form, the names it reads). The steps hold text (``code.Parsed``); ``ast``
answers in a tenth of libcst's parse time, and the rewritten text is built from
the value's own text. Where the text is not in the form ``code.py`` writes
(``t - m``, ``torch.exp(t)``: one space around the operator, no parentheses
around ``t``), libcst reads it, as before, so the output is libcst's either way
(``tests/test_pass_shortcuts.py`` compares the two readers on the goldens).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import libcst as cst

from macrogen.macro import Visitor, walk
from macrogen.macros.tile.code import parse
from macrogen.macros.tile.steps import Assign, Step, _live

READ_WITH_AST = True  # False: libcst reads every step (the tests compare the two)


@dataclass(frozen=True)
class Meta:
    """A tensor local of the torch path: the loops it varies along (its shape on the nest's
    axes), and whether it is floating-point when the value tensors have the default dtype."""

    dims: frozenset[str]
    floating: bool


@dataclass(frozen=True)
class Read:
    """What ``in_place`` needs to know of a step's value."""

    kind: str  # "in place" (t - m, torch.exp(t): t a name), "name", "conditional" or "other"
    names: frozenset[str]  # the names it reads (not attribute or keyword names)
    a: str = ""  # the name: the temporary (in place) or the value itself (name)
    a_code: str = ""  # (in place) the temporary as printed
    fn: str = ""  # (in place) the in-place method: sub_, exp_...
    other: str | None = None  # (in place) the other operand's code, None for a call
    other_names: frozenset[str] = frozenset()
    code: str = ""  # the value as printed


_IN_PLACE = {cst.Add: "add_", cst.Subtract: "sub_", cst.Multiply: "mul_", cst.Divide: "div_"}
_AST_IN_PLACE = {
    ast.Add: ("+", "add_"),
    ast.Sub: ("-", "sub_"),
    ast.Mult: ("*", "mul_"),
    ast.Div: ("/", "div_"),
}
_IN_PLACE_CALLS = ("exp", "log", "sqrt", "tanh", "sigmoid", "abs")


def in_place(steps: list[Step], meta: dict[str, Meta], torch: str, flag: str) -> list[Step]:
    """Reuse a temporary's storage for the next operation on it, as ``t.sub_(m)`` for
    ``t - m``, where nothing reads the temporary afterwards: fewer tensors allocated and
    written (eager torch allocates each). Only for a floating tensor that a torch operation
    made (no view of an argument) whose shape is the result's, and only when ``flag`` holds
    at run time (every value tensor has the default dtype, so the result's dtype is the
    temporary's): ``t.sub_(m) if flag else t - m``."""
    out = list(steps)
    groups: dict[str, frozenset[int]] = {}  # local -> the storages it may share
    made: set[int] = set()  # storages a torch operation made for a local
    for t, step in enumerate(out):
        if not isinstance(step, Assign):
            continue
        value = read(step.value.text, torch)
        if _may_overwrite(value, meta, groups, made, torch, out[t + 1 :], step.target):
            args = value.other if value.other is not None else ""
            fast = f"{value.a_code}.{value.fn}({args}) if {flag} else {value.code}"
            out[t] = Assign(step.target, parse(fast))  # (libcst prints the IfExp so)
            groups[step.target] = groups[value.a]
            continue
        if value.kind == "name":
            groups[step.target] = groups.get(value.a, frozenset())
        elif step.target in meta and value.kind != "conditional":  # an operation's result
            groups[step.target] = frozenset({t})
            made.add(t)
        else:  # a view or anything else: it may share what it reads
            reads = value.names - {torch}
            groups[step.target] = frozenset({t}).union(*(groups.get(n, ()) for n in reads))
    return out


def _may_overwrite(
    value: Read,
    meta: dict[str, Meta],
    groups: dict[str, frozenset[int]],
    made: set[int],
    torch: str,
    later: list[Step],
    target: str,
) -> bool:
    """Whether ``value`` (in place form) may overwrite its temporary."""
    if value.kind != "in place" or value.a not in meta or not meta[value.a].floating:
        return False
    a = value.a
    group = groups.get(a, frozenset())
    if len(group) != 1 or not group <= made:
        return False
    sharing_names = [n for n, g in groups.items() if g & group and n != target]
    if any(_live(n, later) for n in sharing_names):
        return False
    for n in value.other_names - {torch}:
        if n in meta:
            if not meta[n].dims <= meta[a].dims or groups.get(n, frozenset()) & group:
                return False
        elif n in groups:  # a view of an argument: its shape is unknown here
            return False
    return True


def read(text: str, torch: str) -> Read:
    """The step value's form, by ast where the text is as code.py writes it, else by libcst."""
    found = read_ast(text, torch) if READ_WITH_AST else None
    return found if found is not None else read_cst(text, torch)


def read_cst(text: str, torch: str) -> Read:
    """libcst's reading of ``text`` (the reference)."""
    value = cst.parse_expression(text)
    code = _code(value)
    names = frozenset(_names(value))
    if isinstance(value, cst.BinaryOperation) and type(value.operator) in _IN_PLACE:
        a, other, fn = value.left, value.right, _IN_PLACE[type(value.operator)]
    elif (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and isinstance(value.func.value, cst.Name)
        and value.func.value.value == torch
        and value.func.attr.value in _IN_PLACE_CALLS
        and len(value.args) == 1
    ):
        a, other, fn = value.args[0].value, None, f"{value.func.attr.value}_"
    else:
        a = None
    if a is not None and isinstance(a, cst.Name):
        other_names = frozenset(_names(other)) if other is not None else frozenset()
        other_code = _code(cst.Arg(other)) if other is not None else None
        return Read("in place", names, a.value, _code(a), fn, other_code, other_names, code)
    if isinstance(value, cst.Name):
        return Read("name", names, value.value, code=code)
    return Read("conditional" if isinstance(value, cst.IfExp) else "other", names, code=code)


def read_ast(text: str, torch: str) -> Read | None:
    """ast's reading of ``text``; None where libcst must read it (the text is not as
    code.py writes it, so the pieces libcst would print can't be cut from it)."""
    if not text.isascii() or "\n" in text or "\\" in text:
        return None  # (ast's columns count bytes; lines would need counting)
    try:
        value = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    names = _ast_names(value)
    if (
        isinstance(value, ast.BinOp)
        and type(value.op) in _AST_IN_PLACE
        and isinstance(value.left, ast.Name)
    ):
        op, fn = _AST_IN_PLACE[type(value.op)]
        prefix = f"{value.left.id} {op} "
        other = text[len(prefix) :]
        whole = value.col_offset == 0 and value.end_col_offset == len(text)
        if not (whole and text.startswith(prefix) and other[:1].strip()):
            return None
        return Read(
            "in place",
            names,
            value.left.id,
            value.left.id,
            fn,
            other,
            _ast_names(value.right),
            text,
        )
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == torch
        and value.func.attr in _IN_PLACE_CALLS
        and len(value.args) + len(value.keywords) == 1
    ):
        arg = value.args[0] if value.args else None
        if arg is None or isinstance(arg, ast.Starred):
            return None  # libcst reads the value of a keyword or starred argument
        if isinstance(arg, ast.Name):
            if text != f"{torch}.{value.func.attr}({arg.id})":
                return None
            return Read(
                "in place", names, arg.id, arg.id, f"{value.func.attr}_", None, frozenset(), text
            )
    if isinstance(value, ast.Name):
        return Read("name", names, value.id, code=text)
    return Read("conditional" if isinstance(value, ast.IfExp) else "other", names, code=text)


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def _ast_names(node: ast.AST) -> frozenset[str]:
    """The words libcst reads as ``Name`` nodes in ``_names``: variables, lambda parameters
    and ``True``/``False``/``None``."""
    found: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.arg):
            found.add(n.arg)
        elif isinstance(n, ast.Constant) and (n.value is None or isinstance(n.value, bool)):
            found.add(repr(n.value))
    return frozenset(found)


def _names(node: cst.CSTNode) -> set[str]:
    """The names an expression reads (not attribute names: ``torch`` of ``torch.exp``)."""
    found: set[str] = set()

    class _Visitor(Visitor):  # (a read-only walk: libcst's visit rebuilds every node)
        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            walk(n.value, self)
            return False

        def visit_Arg(self, n: cst.Arg) -> bool:  # keyword names are not reads
            walk(n.value, self)
            return False

    walk(node, _Visitor())
    return found
