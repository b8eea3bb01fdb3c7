"""Errors of the pass: the user's (at a position in their file) and our own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no libcst to import for a file without macros
    import libcst as cst


@dataclass(frozen=True)
class Diagnostic:
    """One error at a 1-based line and column of a source file."""

    path: str
    line: int
    col: int
    message: str
    source_line: str = ""
    width: int = 1  # how many characters the caret underlines

    def render(self) -> str:
        head = f"{self.path}:{self.line}:{self.col}: error: {self.message}"
        if not self.source_line.strip():
            return head
        text = self.source_line.rstrip("\n").expandtabs(1)
        width = max(1, min(self.width, len(text) - self.col + 1))
        caret = " " * (self.col - 1) + "^" + "~" * (width - 1)
        return f"{head}\n    {text}\n    {caret}"


class MacroError(Exception):
    """Raised by a macro for a bad use; the pass turns ``node`` into a position."""

    def __init__(self, message: str, node: cst.CSTNode | None = None):
        super().__init__(message)
        self.message = message
        self.node = node


class ExpansionError(Exception):
    """All the errors of one file; ``str()`` is the report the CLI prints."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.line, d.col, d.message))
        super().__init__(self.report())

    def report(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class InternalError(Exception):
    """macrogen's own bug, such as a template that rendered invalid Python."""
