"""Compiling expanded code so that tracebacks point at the user's file and line.

Expansion keeps code outside macro sites byte for byte, so a line diff of source
against expansion tells, for every expanded line, the source line it is (kept
lines) or came from (generated lines: the site named by the nearest
``# macrogen: <macro> at file:line`` comment above it in the changed run).

The expanded code is compiled twice:

- *as the user's file*: the AST's line numbers are rewritten to source lines,
  so a frame in user code shows the user's own line; a line a site became
  shows the site's line, without column carets (its columns were generated);
- *as the expanded file*: unchanged, named after the cached expanded file.

Then the two are spliced per code object: a function the user wrote (its first
line is kept) takes the first, a function macrogen generated takes the second,
so a traceback runs user frame -> site line -> generated helper line, and
``inspect.getsource`` of a generated Triton kernel reads the generated text.

A generated function that copies the user's lines (``@pipeline``'s forward,
one function per statement) follows a ``# macrogen: <what> from file:line``
comment: its lines map to the user's lines from that one on, matched by text,
and it is compiled as the user's, so a frame in it shows the user's line.
"""

from __future__ import annotations

import ast
import difflib
import re
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")
_SITE_COMMENT = re.compile(r"^[ \t]*# macrogen: [\w.]+ at .*:(\d+)[ \t]*$")
_COPY_COMMENT = re.compile(r"^[ \t]*# macrogen: [\w.]+ from .*:(\d+)[ \t]*$")
_NEWLINE = re.compile(r"\r\n|\r|\n")  # what the tokenizer counts as a line end


def source_lines(source: str, expanded: str) -> tuple[list[int], list[bool]]:
    """For each expanded line (index 0 is line 1): its source line, and whether it is kept verbatim."""
    a, b = _NEWLINE.split(source), _NEWLINE.split(expanded)
    origin, kept = [1] * len(b), [False] * len(b)
    for tag, i1, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(j2 - j1):
                origin[j1 + k], kept[j1 + k] = i1 + k + 1, True
            continue
        # inserted lines belong to the line above; replaced ones to the first replaced
        line = i1 + 1 if tag == "replace" else max(i1, 1)
        at, end = 0, -1  # a copied function: the user line it is at, its last line
        for j in range(j1, j2):
            site = _SITE_COMMENT.match(b[j])
            if site:
                line = int(site.group(1))
            copied = _COPY_COMMENT.match(b[j])
            if copied:
                at, end = int(copied.group(1)), _end(b, j + 1)
                origin[j] = at
            elif j <= end:
                if 0 < at <= len(a) and a[at - 1].strip() == b[j].strip():
                    origin[j], at = at, at + 1
                else:  # its def line: the first user line; a generated return: the last
                    origin[j] = at if b[j].lstrip().startswith("def ") else max(at - 1, 1)
            else:
                origin[j] = line
    return origin, kept


def _end(lines: list[str], first: int) -> int:
    """The index of the last line of the def at ``lines[first]`` (by indentation)."""
    if first >= len(lines):
        return first
    indent = len(_indent(lines[first]))
    last = first
    for k in range(first + 1, len(lines)):
        if lines[k].strip():
            if len(_indent(lines[k])) <= indent:
                break
            last = k
    return last


def _indent(text: str) -> str:
    return text[: len(text) - len(text.lstrip())]


def copied_lines(expanded: str) -> set[int]:
    """The lines (1-based) of the generated functions that copy the user's lines."""
    lines = _NEWLINE.split(expanded)
    out: set[int] = set()
    for i, text in enumerate(lines):
        if _COPY_COMMENT.match(text):
            out.update(range(i + 2, _end(lines, i + 1) + 2))
    return out


def compile_expanded(source: str, expanded: str, path: str, expanded_path: str) -> types.CodeType:
    """Module code for ``expanded`` with user frames at ``path`` and generated frames at ``expanded_path``."""
    origin, kept = source_lines(source, expanded)
    tree = ast.parse(expanded, filename=path)
    spans = _def_spans(tree)
    site_lines = {
        i + 1 for i, text in enumerate(_NEWLINE.split(expanded)) if _SITE_COMMENT.match(text)
    }

    copies = copied_lines(expanded)

    def users(code: types.CodeType) -> bool:
        """Did the user write this function (lines in expanded coordinates)?"""
        first = code.co_firstlineno
        if first in copies:
            return True  # a generated function made of the user's lines
        if not _at(kept, first, False):
            return False
        last = spans.get(first)
        if last is None:  # a lambda or comprehension: all its lines must be the user's
            return all(_at(kept, line, False) for *_, line in code.co_lines() if line)
        body = range(first, last + 1)
        # all lines kept, or a user function with a site inside it
        return all(_at(kept, line, False) for line in body) or any(
            line in site_lines for line in body
        )

    generated = compile(expanded, expanded_path, "exec", dont_inherit=True)
    _to_source_lines(tree, origin, kept)
    as_user = compile(tree, path, "exec", dont_inherit=True)
    try:
        return _splice(as_user, generated, users, top=True)
    except _Mismatch:  # never seen; the generated file's lines are still right
        return generated


class _Mismatch(Exception):
    pass


def _at(values: Sequence[_T], line: int, default: _T) -> _T:
    return values[line - 1] if 0 < line <= len(values) else default


def _def_spans(tree: ast.AST) -> dict[int, int]:
    """First line (decorators included, as co_firstlineno counts) -> last line of each def/class."""
    spans: dict[int, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[first] = node.end_lineno or node.lineno
    return spans


def _to_source_lines(tree: ast.AST, origin: list[int], kept: list[bool]) -> None:
    for node in ast.walk(tree):
        start = getattr(node, "lineno", None)
        if start is None or isinstance(node, ast.TypeIgnore):
            continue
        end = getattr(node, "end_lineno", None) or start
        located: Any = node  # a node with a position: a statement, expression, argument, ...
        located.lineno = _at(origin, start, 1)
        if _at(kept, start, False) and _at(kept, end, False):
            located.end_lineno = _at(origin, end, 1)  # columns are the user's: keep them
        else:
            located.end_lineno = max(_at(origin, end, 1), located.lineno)
            located.col_offset = located.end_col_offset = -1  # no carets under a generated line


def _splice(
    user: types.CodeType,
    generated: types.CodeType,
    users: Callable[[types.CodeType], bool],
    *,
    top: bool = False,
) -> types.CodeType:
    """``user`` and ``generated`` are one module compiled twice; pick per code object."""
    own = user if top or users(generated) else generated
    if len(user.co_consts) != len(generated.co_consts):
        raise _Mismatch
    consts = list(own.co_consts)
    for i, (u, g) in enumerate(zip(user.co_consts, generated.co_consts)):
        if isinstance(u, types.CodeType) or isinstance(g, types.CodeType):
            if not (
                isinstance(u, types.CodeType)
                and isinstance(g, types.CodeType)
                and u.co_name == g.co_name
            ):
                raise _Mismatch
            consts[i] = _splice(u, g, users)
    return own.replace(co_consts=tuple(consts))
