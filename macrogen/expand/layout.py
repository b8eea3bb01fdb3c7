"""Where each top-level statement of a file lies in its text.

The pass copies every statement it does not change from the source text
itself (that is what "byte for byte" means), so it needs each top-level
statement's span: from its leading comments and blank lines to the line
before the next statement's. Generating each statement's code with libcst
gives the spans but costs as much as a second parse; the line numbers that
``ast`` already knows give them for free. A span the pass relies on (one it
rewrites) is checked against libcst's code for that statement, and any doubt
falls back to libcst.
"""

from __future__ import annotations

import ast
import re
from bisect import bisect_right
from itertools import accumulate

import libcst as cst

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def split_lines(text: str) -> list[str]:
    """Lines with their ends, split where Python's tokenizer splits (not at \\f or \\x1c)."""
    return _LINE.findall(text)


def count_lines(text: str) -> int:
    return len(split_lines(text))


class Layout:
    """The source's lines and the first line of each top-level statement."""

    def __init__(self, lines: list[str], first_lines: list[int], end: int):
        self.lines = lines  # the source's lines, ends kept
        self.first_lines = first_lines  # 1-based first line of each statement, comments included
        self.end = end  # 1-based line where the module's footer (trailing comments) starts
        self.line_starts = list(accumulate((len(line) for line in lines[:-1]), initial=0))

    @classmethod
    def of(cls, source: str, module: cst.Module, tree: ast.Module) -> Layout:
        lines = split_lines(source)
        end = len(lines) - len(module.footer) + 1
        firsts = _first_lines_from_ast(module, tree)
        if firsts is None or (firsts and firsts[0] != len(module.header) + 1):
            return cls.by_codegen(source, module)
        if any(b <= a for a, b in zip(firsts, firsts[1:])) or (firsts and firsts[-1] >= end):
            return cls.by_codegen(source, module)
        return cls(lines, firsts, end)

    @classmethod
    def by_codegen(cls, source: str, module: cst.Module) -> Layout:
        """The slow, sure way: libcst's own code for the header and each statement."""
        line = 1 + sum(count_lines(module.code_for_node(h)) for h in module.header)
        firsts = []
        for stmt in module.body:
            firsts.append(line)
            line += count_lines(module.code_for_node(stmt))
        return cls(split_lines(source), firsts, line)

    def text(self, i: int) -> str:
        """Statement ``i`` as written, with its leading comments and blank lines."""
        stop = self.first_lines[i + 1] if i + 1 < len(self.first_lines) else self.end
        return "".join(self.lines[self.first_lines[i] - 1 : stop - 1])

    def header(self) -> str:
        first = self.first_lines[0] if self.first_lines else self.end
        return "".join(self.lines[: first - 1])

    def footer(self) -> str:
        return "".join(self.lines[self.end - 1 :])

    def line_at(self, offset: int) -> int:
        """The 1-based line of a character offset into the source."""
        return bisect_right(self.line_starts, offset)

    def statement_at(self, line: int) -> int:
        """The index of the statement that holds ``line`` (-1: the header)."""
        return bisect_right(self.first_lines, line) - 1

    def checked(self, source: str, module: cst.Module, statements: list[int]) -> Layout:
        """This layout if libcst agrees on the spans of ``statements``, else libcst's."""
        for i in statements:
            if module.code_for_node(module.body[i]) != self.text(i):
                return Layout.by_codegen(source, module)
        return self


def _first_lines_from_ast(module: cst.Module, tree: ast.Module) -> list[int] | None:
    """Each libcst statement's first line: ast's first line minus its leading lines.

    A libcst line of ``a; b`` is several ast statements; a decorated definition
    starts at its first decorator. None when the two trees don't line up.
    """
    firsts: list[int] = []
    k = 0
    for stmt in module.body:
        if k >= len(tree.body):
            return None
        node = tree.body[k]
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.decorators:
            if "\\" in stmt.decorators[0].whitespace_after_at.value:
                return None  # "@\" continued: the decorator's line is not the statement's
        firsts.append(start - len(stmt.leading_lines))
        k += len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
    return firsts if k == len(tree.body) else None
