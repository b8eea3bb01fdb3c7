"""Turn a ``Nest`` (tile_ir.py) into the pieces @tile's templates lay out.

Two emitters walk the same statements:

- ``kernel_steps``: Triton code for one tile. Tiles have one axis per grid loop
  (plus a trailing axis for inner loops); a loop variable is an ``arange``
  broadcast along its axis, so ``b[j]`` loads a ``(1, BLOCK_J)`` row and the
  arithmetic broadcasts like the loop nest's scalars would.
- ``torch_steps``: the same computation on whole tensors. Each load is a slice
  of its tensor arranged on the same axes (``b[None, j_lo:j_hi]``), reductions
  are ``.sum``/``.amax`` with ``keepdim``, and a matmul-shaped reduction is ``@``.

Code is built as text from validated identifiers and ``repr`` of numbers only,
then parsed into libcst expressions (rendered by the templates' ``code`` filter).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import libcst as cst

from macrogen.codegen import ident
from macrogen.macros.tile_ir import (
    Accum,
    Binary,
    Bound,
    Call,
    Const,
    Expr,
    Index,
    InnerLoop,
    Let,
    Load,
    Loop,
    Name,
    Nest,
    Store,
    Unary,
)

_IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def parse(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def number(value: float | int) -> str:
    if isinstance(value, float) and math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return f"({value!r})" if value < 0 else repr(value)  # (-0.25) ** 2, not -(0.25 ** 2)


class Namer:
    """Names for generated locals that collide with none of the user's names."""

    def __init__(self, taken: set[str]):
        self.taken = set(taken)

    def __call__(self, hint: str) -> str:
        name, n = hint, 1
        while name in self.taken:
            n += 1
            name = f"{hint}_{n}"
        self.taken.add(name)
        return ident(name)


# -- what the templates receive --------------------------------------------------------
@dataclass(frozen=True)
class Assign:
    target: str
    value: cst.BaseExpression
    kind: str = "assign"


@dataclass(frozen=True)
class TritonStore:
    pointer: cst.BaseExpression
    value: cst.BaseExpression
    mask: cst.BaseExpression
    kind: str = "store"


@dataclass(frozen=True)
class TorchStore:
    target: cst.BaseExpression  # out[i_lo:i_hi, ...]
    value: cst.BaseExpression
    add: bool
    kind: str = "store"


@dataclass(frozen=True)
class LoopBlock:
    start: str  # the tile's first index
    lo: str
    hi: str
    block: str  # the BLOCK_ constexpr
    setup: tuple[Assign, ...]  # index vectors and masks
    body: tuple
    before: tuple[Assign, ...]  # accumulator tiles
    after: tuple[Assign, ...]  # reduce the tiles into the locals
    var: str
    dot: bool
    kind: str = "loop"


@dataclass(frozen=True)
class LoopBounds:
    """``lo``/``hi`` names of one loop and their code in terms of sizes."""

    var: str
    lo: str
    hi: str
    lo_code: cst.BaseExpression
    hi_code: cst.BaseExpression


@dataclass
class Names:
    """Every generated name of one nest, shared by the launcher, kernel and torch path."""

    namer: Namer
    ptr: dict[str, str] = field(default_factory=dict)  # tensor -> pointer argument
    strides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    block: dict[str, str] = field(default_factory=dict)  # loop variable -> BLOCK_ constexpr
    bounds: dict[Loop, LoopBounds] = field(default_factory=dict)
    mask: dict[str, str] = field(default_factory=dict)  # grid variable -> its mask

    def fork(self) -> Names:
        """The same names, with a namer of its own for one generated function's locals."""
        return dataclasses.replace(self, namer=Namer(self.namer.taken))


