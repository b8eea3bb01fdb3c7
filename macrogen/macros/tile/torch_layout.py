"""What the torch path reads off a ``Nest`` before it writes code: its statements, the
axes its values lie on (and their arrangement as slices and matmul operands), the inner
loops it computes once, and the blocks of rows it runs over (torch_path.py writes the code).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from macrogen.macros.tile.code import Code, suffix
from macrogen.macros.tile.ir import Accum, Binary, Expr, InnerLoop, Let, Nest, Statement, Store
from macrogen.macros.tile.names import Names, loads_in, names_in


def all_statements(body: tuple[Statement, ...]) -> list[Let | Accum | Store]:
    """Every statement of ``body``, those of its inner loops too."""
    out: list[Let | Accum | Store] = []
    for st in body:
        if isinstance(st, InnerLoop):
            out.extend(all_statements(st.body))
        else:
            out.append(st)
    return out


def is_product(e: Expr) -> bool:
    """A product of two tensors that vary along loops (``_contract``, ``_matvec`` take it)."""
    return isinstance(e, Binary) and e.op == "*" and bool(e.left.dims) and bool(e.right.dims)


Axes = list[str | None]  # the loop variable on each axis of the nest's tensors (None: none)


def arrange(order: list[str], axes: list[str | None]) -> str:
    """Indexing that puts a slice's dimensions (loop variables ``order``) on ``axes``."""
    if not order:
        return ""
    present = [a for a in axes if a in order]
    code = permutation(order, present)
    if len(present) < len(axes):
        code += "[" + ", ".join(":" if a in order else "None" for a in axes) + "]"
    return code


def matrix_operand(code: Code, axes: Axes, dims: frozenset[str], want: list[str]) -> Code:
    """A tensor on the nest's axes (varying along ``dims``, size 1 elsewhere) as a matmul
    operand whose dimensions are the loop variables ``want``: index 0 on the other axes,
    then reorder (``.mT`` for a swap of the last two)."""
    subs = [":" if a in dims else "0" for a in axes]
    while subs and subs[-1] == ":":
        subs.pop()
    picked = suffix(code, f"[{', '.join(subs)}]" if subs else "")
    have = [a for a in axes if a is not None and a in dims]
    if len(want) >= 2 and have != want and have == [*want[:-2], want[-1], want[-2]]:
        return suffix(picked, ".mT")
    return suffix(picked, permutation(have, want))


def permutation(have: list[str], want: list[str]) -> str:
    if have == want:
        return ""
    return f".permute({', '.join(str(have.index(v)) for v in want)})"


def repeated_loops(nest: Nest) -> set[InnerLoop]:
    """Inner loops that occur more than once and read no locals (a row's scores, recomputed
    in each pass over the row): the torch path computes their reductions once."""
    loops = Counter(nest.all_inner_loops)
    assigned = {
        st.name for loop in loops for st in (*nest.body, *loop.body) if isinstance(st, (Let, Accum))
    }

    def pure(loop: InnerLoop) -> bool:
        return all(
            isinstance(st, Accum) and not (names_in(st.value) & assigned) for st in loop.body
        )

    return {loop for loop, count in loops.items() if count > 1 and pure(loop)}


BLOCK_ELEMENTS = 1 << 18  # elements per block of rows (1 MiB of float32): cache-sized passes
MIN_BLOCK_ROWS = 8  # rows per block at least (per-operation overhead would dominate)


@dataclass(frozen=True)
class RowBlocks:
    """The torch path runs over blocks of the first parallel loop's rows, so that a
    multi-pass computation (GELU's chain of operations, a row's sum then max) reads each
    block from cache instead of memory: ``for lo in range(first, last, block)``."""

    lo: str  # the loop's bounds, rebound per block
    hi: str
    first: str  # its whole range
    last: str
    rows: str  # rows per block
    step: int
    per_row: str  # code: elements of the widest tensor per row (at least 1)


def row_blocks(nest: Nest, names: Names) -> RowBlocks | None:
    """Blocks of the first grid loop for the torch path; None where it has matrix products
    (a matmul, ``_contract``, ``_matvec``): BLAS blocks those itself, and smaller products
    run slower (measured: attention and batched_gate of bench/tile.py)."""
    products = any(
        isinstance(st, Accum) and st.op == "sum" and is_product(st.value)
        for st in all_statements(nest.body)
    )
    if nest.dot is not None or products or not nest.grid:
        return None
    first = nest.grid[0]
    extents = {b.var: f"{b.hi} - {b.lo}" for b in names.bounds.values()}  # (one loop per var)
    widths = set()
    for dims in dim_sets(nest):
        if first.var in dims and len(dims) > 1:
            others = [extents[v] for v in sorted(dims - {first.var})]
            widths.add(others[0] if len(others) == 1 else " * ".join(f"({e})" for e in others))
    per_row = f"max({', '.join(sorted(widths))}, 1)" if widths else "1"  # 1: no empty range
    b = names.bounds[first]
    step = int(b.step[1:]) if b.step else 1
    namer = names.namer
    return RowBlocks(
        b.lo,
        b.hi,
        namer(f"{first.var}_first"),
        namer(f"{first.var}_last"),
        namer("rows"),
        step,
        per_row,
    )


def dim_sets(nest: Nest) -> set[frozenset[str]]:
    """The loop variables each value of the nest varies along (its tensors' shapes)."""
    found: set[frozenset[str]] = set()
    for st in all_statements(nest.body):
        found.add(st.value.dims)
        found.update(ld.dims for ld in loads_in(st.value))
        if isinstance(st, Store):
            found.add(frozenset(st.index))
    return found
