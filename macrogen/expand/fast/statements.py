"""A file's top-level statements: their text, their lines and, on demand, their libcst trees.

The pass copies every statement it does not change from the source text
itself (that is what "byte for byte" means), and it only needs libcst trees
for the statements that mention macrogen. So it starts from ``ast``'s line
numbers (a tenth of libcst's parse time) to cut the file into top-level
statements, and parses with libcst only the statements it visits, each on
its own. Any doubt about a cut (a piece libcst does not read as exactly one
statement) raises ``Disagree`` and the pass starts over from libcst's parse
of the whole file (``WholeFile``).
"""

from __future__ import annotations

import ast
import re
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from itertools import accumulate
from typing import Any

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider

from macrogen.expand.fast.drive import rebuilt
from macrogen.expand.fast.extents import Paired, ast_extents
from macrogen.expand.fast.layout import Layout, split_lines, without_indent_form_feeds
from macrogen.expand.fast.parsing import parse_module
from macrogen.expand.fast.printing import Kept, print_module


class Disagree(Exception):
    """ast's cut of the file is not libcst's: expand from the whole-file parse instead."""


# libcst costs ~0.1-0.5 ms per syntax node of a statement it parses, visits and
# prints: a macro statement beyond this many nodes (a ~2,000-line class, a define()
# of a 20,000-item list) is refused at once rather than expanded for minutes.
MAX_NODES = 20_000


class TooLarge(Exception):
    """A statement the pass would parse with libcst has more than MAX_NODES syntax nodes."""

    def __init__(self, line: int, nodes: int):
        super().__init__(line, nodes)
        self.line = line
        self.nodes = nodes


Positions = Mapping[cst.CSTNode, Any]  # node -> its libcst CodeRange (1-based lines)
Extents = Mapping[cst.CSTNode, "tuple[int, int]"]  # statement -> (first line, last line)


def code_and_positions(module: cst.Module) -> tuple[str, Positions, Extents]:
    """The module's code, every node's position and every statement's extent, in one pass.

    The pass needs the code (to check that a piece reads back as written), the
    positions (of its sites and errors: libcst's ``PositionProvider``, exactly) and
    the lines each statement spans, decorators and comments included (to skip
    statements that mention no macro name). ``MetadataWrapper.resolve`` costs a
    visit that rebuilds the tree plus a codegen that builds two objects per node;
    this codegen counts characters and turns the few offsets asked for into lines
    and columns. It relies on libcst's codegen protocol (``_codegen``,
    ``record_syntactic_position``), hence the fallback to the public API.
    """
    try:
        state = _OffsetState(
            default_indent=module.default_indent, default_newline=module.default_newline
        )
        module._codegen(state)
    except (AttributeError, TypeError):  # pragma: no cover - a libcst with another protocol
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        positions = wrapper.resolve(PositionProvider)
        return module.code, positions, {}
    code = "".join(state.tokens)
    starts = [0]  # the offset where each line starts (a line break ends a line, as for libcst)
    for line in split_lines(code + state.popped):
        if line.endswith(("\n", "\r")):
            starts.append(starts[-1] + len(line))
    return code, _OffsetPositions(state.ranges, starts), _OffsetExtents(state.extents, starts, code)


class _OffsetState(CodegenState):
    """libcst's codegen, recording each node's range as character offsets into the code.

    The same ranges as ``PositionProvidingCodegenState``: syntactic where a node
    records one, else everything the node printed."""

    def __init__(self, default_indent: str, default_newline: str, stop: cst.CSTNode | None = None):
        super().__init__(default_indent=default_indent, default_newline=default_newline)
        self.stop = stop  # raise _Stop once this node is printed (LazyPositions)
        self.offset = 0
        self.ranges: dict[cst.CSTNode, tuple[int, int]] = {}
        self.extents: dict[cst.CSTNode, tuple[int, int]] = {}  # statements, all they print
        self.stack: list[int] = []
        self.popped = ""

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        self.offset += sum(map(len, self.indent_tokens))

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        self.offset += len(value)

    def pop_trailing_newline(self) -> None:
        if self.tokens:  # (libcst's positions keep counting the popped newline: so do these)
            self.popped = self.tokens.pop()

    def before_codegen(self, node: cst.CSTNode) -> None:
        self.stack.append(self.offset)

    def after_codegen(self, node: cst.CSTNode) -> None:
        span = (self.stack.pop(), self.offset)
        self.ranges.setdefault(node, span)
        kind = type(node)
        statement = _STATEMENT.get(kind)
        if statement is None:  # (isinstance on libcst's abstract classes is slow: once per type)
            statement = _STATEMENT[kind] = issubclass(kind, cst.BaseStatement)
        if statement:
            self.extents[node] = span
        if node is self.stop:
            raise _Stop

    def record_syntactic_position(  # type: ignore[override]
        self,
        node: cst.CSTNode,
        *,
        start_node: cst.CSTNode | None = None,
        end_node: cst.CSTNode | None = None,
    ) -> _Syntactic:
        return _Syntactic(self, node, start_node, end_node)