def make_names(nest: Nest, taken: set[str]) -> Names:
    namer = Namer(taken)
    names = Names(namer)
    for tensor, ndim in nest.tensors:
        names.ptr[tensor] = namer(f"{tensor}_ptr")
        names.strides[tensor] = tuple(namer(f"stride_{tensor}{d}") for d in range(ndim))
    loops = [*nest.grid, *(s.loop for s in nest.inner_loops)]
    for loop in loops:
        if loop.var not in names.block:
            names.block[loop.var] = namer(f"BLOCK_{loop.var.upper()}")
        if loop not in names.bounds:
            names.bounds[loop] = LoopBounds(
                loop.var,
                namer(f"{loop.var}_lo"),
                namer(f"{loop.var}_hi"),
                parse(_bound(loop.start)),
                parse(_bound(loop.stop)),
            )
    for loop in nest.grid:
        names.mask[loop.var] = namer(f"{loop.var}_mask")
    return names


def _bound(b: Bound) -> str:
    if b.size is None:
        return repr(b.offset)
    if b.offset == 0:
        return ident(b.size)
    return f"{ident(b.size)} {'+' if b.offset > 0 else '-'} {abs(b.offset)}"


def _offset(code: str, offset: int) -> str:
    if offset == 0:
        return code
    return f"({code} {'+' if offset > 0 else '-'} {abs(offset)})"


def _load_name(load: Load) -> str:
    parts = []
    for ix in load.index:
        if ix.var is None:
            parts.append(str(ix.offset))
        else:
            parts.append(
                ix.var
                + ("" if ix.offset == 0 else f"{'p' if ix.offset > 0 else 'm'}{abs(ix.offset)}")
            )
    sep = "" if all(len(p) == 1 for p in parts) else "_"
    return f"{load.tensor_name}_{sep.join(parts)}"


def loads_in(e: Expr) -> list[Load]:
    if isinstance(e, Load):
        return [e]
    if isinstance(e, Unary):
        return loads_in(e.operand)
    if isinstance(e, Binary):
        return loads_in(e.left) + loads_in(e.right)
    if isinstance(e, Call):
        return [ld for a in e.args for ld in loads_in(a)]
    return []


def _statement_loads(s: Let | Accum | Store) -> list[Load]:
    return loads_in(s.value)


# -- expressions, shared by both emitters ------------------------------------------------
class _Expressions:
    """Expression code; each flavour (Triton, torch) says how to write powers and calls."""

    def __init__(self, loaded: dict[Load, str]):
        self.loaded = loaded

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return number(e.value)
        if isinstance(e, Name):
            return ident(e.name)
        if isinstance(e, Load):
            return ident(self.loaded[e])
        if isinstance(e, Unary):
            return f"(-{self.expr(e.operand)})"
        if isinstance(e, Binary):
            if e.op == "**":
                return self.power(e)  # type: ignore[attr-defined]
            return f"({self.expr(e.left)} {e.op} {self.expr(e.right)})"
        if isinstance(e, Call):
            return self.call(e)  # type: ignore[attr-defined]
        raise AssertionError(e)


class TritonExpressions(_Expressions):
    def __init__(self, loaded: dict[Load, str], tl: str):
        super().__init__(loaded)
        self.tl = ident(tl)

    def power(self, e: Binary) -> str:
        base = self.expr(e.left)
        assert isinstance(e.right, Const)
        return "(" + " * ".join([base] * int(e.right.value)) + ")"

    def call(self, e: Call) -> str:
        args = [self.expr(a) for a in e.args]
        tl = self.tl
        if e.fn == "tanh":  # tl has no tanh: tanh(x) = 2 sigmoid(2x) - 1
            return f"(2.0 * {tl}.sigmoid(2.0 * {args[0]}) - 1.0)"
        name = {"max": "maximum", "min": "minimum"}.get(e.fn, e.fn)
        return f"{tl}.{name}({', '.join(args)})"


