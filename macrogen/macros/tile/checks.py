"""Run-time checks of the shapes function: outputs apart from inputs, every index in range."""

from __future__ import annotations

from macrogen.macros.tile.code import name, parse, plus
from macrogen.macros.tile.ir import Accum, InnerLoop, Let, Load, Loop, Nest, Statement, Store
from macrogen.macros.tile.names import Names, loads_in


def alias_checks(nest: Nest) -> list[dict[str, str]]:
    """One check per (output, other tensor) pair: they must not share memory."""
    checks: list[dict[str, str]] = []
    for o in nest.outputs:
        for t, _ in nest.tensors:
            if t == o or (t in nest.outputs and nest.outputs.index(t) < nest.outputs.index(o)):
                continue
            checks.append(
                {
                    "output": o,
                    "other": t,
                    "message": f"{o} and {t} share memory; @tile needs outputs apart from"
                    " the other tensors (pass a fresh tensor, or a clone)",
                }
            )
    return checks


def index_checks(nest: Nest, names: Names) -> list[dict[str, object]]:
    """One range check per distinct (tensor, dimension, loop, offset) the nest indexes with."""
    # (tensor, dim, loop or None, offset, variable), and (tensor, dim, index load, its loops)
    accesses: _Accesses = {}
    gathers: _Gathers = {}
    loops = {g.var: g for g in nest.grid}
    _visit(nest.body, loops, accesses, gathers)
    checks: list[dict[str, object]] = []
    negative: set[tuple[Loop, int]] = set()
    for tensor, d, loop, offset, var in accesses:
        size = f"{tensor}.shape[{d}]"
        if loop is None:
            checks.append(
                {
                    "test": parse(f"{offset} >= {size}"),
                    "error": "IndexError",
                    "message": f"index {offset} is out of range for dimension {d} of {tensor}",
                }
            )
            continue
        b = names.bounds[loop]
        term = var if offset == 0 else f"{var} {'+' if offset > 0 else '-'} {abs(offset)}"
        # a start known at expansion leaves no negative index (the analysis refuses one that
        # would); one known at run time is checked once per (loop, offset)
        if loop.start.size is not None and (loop, offset) not in negative:
            negative.add((loop, offset))
            checks.append(
                {
                    "test": parse(f"{b.lo} < {b.hi} and {plus(name(b.lo), offset)} < 0"),
                    "error": "ValueError",
                    "message": f"index {term} of {tensor} is negative for some {var} in its range:"
                    " Python counts a negative index from the end of the dimension, @tile does"
                    " not wrap it; start the loop where the index is 0 or more",
                }
            )
        checks.append(
            {
                "test": parse(f"{b.lo} < {b.hi} and {plus(name(b.hi), offset)} > {size}"),
                "error": "IndexError",
                "message": f"{tensor}: index {term} leaves dimension {d} for some {var} in its range"
                " (the loop would raise IndexError)",
            }
        )
    for tensor, d, index, scope in gathers:
        # the values the loop would index with: the index tensor over the loops' ranges
        bounds = {v: names.bounds[loop] for v, loop in scope}
        subs = [
            repr(ix.offset)
            if ix.var is None
            else f"{plus(name(bounds[ix.var].lo), ix.offset)}:{plus(name(bounds[ix.var].hi), ix.offset)}"
            f"{bounds[ix.var].step}"
            for ix in index.index
        ]
        values = f"{index.tensor_name}[{', '.join(subs)}]"
        checks.append(
            {
                "test": parse(f"{values}.numel() and {values}.min() < 0"),
                "error": "ValueError",
                "message": f"{tensor}: an index read from {index.tensor_name} is negative: Python"
                f" counts it from the end of dimension {d}, @tile does not wrap it",
            }
        )
        checks.append(
            {
                "test": parse(f"{values}.numel() and {values}.max() >= {tensor}.shape[{d}]"),
                "error": "IndexError",
                "message": f"{tensor}: an index read from {index.tensor_name} leaves dimension {d}"
                " (the loop would raise IndexError)",
            }
        )
    return checks


_Accesses = dict[tuple[str, int, Loop | None, int, str | None], None]
_Gathers = dict[tuple[str, int, Load, tuple[tuple[str, Loop], ...]], None]


def _load(ld: Load, scope: dict[str, Loop], accesses: _Accesses, gathers: _Gathers) -> None:
    for d, ix in enumerate(ld.index):
        if ix.gather is not None:
            _load(ix.gather, scope, accesses, gathers)
            gathers[(ld.tensor_name, d, ix.gather, tuple(scope.items()))] = None
            continue
        key = (ld.tensor_name, d, scope.get(ix.var) if ix.var else None, ix.offset, ix.var)
        accesses[key] = None


def _visit(
    stmts: tuple[Statement, ...], scope: dict[str, Loop], accesses: _Accesses, gathers: _Gathers
) -> None:
    # (functions of their own, not closures that call themselves: reference cycles)
    for s in stmts:
        if isinstance(s, InnerLoop):
            _visit(s.body, {**scope, s.loop.var: s.loop}, accesses, gathers)
            continue
        if isinstance(s, (Let, Accum, Store)):
            for ld in loads_in(s.value):
                _load(ld, scope, accesses, gathers)
        if isinstance(s, Store):
            for d, var in enumerate(s.index):
                accesses[(s.tensor_name, d, scope[var], 0, var)] = None
