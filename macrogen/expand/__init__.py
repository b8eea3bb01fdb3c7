"""The pass: source text -> libcst tree -> macro sites -> templates -> output text.

``expand_source`` is pure (no I/O) and shared by the CLI, the import hook,
autotune and the tests. Cost matters (it runs on every cold import): a file
that never mentions macrogen is returned after one substring test, and only
top-level statements that mention a macrogen name are visited and positioned.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from macrogen import __version__, macros
from macrogen.expand.args import Evaluator
from macrogen.expand.context import Context, Options, Position, Tunable
from macrogen.expand.errors import Diagnostic, ExpansionError, InternalError, MacroError
from macrogen.expand.layout import Layout, split_lines
from macrogen.expand.sites import MODULE, PACKAGE, ScopeStack, collect_scope
from macrogen.expand.transform import Expander, inside

__all__ = ["Expansion", "ExpansionError", "InternalError", "Options", "expand_source"]

_CODING = re.compile(r"^[ \t\f]*#.*?coding[:=]")


@dataclass(frozen=True)
class Expansion:
    code: str
    changed: bool  # False when the file has no macro sites (code is then the input)
    tunables: Mapping[str, Tunable] = field(default_factory=dict)  # every tunable, by key
    sites: tuple[tuple[str, int], ...] = ()  # (macro, line) of each expanded site


def expand_source(
    source: str,
    *,
    path: str = "<string>",
    target: str | None = None,
    tuning: Mapping[str, Any] | None = None,
) -> Expansion:
    """Expand every macro site of one file. Raises ExpansionError with all its errors."""
    if target not in (None, "cpu", "cuda"):
        raise ValueError(f"target must be 'cpu', 'cuda' or None, not {target!r}")
    if PACKAGE not in source:  # the cheap pre-check: no macrogen, nothing to do
        return Expansion(source, False)
    if source.startswith("\ufeff"):  # a byte order mark decoded as text: keep it, expand the rest
        result = expand_source(source[1:], path=path, target=target, tuning=tuning)
        return replace(result, code="\ufeff" + result.code)
    options = Options(path=path, target=target, tuning=dict(tuning or {}))
    try:
        return _FileExpansion(source, options).run()
    except RecursionError:
        message = "this file is nested too deeply to expand (Python's recursion limit)"
        raise ExpansionError([Diagnostic(path, 1, 1, message)]) from None


class _FileExpansion:
    def __init__(self, source: str, options: Options, *, sure_layout: bool = False):
        self.source = source
        self.options = options
        self.sure_layout = sure_layout  # spans from libcst's codegen, not from ast's lines
        self.errors: list[MacroError] = []
        self.diagnostics: list[Diagnostic] = []
        self.error_statements: set[int] = set()
        self.current = -1  # the top-level statement being expanded (-1: none yet)

    def run(self) -> Expansion:
        module, tree = self._parse()
        self.module = module
        self.layout = (
            Layout.by_codegen(self.source, module)
            if self.sure_layout
            else Layout.of(self.source, module, tree)
        )
        self._positions: dict[int, Mapping[cst.CSTNode, Any]] = {}
        module_scope = collect_scope("module", "", list(module.body), self.errors)
        imports = {name: PACKAGE for name, b in module_scope.macros.items() if b is MODULE}
        self.ctx = Context(self.source, self.options, _module_imports(module))
        self.ctx._module_imports.update(imports)
        self._flush_errors()

        aliases = {name for name in module_scope.macros} | {PACKAGE}
        mentions = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(aliases))) + r")\b")
        candidates = sorted(
            {
                self.layout.statement_at(self.layout.line_at(m.start()))
                for m in mentions.finditer(self.source)
            }
            - {-1}
        )

        self._module_constants(module, module_scope, candidates)
        body = list(module.body)
        new_body: dict[int, list[cst.BaseStatement]] = {}
        expanded: list[tuple[str, int]] = []
        for i in candidates:
            stmt = body[i]
            self.current = i
            expander = Expander(self.ctx, ScopeStack(module_scope), self._position, self.errors)
            result = stmt.visit(expander)
            expander.check_unconsumed()
            self._flush_errors()
            if expander.expanded:
                expanded.extend(expander.expanded)
                new_body[i] = _as_statements(result)

        self._flush_errors()
        relied_on = sorted(set(new_body) | self.error_statements)
        if (
            not self.sure_layout
            and self.layout.checked(self.source, module, relied_on) is not self.layout
        ):
            # ast's lines and libcst's spans disagree somewhere we rely on: redo it the sure way
            return _FileExpansion(self.source, self.options, sure_layout=True).run()
        if self.diagnostics:
            raise ExpansionError(self.diagnostics)
        if not expanded:
            return Expansion(self.source, False, dict(self.ctx.tunables))
        code = self._output(body, new_body)
        return Expansion(self._with_header(code), True, dict(self.ctx.tunables), tuple(expanded))

    def _output(
        self, body: list[cst.BaseStatement], new_body: dict[int, list[cst.BaseStatement]]
    ) -> str:
        """The source text, with each expanded statement's span replaced by its new code."""
        newline = self.module.default_newline
        prelude_at = self._prelude_index(body, min(new_body))
        pieces = [self.layout.header()]
        for i in range(len(body)):
            after_helpers = False
            if i == prelude_at:
                pieces.append(self._prelude().replace("\n", newline))
                after_helpers = bool(self.ctx.prelude)  # PEP 8: two blank lines after a def
            if i in new_body:
                text = "".join(self.module.code_for_node(stmt) for stmt in new_body[i])
            else:
                text = self.layout.text(i)
            if after_helpers:
                text = _blank_lines_before(text, 2, newline)
            pieces.append(text)
        pieces.append(self.layout.footer())
        code = "".join(pieces)
        if not self.source.endswith(("\n", "\r")) and code.endswith(newline):
            code = code[: -len(newline)]  # the file ended without one: so does the output
        return code

    # -- parsing and positions ----------------------------------------------------
    def _parse(self) -> tuple[cst.Module, ast.Module]:
        try:
            tree = ast.parse(self.source, filename=self.options.path)
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
                        text,
                    )
                ]
            ) from None
        except ValueError as e:  # null bytes
            raise ExpansionError(
                [Diagnostic(self.options.path, 1, 1, f"invalid source: {e}")]
            ) from None
        try:
            return cst.parse_module(self.source), tree
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

    def _positions_of(self, i: int) -> Mapping[cst.CSTNode, Any]:
        if i not in self._positions:  # positions only for statements that need them
            wrapper = MetadataWrapper(
                self.module.with_changes(body=[self.module.body[i]], header=[], footer=[]),
                unsafe_skip_copy=True,
            )
            self._positions[i] = wrapper.resolve(PositionProvider)
        return self._positions[i]

    def _statement_of(self, node: cst.CSTNode) -> int:
        """The top-level statement that holds ``node``: the current one, else a search."""
        if self.current >= 0 and inside(node, self.module.body[self.current]):
            return self.current
        for i, stmt in enumerate(self.module.body):
            if inside(node, stmt):
                return i
        return -1

    def _position(self, node: cst.CSTNode, i: int | None = None) -> Position:
        i = self.current if i is None else i
        code_range = self._positions_of(i).get(node) if i >= 0 else None
        if code_range is None:
            return Position(self.layout.first_lines[i] if i >= 0 else 1, 1)
        first_line = self.layout.first_lines[i]
        start, end = code_range.start, code_range.end
        width = end.column - start.column if end.line == start.line else 1
        return Position(first_line + start.line - 1, start.column + 1, max(1, width))

    def _flush_errors(self) -> None:
        for e in self.errors:
            if e.node is None:
                pos = Position(1, 1)
            else:
                i = self._statement_of(e.node)
                if i >= 0:
                    self.error_statements.add(i)
                pos = self._position(e.node, i)
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

    # -- module constants: define() and tunable() assigned to names ---------------------
    def _module_constants(
        self, module: cst.Module, module_scope: Any, candidates: list[int]
    ) -> None:
        scopes = ScopeStack(module_scope)
        for i in candidates:
            stmt = module.body[i]
            if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
                continue
            assign = stmt.body[0]
            if not (
                isinstance(assign, cst.Assign)
                and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)
            ):
                continue
            macro = scopes.macro_of(assign.value) if isinstance(assign.value, cst.Call) else None
            if macro not in ("define", "tunable"):
                continue
            self.current = i
            name = assign.targets[0].target.value
            evaluator = Evaluator(self.ctx.constants, lambda c: False, self._use_tunable)
            try:
                self.ctx.constants[name] = macros.get(macro).constant(name, assign.value, evaluator)
            except MacroError as e:
                self.errors.append(e)
            self._flush_errors()

    def _use_tunable(
        self, key: str, default: Any, choices: tuple[Any, ...], node: cst.CSTNode
    ) -> Any:
        return self.ctx.tunable(key, default, choices, node, self._position(node).line)

    # -- output --------------------------------------------------------------------
    def _prelude_index(self, body: list[cst.BaseStatement], first_site: int) -> int:
        """Generated helpers go after the imports that precede the first site, else right before it."""
        at = first_site
        for i in range(first_site):
            stmt = body[i]
            if isinstance(stmt, cst.SimpleStatementLine) and any(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
            ):
                at = i + 1
        return at

    def _prelude(self) -> str:
        """The generated imports and helpers, as text (each template was parse-checked)."""
        imports, blocks = self.ctx.import_lines(), self.ctx.prelude
        if not imports and not blocks:
            return ""
        parts = [
            "\n# ---- macrogen: generated from"
            f" {self.options.path}; edit the source, not this block ----\n"
        ]
        parts += [line + "\n" for line in imports]
        for block in blocks:
            parts.append("\n\n" + block.rstrip("\n") + "\n")
        return "".join(parts)

    def _with_header(self, code: str) -> str:
        tuned = [t for t in self.ctx.tunables.values()]
        header = [
            f"# Generated by macrogen {__version__} from {self.options.path}. Do not edit:",
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
        newline = self.module.default_newline
        return "".join(lines[:keep]) + newline.join(header) + newline + "".join(lines[keep:])


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


def _module_imports(module: cst.Module) -> dict[str, str]:
    """Plain top-level ``import x`` / ``import x.y as z`` statements: local name -> module."""
    out: dict[str, str] = {}
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    full = cst.Module([]).code_for_node(alias.name)
                    if alias.asname is not None:
                        out[cst.Module([]).code_for_node(alias.asname.name)] = full
                    elif "." not in full:
                        out[full] = full
    return out