_STATEMENT: dict[type, bool] = {}


class _Stop(Exception):
    """The node a partial codegen was run for is printed."""


class LazyPositions(Mapping[cst.CSTNode, Any]):
    """``code_and_positions``'s positions of a module's nodes, computed when first asked for.

    The pass needs few: a site's line, the node an error is reported at. A codegen that
    stops once the node asked for is printed knows every node printed before it (a
    decorator's site: the first line); a second node not among those runs the codegen
    to the end."""

    def __init__(self, module: cst.Module):
        self.module = module
        self.ranges: dict[cst.CSTNode, tuple[int, int]] = {}
        self.starts = [0]
        self.runs = 0
        self.complete = False

    def _span(self, node: object) -> tuple[int, int] | None:
        span: tuple[int, int] | None = self.ranges.get(node)  # type: ignore[call-overload]
        if span is None and not self.complete:
            self._run(node if self.runs == 0 and isinstance(node, cst.CSTNode) else None)
            span = self.ranges.get(node)  # type: ignore[call-overload]
        return span

    def _run(self, stop: cst.CSTNode | None) -> None:
        module = self.module
        state = _OffsetState(module.default_indent, module.default_newline, stop)
        try:
            module._codegen(state)
            self.complete = True
        except _Stop:
            pass
        self.runs += 1
        self.ranges = state.ranges
        self.starts = [0]
        for line in split_lines("".join(state.tokens) + state.popped):
            if line.endswith(("\n", "\r")):
                self.starts.append(self.starts[-1] + len(line))

    def __getitem__(self, node: cst.CSTNode) -> Any:
        span = self._span(node)
        if span is None:
            raise KeyError(node)
        return CodeRange(_line_col(self.starts, span[0]), _line_col(self.starts, span[1]))

    def __contains__(self, node: object) -> bool:
        return self._span(node) is not None

    def __iter__(self) -> Iterator[cst.CSTNode]:
        if not self.complete:
            self._run(None)
        return iter(self.ranges)

    def __len__(self) -> int:
        if not self.complete:
            self._run(None)
        return len(self.ranges)


class _Syntactic:
    """``with state.record_syntactic_position(node):`` without a generator per node."""

    __slots__ = ("end_node", "node", "start", "start_node", "state")

    def __init__(
        self,
        state: _OffsetState,
        node: cst.CSTNode,
        start_node: cst.CSTNode | None,
        end_node: cst.CSTNode | None,
    ):
        self.state, self.node, self.start_node, self.end_node = state, node, start_node, end_node
        self.start = 0

    def __enter__(self) -> None:
        self.start = self.state.offset

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:
            return  # (a partial codegen stopping: this node is not all printed)
        ranges = self.state.ranges
        start = ranges[self.start_node][0] if self.start_node is not None else self.start
        end = ranges[self.end_node][1] if self.end_node is not None else self.state.offset
        ranges[self.node] = (start, end)


def _line_col(starts: list[int], offset: int) -> CodePosition:
    """The 1-based line and 0-based column of a character offset, as libcst counts them."""
    line = bisect_right(starts, offset) - 1
    return CodePosition(line + 1, offset - starts[line])


class _OffsetPositions(Mapping[cst.CSTNode, Any]):
    """Offsets turned into libcst ``CodeRange`` objects when asked for."""

    def __init__(self, ranges: dict[cst.CSTNode, tuple[int, int]], starts: list[int]):
        self.ranges = ranges
        self.starts = starts

    def __getitem__(self, node: cst.CSTNode) -> Any:
        start, end = self.ranges[node]
        return CodeRange(_line_col(self.starts, start), _line_col(self.starts, end))

    def __contains__(self, node: object) -> bool:
        return node in self.ranges

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)


