"""The pass over a file that mentions macrogen (``expand_source`` is the entry point).

``ast`` cuts the file into top-level statements (``statements.py``) and only
those that mention a macrogen name are parsed by libcst, visited and
positioned. Every other statement is copied from the source text.
"""

from __future__ import annotations

import ast
import gc
import re
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import libcst as cst

from macrogen import macros
from macrogen.expand import codegen, protocol
from macrogen.expand.args import Evaluator, no_argument_macros
from macrogen.expand.context import Context, Options, Position, SiteArguments
from macrogen.expand.errors import Diagnostic, ExpansionError, MacroError
from macrogen.expand.fast import drive
from macrogen.expand.fast.layout import split_lines, without_indent_form_feeds
from macrogen.expand.fast.statements import MAX_NODES, Disagree, Pieces, TooLarge, WholeFile
from macrogen.expand.result import Expansion
from macrogen.expand.sites import PACKAGE, Scope, ScopeStack, collect_scope, nfkc
from macrogen.expand.transform import Expander
from macrogen.version import __version__

_NON_ASCII_WORD = re.compile(r"\w*[^\x00-\x7f]\w*")
_CODING = re.compile(r"^[ \t\f]*#.*?coding[:=]")


def expand_file(source: str, options: Options) -> Expansion:
    """Expand a file that mentions macrogen. Raises ExpansionError with all its errors."""
    path = options.path
    try:
        with _no_cycle_collection():
            return _FileExpansion(source, options).run()
    except ExpansionError:
        raise
    except TooLarge as e:
        message = (
            f"this statement is too large to expand: more than {MAX_NODES:,} syntax nodes"
            " (macrogen's limit; move large data out of the macro statement)"
        )
        diagnostic = Diagnostic(path, e.line, 1, message, _line(source, e.line)[:120])
        raise ExpansionError([diagnostic]) from None
    except Exception as e:
        # libcst hitting the recursion limit can surface as another error raised
        # while the RecursionError unwinds (a KeyError in its position tracker).
        if not _from_recursion(e):
            raise
        message = "this file is nested too deeply to expand (Python's recursion limit)"
        raise ExpansionError([Diagnostic(path, 1, 1, message)]) from None


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The pass allocates hundreds of thousands of libcst nodes, freed by reference counting
    (a tree holds no cycles); the cycle collector, run by those allocations, walked
    the trees still alive over and over: 10-20% of an expansion. Off while it runs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _from_recursion(e: BaseException | None) -> bool:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, RecursionError):
            return True
        seen.add(id(e))
        e = e.__context__
    return False


