"""Printing the expanded statements: libcst's codegen, less its per-node costs.

``print_module`` is ``module.code`` with a codegen state whose
``record_syntactic_position`` is a shared no-op (libcst's makes a generator
per node, for positions nobody asks of the output).

``Kept.statements`` stands in for each statement the transform left as it was
parsed (a ``@tensor_parallel`` class's methods under its new name, the
statements around a site) a ``Verbatim`` node that prints the source lines it
was parsed from: printed at the indentation it had, with the piece's
indentation and ``\\n`` line endings, that is what libcst prints for it. Its
lines come from ``ast``'s (``extents.py``): from its first line of code less
its leading comment lines, to its last line of code plus the trailing lines
its blocks own (their footers). ``fast.ENABLED = False`` prints every statement
through libcst (``tests/test_pass_shortcuts.py`` compares the two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import libcst as cst
from libcst._nodes.internal import CodegenState

from macrogen.expand import fast
from macrogen.expand.fast.drive import rebuilt


class _NoPosition:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_POSITION = _NoPosition()


class _PrintState(CodegenState):
    def record_syntactic_position(self, node: Any, **kwargs: Any) -> Any:
        return _NO_POSITION


def print_module(module: cst.Module) -> str:
    """``module.code``."""
    try:
        state = _PrintState(
            default_indent=module.default_indent, default_newline=module.default_newline
        )
        module._codegen(state)
    except (AttributeError, TypeError):  # pragma: no cover - a libcst with another protocol
        return module.code
    return "".join(state.tokens)


@dataclass(frozen=True)
class Verbatim(cst.BaseStatement):
    node: cst.BaseStatement  # as parsed
    text: str  # its source lines (ends with "\n")
    indent: str  # the indentation of its first line of code
    default_indent: str  # the parsed piece's

    def _visit_and_replace_children(self, visitor: Any) -> Verbatim:
        return self

    def _codegen_impl(self, state: CodegenState) -> None:
        if not (
            state.default_indent == self.default_indent
            and state.default_newline == "\n"
            and "".join(state.indent_tokens) == self.indent
        ):
            self.node._codegen(state)
            return
        state.add_token(self.text[:-1])
        state.add_token("\n")  # a token of its own: the module may pop a last newline


class Kept:
    """The statements of one piece of plain text (printable ASCII and ``\\n``) that the
    transform kept as parsed, and their source lines."""

    def __init__(
        self,
        lines: Sequence[str],
        extents: Mapping[cst.CSTNode, tuple[int, int]],
        default_indent: str,
    ):
        self.lines = lines  # the piece's lines
        self.extents = extents  # each parsed statement -> its first and last line of code
        self.default_indent = default_indent

    def statements(self, statements: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """``statements`` with each kept one (at any depth of a new one) as ``Verbatim``."""
        if not fast.ENABLED:
            return list(statements)
        return [self._statement(s) for s in statements]

    def _statement(self, s: cst.BaseStatement) -> cst.BaseStatement:
        if s in self.extents:
            verbatim = self._verbatim(s)
            return s if verbatim is None else verbatim
        new: cst.BaseStatement = self._compound(s)
        return new

    def _compound(self, s: Any) -> Any:
        """A new compound statement with the kept statements of its blocks as ``Verbatim``."""
        if isinstance(s, (cst.FunctionDef, cst.ClassDef, cst.With)):
            return self._with_suite(s, "body")
        if isinstance(s, (cst.If, cst.For, cst.While)):
            s = self._with_suite(s, "body")
            orelse = s.orelse
            if isinstance(orelse, cst.If):  # elif: printed by the If, not as a statement
                new = self._compound(orelse)
                return s if new is orelse else s.with_changes(orelse=new)
            return s if orelse is None else self._with_suite(s, "orelse")
        return s  # (try, match: printed by libcst)

    def _with_suite(self, s: Any, field: str) -> Any:
        """``s`` with its field's block (``body``, or an else's body) made of ``_statement``s."""
        holder = getattr(s, field)
        block = holder.body if field == "orelse" else holder
        if not isinstance(block, cst.IndentedBlock):
            return s
        body = [self._statement(x) for x in block.body]
        if all(map(lambda a, b: a is b, body, block.body)):
            return s
        block = rebuilt(block, {"body": body})  # (with_changes, without its field scan)
        if field == "orelse":
            return rebuilt(s, {"orelse": rebuilt(holder, {"body": block})})
        return rebuilt(s, {field: block})

    def _verbatim(self, s: cst.BaseStatement) -> Verbatim | None:
        first, last = self.extents[s]
        leading = getattr(s, "leading_lines", None)
        trailing = _trailing(s)
        if leading is None or trailing is None:
            return None
        start, stop = first - len(leading), last + trailing  # 1-based, inclusive
        lines = self.lines
        if start < 1 or stop > len(lines):
            return None
        # (sure of the count: the lines around the code are blank or comments)
        for line in (*lines[start - 1 : first - 1], *lines[last:stop]):
            stripped = line.strip()
            if stripped and not stripped.startswith("#"):
                return None
        code = lines[first - 1]
        indent = code[: len(code) - len(code.lstrip(" \t"))]
        return Verbatim(s, "".join(lines[start - 1 : stop]), indent, self.default_indent)


def _trailing(s: Any) -> int | None:
    """How many lines after its last line of code the statement prints: the footers of
    its last blocks (None: a statement not counted here)."""
    if isinstance(s, cst.SimpleStatementLine):
        return 0
    if isinstance(s, (cst.FunctionDef, cst.ClassDef, cst.With)):
        suite = s.body
    elif isinstance(s, (cst.If, cst.For, cst.While)):
        orelse = s.orelse
        if isinstance(orelse, cst.If):
            return _trailing(orelse)
        suite = s.body if orelse is None else orelse.body
    elif isinstance(s, (cst.Try, cst.TryStar)):
        last = s.finalbody or s.orelse or (s.handlers[-1] if s.handlers else None)
        suite = s.body if last is None else last.body
    else:
        return None  # (match)
    if not isinstance(suite, cst.IndentedBlock):
        return 0  # (a one-line suite)
    inner = _trailing(suite.body[-1]) if suite.body else 0
    return None if inner is None else len(suite.footer) + inner