class TorchExpressions(_Expressions):
    def __init__(self, loaded: dict[Load, str], torch: str):
        super().__init__(loaded)
        self.torch = ident(torch)

    def power(self, e: Binary) -> str:
        assert isinstance(e.right, Const)
        return f"({self.expr(e.left)} ** {e.right.value!r})"

    def call(self, e: Call) -> str:
        args = [self.expr(a) for a in e.args]
        torch = self.torch
        if e.fn in ("max", "min"):
            a, b = e.args
            if a.tensor and b.tensor:
                return f"{torch}.{'maximum' if e.fn == 'max' else 'minimum'}({args[0]}, {args[1]})"
            if not a.tensor and not b.tensor:
                return f"{e.fn}({args[0]}, {args[1]})"
            t, s = (args[0], args[1]) if a.tensor else (args[1], args[0])
            return f"{torch}.clamp({t}, {'min' if e.fn == 'max' else 'max'}={s})"
        return f"{torch}.{e.fn}({', '.join(args)})"


# -- the Triton kernel -----------------------------------------------------------------------
class KernelEmitter:
    def __init__(self, nest: Nest, names: Names, tl: str, dot_precision: str):
        self.nest = nest
        self.names = names
        self.tl = ident(tl)
        self.dot_precision = dot_precision  # the constexpr's name ("" without a dot)
        self.grid_vars = tuple(loop.var for loop in nest.grid)
        self.rank = nest.rank
        self.loaded: dict[Load, str] = {}  # grid-level loads
        self.identity: dict[str, float] = {}  # locals whose value is still a constant

    def axis_suffix(self, axis: int) -> str:
        if self.rank == 1:
            return ""
        return "[" + ", ".join(":" if a == axis else "None" for a in range(self.rank)) + "]"

    def grid_setup(self, pid: str, tiles: dict[str, int]) -> list[dict]:
        """Per grid loop: this program's tile index, index vector and mask (last loop fastest)."""
        namer = self.names.namer
        counts = [namer(f"tiles_{loop.var}") for loop in self.nest.grid]
        out = []
        for axis, loop in enumerate(self.nest.grid):
            b = self.names.bounds[loop]
            later = counts[axis + 1 :]
            pid_code = ident(pid)
            if later:
                pid_code = (
                    f"{pid_code} // ({' * '.join(later)})"
                    if len(later) > 1
                    else f"{pid_code} // {later[0]}"
                )
            if axis > 0:
                pid_code = f"{pid_code} % {counts[axis]}"
            block = self.names.block[loop.var]
            out.append(
                {
                    "var": loop.var,
                    "lo": b.lo,
                    "hi": b.hi,
                    "block": block,
                    "block_value": tiles[loop.var],
                    "tiles": counts[axis],
                    "pid": namer(f"pid_{loop.var}"),
                    "pid_code": parse(pid_code),
                    "arange": parse(f"{self.tl}.arange(0, {block}){self.axis_suffix(axis)}"),
                    "mask": self.names.mask[loop.var],
                }
            )
        return out

    def steps(self) -> list:
        out: list = []
        for s in self.nest.body:
            if isinstance(s, InnerLoop):
                out.extend(self._hoist(s))
                out.append(self._dot_loop(s) if self.nest.dot is not None else self._loop(s))
            else:
                out.extend(self._statement(s, self.loaded, self._grid_index(), self.names.mask))
        return out

    # index code and mask of each loop variable in a scope
    def _grid_index(self) -> dict[str, str]:
        return {v: v for v in self.grid_vars}

    def _hoist(self, s: InnerLoop) -> list[Assign]:
        """Loads inside the loop that don't depend on its variable are loaded once, before it."""
        out = []
        for st in s.body:
            for ld in _statement_loads(st):
                if s.loop.var not in ld.dims and ld not in self.loaded:
                    out.append(
                        self._load(ld, self.loaded, self._grid_index(), self.names.mask, True)
                    )
        return out

    def _load(
        self,
        ld: Load,
        loaded: dict[Load, str],
        index: dict[str, str],
        masks: dict[str, str],
        upcast: bool,
    ) -> Assign:
        name = self.names.namer(_load_name(ld))
        loaded[ld] = name
        return Assign(name, parse(self._load_code(ld, index, masks, upcast)))

    def _address(
        self, tensor: str, index: tuple[Index, ...] | tuple[str, ...], index_code: dict[str, str]
    ) -> str:
        terms = [ident(self.names.ptr[tensor])]
        for d, ix in enumerate(index):
            if isinstance(ix, str):
                ix = Index(ix, 0)
            if ix.var is None:
                if ix.offset:
                    terms.append(f"{ix.offset} * {ident(self.names.strides[tensor][d])}")
                continue
            terms.append(
                f"{_offset(ident(index_code[ix.var]), ix.offset)} * {ident(self.names.strides[tensor][d])}"
            )
        return " + ".join(terms)

    def _mask(self, variables: list[str], masks: dict[str, str]) -> str | None:
        parts = [ident(masks[v]) for v in variables]
        return " & ".join(parts) if parts else None

    def _load_code(
        self, ld: Load, index: dict[str, str], masks: dict[str, str], upcast: bool
    ) -> str:
        mask = self._mask([ix.var for ix in ld.index if ix.var is not None], masks)
        masked = f", mask={mask}, other=0.0" if mask else ""
        code = f"{self.tl}.load({self._address(ld.tensor_name, ld.index, index)}{masked})"
        return f"{code}.to({self.tl}.float32)" if upcast else code

    def _statement(
        self, s: Let | Store, loaded: dict[Load, str], index: dict[str, str], masks: dict[str, str]
    ) -> list:
        out: list = []
        for ld in _statement_loads(s):
            if ld not in loaded:
                out.append(self._load(ld, loaded, index, masks, True))
        value = TritonExpressions(loaded, self.tl).expr(s.value)
        if isinstance(s, Let):
            if isinstance(s.value, Const):
                self.identity[s.name] = s.value.value
            else:
                self.identity.pop(s.name, None)
            out.append(Assign(ident(s.name), parse(value)))
            return out
        assert isinstance(s, Store)
        ptrs = self.names.namer(f"{s.tensor_name}_ptrs")
        out.append(Assign(ptrs, parse(self._address(s.tensor_name, s.index, index))))
        mask = self._mask(list(s.index), masks) or "True"
        if not s.value.tensor:  # a number: make it a tile so that it has a dtype to cast
            value = f"{value} + {self.tl}.zeros({self._store_shape(s)}, dtype={self.tl}.float32)"
        if s.add:
            value = f"{self.tl}.load({ptrs}, mask={mask}).to({self.tl}.float32) + {value}"
        ptr = ident(self.names.ptr[s.tensor_name])
        out.append(
            TritonStore(parse(ptrs), parse(f"({value}).to({ptr}.dtype.element_ty)"), parse(mask))
        )
        return out

    def _store_shape(self, s: Store) -> str:
        """The shape of a store's pointer tile: its loop variables' blocks on their axes."""
        inner = [v for v in s.index if v not in self.grid_vars]
        axes = (
            list(self.grid_vars) + (inner or [""])
            if self.rank > len(self.grid_vars)
            else self.grid_vars
        )
        return "[" + ", ".join(self.names.block[v] if v in s.index else "1" for v in axes) + "]"

    def _tile_shape(self) -> str:
        blocks = [self.names.block[v] for v in self.grid_vars]
        return "[" + ", ".join(blocks) + "]"

    def _loop(self, s: InnerLoop) -> LoopBlock:
        loop, namer, tl = s.loop, self.names.namer, self.tl
        b = self.names.bounds[loop]
        var = ident(loop.var)
        start = namer(f"{loop.var}_start")
        block = self.names.block[loop.var]
        inner_mask = namer(f"{loop.var}_mask")
        mask = namer("mask") if any(isinstance(st, Accum) for st in s.body) else ""
        masks = {**self.names.mask, loop.var: inner_mask}
        setup = [
            Assign(
                var, parse(f"{start} + {tl}.arange(0, {block}){self.axis_suffix(self.rank - 1)}")
            ),
            Assign(inner_mask, parse(f"{var} < {b.hi}")),
        ]
        if any(isinstance(st, Accum) for st in s.body):  # where reductions must skip the padding
            setup.append(
                Assign(mask, parse(self._mask([*self.grid_vars, loop.var], masks) or "True"))
            )
        loaded = dict(self.loaded)
        index = {**self._grid_index(), loop.var: loop.var}
        body: list = []
        before: list[Assign] = []
        after: list[Assign] = []
        tiles: dict[int, str] = {}
        shape = "[" + ", ".join([*(self.names.block[v] for v in self.grid_vars), block]) + "]"
        for i, st in enumerate(s.body):
            if not isinstance(st, Accum):
                body.extend(self._statement(st, loaded, index, masks))
                continue
            for ld in _statement_loads(st):
                if ld not in loaded:
                    body.append(self._load(ld, loaded, index, masks, True))
            tile = tiles[i] = namer(f"{st.name}_tile")
            identity = number(_IDENTITY[st.op])
            before.append(Assign(tile, parse(f"{tl}.full({shape}, {identity}, {tl}.float32)")))
            value = (
                f"{tl}.where({mask}, {TritonExpressions(loaded, tl).expr(st.value)}, {identity})"
            )
            combine = {
                "sum": f"{tile} + {value}",
                "max": f"{tl}.maximum({tile}, {value})",
                "min": f"{tl}.minimum({tile}, {value})",
            }
            body.append(Assign(tile, parse(combine[st.op])))
            axis = self.rank - 1
            reduced = f"{tl}.{st.op}({tile}, axis={axis}, keep_dims=True)"
            after.append(Assign(ident(st.name), parse(self._combine(st.op, st.name, reduced))))
        return LoopBlock(
            start,
            b.lo,
            b.hi,
            block,
            tuple(setup),
            tuple(body),
            tuple(before),
            tuple(after),
            loop.var,
            False,
        )

    def _dot_loop(self, s: InnerLoop) -> LoopBlock:
        dot = self.nest.dot
        assert dot is not None
        loop, namer, tl = s.loop, self.names.namer, self.tl
        b = self.names.bounds[loop]
        start = namer(f"{loop.var}_start")
        block = self.names.block[loop.var]
        g0, g1 = self.grid_vars
        left_k, right_k = namer(f"{loop.var}_left"), namer(f"{loop.var}_right")
        left_mask, right_mask = namer(f"{loop.var}_left_mask"), namer(f"{loop.var}_right_mask")
        setup = [
            Assign(
                left_k, parse(f"{start} + {tl}.arange(0, {block})[None, :]")
            ),  # columns of the left operand
            Assign(
                right_k, parse(f"{start} + {tl}.arange(0, {block})[:, None]")
            ),  # rows of the right operand
            Assign(left_mask, parse(f"{left_k} < {b.hi}")),
            Assign(right_mask, parse(f"{right_k} < {b.hi}")),
        ]
        native = isinstance(dot.left, Load) and isinstance(dot.right, Load)
        body: list = []
        operands = []
        for e, k_code, k_mask in ((dot.left, left_k, left_mask), (dot.right, right_k, right_mask)):
            loaded = dict(self.loaded)
            index = {g0: g0, g1: g1, loop.var: k_code}
            masks = {**self.names.mask, loop.var: k_mask}
            for ld in loads_in(e):
                if ld not in loaded:
                    body.append(self._load(ld, loaded, index, masks, not native))
            code = TritonExpressions(loaded, tl).expr(e)
            if not isinstance(e, Load):  # padding along k must add nothing
                code = f"{tl}.where({k_mask}, {code}, 0.0)"
            operands.append(code)
        tile = namer(f"{dot.acc}_tile")
        before = [Assign(tile, parse(f"{tl}.zeros({self._tile_shape()}, dtype={tl}.float32)"))]
        precision = ident(self.dot_precision)
        body.append(
            Assign(
                tile,
                parse(
                    f"{tl}.dot({operands[0]}, {operands[1]}, {tile}, input_precision={precision})"
                ),
            )
        )
        after = [Assign(ident(dot.acc), parse(self._combine("sum", dot.acc, tile)))]
        return LoopBlock(
            start,
            b.lo,
            b.hi,
            block,
            tuple(setup),
            tuple(body),
            tuple(before),
            tuple(after),
            loop.var,
            True,
        )

    def _combine(self, op: str, acc: str, reduced: str) -> str:
        """Fold a reduced tile into the local ``acc`` (just the tile while ``acc`` is the identity)."""
        if self.identity.pop(acc, None) == _IDENTITY[op]:
            return reduced
        if op == "sum":
            return f"{ident(acc)} + {reduced}"
        return f"{self.tl}.{'maximum' if op == 'max' else 'minimum'}({ident(acc)}, {reduced})"


