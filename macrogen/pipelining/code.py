"""forward's statements as functions: the code a pipeline stage runs (written at expansion,
or at run time for ``mg.parallelize(pp=N)``).

Each top-level statement becomes ``def <name>(self, <reads>): <statement>; return
<writes>``; a loop over a ModuleList becomes its body, ``def <name>(self, block,
<reads>)``, run once per block. The statement's lines are copied as they are
(comments included), so the generated file reads like forward, and the line
map (``macrogen/linemap.py``) can give a frame in them the user's line.
"""

from __future__ import annotations

import ast

from macrogen.pipelining.analysis import Analysed

INDENT = "    "


def unit_function(a: Analysed, k: int, name: str) -> str:
    """Statement k's function (``def`` line, the copied lines, the return)."""
    stmt = a.forward.statements[k]
    node = a.nodes[k]
    params = [a.self_name]
    if stmt.loop is not None:
        params.append(node.target.id)  # type: ignore[attr-defined]
        body = list(node.body)  # type: ignore[attr-defined]
    else:
        body = [node]
    params.extend(stmt.reads)
    lines = _lines(a, node, body)
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
    if stmt.writes:
        lines.append(f"{indent}return {', '.join(stmt.writes)}")
    return f"def {name}({', '.join(params)}):\n" + "".join(line + "\n" for line in lines)


def _lines(a: Analysed, owner: ast.stmt, body: list[ast.stmt]) -> list[str]:
    """The statements' own lines, re-indented one level where that changes no string."""
    source = a.source.splitlines()
    first, last = body[0].lineno, body[-1].end_lineno or body[-1].lineno
    shared = source[first - 1][: body[0].col_offset].strip() or any(
        n.lineno <= last and (n.end_lineno or n.lineno) >= first
        for n in a.node.body
        if n is not owner
    )
    if shared:  # `a; b` or `for block in self.blocks: x = block(x)`: no whole lines to copy
        return [INDENT + line for b in body for line in ast.unparse(b).splitlines()]
    lines = source[first - 1 : last]
    multiline_string = any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and n.end_lineno != n.lineno
        for b in body
        for n in ast.walk(b)
    )
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
    if multiline_string or not all(not ln.strip() or ln.startswith(indent) for ln in lines):
        return lines  # a string's lines keep their text: the body keeps its indentation
    return [INDENT + ln[len(indent) :] if ln.strip() else "" for ln in lines]
