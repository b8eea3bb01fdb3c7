"""The torch path of a ``Nest``: the same computation on whole tensors (templates/tile_torch.py.j2).

Each load is a slice of its tensor arranged on the nest's axes
(``b[None, j_lo:j_hi]``), reductions are ``.sum``/``.amax`` with ``keepdim``,
and a matmul-shaped reduction is ``@``. Never a Python loop.
"""

from __future__ import annotations

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
from macrogen.macros.tile.ir import Accum, Binary, Const, InnerLoop, Let, Load, Nest, Store
from macrogen.macros.tile.kernel import IDENTITY
from macrogen.macros.tile.names import LoopBounds, Names, load_name, loads_in, vars_in
from macrogen.macros.tile.printer import TorchPrinter
from macrogen.macros.tile.steps import Assign, Step, TorchStore, drop_dead_stores


class TorchEmitter:
    def __init__(self, nest: Nest, names: Names, torch: str):
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

    def steps(self) -> list[Step]:
        out: list[Step] = []
        grid_bounds = {loop.var: self.names.bounds[loop] for loop in self.nest.grid}
        axes = list(self.grid_vars) + ([None] if self.nest.inner_axis else [])
        for s in self.nest.body:
            if isinstance(s, InnerLoop):
                out.extend(self._inner(s, grid_bounds))
                continue
            out.extend(self._loads(s, self.loaded, grid_bounds, axes))
            out.extend(self._statement(s, self.loaded, grid_bounds, inner=False))
        return drop_dead_stores(out)

    def _gather(self, ld: Load, loaded, bounds, axes, into: list) -> Code:
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

    def _loads(self, s, loaded, bounds, axes) -> list[Assign]:
        out = []
        for ld in loads_in(s.value):
            if ld not in loaded:
                out.extend(self._view(ld, loaded, bounds, axes))
        out.extend(self._indices(s.value, bounds, axes))
        return out

    def _indices(self, e, bounds: dict[str, LoopBounds], axes: list) -> list[Assign]:
        """Views of ``torch.arange`` for the loop variables ``e`` reads as values (``j <= i``)."""
        return [a for var in vars_in(e) for a in self._index_view(var, bounds, axes)]

    def _index_view(self, var: str, bounds: dict[str, LoopBounds], axes: list) -> list[Assign]:
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
        self, ld: Load, loaded: dict[Load, str], bounds: dict[str, LoopBounds], axes: list
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

    def _statement(self, s: Let | Store, loaded, bounds, *, inner: bool) -> list[Step]:
        printer = TorchPrinter(loaded, self.torch, self.indices)
        value = printer.expr(s.value)
        if isinstance(s, Let):
            if isinstance(s.value, Const):
                self.identity[s.name] = s.value.value
            else:
                self.identity.pop(s.name, None)
            if s.value.tensor:
                self.scalar.discard(s.name)
            else:
                self.scalar.add(s.name)
            return [Assign(s.name, parse(value))]
        order = list(s.index)

        def placed(e, code: Code) -> Code:
            """A tensor on the nest's axes, on the store's: drop the inner axis, reorder."""
            if not (e.tensor and e.dims):
                return code
            if self.nest.inner_axis and not inner:
                code = suffix(code, "[..., 0]")
            canonical = list(self.grid_vars) + [v for v in order if v not in self.grid_vars]
            return suffix(code, _permute(canonical, order))

        value = placed(s.value, value)
        subs = [f"{bounds[v].lo}:{bounds[v].hi}{bounds[v].step}" for v in order]
        target = suffix(name(s.tensor_name), f"[{', '.join(subs)}]")
        if s.cond is not None:  # stored only where cond holds: elsewhere keep (or add) nothing
            cond = placed(s.cond, printer.expr(s.cond))
            keep = number(0.0) if s.add else target
            value = (
                call(f"{self.torch}.where", cond, value, keep)
                if s.cond.tensor
                else conditional(cond, value, keep)
            )
        return [TorchStore(parse(target), parse(value), s.add)]

    def _inner(self, s: InnerLoop, grid_bounds: dict[str, LoopBounds]) -> list[Step]:
        bounds = {**grid_bounds, s.loop.var: self.names.bounds[s.loop]}
        out: list[Step] = []
        if self.nest.dot is not None:
            dot = self.nest.dot
            g0, g1 = self.grid_vars
            operands = []
            for e, axes in ((dot.left, [g0, s.loop.var]), (dot.right, [s.loop.var, g1])):
                loaded: dict[Load, str] = {}
                for ld in loads_in(e):
                    if ld not in loaded:
                        out.extend(self._view(ld, loaded, bounds, list(axes)))
                operands.append(TorchPrinter(loaded, self.torch).expr(e))
            product = binary("@", operands[0], operands[1])
            out.append(Assign(dot.acc, parse(self._reduce("sum", dot.acc, product))))
            return out
        axes = list(self.grid_vars) + [s.loop.var]
        grid_axes = list(self.grid_vars) + [None]
        loaded = dict(self.loaded)
        for st in s.body:
            for ld in loads_in(st.value):
                if ld not in loaded:
                    inner = s.loop.var in ld.dims
                    out.extend(self._view(ld, loaded, bounds, axes if inner else grid_axes))
                    if not inner:
                        self.loaded[ld] = loaded[ld]
            out.extend(self._indices(st.value, bounds, axes))
            if isinstance(st, Accum):
                printer = TorchPrinter(loaded, self.torch, self.indices)
                fn = {"sum": "sum", "max": "amax", "min": "amin"}[st.op]
                reduced = (
                    st.op == "sum" and self._matvec(st.value, printer, s.loop.var)
                ) or method(printer.expr(st.value), fn, dim=str(self.rank - 1), keepdim="True")
                out.append(Assign(st.name, parse(self._reduce(st.op, st.name, reduced))))
            else:
                out.extend(self._statement(st, loaded, bounds, inner=True))
        return out

    def _matvec(self, e, printer: TorchPrinter, var: str) -> Code | None:
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