class _OffsetExtents(Mapping[cst.CSTNode, "tuple[int, int]"]):
    """A statement's first and last line (1-based, counted from the piece's first)."""

    def __init__(self, extents: dict[cst.CSTNode, tuple[int, int]], starts: list[int], code: str):
        self.extents = extents
        self.starts = starts
        self.code = code

    def text(self, node: cst.CSTNode) -> str | None:
        """All that the statement printed: its code as ``code_for_node`` gives it, but
        indented where it stands."""
        span = self.extents.get(node)
        return self.code[span[0] : span[1]] if span is not None else None

    def __getitem__(self, node: cst.CSTNode) -> tuple[int, int]:
        start, end = self.extents[node]
        return _line_col(self.starts, start).line, _line_col(self.starts, end).line

    def __contains__(self, node: object) -> bool:
        return node in self.extents

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self.extents)

    def __len__(self) -> int:
        return len(self.extents)


# Python's syntax makes at most ~2 ast nodes per character of source (``-a``: UnaryOp, USub,
# Name, Load): a statement this short can't reach MAX_NODES, so it is not counted.
_NODES_PER_CHARACTER = 4


def _check_size(nodes: list[ast.stmt]) -> None:
    """Count a statement's ast nodes, stopping at MAX_NODES + 1 (so the check costs at most that)."""
    count, stack = 0, list[ast.AST](nodes)
    while stack:
        count += 1
        if count > MAX_NODES:
            raise TooLarge(nodes[0].lineno, count)
        stack.extend(ast.iter_child_nodes(stack.pop()))


class Statements:
    """What the pass needs to know about the file's top-level statements."""

    lines: list[str]
    first_lines: list[int]  # 1-based first line of each statement (its comments included)
    newline: str

    @property
    def count(self) -> int:
        return len(self.first_lines)

    def source_text(self, i: int, node: cst.CSTNode) -> str | None:
        """The text of a statement inside statement ``i`` (see ``_OffsetExtents.text``), or None."""
        extents = self.extents(i)
        return extents.text(node) if isinstance(extents, _OffsetExtents) else None

    def extents(self, i: int) -> Extents:
        raise NotImplementedError

    def site_range(self, i: int, node: cst.CSTNode) -> CodeRange | None:
        return None  # (Pieces knows some from ast)

    def line_at(self, offset: int) -> int:
        """The 1-based line of a character offset into the source."""
        return bisect_right(self._starts, offset)

    def statement_at(self, line: int) -> int:
        """The index of the statement that holds ``line`` (-1: none)."""
        return bisect_right(self.first_lines, line) - 1

    def _init_lines(self, source: str) -> None:
        self.lines = split_lines(source)
        self._starts = list(accumulate((len(line) for line in self.lines[:-1]), initial=0))
        self.newline = next(
            (
                line[len(line.rstrip("\r\n")) :]
                for line in self.lines
                if line.endswith(("\n", "\r"))
            ),
            "\n",
        )


