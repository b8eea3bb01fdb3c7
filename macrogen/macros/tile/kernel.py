"""The Triton kernel of a ``Nest``: the steps that templates/tile_kernel.py.j2 lays out.

Tiles have one axis per grid loop (plus a trailing axis for inner loops); a
loop variable is an ``arange`` broadcast along its axis, so ``b[j]`` loads a
``(1, BLOCK_J)`` row and the arithmetic broadcasts as the loop's scalars would.
Inner loops walk their row one tile at a time; a reduction keeps a tile-shaped
accumulator and folds it after the loop; a matmul-shaped one is a ``tl.dot``
per K tile. Masks are computed once per scope and named.

A *persistent* variant (``steps(persistent=True)``, for a nest that
``persistent_ok``) is the same body with each inner loop's row in one block
(the launcher passes ``BLOCK_J`` >= the row's length): no ``for``, and every
pass over a row reads the values the first pass loaded, from registers. The
kernel holds both variants under ``if PERSISTENT:`` (a constexpr), and the
launcher picks one from the sizes (``PERSISTENT_MAX`` elements per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from macrogen.macros.tile.code import (
    Code,
    binary,
    call,
    chain,
    method,
    name,
    number,
    parse,
    plus,
    suffix,
)
from macrogen.macros.tile.ir import (
    Accum,
    Const,
    Expr,
    Index,
    InnerLoop,
    Let,
    Load,
    Nest,
    Statement,
    Store,
)
from macrogen.macros.tile.names import Names, load_name, load_vars, loads_in
from macrogen.macros.tile.printer import TritonPrinter
from macrogen.macros.tile.steps import (
    Assign,
    LoopBlock,
    Step,
    TritonStore,
    Widen,
    drop_dead_stores,
)

IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf, "expsum": 0.0}
# the longest row a persistent reduction holds in registers (float32 elements per row; the
# launcher also shrinks the grid's tiles so that a program holds at most PERSISTENT_TILE)
PERSISTENT_MAX = 16384
PERSISTENT_TILE = 8192
# and at most this many rows: each row's reduction crosses the program's warps (shuffles, and
# shared memory with a barrier per step), so short rows packed 8 to a program (8 x 1024 at 16
# warps: 72 shuffles and 9 barriers in its sm_90 PTX, against 18 and 1 for 2 x 4096) spend
# longer reducing than loading; 2 x 1024 at 4 warps: 15 and 1 (docs/tile.md, Persistent)
PERSISTENT_ROWS = 2


def persistent_ok(nest: Nest) -> bool:
    """Whether the kernel gets a persistent variant: one level of inner loops (no tl.dot), and
    the loops over one variable share their bounds (so that passes share the loaded row)."""
    loops = nest.inner_loops
    if not loops or nest.dot is not None or nest.depth != 1:
        return False
    ranges: dict[str, tuple[object, ...]] = {}
    for s in loops:
        key = (s.loop.start, s.loop.stop, s.loop.step)
        if ranges.setdefault(s.loop.var, key) != key:
            return False
    return True


@dataclass
class _Scope:
    """What loop variables mean where code is emitted: index code, masks, loaded values."""

    index: dict[str, Code]  # loop variable -> its index vector
    masks: dict[str, str]  # loop variable -> its mask
    loaded: dict[Load, str]
    sink: list[Step]  # where a combined mask goes when first needed
    combined: dict[frozenset[str], str] | None = field(default_factory=dict)  # None: inline


class KernelEmitter:
    def __init__(self, nest: Nest, names: Names, tl: str, dot_precision: str):
        self.nest = nest
        self.names = names
        self.tl = tl
        self.dot_precision = dot_precision  # the constexpr's name ("" without a dot)
        self.grid_vars = tuple(loop.var for loop in nest.grid)
        self.rank = nest.rank
        self.identity: dict[str, float] = {}  # locals whose value is still a constant
        self.rows: dict[str, _Scope] | None = None  # persistent: loop variable -> its row

    def axis_suffix(self, axis: int) -> str:
        if self.rank == 1:
            return ""
        return "[" + ", ".join(":" if a == axis else "None" for a in range(self.rank)) + "]"

    def arange(self, block: str, axis: int) -> Code:
        return suffix(call(f"{self.tl}.arange", "0", block), self.axis_suffix(axis))

    def _spaced(self, code: Code, step: int) -> Code:
        """Tile positions times a loop's step: the indices the loop visits."""
        return code if step == 1 else binary("*", code, number(step))

    def grid_setup(
        self, pid: str, tiles: dict[str, int], group: str = ""
    ) -> list[dict[str, object]]:
        """Per grid loop: this program's tile index, index vector and mask (last loop fastest).

        With ``group`` (a matmul), tiles go in grouped order as in Triton's matmul
        tutorial: ``group`` rows of tiles walk the columns together, so the
        columns they read stay in L2 (``self.grouping`` computes where a group starts).
        """
        namer = self.names.namer
        counts = [namer(f"tiles_{loop.var}") for loop in self.nest.grid]
        self.grouping: list[Assign] = []
        if group:
            in_group, first, rows = namer("in_group"), namer("first_row"), namer("group_rows")
            per_group = binary("*", name(group), name(counts[1]))
            self.grouping = [
                Assign(in_group, parse(per_group)),
                Assign(
                    first, parse(binary("*", binary("//", name(pid), name(in_group)), name(group)))
                ),
                Assign(
                    rows,
                    parse(
                        call(f"{self.tl}.minimum", binary("-", name(counts[0]), name(first)), group)
                    ),
                ),
            ]
            local = binary("%", name(pid), name(in_group))
            grouped = [
                binary("+", name(first), binary("%", local, name(rows))),
                binary("//", local, name(rows)),
            ]
        out = []
        for axis, loop in enumerate(self.nest.grid):
            pid_code = name(pid)
            later = [name(c) for c in counts[axis + 1 :]]
            if later:
                pid_code = binary("//", pid_code, chain("*", later))
            if axis > 0:
                pid_code = binary("%", pid_code, name(counts[axis]))
            if group:
                pid_code = grouped[axis]
            block = self.names.block[loop.var]
            bounds = self.names.bounds[loop]
            pid_var = namer(f"pid_{loop.var}")
            iterations = binary("-", name(bounds.hi), name(bounds.lo))
            if loop.step != 1:
                iterations = call(f"{self.tl}.cdiv", iterations, number(loop.step))
            tile_start = binary("*", name(pid_var), name(block))
            if loop.step == 1:  # integers: the grouping does not matter, leave it out
                index = chain("+", [name(bounds.lo), tile_start, self.arange(block, axis)])
            else:
                offsets = binary("+", tile_start, self.arange(block, axis))
                index = binary("+", name(bounds.lo), self._spaced(offsets, loop.step))
            out.append(
                {
                    "var": loop.var,
                    "lo": bounds.lo,
                    "hi": bounds.hi,
                    "block_value": tiles[loop.var],
                    "tiles": counts[axis],
                    "count": parse(call(f"{self.tl}.cdiv", iterations, block)),
                    "pid": pid_var,
                    "pid_code": parse(pid_code),
                    "index": parse(index),
                    "mask": self.names.mask[loop.var],
                }
            )
        return out

    def steps(self, persistent: bool = False) -> list[Step]:
        """The body's steps; ``persistent``: each inner loop's row in one block, loaded once."""
        self.rows = {} if persistent else None
        out: list[Step] = [Widen(self.grid_vars, self.names.wide)]
        grid = _Scope({v: name(v) for v in self.grid_vars}, dict(self.names.mask), {}, out)
        for s in self.nest.body:
            if isinstance(s, InnerLoop):
                self._hoist(s, grid)
                if self.rows is not None:
                    out.extend(self._row(s, grid))
                else:
                    out.append(
                        self._dot_loop(s, grid)
                        if self.nest.dot is not None
                        else self._loop(s, grid)
                    )
            else:
                assert not isinstance(s, Accum)  # reductions live in inner loops
                self._statement(s, grid, out)
        return drop_dead_stores(out)

    def _hoist(self, s: InnerLoop, outer: _Scope) -> None:
        """Loads inside the loop (and the loops in it) that don't depend on its variable are
        loaded once, before it."""
        for st in flat(s.body):
            for ld in loads_in(st.value):
                if s.loop.var not in ld.dims and ld.dims <= set(outer.index):
                    self._ensure(ld, outer, outer.sink)
                for ix in ld.index:  # the indices of a gather along the loop, loaded once
                    if (
                        ix.gather is not None
                        and s.loop.var not in ix.gather.dims
                        and ix.gather.dims <= set(outer.index)
                    ):
                        self._ensure(ix.gather, outer, outer.sink, index=True)

    # -- addresses, masks, loads -------------------------------------------------------------
    def _address(self, tensor: str, index: tuple[Index, ...], scope: _Scope) -> Code:
        terms = [name(self.names.ptr[tensor])]
        for d, ix in enumerate(index):
            stride = name(self.names.strides[tensor][d])
            if ix.gather is not None:  # an indirect read: the loaded index, in 64 bits
                terms.append(binary("*", name(scope.loaded[ix.gather]), stride))
                continue
            if ix.var is None:
                if ix.offset:
                    terms.append(binary("*", number(ix.offset), stride))
                continue
            terms.append(binary("*", plus(scope.index[ix.var], ix.offset), stride))
        return chain("+", terms)

    def _mask(self, variables: list[str], scope: _Scope) -> Code | None:
        """The mask of the tile along ``variables``; a combination is named once per scope."""
        if not variables:
            return None
        both = chain("&", [name(scope.masks[v]) for v in variables])
        if len(variables) == 1 or scope.combined is None:
            return both
        key = frozenset(variables)
        if key not in scope.combined:
            scope.combined[key] = self.names.namer("mask")
            scope.sink.append(Assign(scope.combined[key], parse(both)))
        return name(scope.combined[key])

    def _load(self, ld: Load, scope: _Scope, upcast: bool, other: str = "0.0") -> Assign:
        mask = self._mask(load_vars(ld), scope)
        address = self._address(ld.tensor_name, ld.index, scope)
        code = (
            call(f"{self.tl}.load", address, mask=mask, other=other)
            if mask is not None
            else call(f"{self.tl}.load", address)
        )
        if upcast:
            code = method(code, "to", f"{self.tl}.float32")
        local = scope.loaded[ld] = self.names.namer(load_name(ld))
        return Assign(local, parse(code))

    def _loads(self, value: Expr, scope: _Scope, into: list[Step]) -> None:
        for ld in loads_in(value):
            self._ensure(ld, scope, into)

    def _ensure(self, ld: Load, scope: _Scope, into: list[Step], index: bool = False) -> None:
        """Load ``ld`` into a local (after the indices it gathers by) unless it already is;
        an ``index`` (a gather's integers) stays integer."""
        if ld in scope.loaded:
            return
        for ix in ld.index:
            if ix.gather is not None:
                self._ensure(ix.gather, scope, into, index=True)
        into.append(self._load(ld, scope, upcast=not index, other="0" if index else "0.0"))
        if index:  # gathered indices multiply strides too
            into.append(Widen((scope.loaded[ld],), self.names.wide))

    # -- statements ------------------------------------------------------------------------------
    def _statement(
        self, s: Let | Store, scope: _Scope, into: list[Step], level: tuple[str, ...] = ()
    ) -> None:
        self._loads(s.value, scope, into)
        value = TritonPrinter(scope.loaded, self.tl).expr(s.value)
        if isinstance(s, Let):
            if isinstance(s.value, Const):
                self.identity[s.name] = s.value.value
            else:
                self.identity.pop(s.name, None)
            into.append(Assign(s.name, parse(value)))
            return
        tl = self.tl
        pointer = self._address(s.tensor_name, tuple(Index(v, 0) for v in s.index), scope)
        mask = self._mask(list(s.index), scope)
        if s.cond is not None:  # stored only where the if's condition holds
            self._loads(s.cond, scope, into)
            cond = TritonPrinter(scope.loaded, tl).expr(s.cond)
            mask = binary("&", mask, cond) if mask is not None else cond
        if not s.value.tensor:  # a number: make it a tile so that it has a dtype to cast
            zeros = call(f"{tl}.zeros", self._store_shape(s, level), dtype=f"{tl}.float32")
            value = binary("+", value, zeros)
        if s.add:  # read-modify-write: name the pointers, they are used twice
            ptrs = self.names.namer(f"{s.tensor_name}_ptrs")
            into.append(Assign(ptrs, parse(pointer)))
            pointer = name(ptrs)
            old = call(f"{tl}.load", pointer, mask=mask) if mask else call(f"{tl}.load", pointer)
            value = binary("+", method(old, "to", f"{tl}.float32"), value)
        ptr = self.names.ptr[s.tensor_name]
        value = method(value, "to", f"{ptr}.dtype.element_ty")
        into.append(TritonStore(parse(pointer), parse(value), parse(mask) if mask else None))

    def _store_shape(self, s: Store, level: tuple[str, ...]) -> str:
        """The shape of a store's pointer tile: its loop variables' blocks on their axes."""
        axes = [*self.grid_vars, *level]
        blocks = [self.names.block[v] if v in s.index else "1" for v in axes]
        return "[" + ", ".join(blocks + ["1"] * (self.rank - len(blocks))) + "]"

    # -- inner loops -----------------------------------------------------------------------------
    def _loop(
        self,
        s: InnerLoop,
        outer: _Scope,
        level: tuple[str, ...] = (),
        scope: _Scope | None = None,
    ) -> LoopBlock:
        """The tiles of an inner loop; ``level``: the inner loops around it (their variables).
        With ``scope`` (a persistent row, set up by ``_row``) the steps are for one block: the
        caller lays out ``before``, ``body`` and ``after`` without the ``for``."""
        loop, namer, tl = s.loop, self.names.namer, self.tl
        bounds = self.names.bounds[loop]
        block = self.names.block[loop.var]
        axis = len(self.grid_vars) + len(level)
        setup: list[Step] = []
        start = ""
        if scope is None:
            start = namer(f"{loop.var}_start")
            inner_mask = namer(f"{loop.var}_mask")
            offsets = self._spaced(self.arange(block, axis), loop.step)
            setup = [
                Assign(loop.var, parse(binary("+", name(start), offsets))),
                Widen((loop.var,), self.names.wide),
                Assign(inner_mask, parse(binary("<", name(loop.var), name(bounds.hi)))),
            ]
            scope = _Scope(
                {**outer.index, loop.var: name(loop.var)},
                {**outer.masks, loop.var: inner_mask},
                dict(outer.loaded),
                setup,
                dict(outer.combined or {}),
            )
        once = not start  # one block: an accumulator starts as its first (only) value
        here = (*level, loop.var)
        body: list[Step] = []
        before: list[Assign] = []
        after: list[Assign] = []
        tail: list[Assign] = []  # an online softmax's running max, updated after its sum
        axes = [*(self.names.block[v] for v in (*self.grid_vars, *here))]
        shape = "[" + ", ".join(axes + ["1"] * (self.rank - len(axes))) + "]"
        shifts = {st.shift for st in s.body if isinstance(st, Accum) and st.shift}
        running: dict[str, tuple[str, str]] = {}  # max local -> (its tile, the tile's next value)
        for st in s.body:
            if isinstance(st, InnerLoop):
                self._hoist(st, scope)
                body.append(self._loop(st, scope, here))
                continue
            if not isinstance(st, Accum):
                self._statement(st, scope, body, here)
                continue
            self._loads(st.value, scope, body)
            tile = namer(f"{st.name}_tile")
            identity = number(IDENTITY[st.op])
            before.append(Assign(tile, parse(call(f"{tl}.full", shape, identity, f"{tl}.float32"))))
            mask = self._mask([*self.grid_vars, *here], scope)  # padding adds nothing
            assert mask is not None  # an inner loop always has its own mask
            printed = TritonPrinter(scope.loaded, tl).expr(st.value)
            reduce_axis = str(axis)
            if once:  # one block: reduce it now; an online softmax's sum uses the row's max
                before.pop()
                op, identity = st.op, number(IDENTITY[st.op])
                if st.op == "expsum":
                    assert st.shift is not None
                    printed = call(f"{tl}.exp", binary("-", printed, name(st.shift)))
                    op = "sum"
                body.append(Assign(tile, parse(call(f"{tl}.where", mask, printed, identity))))
                reduced = call(f"{tl}.{op}", tile, axis=reduce_axis, keep_dims="True")
                body.append(Assign(st.name, parse(self._combine(op, st.name, reduced))))
                continue
            if st.op == "expsum":  # s * exp(m_old - m_new) + exp(e - m_new), per lane
                assert st.shift is not None
                old, new = running[st.shift]
                alpha = call(
                    f"{tl}.where",
                    binary("==", name(old), name(new)),
                    "1.0",
                    call(f"{tl}.exp", binary("-", name(old), name(new))),
                )
                term = call(
                    f"{tl}.where", mask, call(f"{tl}.exp", binary("-", printed, name(new))), "0.0"
                )
                body.append(Assign(tile, parse(binary("+", binary("*", name(tile), alpha), term))))
                # fold: each lane's sum rescaled to the row's max (lanes already at it as they are)
                final = st.shift  # its after-loop value: the row's max
                lanes = call(
                    f"{tl}.where",
                    binary("==", name(old), name(final)),
                    tile,
                    binary("*", name(tile), call(f"{tl}.exp", binary("-", name(old), name(final)))),
                )
                reduced = call(f"{tl}.sum", lanes, axis=reduce_axis, keep_dims="True")
                assert self.identity.pop(st.name, None) == 0.0
                after.append(Assign(st.name, parse(reduced)))
                continue
            value = call(f"{tl}.where", mask, printed, identity)
            combine = {
                "sum": binary("+", name(tile), value),
                "max": call(f"{tl}.maximum", tile, value),
                "min": call(f"{tl}.minimum", tile, value),
            }[st.op]
            if st.name in shifts:  # the running max: the sum reads both its old and new value
                nxt = namer(f"{st.name}_next")
                running[st.name] = (tile, nxt)
                body.append(Assign(nxt, parse(combine)))
                tail.append(Assign(tile, parse(name(nxt))))
                assert self.identity.get(st.name) == -math.inf
            else:
                body.append(Assign(tile, parse(combine)))
            reduced = call(f"{tl}.{st.op}", tile, axis=reduce_axis, keep_dims="True")
            after.append(Assign(st.name, parse(self._combine(st.op, st.name, reduced))))
        body.extend(tail)
        return LoopBlock(
            start=start,
            lo=bounds.lo,
            hi=bounds.hi,
            block=block,
            stride=parse(self._spaced(name(block), loop.step)),
            step=loop.step,
            before=tuple(before),
            setup=tuple(setup),
            body=tuple(body),
            after=tuple(after),
            var=loop.var,
            dot=False,
        )

    def _row(self, s: InnerLoop, grid: _Scope) -> list[Step]:
        """A top-level inner loop whose whole row is one block: straight-line steps. The first
        loop over a variable sets up its index and mask; later passes reuse them and its loads."""
        assert self.rows is not None
        loop = s.loop
        out = grid.sink  # the setup first: combined masks follow it there as they are needed
        scope = self.rows.get(loop.var)
        if scope is None:
            bounds = self.names.bounds[loop]
            mask = self.names.namer(f"{loop.var}_mask")
            offsets = self._spaced(
                self.arange(self.names.block[loop.var], len(self.grid_vars)), loop.step
            )
            out += [
                Assign(loop.var, parse(binary("+", name(bounds.lo), offsets))),
                Widen((loop.var,), self.names.wide),
                Assign(mask, parse(binary("<", name(loop.var), name(bounds.hi)))),
            ]
            scope = _Scope(
                {**grid.index, loop.var: name(loop.var)},
                {**grid.masks, loop.var: mask},
                grid.loaded,  # loads of the grid's tile hoisted later are seen here too
                grid.sink,
                grid.combined,
            )
            self.rows[loop.var] = scope
        block = self._loop(s, grid, scope=scope)
        return [*block.before, *block.body, *block.after]

    def _dot_loop(self, s: InnerLoop, grid: _Scope) -> LoopBlock:
        dot = self.nest.dot
        assert dot is not None
        loop, namer, tl = s.loop, self.names.namer, self.tl
        bounds = self.names.bounds[loop]
        start = namer(f"{loop.var}_start")
        block = self.names.block[loop.var]
        g0, g1 = self.grid_vars
        left_k, right_k = namer(f"{loop.var}_left"), namer(f"{loop.var}_right")
        left_mask, right_mask = namer(f"{loop.var}_left_mask"), namer(f"{loop.var}_right_mask")
        arange = call(f"{tl}.arange", "0", block)
        row = self._spaced(suffix(arange, "[None, :]"), loop.step)
        column = self._spaced(suffix(arange, "[:, None]"), loop.step)
        setup: list[Step] = [
            Assign(left_k, parse(binary("+", name(start), row))),
            Assign(right_k, parse(binary("+", name(start), column))),
            Widen((left_k, right_k), self.names.wide),
            Assign(left_mask, parse(binary("<", name(left_k), name(bounds.hi)))),
            Assign(right_mask, parse(binary("<", name(right_k), name(bounds.hi)))),
        ]
        native = isinstance(dot.left, Load) and isinstance(dot.right, Load)
        body: list[Step] = []
        operands = []
        for e, k_code, k_mask in ((dot.left, left_k, left_mask), (dot.right, right_k, right_mask)):
            scope = _Scope(
                {g0: name(g0), g1: name(g1), loop.var: name(k_code)},
                {**grid.masks, loop.var: k_mask},
                dict(grid.loaded),
                setup,
                None,  # each operand's mask is used once
            )
            for ld in loads_in(e):
                if ld not in scope.loaded:
                    body.append(self._load(ld, scope, upcast=not native))
            code = TritonPrinter(scope.loaded, tl).expr(e)
            if not isinstance(e, Load):  # padding along k must add nothing
                code = call(f"{tl}.where", k_mask, code, "0.0")
            operands.append(code)
        tile = namer(f"{dot.acc}_tile")
        zeros = call(f"{tl}.zeros", self._tile_shape(), dtype=f"{tl}.float32")
        product = call(f"{tl}.dot", *operands, tile, input_precision=self.dot_precision)
        body.append(Assign(tile, parse(product)))
        return LoopBlock(
            start=start,
            lo=bounds.lo,
            hi=bounds.hi,
            block=block,
            stride=parse(self._spaced(name(block), loop.step)),
            step=loop.step,
            before=(Assign(tile, parse(zeros)),),
            setup=tuple(setup),
            body=tuple(body),
            after=(Assign(dot.acc, parse(self._combine("sum", dot.acc, name(tile)))),),
            var=loop.var,
            dot=True,
        )

    def _tile_shape(self) -> str:
        return "[" + ", ".join(self.names.block[v] for v in self.grid_vars) + "]"

    def _combine(self, op: str, acc: str, reduced: Code) -> Code:
        """Fold a reduced tile into the local ``acc`` (just the tile while ``acc`` is the identity)."""
        if self.identity.pop(acc, None) == IDENTITY[op]:
            return reduced
        if op == "sum":
            return binary("+", name(acc), reduced)
        return call(f"{self.tl}.{'maximum' if op == 'max' else 'minimum'}", acc, reduced)


def flat(body: tuple[Statement, ...]) -> list[Let | Accum | Store]:
    """The statements of ``body`` and of the loops in it."""
    out: list[Let | Accum | Store] = []
    for st in body:
        out.extend(flat(st.body) if isinstance(st, InnerLoop) else [st])
    return out
