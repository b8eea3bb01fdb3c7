"""The torch path of a ``Nest``: the same computation on whole tensors (templates/tile_torch.py.j2).

Each load is a slice of its tensor arranged on the nest's axes
(``b[None, j_lo:j_hi]``), reductions are ``.sum``/``.amax`` with ``keepdim``,
and a matmul-shaped reduction is ``@``. Never a Python loop.
"""

from __future__ import annotations

import re
from collections import Counter

from macrogen.macros.tile.code import (
    Code,
    binary,
    call,
    conditional,
    method,
    name,
    number,
    parse,
    plus,
    suffix,
)
from macrogen.macros.tile.ir import (
    Accum,
    Binary,
    Call,
    Const,
    Expr,
    InnerLoop,
    Let,
    Load,
    Name,
    Nest,
    Store,
)
from macrogen.macros.tile.kernel import IDENTITY
from macrogen.macros.tile.names import LoopBounds, Names, load_name, loads_in, names_in, vars_in
from macrogen.macros.tile.printer import TorchPrinter
from macrogen.macros.tile.steps import Assign, Step, TorchStore, drop_dead_stores


class TorchEmitter:
    """``shared``: the keys of the tensor operations worth a local (used twice, see ``sharing``);
    None computes every one into a local and counts the uses (``self.uses``)."""

    def __init__(self, nest: Nest, names: Names, torch: str, shared: set[str] | None = None):
        self.nest = nest
        self.names = names
        self.torch = torch
        self.grid_vars = tuple(loop.var for loop in nest.grid)
        self.rank = nest.rank
        self.loaded: dict[Load, str] = {}
        self.identity: dict[str, float] = {}  # locals whose value is still a constant
        self.scalar: set[str] = set()  # locals that are still Python numbers
        self.views: dict[str, str] = {}  # slice code -> its name
        self.indices: dict[str, str] = {}  # loop variable -> its values here (an arange view)
        self.memo: dict[str, str] = {}  # an operation's key (_key) -> the local holding it
        self.value_of: dict[str, str] = {}  # local -> the key of the value it holds
        self.shared = shared
        self.uses: Counter[str] = Counter()
        self.reductions: dict[str, str] = {}  # a repeated loop's reduction -> its local
        self.repeated = _repeated(nest)

    def steps(self) -> list[Step]:
        out: list[Step] = []
        grid_bounds = {loop.var: self.names.bounds[loop] for loop in self.nest.grid}
        axes = self._axes(())
        for s in self.nest.body:
            if isinstance(s, InnerLoop):
                out.extend(self._inner(s, grid_bounds, self.loaded, ()))
                continue
            assert not isinstance(s, Accum)  # reductions live in inner loops
            out.extend(self._loads(s, self.loaded, grid_bounds, axes))
            out.extend(self._statement(s, self.loaded, grid_bounds, ()))
        return drop_dead_stores(out)

    def _axes(self, level: tuple[str, ...]) -> list[str | None]:
        """The nest's axes inside the inner loops ``level``: the grid's, then theirs, then None."""
        axes: list[str | None] = [*self.grid_vars, *level]
        return axes + [None] * (self.rank - len(axes))

    def _printer(self, loaded: dict[Load, str], into: list[Step]) -> TorchPrinter:
        return TorchPrinter(
            loaded,
            self.torch,
            self.indices,
            self.memo,
            into,
            self.names.namer,
            self._key,
            self.shared,
            self.uses,
        )

    def _key(self, text: str) -> str:
        """A shared result's key: its code and the values of the locals it reads."""
        reads = sorted(set(_WORD.findall(text)) & set(self.value_of))
        return text + "".join(f"|{n}={self.value_of[n]}" for n in reads)

    def _assigned(self, local: str, value: Code) -> None:
        """``local`` now holds ``value`` (results that read it are keyed by its value)."""
        self.value_of[local] = self._key(value.text)

    def _gather(
        self,
        ld: Load,
        loaded: dict[Load, str],
        bounds: dict[str, LoopBounds],
        axes: Axes,
        into: list[Assign],
    ) -> Code:
        """``table[idx_i, j_index]``: advanced indexing by index tensors arranged on the axes."""
        subs = []
        for ix in ld.index:
            if ix.gather is not None:
                into.extend(self._view(ix.gather, loaded, bounds, axes))
                subs.append(loaded[ix.gather])
            elif ix.var is None:
                subs.append(repr(ix.offset))
            else:
                into.extend(self._index_view(ix.var, bounds, axes))
                subs.append(plus(name(self.indices[ix.var]), ix.offset).text)
        return suffix(name(ld.tensor_name), f"[{', '.join(subs)}]")

    def _slice(self, ld: Load, bounds: dict[str, LoopBounds], axes: list[str | None]) -> Code:
        subs, order = [], []
        for ix in ld.index:
            if ix.var is None:
                subs.append(repr(ix.offset))
                continue
            b = bounds[ix.var]
            subs.append(f"{plus(name(b.lo), ix.offset)}:{plus(name(b.hi), ix.offset)}{b.step}")
            order.append(ix.var)
        return suffix(name(ld.tensor_name), f"[{', '.join(subs)}]" + _arrange(order, axes))

    def _loads(
        self,
        s: Let | Store,
        loaded: dict[Load, str],
        bounds: dict[str, LoopBounds],
        axes: Axes,
    ) -> list[Assign]:
        out = []
        for ld in loads_in(s.value):
            if ld not in loaded:
                out.extend(self._view(ld, loaded, bounds, axes))
        out.extend(self._indices(s.value, bounds, axes))
        return out

    def _indices(self, e: Expr, bounds: dict[str, LoopBounds], axes: Axes) -> list[Assign]:
        """Views of ``torch.arange`` for the loop variables ``e`` reads as values (``j <= i``)."""
        return [a for var in vars_in(e) for a in self._index_view(var, bounds, axes)]

    def _index_view(self, var: str, bounds: dict[str, LoopBounds], axes: Axes) -> list[Assign]:
        """``self.indices[var]``: ``torch.arange`` of the loop's values, arranged on ``axes``."""
        b = bounds[var]
        args = [b.lo, b.hi] + ([b.step[1:]] if b.step else [])
        device = f"{self.nest.tensors[0][0]}.device"
        code = suffix(call(f"{self.torch}.arange", *args, device=device), _arrange([var], axes))
        self.indices[var] = self.views.get(code.text, "")
        if self.indices[var]:
            return []
        self.indices[var] = self.views[code.text] = self.names.namer(f"{var}_index")
        return [Assign(self.indices[var], parse(code))]

    def _view(
        self, ld: Load, loaded: dict[Load, str], bounds: dict[str, LoopBounds], axes: Axes
    ) -> list[Assign]:
        """``loaded[ld]``: a view of the tensor, named once per distinct slice and arrangement."""
        pre: list[Assign] = []
        gathers = any(ix.gather is not None for ix in ld.index)
        code = self._gather(ld, {}, bounds, axes, pre) if gathers else self._slice(ld, bounds, axes)
        if code.text in self.views:
            loaded[ld] = self.views[code.text]
            return []
        local = loaded[ld] = self.views[code.text] = self.names.namer(load_name(ld))
        return [*pre, Assign(local, parse(code))]

    def _statement(
        self,
        s: Let | Store,
        loaded: dict[Load, str],
        bounds: dict[str, LoopBounds],
        level: tuple[str, ...],
    ) -> list[Step]:
        shared: list[Step] = []
        printer = self._printer(loaded, shared)
        direct = isinstance(s, Store) and self._direct(s, level)
        value = printer.expr(s.value) if not direct else number(0)
        if isinstance(s, Let):
            self._assigned(s.name, value)
            if isinstance(s.value, Const):
                self.identity[s.name] = s.value.value
            else:
                self.identity.pop(s.name, None)
            if s.value.tensor:
                self.scalar.discard(s.name)
            else:
                self.scalar.add(s.name)
            return [*shared, Assign(s.name, parse(value))]
        order = list(s.index)

        def placed(e: Expr, code: Code) -> Code:
            """A tensor on the nest's axes, on the store's: drop the deeper axes, reorder."""
            if not (e.tensor and e.dims):
                return code
            deeper = self.rank - len(self.grid_vars) - len(level) if self.nest.inner_axis else 0
            if deeper:
                code = suffix(code, "[..." + ", 0" * deeper + "]")
            canonical = [*self.grid_vars, *level]
            return suffix(code, _permute(canonical, order))

        subs = [f"{bounds[v].lo}:{bounds[v].hi}{bounds[v].step}" for v in order]
        target = suffix(name(s.tensor_name), f"[{', '.join(subs)}]")
        if direct:  # the last operation writes the output: no temporary, no copy
            assert isinstance(s.value, Binary)
            fn = f"{self.torch}.{_DIRECT[s.value.op]}"
            left, right = printer.expr(s.value.left), printer.expr(s.value.right)
            code = call(fn, left, right, out=target)
            return [*shared, TorchStore(parse(target), parse(code), False, direct=True)]
        value = placed(s.value, value)
        if s.cond is not None:  # stored only where cond holds: elsewhere keep (or add) nothing
            cond = placed(s.cond, printer.expr(s.cond))
            keep = number(0.0) if s.add else target
            value = (
                call(f"{self.torch}.where", cond, value, keep)
                if s.cond.tensor
                else conditional(cond, value, keep)
            )
        return [*shared, TorchStore(parse(target), parse(value), s.add)]

    def _direct(self, s: Store, level: tuple[str, ...]) -> bool:
        """Whether ``out[...] = a op b`` can be ``torch.op(a, b, out=out[...])``: a plain store
        of arithmetic whose result has the store's shape, on the nest's axes as they are."""
        e = s.value
        deeper = self.rank - len(self.grid_vars) - len(level) if self.nest.inner_axis else 0
        return (
            not s.add
            and s.cond is None
            and isinstance(e, Binary)
            and e.op in _DIRECT
            and e.left.tensor
            and e.dims == frozenset(s.index)
            and deeper == 0
            and [*self.grid_vars, *level] == list(s.index)
        )

    def _inner(
        self,
        s: InnerLoop,
        outer_bounds: dict[str, LoopBounds],
        outer_loaded: dict[Load, str],
        level: tuple[str, ...],
    ) -> list[Step]:
        """An inner loop as whole tensors on the nest's axes; ``level``: the loops around it."""
        bounds = {**outer_bounds, s.loop.var: self.names.bounds[s.loop]}
        out: list[Step] = []
        if self.nest.dot is not None:
            dot = self.nest.dot
            g0, g1 = self.grid_vars
            operands = []
            pairs: tuple[tuple[Expr, Axes], ...] = (
                (dot.left, [g0, s.loop.var]),
                (dot.right, [s.loop.var, g1]),
            )
            for e, dot_axes in pairs:
                loaded: dict[Load, str] = {}
                for ld in loads_in(e):
                    if ld not in loaded:
                        out.extend(self._view(ld, loaded, bounds, dot_axes))
                operands.append(TorchPrinter(loaded, self.torch).expr(e))
            product = binary("@", operands[0], operands[1])
            out.append(Assign(dot.acc, parse(self._reduce("sum", dot.acc, product))))
            return out
        here = (*level, s.loop.var)
        axes = self._axes(here)
        axis = len(self.grid_vars) + len(level)
        loaded = dict(outer_loaded)
        for st in s.body:
            if isinstance(st, InnerLoop):
                out.extend(self._inner(st, bounds, loaded, here))
                continue
            for ld in loads_in(st.value):
                if ld not in loaded:
                    out.extend(self._view(ld, loaded, bounds, axes))
                    if ld.dims <= set(self.grid_vars):
                        self.loaded[ld] = loaded[ld]
            out.extend(self._indices(st.value, bounds, axes))
            if isinstance(st, Accum):
                value, op = st.value, st.op
                if op == "expsum":  # the sum of exp(value - the final max), computed after it
                    assert st.shift is not None
                    shift = Name(frozenset(self.grid_vars), True, st.shift)
                    diff = Binary(value.dims, True, "-", value, shift)
                    value, op = Call(value.dims, True, "exp", (diff,)), "sum"
                printer = self._printer(loaded, out)
                fn = {"sum": "sum", "max": "amax", "min": "amin"}[op]
                reduced = (
                    op == "sum"
                    and (
                        (axis == self.rank - 1 and self._matvec(value, printer, s.loop.var))
                        or self._contract(value, printer, axis)
                    )
                ) or method(printer.expr(value), fn, dim=str(axis), keepdim="True")
                if s in self.repeated:  # the same loop again (scores in each pass): compute once
                    if reduced.text not in self.reductions:
                        self.reductions[reduced.text] = self.names.namer(f"{st.name}_{fn}")
                        out.append(Assign(self.reductions[reduced.text], parse(reduced)))
                    reduced = name(self.reductions[reduced.text])
                code = self._reduce(op, st.name, reduced)
                out.append(Assign(st.name, parse(code)))
                self._assigned(st.name, code)
            else:
                out.extend(self._statement(st, loaded, bounds, here))
        return out

    def _contract(self, e: Expr, printer: TorchPrinter, axis: int) -> Code | None:
        """``sum over k of a * b`` as one ``einsum`` (a matrix product where the axes allow it),
        with no temporary of the product: ``q[i, k] * kk[j, k]`` summed over k is ``q @ kk.T``.
        Both factors vary along some loop, so both are tensors with every axis of the nest."""
        if not (isinstance(e, Binary) and e.op == "*" and e.left.dims and e.right.dims):
            return None
        letters = "abcdefgh"[: self.rank]
        kept = letters.replace(letters[axis], "")
        spec = f"{letters},{letters}->{kept}"
        product = call(
            f"{self.torch}.einsum", repr(spec), printer.expr(e.left), printer.expr(e.right)
        )
        return method(product, "unsqueeze", str(axis))

    def _matvec(self, e: Expr, printer: TorchPrinter, var: str) -> Code | None:
        """``sum over k of t * v[k]`` as ``t @ v``: one matrix-vector product, no temporary.

        ``v`` is a plain load that varies along the inner loop only; ``t`` is a
        floating tensor with the inner loop on its last axis (``x[b, i, j] * w[j]``).
        """
        if not (isinstance(e, Binary) and e.op == "*"):
            return None
        for vec, other in ((e.right, e.left), (e.left, e.right)):
            if (
                isinstance(vec, Load)
                and vec.dims == frozenset((var,))
                and all(ix.gather is None for ix in vec.index)
                and var in other.dims
                and other.tensor
                and not vars_in(other)
            ):
                product = binary("@", printer.expr(other), method(printer.expr(vec), "flatten"))
                return suffix(product, "[..., None]")
        return None

    def _reduce(self, op: str, acc: str, reduced: Code) -> Code:
        """Fold ``reduced`` into the local ``acc``; skip the fold when ``acc`` is still the identity."""
        start = self.identity.pop(acc, None)
        scalar = acc in self.scalar
        self.scalar.discard(acc)
        if start is not None and start == IDENTITY[op]:
            return reduced
        if op == "sum":
            return binary("+", name(acc), reduced)
        if scalar:  # a Python number: clamp keeps the tensor a tensor
            return call(f"{self.torch}.clamp", reduced, **{"min" if op == "max" else "max": acc})
        return call(f"{self.torch}.{'maximum' if op == 'max' else 'minimum'}", acc, reduced)


_DIRECT = {"+": "add", "-": "sub", "*": "mul", "/": "div"}  # torch functions with out=
Axes = list[str | None]  # the loop variable on each axis of the nest's tensors (None: none)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


def _repeated(nest: Nest) -> set[InnerLoop]:
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


def sharing(nest: Nest, names: Names, torch: str) -> set[str]:
    """The tensor operations the torch path computes more than once (a softmax's
    ``exp(x - m)``): only these get a local, so that the others' temporaries are freed
    (and their memory reused) as in eager torch."""
    emitter = TorchEmitter(nest, names.fork(), torch)
    emitter.steps()
    return {key for key, n in emitter.uses.items() if n > 1}