class _FileExpansion:
    def __init__(self, source: str, options: Options, *, whole: bool = False):
        self.source = source
        self.options = options
        self.whole = whole  # libcst parses the whole file (else: only the statements visited)
        self.errors: list[MacroError] = []
        self.diagnostics: list[Diagnostic] = []
        self.current = -1  # the top-level statement being expanded (-1: none yet)

    def run(self) -> Expansion:
        tree = self._parse()
        try:
            return self._expand(tree)
        except Disagree:
            if self.whole:
                raise
            # ast's cut of the file is not libcst's: expand from libcst's whole-file parse
            return _FileExpansion(self.source, self.options, whole=True).run()
        finally:
            # ctx.source_text refers to self: without it, the trees go by reference
            # counting, not in a cycle collection once the pass is over (0.3 x parse)
            ctx = getattr(self, "ctx", None)
            if ctx is not None:
                ctx.source_text = _no_source_text

    def _expand(self, tree: ast.Module) -> Expansion:
        self.statements = (
            WholeFile(self.source, self._parse_whole(), tree)
            if self.whole
            else Pieces(self.source, tree)
        )
        statements = self.statements
        # The statements that import macrogen tell its names; those that name one of them
        # (to use it, or to bind it to something else) are all the pass needs to parse.
        imports_it = self._mentioning({PACKAGE})
        first = collect_scope("module", "", [statements.node(i) for i in imports_it], [])
        self.visited = sorted(set(imports_it) | set(self._mentioning(set(first.macros))))
        module_scope = collect_scope(
            "module", "", [statements.node(i) for i in self.visited], self.errors
        )
        imports = {name: b.module for name, b in module_scope.macros.items() if b.macro is None}
        self.ctx = Context(self.source, self.options, {**statements.module_imports(), **imports})
        self.ctx.source_text = lambda node: (
            statements.source_text(self.current, node) if self.current >= 0 else None
        )
        self._flush_errors()
        candidates = sorted(
            set(self._mentioning(set(module_scope.macros) | {PACKAGE})) & set(self.visited)
        )

        constants = self._module_constants(module_scope, candidates)
        hot = _HotLines(self, {PACKAGE, *module_scope.macros})
        module_names = statements.imported_names()
        new_body: dict[int, list[cst.BaseStatement]] = {}
        expanded: list[tuple[str, int]] = []
        arguments: list[SiteArguments] = []
        for i in candidates:
            self.current = i
            expander = Expander(
                self.ctx,
                ScopeStack(module_scope),
                self._position,
                self.errors,
                constants=constants,
                module_names=module_names,
                hot=hot,
            )
            result = drive.visit(statements.node(i), expander)
            expander.check_unconsumed()
            expander.release()
            self._flush_errors()
            if expander.expanded:
                expanded.extend(expander.expanded)
                arguments.extend(expander.arguments)
                new_body[i] = _as_statements(result)

        self._flush_errors()
        if self.diagnostics:
            raise ExpansionError(self.diagnostics)
        self._decorate_classes(new_body)
        if not expanded:
            return Expansion(self.source, False, dict(self.ctx.tunables))
        code = self._output(new_body)
        return Expansion(
            self._with_header(code),
            True,
            dict(self.ctx.tunables),
            tuple(expanded),
            tuple(arguments),
        )

    def _decorate_classes(self, new_body: dict[int, list[cst.BaseStatement]]) -> None:
        """The decorators sites asked for on other top-level classes (``Expanded.decorates``),
        each put first in its class's decorator list (it wraps what the others made)."""
        wanted = self.ctx.class_decorators
        if not wanted:
            return
        for i in self._mentioning(set(wanted)):
            body = new_body.get(i) or [self.statements.node(i)]
            for k, stmt in enumerate(body):
                if isinstance(stmt, cst.ClassDef) and stmt.name.value in wanted:
                    text = wanted[stmt.name.value]
                    # (after a statement, the comments are the class's lines, not the header)
                    placeholder = cst.parse_module(f"pass\n{text}\nclass _:\n    pass\n").body[-1]
                    assert isinstance(placeholder, cst.ClassDef) and placeholder.decorators
                    body[k] = stmt.with_changes(  # (its comments above the user's decorators)
                        leading_lines=[*stmt.leading_lines, *placeholder.leading_lines],
                        decorators=[placeholder.decorators[0], *stmt.decorators],
                    )
                    new_body[i] = body

    def _mentioning(self, names: set[str]) -> list[int]:
        """The top-level statements whose text has one of ``names`` as a word."""
        at = self.statements
        return sorted({at.statement_at(line) for line in self._lines_with(names)} - {-1})

    def _lines_with(self, names: Iterable[str]) -> set[int]:
        """The lines whose text has one of ``names`` as a word (in code, comments or strings)."""
        names = set(names)
        if not names:
            return set()
        # (no \b before the names: a pattern that starts with its literals is searched for
        # fast, five times faster for one name; the match's start is checked instead, as
        # \b checks it: a word character is alphanumeric or "_", for re as for str)
        alternatives = "|".join(map(re.escape, sorted(names)))
        at, source = self.statements, self.source
        if all(_is_word(n[0]) and _is_word(n[-1]) for n in names):
            pattern = re.compile(r"(?:" + alternatives + r")(?!\w)")
            found = {
                at.line_at(start)
                for start in (m.start() for m in pattern.finditer(source))
                if not start or not _is_word(source[start - 1])
            }
        else:  # (a name that ends in a combining mark: \b means something else there)
            pattern = re.compile(r"\b(?:" + alternatives + r")\b")
            found = {at.line_at(m.start()) for m in pattern.finditer(source)}
        if not self.source.isascii():  # Python reads identifiers NFKC-normalized: ｍg is mg
            for m in _NON_ASCII_WORD.finditer(self.source):
                if nfkc(m.group()) in names:
                    found.add(at.line_at(m.start()))
        return found

    def _output(self, new_body: dict[int, list[cst.BaseStatement]]) -> str:
        """The source text, with each expanded statement's text replaced by its new code."""
        statements = self.statements
        newline = statements.newline
        prelude_at = self._prelude_index(min(new_body))
        pieces = [statements.header()]
        for i in range(statements.count):
            after_helpers = False
            if i == prelude_at:
                pieces.append(self._prelude().replace("\n", newline))
                after_helpers = bool(self.ctx.prelude)  # PEP 8: two blank lines after a def
            if i in new_body:
                text = statements.code(i, new_body[i])
            else:
                text = statements.text(i)
            if after_helpers:
                text = _blank_lines_before(text, 2, newline)
            pieces.append(text)
        pieces.append(statements.footer())
        code = "".join(pieces)
        if not self.source.endswith(("\n", "\r")) and code.endswith(newline):
            code = code[: -len(newline)]  # the file ended without one: so does the output
        return code

    # -- parsing and positions ----------------------------------------------------
    def _parse(self) -> ast.Module:
        try:
            return ast.parse(self.source, filename=codegen.text(self.options.path))
        except SyntaxError as e:
            line = e.lineno or 1
            text = e.text if e.text is not None else _line(self.source, line)
            raise ExpansionError(
                [
                    Diagnostic(
                        self.options.path,
                        line,
                        max(1, e.offset or 1),
                        f"invalid syntax: {e.msg}",
                        text.rstrip("\r\n"),
                    )
                ]
            ) from None
        except ValueError as e:  # null bytes
            raise ExpansionError(
                [Diagnostic(self.options.path, 1, 1, f"invalid source: {e}")]
            ) from None

    def _parse_whole(self) -> cst.Module:
        try:
            return cst.parse_module(without_indent_form_feeds(self.source))
        except cst.ParserSyntaxError as e:
            line = e.editor_line
            raise ExpansionError(
                [
                    Diagnostic(
                        self.options.path,
                        line,
                        e.editor_column,
                        f"invalid syntax: {e.message}",
                        _line(self.source, line),
                    )
                ]
            ) from None

    def _statement_of(self, node: cst.CSTNode) -> int:
        """The top-level statement that holds ``node``: the current one, else a search."""
        if self.current >= 0 and node in self.statements.positions(self.current):
            return self.current
        visited: list[int] = getattr(self, "visited", [])
        for i in visited:
            if node in self.statements.positions(i):
                return i
        return -1

    def _position(self, node: cst.CSTNode, i: int | None = None) -> Position:
        i = self.current if i is None else i
        code_range = None
        if i >= 0:
            code_range = self.statements.site_range(i, node) or self.statements.positions(i).get(
                node
            )
        if code_range is None:
            return Position(self.statements.first_lines[i] if i >= 0 else 1, 1)
        first_line = self.statements.first_lines[i]
        start, end = code_range.start, code_range.end
        width = end.column - start.column if end.line == start.line else 1
        return Position(first_line + start.line - 1, start.column + 1, max(1, width))

    def _flush_errors(self) -> None:
        for e in self.errors:
            if e.node is None:
                pos = Position(1, 1)
            else:
                pos = self._position(e.node, self._statement_of(e.node))
            self.diagnostics.append(
                Diagnostic(
                    self.options.path,
                    pos.line,
                    pos.col,
                    e.message,
                    _line(self.source, pos.line),
                    pos.width,
                )
            )
        self.errors.clear()

    # -- module constants: NAME = m(...) where the macro has a ``constant`` hook --------
    def _module_constants(
        self, module_scope: Scope, candidates: list[int]
    ) -> dict[cst.CSTNode, bool]:
        """Evaluate every module constant first, so that every site of the file knows them.

        Returns the calls evaluated -> whether their hook succeeded."""
        scopes = ScopeStack(module_scope)
        evaluated: dict[cst.CSTNode, bool] = {}
        for i in candidates:
            stmt = self.statements.node(i)
            if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
                continue
            assign = stmt.body[0]
            if not (
                isinstance(assign, cst.Assign)
                and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)
                and isinstance(assign.value, cst.Call)
            ):
                continue
            name = scopes.macro_of(assign.value)
            try:
                macro = macros.get(name) if name is not None else None
            except KeyError:
                continue
            hook = protocol.constant_hook(macro) if macro is not None else None
            if macro is None or hook is None or "assign" not in macro.FORMS:
                continue
            self.current = i
            target = assign.targets[0].target.value
            evaluator = Evaluator(self.ctx.constants, no_argument_macros, self._use_tunable)
            try:
                self.ctx.constants[target] = hook(target, assign.value, evaluator)
                evaluated[assign.value] = True
            except MacroError as e:
                self.errors.append(e)
                evaluated[assign.value] = False
            self._flush_errors()
        return evaluated

    def _use_tunable(
        self, key: str, default: Any, choices: tuple[Any, ...], node: cst.CSTNode
    ) -> Any:
        return self.ctx.tunable(key, default, choices, node, self._position(node).line)

    # -- output --------------------------------------------------------------------
    def _prelude_index(self, first_site: int) -> int:
        """Generated helpers go after the imports that precede the first site, else right before it."""
        at = first_site
        for i in range(first_site):
            if self.statements.is_import(i):
                at = i + 1
        return at

    def _prelude(self) -> str:
        """The generated imports and helpers, as text (each template was parse-checked)."""
        imports, blocks = self.ctx.import_lines(), self.ctx.prelude
        if not imports and not blocks:
            return ""
        parts = [
            "\n# ---- macrogen: generated from"
            f" {codegen.text(self.options.path)}; edit the source, not this block ----\n"
        ]
        parts += [line + "\n" for line in imports]
        for block in blocks:
            parts.append("\n\n" + block.rstrip("\n") + "\n")
        return "".join(parts)

    def _with_header(self, code: str) -> str:
        tuned = [t for t in self.ctx.tunables.values()]
        header = [
            f"# Generated by macrogen {__version__} from {codegen.text(self.options.path)}. Do not edit:",
            "# edit the source and run `macrogen expand` again.",
        ]
        if self.options.target is not None:
            header.append(f"# Target: {self.options.target}.")
        for t in sorted(tuned, key=lambda t: t.key):
            how = "tuned" if t.key in self.options.tuning else "default"
            header.append(f"# tunable {t.key} = {t.value!r} ({how}; choices {list(t.choices)})")
        lines = code.splitlines(keepends=True)
        keep = 0  # a shebang and a coding cookie must stay on the first two lines
        while keep < min(2, len(lines)) and (
            lines[keep].startswith("#!") and keep == 0 or _CODING.match(lines[keep])
        ):
            keep += 1
        newline = self.statements.newline
        return "".join(lines[:keep]) + newline.join(header) + newline + "".join(lines[keep:])