class Pieces(Statements):
    """Statements cut by ast's lines; each parsed alone by libcst when first asked for."""

    def __init__(self, source: str, tree: ast.Module):
        self._init_lines(source)
        self.tree = tree
        self.groups: list[list[ast.stmt]] = []  # ast statements of one libcst statement (a; b)
        ends: list[int] = []
        for node in tree.body:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
            if self.groups and start <= ends[-1]:
                self.groups[-1].append(node)
                ends[-1] = max(ends[-1], node.end_lineno or node.lineno)
            else:
                self.groups.append([node])
                ends.append(node.end_lineno or node.lineno)
        # statement i runs from the line after statement i-1 to its own last line
        self.first_lines = [1] + [end + 1 for end in ends[:-1]] if ends else []
        self.indent = first_indent(tree, self.lines)
        self._modules: dict[int, cst.Module] = {}
        self._parsed: dict[int, cst.Module] = {}  # as parsed (the codegen's positions are of these)
        self._positions: dict[int, tuple[Positions, Extents]] = {}  # a full codegen's
        self._lazy: dict[int, LazyPositions] = {}
        self._pairs: dict[int, Paired | None] = {}
        self._plain: dict[int, bool] = {}  # the piece is printable ASCII and "\n" (_PLAIN)

    def text(self, i: int) -> str:
        stop = self.first_lines[i + 1] - 1 if i + 1 < self.count else len(self.lines)
        return "".join(self.lines[self.first_lines[i] - 1 : stop])

    def header(self) -> str:
        return ""  # the first statement's piece starts at line 1

    def footer(self) -> str:
        return ""  # the last statement's piece runs to the end

    def module(self, i: int) -> cst.Module:
        """Statement ``i`` parsed alone: its module holds it and its leading comments."""
        if i not in self._modules:
            text = self.text(i)
            if len(text) * _NODES_PER_CHARACTER > MAX_NODES:
                _check_size(self.groups[i])
            readable = self.readable(i)
            try:
                module = parse_module(readable)
            except cst.ParserSyntaxError:
                raise Disagree from None
            if len(module.body) != 1:
                raise Disagree
            self._parsed[i] = module
            self._plain[i] = bool(_PLAIN.fullmatch(text))
            if not self._plain[i]:
                # libcst reads odd characters (a lone CR, form feeds, backslashes...) in ways
                # of its own: check that the piece reads back as written (else: whole file)
                code, positions, extents = code_and_positions(module)
                self._positions[i] = (positions, extents)
                if code != readable:
                    raise Disagree
            # A statement with blocks keeps the indentation libcst read from it (blocks that
            # use it print with the module's); one without takes the file's for new code.
            indent = module.default_indent
            if indent != self.indent and not _opens_block(self.groups[i]):
                indent = self.indent
            self._modules[i] = rebuilt(  # (with_changes, without its field scan)
                module,
                {
                    "default_newline": self.newline,
                    "default_indent": indent,
                    # libcst misses a final lone "\r"; the piece's own end is what counts
                    "has_trailing_newline": text.endswith(("\n", "\r")),
                },
            )
        return self._modules[i]

    def readable(self, i: int) -> str:
        """Statement ``i``'s text as libcst is given it: its indentation's form feeds out
        (``layout.without_indent_form_feeds``); the text itself almost always."""
        return without_indent_form_feeds(self.text(i))

    def node(self, i: int) -> cst.BaseStatement:
        return self.module(i).body[0]

    def positions(self, i: int) -> Positions:
        """Where each node of statement ``i`` is, lines counted from the piece's first
        (computed when asked for: ``LazyPositions``)."""
        self.module(i)
        if i in self._positions:
            return self._positions[i][0]
        if i not in self._lazy:
            self._lazy[i] = LazyPositions(self._parsed[i])
        return self._lazy[i]

    def site_range(self, i: int, node: cst.CSTNode) -> CodeRange | None:
        """``positions(i)[node]`` from ast's positions, without a codegen, for the nodes
        statement-form sites are (a decorator, an ``if``'s test, a ``with`` item, an
        assignment's value...). None for any other node, or where ast's columns (bytes)
        might not be libcst's (characters)."""
        paired = self._paired(i)
        if paired is None or not self._plain[i]:
            return None
        found = paired.sites.get(node)
        if found is None or found.end_lineno is None or found.end_col_offset is None:
            return None
        offset = paired.offset  # (lines counted from the piece's first, as positions)
        return CodeRange(
            CodePosition(found.lineno - offset, found.col_offset),
            CodePosition(found.end_lineno - offset, found.end_col_offset),
        )

    def extents(self, i: int) -> Extents:
        """The lines each statement inside statement ``i`` spans, from its first line of code
        (``extents.ast_extents``; else, from the codegen, from its leading comments)."""
        paired = self._paired(i)
        return paired.extents if paired is not None else self._codegen(i)[1]

    def _paired(self, i: int) -> Paired | None:
        """Statement ``i``'s libcst tree paired with ast's (None: they differ)."""
        self.module(i)
        if i not in self._pairs:
            self._pairs[i] = ast_extents(self._parsed[i].body, self.groups[i], self.first_lines[i])
        return self._pairs[i]

    def source_text(self, i: int, node: cst.CSTNode) -> str | None:
        self.module(i)
        module = self._parsed[i]
        if node is module.body[0]:
            # the statement prints as its piece does, less the comment lines libcst
            # gives the module (header and footer: whole lines)
            lines = split_lines(self.readable(i))
            return "".join(lines[len(module.header) : len(lines) - len(module.footer)])
        extents = self._codegen(i)[1]
        return extents.text(node) if isinstance(extents, _OffsetExtents) else None

    def _codegen(self, i: int) -> tuple[Positions, Extents]:
        """``code_and_positions``'s positions and extents of statement ``i``."""
        if i not in self._positions:
            _, positions, extents = code_and_positions(self._parsed[i])
            self._positions[i] = (positions, extents)
        return self._positions[i]

    def code(self, i: int, statements: list[cst.BaseStatement]) -> str:
        paired = self._paired(i) if self._plain[i] and self.newline == "\n" else None
        if paired is not None:  # the statements kept as parsed print as their lines
            first = self.first_lines[i] - 1
            stop = self.first_lines[i + 1] - 1 if i + 1 < self.count else len(self.lines)
            kept = Kept(self.lines[first:stop], paired.extents, self._parsed[i].default_indent)
            statements = kept.statements(statements)
        return print_module(rebuilt(self.module(i), {"body": statements}))

    def is_import(self, i: int) -> bool:
        return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in self.groups[i])

    def module_imports(self) -> dict[str, str]:
        """Plain top-level ``import x`` / ``import x.y as z``: local name -> module."""
        out: dict[str, str] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname is not None:
                        out[alias.asname] = alias.name
                    elif "." not in alias.name:
                        out[alias.name] = alias.name
        return out

    def imported_names(self) -> dict[str, str]:
        """Every top-level absolute import: local name -> what it names (``from`` imports too)."""
        out: dict[str, str] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".", 1)[0]
                    out[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                for alias in node.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        return out


class WholeFile(Statements):
    """libcst's parse of the whole file, cut where libcst cuts it (the sure, slower way)."""

    def __init__(self, source: str, module: cst.Module, tree: ast.Module):
        self._init_lines(source)
        self.whole = module
        self.tree = tree
        layout = Layout.by_codegen(source, module)
        self.layout = layout
        self.first_lines = layout.first_lines
        self.newline = module.default_newline
        self._positions: dict[int, tuple[Positions, Extents]] = {}

    def text(self, i: int) -> str:
        return self.layout.text(i)

    def header(self) -> str:
        return self.layout.header()

    def footer(self) -> str:
        return self.layout.footer()

    def node(self, i: int) -> cst.BaseStatement:
        return self.whole.body[i]

    def positions(self, i: int) -> Positions:
        return self._positions_and_extents(i)[0]

    def extents(self, i: int) -> Extents:
        return self._positions_and_extents(i)[1]

    def _positions_and_extents(self, i: int) -> tuple[Positions, Extents]:
        if i not in self._positions:
            module = self.whole.with_changes(body=[self.whole.body[i]], header=[], footer=[])
            _, positions, extents = code_and_positions(module)
            self._positions[i] = (positions, extents)
        return self._positions[i]

    def code(self, i: int, statements: list[cst.BaseStatement]) -> str:
        return "".join(self.whole.code_for_node(s) for s in statements)

    def is_import(self, i: int) -> bool:
        stmt = self.whole.body[i]
        return isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
        )

    def module_imports(self) -> dict[str, str]:
        return Pieces.module_imports(self)  # type: ignore[arg-type]

    def imported_names(self) -> dict[str, str]:
        return Pieces.imported_names(self)  # type: ignore[arg-type]


# Text libcst surely reads back as written: printable ASCII (no backslash) and "\n"
_PLAIN = re.compile(r"[\n\x20-\x5b\x5d-\x7e]*\n")


def _opens_block(nodes: list[ast.stmt]) -> bool:
    """Whether these statements hold a block on lines of its own (libcst infers indent from it)."""
    for top in nodes:
        for node in ast.walk(top):
            body = getattr(node, "body", None)
            if isinstance(node, ast.stmt) and isinstance(body, list) and body:
                if body[0].lineno > node.lineno:
                    return True
    return False


def first_indent(tree: ast.Module, lines: list[str]) -> str:
    """The file's first block indentation, as libcst would infer it from the whole file."""
    for node in tree.body:
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and body[0].lineno > node.lineno:
            line = lines[body[0].lineno - 1]
            return line[: len(line) - len(line.lstrip(" \t"))] or "    "
    return "    "
