"""The torch path of a ``Nest``: the same computation on whole tensors (templates/tile_torch.py.j2).

Each load is a slice of its tensor arranged on the nest's axes
(``b[None, j_lo:j_hi]``), reductions are ``.sum``/``.amax`` with ``keepdim``,
and a matmul-shaped reduction is ``@``. Never a Python loop.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from macrogen.macros.tile.code import (
    COMPARE,
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
from macrogen.macros.tile.in_place import Meta, in_place
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
    Unary,
)
from macrogen.macros.tile.kernel import IDENTITY
from macrogen.macros.tile.names import LoopBounds, Names, load_name, loads_in, names_in, vars_in
from macrogen.macros.tile.printer import TorchPrinter
from macrogen.macros.tile.steps import Assign, Step, TorchStore, drop_dead_stores
from macrogen.macros.tile.torch_layout import (
    Axes,
    all_statements,
    arrange,
    is_product,
    matrix_operand,
    permutation,
    repeated_loops,
)


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
        self.repeated = repeated_loops(nest)
        self.folded: set[Store] = set()  # stores already written by their reduction (out=)
        self.meta: dict[str, Meta] = {}  # tensor locals: what in_place needs to know

    def steps(self, *, rewrite: bool = True) -> list[Step]:
        """The torch path's steps; ``rewrite=False``: as emitted, without dropping dead stores
        or in_place's rewrite (``sharing`` only counts the uses, which the emission makes)."""
        out: list[Step] = []
        grid_bounds = {loop.var: self.names.bounds[loop] for loop in self.nest.grid}
        axes = self._axes(())
        for s in self.nest.body:
            if isinstance(s, InnerLoop):
                out.extend(self._inner(s, grid_bounds, self.loaded, ()))
                continue
            assert not isinstance(s, Accum)  # reductions live in inner loops
            if s in self.folded:
                continue
            out.extend(self._loads(s, self.loaded, grid_bounds, axes))
            out.extend(self._statement(s, self.loaded, grid_bounds, ()))
        if not rewrite:
            return out
        out = drop_dead_stores(out)
        values = sorted(
            {ld.tensor_name for st in all_statements(self.nest.body) for ld in loads_in(st.value)}
        )
        flag = self.names.namer("default_dtype")
        fast = in_place(out, self.meta, self.torch, flag)
        if fast == out or not values:
            return out
        same = " == ".join([*(f"{t}.dtype" for t in values), f"{self.torch}.get_default_dtype()"])
        return [Assign(flag, parse(same)), *fast]

    def _axes(self, level: tuple[str, ...]) -> list[str | None]:
        """The nest's axes inside the inner loops ``level``: the grid's, then theirs, then None."""
        axes: list[str | None] = [*self.grid_vars, *level]
        return axes + [None] * (self.rank - len(axes))

    def _printer(self, loaded: dict[Load, str], into: list[Step]) -> TorchPrinter:
        return _NotingPrinter(
            self._note,
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

    def _note(self, local: str, e: Expr, dims: frozenset[str] | None = None) -> None:
        """``local`` holds a tensor a torch operation made (its own storage) from ``e``."""
        if e.tensor:
            self.meta[local] = Meta(e.dims if dims is None else dims, self._floating(e))

    def _floating(self, e: Expr) -> bool:
        """Whether ``e`` is a floating-point tensor whenever the value tensors have the
        default dtype (in_place's run-time condition): loads are, and what arithmetic or a
        float function makes from them; comparisons and integer index values are not."""
        if isinstance(e, Load):
            return True
        if isinstance(e, Const):
            return isinstance(e.value, float)
        if isinstance(e, Name):  # a tensor local; a scalar may be an int
            meta = self.meta.get(e.name)
            return meta is not None and meta.floating
        if isinstance(e, Unary):
            return self._floating(e.operand)
        if isinstance(e, Binary):
            if e.op in _ARITHMETIC:
                return e.op == "/" or self._floating(e.left) or self._floating(e.right)
            return False
        if isinstance(e, Call):
            if e.fn in ("exp", "log", "sqrt", "tanh", "sigmoid"):
                return True
            values = e.args[1:] if e.fn == "where" else e.args
            return any(self._floating(a) for a in values)
        return False

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
        return suffix(name(ld.tensor_name), f"[{', '.join(subs)}]" + arrange(order, axes))

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
        code = suffix(call(f"{self.torch}.arange", *args, device=device), arrange([var], axes))
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
        direct = isinstance(s, Store) and self._direct(s)
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
            if _is_name(value):  # the same tensor under another name
                if value.text in self.meta:
                    self.meta[s.name] = self.meta[value.text]
            elif isinstance(s.value, (Binary, Unary)) or (
                isinstance(s.value, Call) and (s.value.fn != "where" or s.value.args[0].tensor)
            ):
                self._note(s.name, s.value)
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
            return suffix(code, permutation(canonical, order))

        subs = [f"{bounds[v].lo}:{bounds[v].hi}{bounds[v].step}" for v in order]
        target = suffix(name(s.tensor_name), f"[{', '.join(subs)}]")
        if direct:  # the last operation writes the output: no temporary, no copy
            assert isinstance(s.value, Binary)
            fn = f"{self.torch}.{_DIRECT[s.value.op]}"
            left = placed(s.value.left, printer.expr(s.value.left))
            right = placed(s.value.right, printer.expr(s.value.right))
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

    def _direct(self, s: Store) -> bool:
        """Whether ``out[...] = a op b`` can be ``torch.op(a, b, out=out[...])``: a plain store
        of arithmetic whose result has the store's shape (each operand is placed on the
        store's axes: deeper axes dropped, reordered)."""
        e = s.value
        return (
            not s.add
            and s.cond is None
            and isinstance(e, Binary)
            and e.op in _DIRECT
            and e.left.tensor
            and e.dims == frozenset(s.index)
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
            store = self._fold_target(dot.acc, "sum", s)
            if store is not None:  # out += a @ b as one addmm_: no product temporary
                out.extend(self._fold_dot(store, operands, bounds))
                return out
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
                store = None
                full = frozenset((*self.grid_vars, s.loop.var))  # the result has the store's shape
                if (
                    not level
                    and axis == self.rank - 1 == len(self.grid_vars)
                    and value.dims == full
                ):
                    store = self._fold_target(st.name, op, s)
                if (
                    store is not None and not store.add and not (op == "sum" and is_product(value))
                ):  # total[i] = s: the reduction writes the output (out=), no temporary
                    out.extend(self._fold_reduction(store, printer.expr(value), fn, axis, bounds))
                    continue
                reduced = (
                    op == "sum"
                    and (
                        (axis == self.rank - 1 and self._matvec(value, printer, s.loop.var))
                        or self._contract(value, printer, axes, axis)
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
                reduced_dims = value.dims - {s.loop.var}
                for local in {st.name, *(n for n in [reduced.text] if _is_name(reduced))}:
                    self._note(local, value, reduced_dims)
            else:
                out.extend(self._statement(st, loaded, bounds, here))
        return out

    def _fold_target(self, acc: str, op: str, loop: InnerLoop) -> Store | None:
        """The store ``out[grid] = acc`` (or ``+=``) that the reduction into ``acc`` in ``loop``
        (a loop of the grid body) can write itself: its result is read nowhere else, it starts
        from the identity, and the store is a plain one in the grid body, after the loop with
        no assignment of ``acc`` between, indexed by the grid's loops in order."""
        if self.identity.get(acc) != IDENTITY[op] or loop in self.repeated:
            return None
        reads = [st for st in all_statements(self.nest.body) if acc in _reads(st)]
        writes = [
            st
            for st in all_statements(self.nest.body)
            if isinstance(st, (Let, Accum)) and st.name == acc
        ]
        if len(reads) != 1 or sum(isinstance(st, Accum) for st in writes) != 1:
            return None
        store = reads[0]
        body = list(self.nest.body)
        if not (
            isinstance(store, Store)
            and store in body
            and store.value == Name(store.value.dims, store.value.tensor, acc)
            and store.cond is None
            and list(store.index) == list(self.grid_vars)
        ):
            return None
        start, at = body.index(loop), body.index(store)
        between = [st for st in body[start + 1 : at] if st in writes]
        return store if start < at and not between else None

    def _fold_reduction(
        self, store: Store, value: Code, fn: str, axis: int, bounds: dict[str, LoopBounds]
    ) -> list[Step]:
        """``torch.sum(x, dim=1, out=total[...])`` where the dtypes agree (``out=`` would
        otherwise reduce in the output's dtype), else the reduction copied into the output."""
        out: list[Step] = []
        if not _is_name(value):
            local = self.names.namer("t")
            out.append(Assign(local, parse(value)))
            value = name(local)
        target = self._target(store, bounds)
        direct = call(f"{self.torch}.{fn}", value, dim=str(axis), out=target)
        copied = method(target, "copy_", method(value, fn, dim=str(axis)))
        same = binary("==", _dtype(name(store.tensor_name)), _dtype(value))
        self.folded.add(store)
        code = conditional(same, direct, copied)
        return [*out, TorchStore(parse(target), parse(code), False, direct=True)]

    def _fold_dot(
        self, store: Store, operands: list[Code], bounds: dict[str, LoopBounds]
    ) -> list[Step]:
        """``out[...] += a @ b`` as ``out[...].addmm_(a, b)`` (``out[...] = a @ b`` as
        ``torch.matmul(a, b, out=...)``) where the three dtypes agree, as both require."""
        out: list[Step] = []
        for n, operand in enumerate(operands):
            if not _is_name(operand):
                local = self.names.namer("t")
                out.append(Assign(local, parse(operand)))
                operands[n] = name(local)
        a, b = operands
        target = self._target(store, bounds)
        product = binary("@", a, b)
        if store.add:
            direct = method(target, "addmm_", a, b)
            other = method(target, "add_", product)
        else:
            direct = call(f"{self.torch}.matmul", a, b, out=target)
            other = method(target, "copy_", product)
        dtypes = [_dtype(name(store.tensor_name)), _dtype(a), _dtype(b)]
        same = Code(" == ".join(d.text for d in dtypes), COMPARE)
        self.folded.add(store)
        code = conditional(same, direct, other)
        return [*out, TorchStore(parse(target), parse(code), False, direct=True)]

    def _target(self, store: Store, bounds: dict[str, LoopBounds]) -> Code:
        """``out[i_lo:i_hi, ...]``: the part of an output a store writes."""
        subs = [f"{bounds[v].lo}:{bounds[v].hi}{bounds[v].step}" for v in store.index]
        return suffix(name(store.tensor_name), f"[{', '.join(subs)}]")

    def _contract(self, e: Expr, printer: TorchPrinter, axes: Axes, axis: int) -> Code | None:
        """``sum over k of a * b`` with no temporary of the product: a matrix product where
        each factor has at most one axis the other lacks (``q[i, k] * kk[j, k]`` summed over
        k is ``q @ kk.mT``; shared axes are batch axes), else one ``einsum``. Both factors
        vary along some loop, so both are tensors with every axis of the nest."""
        if not (isinstance(e, Binary) and e.op == "*" and e.left.dims and e.right.dims):
            return None
        k = axes[axis]
        assert k is not None
        left, right = e.left.dims, e.right.dims
        only_left, only_right = sorted(left - right), sorted(right - left)
        if k in left & right and len(only_left) <= 1 and len(only_right) <= 1:
            batch = [v for v in axes if v in left & right and v != k]
            a = matrix_operand(printer.expr(e.left), axes, left, [*batch, *only_left, k])
            b = matrix_operand(printer.expr(e.right), axes, right, [*batch, k, *only_right])
            if not only_left:  # a row: (..., 1, k)
                a = suffix(a, "[..., None, :]")
            if not only_right:  # a column: (..., k, 1)
                b = suffix(b, "[..., None]")
            squeeze = ("" if only_left else ", 0") + ("" if only_right else ", 0")
            product = suffix(binary("@", a, b), f"[...{squeeze}]" if squeeze else "")
            return suffix(product, arrange([*batch, *only_left, *only_right], axes))
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


class _NotingPrinter(TorchPrinter):
    """A TorchPrinter that reports each local it computes a tensor operation into."""

    def __init__(self, note: Callable[[str, Expr], None], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.note = note

    def expr(self, e: Expr) -> Code:
        before = len(self.into) if self.into is not None else 0
        code = super().expr(e)
        if self.into is not None and len(self.into) > before:
            made = self.into[-1]
            if isinstance(made, Assign) and made.target == code.text:
                self.note(made.target, e)
        return code


_ARITHMETIC = ("+", "-", "*", "/", "**")


def _reads(st: Let | Accum | Store) -> set[str]:
    """The names (locals, scalars) a statement reads; an online softmax's sum reads its max."""
    found = names_in(st.value)
    if isinstance(st, Accum) and st.shift is not None:
        found.add(st.shift)
    if isinstance(st, Store) and st.cond is not None:
        found |= names_in(st.cond)
    return found


def _is_name(code: Code) -> bool:
    return code.text.isidentifier()


def _dtype(code: Code) -> Code:
    return suffix(code, ".dtype")


_DIRECT = {"+": "add", "-": "sub", "*": "mul", "/": "div"}  # torch functions with out=


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def sharing(nest: Nest, names: Names, torch: str) -> set[str]:
    """The tensor operations the torch path computes more than once (a softmax's
    ``exp(x - m)``): only these get a local, so that the others' temporaries are freed
    (and their memory reused) as in eager torch."""
    emitter = TorchEmitter(nest, names.fork(), torch)
    emitter.steps(rewrite=False)
    return {key for key, n in emitter.uses.items() if n > 1}