class _HotLines:
    """The lines that mention a name that may mean macrogen, and whether a statement has one.

    The pass visits only the statements of the current top-level statement whose lines
    (decorators and comments included) hold one of these names: a method of a
    ``@tensor_parallel`` class or the loops of a ``@tile`` kernel can hold no site.
    Names that a function or class binds to macrogen itself are added when its scope
    is entered (its import names ``macrogen``, so it is visited)."""

    def __init__(self, expansion: _FileExpansion, names: set[str]):
        self.expansion = expansion
        self.names = set(names)
        self.lines = sorted(expansion._lines_with(self.names))

    def add(self, names: Iterable[str]) -> None:
        new = set(names) - self.names
        if new:
            self.names |= new
            self.lines = sorted(set(self.lines) | self.expansion._lines_with(new))

    def __call__(self, node: cst.CSTNode) -> bool:
        at = self.expansion.current
        statements = self.expansion.statements
        extent = statements.extents(at).get(node) if at >= 0 else None
        if extent is None:
            return True  # not a statement of the source: visit it
        offset = statements.first_lines[at] - 1
        j = bisect_left(self.lines, extent[0] + offset)
        return j < len(self.lines) and self.lines[j] <= extent[1] + offset


def _no_source_text(node: cst.CSTNode) -> None:
    return None


def _line(source: str, line: int) -> str:
    lines = split_lines(source)
    return lines[line - 1].rstrip("\r\n") if 0 < line <= len(lines) else ""


def _as_statements(result: Any) -> list[cst.BaseStatement]:
    if isinstance(result, cst.FlattenSentinel):
        return list(result.nodes)
    if isinstance(result, cst.RemovalSentinel):
        return []
    return [result]


def _blank_lines_before(text: str, count: int, newline: str) -> str:
    """``text`` with at least ``count`` blank lines before its first non-blank line."""
    lines = split_lines(text)
    blank = 0
    while blank < len(lines) and not lines[blank].strip():
        blank += 1
    return newline * max(0, count - blank) + text


def _is_word(ch: str) -> bool:
    """Whether re's \\w (of a str pattern) matches ``ch``."""
    return ch.isalnum() or ch == "_"
