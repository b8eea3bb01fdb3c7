"""Generated statements kept as the text their template rendered, printed as such.

A macro that adds a class beside the user's (``@tensor_parallel``,
``@data_parallel``) rendered it as text; parsing that text with libcst only
to print it back cost more than the rest of the site. ``Rendered`` is a
statement node that holds the text. Printed at module level in a file with
the template's indentation and ``\\n`` line endings, it is the text, after the
leading lines a macro gave it; anywhere else (an indented block, a file
indented with tabs, CRLF line endings) and for a macro stacked above that
needs the tree, it is what libcst parses from the text, so the output is the
same either way (``tests/test_pass_shortcuts.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import libcst as cst
from libcst._nodes.internal import CodegenState

from macrogen.expand import fast
from macrogen.expand.errors import InternalError
from macrogen.expand.fast.layout import split_lines
from macrogen.expand.fast.parsing import parse_module
from macrogen.expand.fast.statements import first_indent


@dataclass(frozen=True)
class Rendered(cst.BaseStatement):
    text: str  # whole statements, as the template rendered them
    template: str  # for an internal error's message
    indent: str  # the text's block indentation, as libcst infers it
    plain: bool  # starts with a statement, ends with one, no CR, tab or form feed
    names: tuple[str, ...] = ()  # the classes and functions it defines at its top level
    leading_lines: Sequence[cst.EmptyLine] | None = None  # None: the text's own
    # each line a line of code (no blank line, comment, string or backslash): inside a
    # block, libcst prints it as the text with the block's indentation before each line
    indentable: bool = False

    def statements(self) -> list[cst.BaseStatement]:
        """The text parsed, with the leading lines given to the first statement."""
        try:
            body: list[cst.BaseStatement] = list(parse_module(self.text).body)
        except cst.ParserSyntaxError as e:
            raise InternalError(
                f"template {self.template} rendered code libcst can't parse: {e.message}"
            ) from e
        if body and self.leading_lines is not None:
            body[0] = body[0].with_changes(leading_lines=self.leading_lines)
        return body

    def _visit_and_replace_children(self, visitor: Any) -> Rendered:
        return self  # generated code holds no macro site

    def _codegen_impl(self, state: CodegenState) -> None:
        if not (
            fast.ENABLED
            and self.plain
            and (self.indentable or not state.indent_tokens)
            and state.default_indent == self.indent
            and state.default_newline == "\n"
        ):
            for statement in self.statements():
                statement._codegen(state)
            return
        for line in self.leading_lines or ():
            line._codegen(state)
        text = self.text
        if state.indent_tokens:
            indent = "".join(state.indent_tokens)
            text = indent + text[:-1].replace("\n", "\n" + indent) + "\n"
        state.add_token(text[:-1])
        state.add_token("\n")  # a token of its own: the module may pop a last newline


def rendered(text: str, tree: ast.Module, template: str) -> Rendered:
    """``text`` (which ``tree`` is ast's parse of) as a statement node."""
    lines = split_lines(text)
    last = lines[-1].strip() if lines else ""
    plain = (
        bool(lines)
        and not text[0].isspace()
        and not text.startswith("#")
        and text.endswith("\n")
        and bool(last)
        and not last.startswith("#")
        and not any(c in text for c in "\r\t\f")
    )
    names = tuple(
        node.name
        for node in tree.body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    )
    indentable = not any(c in text for c in "#\\'\"") and all(
        line.strip() and sum(map(line.count, "([{")) == sum(map(line.count, ")]}"))
        for line in lines
    )  # (no line continues a bracket the line before opened: each is a statement's own)
    return Rendered(text, template, first_indent(tree, lines), plain, names, indentable=indentable)


def materialized(statements: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """The statements with each ``Rendered`` one replaced by its parsed statements, and
    those of a definition's block (a @tile function's body)."""
    out: list[cst.BaseStatement] = []
    for s in statements:
        if isinstance(s, Rendered):
            out.extend(s.statements())
            continue
        body = getattr(s, "body", None)
        if isinstance(s, (cst.FunctionDef, cst.ClassDef)) and isinstance(body, cst.IndentedBlock):
            if any(isinstance(b, Rendered) for b in body.body):
                s = s.with_changes(body=body.with_changes(body=materialized(body.body)))
        out.append(s)
    return out