# -- the torch path ---------------------------------------------------------------------------
class TorchEmitter:
    def __init__(self, nest: Nest, names: Names, torch: str):
        self.nest = nest
        self.names = names
        self.torch = ident(torch)
        self.grid_vars = tuple(loop.var for loop in nest.grid)
        self.rank = nest.rank
        self.loaded: dict[Load, str] = {}
        self.identity: dict[str, float] = {}  # locals whose value is still a constant
        self.scalar: set[str] = set()  # locals that are still Python numbers
        self.views: dict[str, str] = {}  # slice code -> its name

    def steps(self) -> list:
        out: list = []
        grid_bounds = {loop.var: self.names.bounds[loop] for loop in self.nest.grid}
        axes = list(self.grid_vars) + ([None] if self.nest.inner_axis else [])
        for s in self.nest.body:
            if isinstance(s, InnerLoop):
                out.extend(self._inner(s, grid_bounds))
                continue
            out.extend(self._loads(s, self.loaded, grid_bounds, axes))
            out.extend(self._statement(s, self.loaded, grid_bounds, inner=False))
        return out

    def _slice(self, ld: Load, bounds: dict[str, LoopBounds], axes: list[str | None]) -> str:
        subs, order = [], []
        for ix in ld.index:
            if ix.var is None:
                subs.append(repr(ix.offset))
                continue
            b = bounds[ix.var]
            subs.append(f"{_offset(b.lo, ix.offset)}:{_offset(b.hi, ix.offset)}")
            order.append(ix.var)
        code = f"{ident(ld.tensor_name)}[{', '.join(subs)}]"
        return code + _arrange(order, axes)

    def _loads(self, s, loaded, bounds, axes) -> list[Assign]:
        out = []
        for ld in _statement_loads(s):
            if ld not in loaded:
                out.extend(self._view(ld, loaded, bounds, axes))
        return out

    def _view(
        self, ld: Load, loaded: dict[Load, str], bounds: dict[str, LoopBounds], axes: list
    ) -> list[Assign]:
        """``loaded[ld]``: a view of the tensor, named once per distinct slice and arrangement."""
        code = self._slice(ld, bounds, axes)
        if code in self.views:
            loaded[ld] = self.views[code]
            return []
        name = loaded[ld] = self.views[code] = self.names.namer(_load_name(ld))
        return [Assign(name, parse(code))]

    def _statement(self, s: Let | Store, loaded, bounds, *, inner: bool) -> list:
        value = TorchExpressions(loaded, self.torch).expr(s.value)
        if isinstance(s, Let):
            if isinstance(s.value, Const):
                self.identity[s.name] = s.value.value
            else:
                self.identity.pop(s.name, None)
            if s.value.tensor:
                self.scalar.discard(s.name)
            else:
                self.scalar.add(s.name)
            return [Assign(ident(s.name), parse(value))]
        assert isinstance(s, Store)
        order = list(s.index)
        if (
            s.value.tensor and s.value.dims
        ):  # a tensor on the nest's axes: drop the inner one, reorder
            if self.nest.inner_axis and not inner:
                value = f"{value}[..., 0]"
            canonical = list(self.grid_vars) + [v for v in order if v not in self.grid_vars]
            value += _permute(canonical, order)
        subs = [f"{bounds[v].lo}:{bounds[v].hi}" for v in order]
        target = f"{ident(s.tensor_name)}[{', '.join(subs)}]"
        return [TorchStore(parse(target), parse(value), s.add)]

    def _inner(self, s: InnerLoop, grid_bounds: dict[str, LoopBounds]) -> list:
        bounds = {**grid_bounds, s.loop.var: self.names.bounds[s.loop]}
        out: list = []
        if self.nest.dot is not None:
            dot = self.nest.dot
            g0, g1 = self.grid_vars
            operands = []
            for e, axes in ((dot.left, [g0, s.loop.var]), (dot.right, [s.loop.var, g1])):
                loaded: dict[Load, str] = {}
                for ld in loads_in(e):
                    if ld not in loaded:
                        out.extend(self._view(ld, loaded, bounds, list(axes)))
                operands.append(TorchExpressions(loaded, self.torch).expr(e))
            product = f"{operands[0]} @ {operands[1]}"
            out.append(Assign(ident(dot.acc), parse(self._reduce("sum", dot.acc, product))))
            return out
        axes = list(self.grid_vars) + [s.loop.var]
        grid_axes = list(self.grid_vars) + [None]
        loaded = dict(self.loaded)
        for st in s.body:
            for ld in _statement_loads(st):
                if ld not in loaded:
                    inner = s.loop.var in ld.dims
                    out.extend(self._view(ld, loaded, bounds, axes if inner else grid_axes))
                    if not inner:
                        self.loaded[ld] = loaded[ld]
            if isinstance(st, Accum):
                value = TorchExpressions(loaded, self.torch).expr(st.value)
                method = {"sum": "sum", "max": "amax", "min": "amin"}[st.op]
                reduced = f"({value}).{method}(dim={self.rank - 1}, keepdim=True)"
                out.append(Assign(ident(st.name), parse(self._reduce(st.op, st.name, reduced))))
            else:
                out.extend(self._statement(st, loaded, bounds, inner=True))
        return out

    def _reduce(self, op: str, acc: str, reduced: str) -> str:
        """Fold ``reduced`` into the local ``acc``; skip the fold when ``acc`` is still the identity."""
        start = self.identity.pop(acc, None)
        scalar = acc in self.scalar
        self.scalar.discard(acc)
        if start is not None and start == _IDENTITY[op]:
            return reduced
        if op == "sum":
            return f"{ident(acc)} + {reduced}"
        if scalar:  # a Python number: clamp keeps the tensor a tensor
            return f"{self.torch}.clamp({reduced}, {'min' if op == 'max' else 'max'}={ident(acc)})"
        return f"{self.torch}.{'maximum' if op == 'max' else 'minimum'}({ident(acc)}, {reduced})"


def _arrange(order: list[str], axes: list[str | None]) -> str:
    """Indexing that puts a slice's dimensions (loop variables ``order``) on ``axes``."""
    if not order:
        return ""
    present = [a for a in axes if a in order]
    code = _permute(order, present)
    if len(present) < len(axes):
        code += "[" + ", ".join(":" if a in order else "None" for a in axes) + "]"
    return code


def _permute(have: list[str], want: list[str]) -> str:
    if have == want:
        return ""
    return f".permute({', '.join(str(have.index(v)) for v in want)})"
