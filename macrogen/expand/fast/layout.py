"""Lines as Python counts them, and libcst's own cut of a file into statements.

``Layout.by_codegen`` is the sure (and slower) way to find where each top-level
statement lies: libcst's code for the header and for each statement. The pass
normally cuts the file by ``ast``'s lines instead (see ``statements.py``).
"""

from __future__ import annotations

import re
import tokenize

import libcst as cst

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def split_lines(text: str) -> list[str]:
    """Lines with their ends, split where Python's tokenizer splits (not at \\f or \\x1c)."""
    return _LINE.findall(text)


def without_indent_form_feeds(text: str) -> str:
    """``text`` with the form feeds of its lines' indentation taken out, as Python reads them.

    Python's tokenizer resets the column at a form feed (``"\\f    x"`` is indented
    four columns); libcst's counts it, so it reads a block with a form-feed line as
    badly dedented (or moves the line). The same lines, without what comes up to
    the last form feed of a line's leading whitespace, are the same program to both.
    Lines inside a string (no token starts on them), blank lines and comment lines
    (libcst reads those as they are) are not touched. Columns on a
    changed line shift by what was taken out; lines stay where they were."""
    if "\f" not in text:
        return text
    lines = split_lines(text)
    cut: dict[int, int] = {}  # 0-based line -> characters to take out at its start
    feed = iter(lines)
    try:
        for tok in tokenize.generate_tokens(lambda: next(feed, "")):
            row, col = tok.start
            if tok.type in (tokenize.INDENT, tokenize.DEDENT) or row - 1 in cut:
                continue
            cut[row - 1] = 0
            if tok.type in (tokenize.NL, tokenize.COMMENT):
                continue  # a blank or comment line: no indentation (libcst keeps its form feed)
            prefix = lines[row - 1][:col] if row <= len(lines) else ""
            if "\f" in prefix and not prefix.strip(" \t\f"):
                cut[row - 1] = prefix.rindex("\f") + 1
    except (tokenize.TokenError, SyntaxError):
        return text  # (the pass reports what Python's parser says)
    if not any(cut.values()):
        return text
    return "".join(line[cut.get(i, 0) :] for i, line in enumerate(lines))


def count_lines(text: str) -> int:
    return len(split_lines(text))


class Layout:
    """The source's lines and the first line of each top-level statement."""

    def __init__(self, lines: list[str], first_lines: list[int], end: int):
        self.lines = lines  # the source's lines, ends kept
        self.first_lines = first_lines  # 1-based first line of each statement, comments included
        self.end = end  # 1-based line where the module's footer (trailing comments) starts

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
