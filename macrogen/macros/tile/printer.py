"""IR expressions (ir.py) as code: shared by the kernel (Triton) and the torch path."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from macrogen.macros.tile.code import (
    Code,
    binary,
    call,
    chain,
    conditional,
    name,
    neg,
    number,
    parse,
)
from macrogen.macros.tile.ir import Binary, Call, Const, Expr, Load, Name, Unary, Var
from macrogen.macros.tile.steps import Assign, Step


class Printer:
    """Expression code; each flavour says how to write powers and calls."""

    def __init__(self, loaded: dict[Load, str], indices: dict[str, str] | None = None):
        self.loaded = loaded  # each load's local
        self.indices = indices or {}  # loop variable -> the local holding its values

    def expr(self, e: Expr) -> Code:
        if isinstance(e, Const):
            return number(e.value)
        if isinstance(e, Name):
            return name(e.name)
        if isinstance(e, Load):
            return name(self.loaded[e])
        if isinstance(e, Var):
            return name(self.indices.get(e.name, e.name))
        if isinstance(e, Unary):
            return neg(self.expr(e.operand))
        if isinstance(e, Binary):
            if e.op == "**":
                return self.power(e)
            return binary(e.op, self.expr(e.left), self.expr(e.right))
        if isinstance(e, Call):
            return self.call(e)
        raise AssertionError(e)

    def power(self, e: Binary) -> Code:
        raise NotImplementedError

    def call(self, e: Call) -> Code:
        raise NotImplementedError


class TritonPrinter(Printer):
    def __init__(self, loaded: dict[Load, str], tl: str):
        super().__init__(loaded)
        self.tl = tl

    def power(self, e: Binary) -> Code:
        assert isinstance(e.right, Const)
        return chain("*", [self.expr(e.left)] * int(e.right.value))

    def call(self, e: Call) -> Code:
        args = [self.expr(a) for a in e.args]
        if e.fn == "tanh":  # tl has no tanh: tanh(x) = 2 sigmoid(2x) - 1
            twice = binary("*", number(2.0), args[0])
            sig = call(f"{self.tl}.sigmoid", twice)
            return binary("-", binary("*", number(2.0), sig), number(1.0))
        fn = {"max": "maximum", "min": "minimum"}.get(e.fn, e.fn)
        return call(f"{self.tl}.{fn}", *args)


class TorchPrinter(Printer):
    """Torch code; with ``memo``, each distinct tensor-valued call or operation is computed
    once into a local (``into``), and the same code later reads that local: a softmax's
    ``exp(x - m)`` is one pass, not two."""

    def __init__(
        self,
        loaded: dict[Load, str],
        torch: str,
        indices: dict[str, str] | None = None,
        memo: dict[str, str] | None = None,
        into: list[Step] | None = None,
        namer: Callable[[str], str] | None = None,
        key: Callable[[str], str] = str,
        shared: set[str] | None = None,
        uses: Counter[str] | None = None,
    ):
        super().__init__(loaded, indices)
        self.torch = torch
        self.memo = memo
        self.into = into
        self.namer = namer
        self.key = key  # code -> its memo key (the code, and the values of the locals it reads)
        self.shared = shared  # the keys to compute once (None: all, counting ``uses``)
        self.uses = uses if uses is not None else Counter()

    def expr(self, e: Expr) -> Code:
        code = super().expr(e)
        if (
            self.memo is None
            or self.into is None
            or self.namer is None
            or not (isinstance(e, (Call, Binary)) and e.tensor and e.dims)
        ):
            return code
        key = self.key(code.text)
        self.uses[key] += 1
        if self.shared is not None and key not in self.shared:
            return code
        if key not in self.memo:
            local = self.namer(e.fn if isinstance(e, Call) else "t")
            self.into.append(Assign(local, parse(code)))
            self.memo[key] = local
        return name(self.memo[key])

    def power(self, e: Binary) -> Code:
        assert isinstance(e.right, Const)
        return binary("**", self.expr(e.left), number(e.right.value))

    def call(self, e: Call) -> Code:
        args = [self.expr(a) for a in e.args]
        torch = self.torch
        if e.fn in ("max", "min"):
            a, b = e.args
            if a.tensor and b.tensor:
                return call(f"{torch}.{'maximum' if e.fn == 'max' else 'minimum'}", *args)
            if not a.tensor and not b.tensor:
                return call(e.fn, *args)
            t, s = (args[0], args[1]) if a.tensor else (args[1], args[0])
            return call(f"{torch}.clamp", t, **{"min" if e.fn == "max" else "max": s})
        if e.fn == "where" and not e.args[0].tensor:  # a Python bool: torch.where wants a tensor
            return conditional(args[0], args[1], args[2])
        return call(f"{torch}.{e.fn}", *args)
