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
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from macrogen import __version__, macros
from macrogen.expand.args import Evaluator
from macrogen.expand.context import Context, Options, Position, Tunable
from macrogen.expand.errors import Diagnostic, ExpansionError, InternalError, MacroError
from macrogen.expand.sites import MODULE, PACKAGE, ScopeStack, collect_scope
from macrogen.expand.transform import Expander

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
    options = Options(path=path, target=target, tuning=dict(tuning or {}))
    try:
        return _FileExpansion(source, options).run()
    except RecursionError:
        message = "this file is nested too deeply to expand (Python's recursion limit)"
        raise ExpansionError([Diagnostic(path, 1, 1, message)]) from None


class _FileExpansion:
    def __init__(self, source: str, options: Options):
        self.source = source
        self.options = options
        self.errors: list[MacroError] = []
        self.diagnostics: list[Diagnostic] = []

    def run(self) -> Expansion:
        module = self._parse()
        module_scope = collect_scope("module", "", list(module.body), self.errors)
        imports = {name: PACKAGE for name, b in module_scope.macros.items() if b is MODULE}
        self.ctx = Context(self.source, self.options, _module_imports(module))
        self.ctx._module_imports.update(imports)
        self._statement_lines(module)

        aliases = {name for name in module_scope.macros} | {PACKAGE}
        mentions = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(aliases))) + r")\b")
        candidates = [i for i, text in enumerate(self.texts) if mentions.search(text)]

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
        if self.diagnostics:
            raise ExpansionError(self.diagnostics)
        if not expanded:
            return Expansion(self.source, False, dict(self.ctx.tunables))

        out_body: list[cst.BaseStatement] = []
        prelude_at = self._prelude_index(body, min(new_body))
        prelude: list[cst.BaseStatement] = []
        for i, stmt in enumerate(body):
            if i == prelude_at:
                prelude = self._prelude()
                out_body.extend(prelude)
            replaced = new_body.get(i, [stmt])
            if prelude and i == prelude_at and replaced:
                replaced = [_two_blank_lines_after(prelude[-1], replaced[0]), *replaced[1:]]
            out_body.extend(replaced)
        code = module.with_changes(body=out_body).code
        return Expansion(self._with_header(code), True, dict(self.ctx.tunables), tuple(expanded))

    # -- parsing and positions ----------------------------------------------------
    def _parse(self) -> cst.Module:
        try:
            ast.parse(self.source, filename=self.options.path)
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
            return cst.parse_module(self.source)
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

    def _statement_lines(self, module: cst.Module) -> None:
        """Each top-level statement's text and first line: positions come from these."""
        self.module = module
        self.texts = [module.code_for_node(stmt) for stmt in module.body]
        header = "".join(module.code_for_node(line) for line in module.header)
        self.first_line = []
        line = 1 + header.count("\n")
        for text in self.texts:
            self.first_line.append(line)
            line += text.count("\n")
        self._positions: dict[int, Mapping[cst.CSTNode, Any]] = {}

    def _position(self, node: cst.CSTNode) -> Position:
        i = self.current
        if i not in self._positions:  # positions only for statements that need them
            wrapper = MetadataWrapper(
                self.module.with_changes(body=[self.module.body[i]], header=[], footer=[]),
                unsafe_skip_copy=True,
            )
            self._positions[i] = wrapper.resolve(PositionProvider)
        code_range = self._positions[i].get(node)
        if code_range is None:
            return Position(self.first_line[i], 1)
        start, end = code_range.start, code_range.end
        width = end.column - start.column if end.line == start.line else 1
        return Position(self.first_line[i] + start.line - 1, start.column + 1, max(1, width))

    def _flush_errors(self) -> None:
        for e in self.errors:
            pos = self._position(e.node) if e.node is not None else Position(1, 1)
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

    def _prelude(self) -> list[cst.BaseStatement]:
        imports, blocks = self.ctx.import_lines(), self.ctx.prelude
        if not imports and not blocks:
            return []
        parts = [
            f"# ---- macrogen: generated from {self.options.path}; edit the source, not this block ----\n"
        ]
        parts += [line + "\n" for line in imports]
        for block in blocks:
            parts.append("\n\n" + block.rstrip("\n") + "\n")
        text = "".join(parts)
        try:
            prelude = cst.parse_module(text)
        except cst.ParserSyntaxError as e:
            raise InternalError(f"generated helpers are invalid Python: {e.message}") from e
        statements = list(prelude.body)
        first = statements[
            0
        ]  # the banner parsed as the module header: move it onto the first statement
        statements[0] = first.with_changes(
            leading_lines=[cst.EmptyLine(), *prelude.header, *first.leading_lines]
        )
        return statements

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
        return "".join(lines[:keep]) + "\n".join(header) + "\n" + "".join(lines[keep:])


def _line(source: str, line: int) -> str:
    lines = source.splitlines()
    return lines[line - 1] if 0 < line <= len(lines) else ""


def _as_statements(result: Any) -> list[cst.BaseStatement]:
    if isinstance(result, cst.FlattenSentinel):
        return list(result.nodes)
    if isinstance(result, cst.RemovalSentinel):
        return []
    return [result]


def _two_blank_lines_after(
    generated: cst.BaseStatement, stmt: cst.BaseStatement
) -> cst.BaseStatement:
    """PEP 8 spacing between the generated helpers (ending in a def) and the user's next statement."""
    if isinstance(generated, cst.SimpleStatementLine):
        return stmt
    blank = 0
    for line in stmt.leading_lines:
        if line.comment is not None:
            break
        blank += 1
    if blank >= 2:
        return stmt
    return stmt.with_changes(
        leading_lines=[cst.EmptyLine()] * (2 - blank) + list(stmt.leading_lines)
    )


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
