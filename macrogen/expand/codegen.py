"""The one Jinja2 environment: render a template, then prove it is Python.

Values reach generated code only through four filters: ``ident`` (a validated
identifier), ``py`` (``repr`` of a number, string, bool, None or a tuple/list
of them: user text inside string literals), ``text`` (user text such as a file
path inside a comment or docstring, see ``text``) and ``code`` (a libcst
expression node a macro built, such as a kernel expression rebuilt from a
validated IR; or an ``Expression``, such text checked by ``ast``). Nothing from a
user's file is pasted in as raw text.
"""

from __future__ import annotations

import ast
import functools
import keyword
import math
import symtable
from pathlib import Path
from typing import Any

import jinja2
import libcst as cst

from macrogen.expand.errors import InternalError
from macrogen.expand.fast.rendered import Rendered, rendered
from macrogen.expand.fast.shapes import Checked


def templates_dir() -> Path:
    package = Path(__file__).resolve().parent.parent  # macrogen/
    installed = package / "templates"  # inside a wheel
    return installed if installed.is_dir() else package.parent / "templates"  # in the repository


def ident(value: Any) -> str:
    if type(value) is str and value in _IDENTIFIERS:
        return value  # (checked before: templates ask for the same names again and again)
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
        raise InternalError(f"not an identifier: {value!r}")
    if len(_IDENTIFIERS) < 100_000:
        _IDENTIFIERS.add(value)
    return value


_IDENTIFIERS: set[str] = set()


def text(value: Any) -> str:
    """User text (a path, a name) made safe for a comment or a docstring.

    One line, whatever the text holds: every character ``str.isprintable`` refuses
    (newline, carriage return, NUL, U+2028, lone surrogates of undecodable file
    names), and the backslash and double quote, are written as Python escapes, so
    a comment can't end early and a docstring reads back the exact text (a
    newline in a path is written as backslash-n).
    """
    line = str(value)
    if line.isprintable() and "\\" not in line and '"' not in line:
        return line  # (what the loop below gives: every character as it is)
    out = []
    for ch in line:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # \n, \r, \x00, \u2028, \udcff
    return "".join(out)


def py(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InternalError(f"not a finite float: {value!r}")
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = ", ".join(py(v) for v in value)
        if isinstance(value, list):
            return f"[{items}]"
        return f"({items},)" if len(value) == 1 else f"({items})"
    if isinstance(value, (set, frozenset)):  # sorted: the output must not depend on the hash seed
        texts = sorted((py(v) for v in value), key=lambda text: (len(text), text))
        return "{" + ", ".join(texts) + "}" if texts else "set()"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in value.items()) + "}"
    raise InternalError(f"can't render {type(value).__name__} {value!r} as a Python literal")


class Expression:
    """Expression code a macro generated from validated pieces and checked to be one
    Python expression (``macros/tile/code.py``): ``code`` writes its text as is."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Expression({self.text!r})"


def code(value: Any) -> str:
    if isinstance(value, Expression):
        return value.text
    if not isinstance(value, cst.BaseExpression):
        raise InternalError(f"not a libcst expression: {value!r}")
    return cst.Module([]).code_for_node(value)


_extra_dirs: list[Path] = []  # template folders of macros that live outside macrogen


def add_templates(directory: Path) -> None:
    """Also look for templates in ``directory`` (a macro shipped elsewhere, e.g. a test's)."""
    if directory not in _extra_dirs:
        _extra_dirs.append(directory)
        environment.cache_clear()


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(templates_dir()), *map(str, _extra_dirs)]),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        auto_reload=False,  # each template compiled once per process, its file not checked again
    )
    env.filters["ident"] = ident
    env.filters["py"] = py
    env.filters["text"] = text
    env.filters["code"] = code
    return env


def render(template: str, **params: Any) -> str:
    """Render ``templates/<template>`` and check that the result is Python (or that it
    has the shape of a text that passed, where that proves it: macrogen/expand/fast/shapes.py)."""
    text = _text(template, params)
    if CHECKED.find(text) is not None:
        return text  # the shape of a checked text (macrogen/expand/fast/shapes.py)
    try:
        # The check: Python's parser and symbol table, as compile() runs them, without
        # building ast's objects (a third cheaper than ast.parse; stricter: it also
        # refuses a duplicate parameter name, as compile does)
        symtable.symtable(text, "<template>", "exec")
    except SyntaxError as e:
        raise _invalid(template, e) from e
    CHECKED.add(text, None)
    return text


# Texts that passed the check, by shape; with the Rendered node built for a definition
CHECKED: Checked[None] = Checked()
CHECKED_NODES: Checked[Rendered] = Checked()


def clear_checked() -> None:
    """Forget the checked shapes (the bench times a first expansion in a process)."""
    CHECKED.clear()
    CHECKED_NODES.clear()


def _text(template: str, params: dict[str, Any]) -> str:
    try:
        return environment().get_template(template).render(**params)
    except jinja2.TemplateError as e:
        raise InternalError(f"template {template} failed to render: {e}") from e


def _invalid(template: str, e: SyntaxError) -> InternalError:
    return InternalError(f"template {template} rendered invalid Python (line {e.lineno}): {e.msg}")


def _rendered(template: str, params: dict[str, Any]) -> Rendered:
    """``render``, as a ``Rendered`` node (built from ast's tree of the text)."""
    text = _text(template, params)
    found = CHECKED_NODES.find(text)
    if found is not None:  # the shape of a checked text: the same node, other names
        node, words = found
        names = tuple(words.get(n, n) for n in node.names)
        return Rendered(text, template, node.indent, node.plain, names, indentable=node.indentable)
    try:
        tree = ast.parse(text)  # the check: ast is ten times faster than libcst here
    except SyntaxError as e:
        raise _invalid(template, e) from e
    node = rendered(text, tree, template)
    CHECKED_NODES.add(text, node)
    return node


def render_statements(template: str, **params: Any) -> list[cst.BaseStatement]:
    """Render a template into statements to splice into the user's tree: one statement
    node that keeps the text and prints it as it is where it can (indented to where
    it lands), else as libcst's parse of it (``expand/fast/rendered.py``)."""
    return [_rendered(template, params)]
