"""The attention nest's logit ``f(s)``, for its kernels: the scale to fold, and ``f'(s)``.

The softmax exponentiates ``f(s)`` of each score ``s`` (``s * scale``, or a
soft cap ``c * tanh(s / c)``: arithmetic on ``s``, scalars, sizes and numbers).
The forward kernel works in base 2, ``exp(x) = exp2(x * log2(e))``: when ``f``
is ``s * c`` (``c * s``, ``s / c``), ``c * log2(e)`` is folded into one scalar
and each score costs one multiply (``linear_scale``). The backward needs
``f'(s)`` (``derivative``): ``ds = dz * f'(s)``, a constant ``c`` for the linear
case (applied once to the accumulated ``dq`` and ``dk``).
"""

from __future__ import annotations

from macrogen.macros.tile.ir import Binary, Call, Const, Expr, Name, Unary


def linear_scale(f: Expr, s: str) -> Expr | None:
    """``c`` when ``f`` is ``s * c``, ``c * s`` or ``s / c`` (``c`` not reading ``s``), else None."""
    if isinstance(f, Name) and f.name == s:
        return _const(1.0)
    if isinstance(f, Binary) and f.op in ("*", "/"):
        left, right = f.left, f.right
        if _is(left, s) and not _reads(right, s):
            return right if f.op == "*" else _div(_const(1.0), right)
        if f.op == "*" and _is(right, s) and not _reads(left, s):
            return left
    return None


def derivative(f: Expr, s: str) -> Expr:
    """``df/ds`` for the arithmetic ``_logit`` (flash.py) accepts, constants folded."""
    if isinstance(f, Name):
        return _const(1.0 if f.name == s else 0.0)
    if isinstance(f, Const):
        return _const(0.0)
    if isinstance(f, Unary):
        return _neg(derivative(f.operand, s))
    if isinstance(f, Binary):
        a, b = f.left, f.right
        da, db = derivative(a, s), derivative(b, s)
        if f.op == "+":
            return _add(da, db)
        if f.op == "-":
            return _sub(da, db)
        if f.op == "*":
            return _add(_mul(da, b), _mul(a, db))
        if f.op == "/":  # (da * b - a * db) / b**2
            return _sub(_div(da, b), _div(_mul(a, db), _mul(b, b)))
        if f.op == "**":  # a ** n: n * a ** (n - 1) * da
            assert isinstance(b, Const)
            n = int(b.value)
            power = a if n == 2 else Binary(a.dims, a.tensor, "**", a, _const(n - 1))
            return _mul(_mul(_const(float(n)), power), da)
    if isinstance(f, Call):
        (a,) = f.args
        da = derivative(a, s)
        if f.fn == "exp":
            return _mul(f, da)
        if f.fn == "log":
            return _div(da, a)
        if f.fn == "sqrt":
            return _div(da, _mul(_const(2.0), f))
        if f.fn == "tanh":
            return _mul(_sub(_const(1.0), _mul(f, f)), da)
        if f.fn == "sigmoid":
            return _mul(_mul(f, _sub(_const(1.0), f)), da)
        if f.fn == "abs":  # torch's: sign(a), 0 at 0
            zero = _const(0.0)
            positive = Binary(a.dims, a.tensor, ">", a, zero)
            negative = Binary(a.dims, a.tensor, "<", a, zero)
            sign = Call(
                a.dims,
                a.tensor,
                "where",
                (
                    positive,
                    _const(1.0),
                    Call(a.dims, a.tensor, "where", (negative, _const(-1.0), zero)),
                ),
            )
            return _mul(sign, da)
    raise AssertionError(f"no derivative for {f}")


def _const(value: float | int) -> Const:
    return Const(frozenset(), False, value)


def _is(e: Expr, s: str) -> bool:
    return isinstance(e, Name) and e.name == s


def _reads(e: Expr, s: str) -> bool:
    if isinstance(e, Name):
        return e.name == s
    if isinstance(e, Unary):
        return _reads(e.operand, s)
    if isinstance(e, Binary):
        return _reads(e.left, s) or _reads(e.right, s)
    if isinstance(e, Call):
        return any(_reads(a, s) for a in e.args)
    return False


def _value(e: Expr) -> float | None:
    return float(e.value) if isinstance(e, Const) else None


def _binary(op: str, a: Expr, b: Expr) -> Expr:
    return Binary(a.dims | b.dims, a.tensor or b.tensor, op, a, b)


def _add(a: Expr, b: Expr) -> Expr:
    if _value(a) == 0.0:
        return b
    if _value(b) == 0.0:
        return a
    return _binary("+", a, b)


def _sub(a: Expr, b: Expr) -> Expr:
    if _value(b) == 0.0:
        return a
    if _value(a) == 0.0:
        return _neg(b)
    return _binary("-", a, b)


def _mul(a: Expr, b: Expr) -> Expr:
    if _value(a) == 0.0 or _value(b) == 0.0:
        return _const(0.0)
    if _value(a) == 1.0:
        return b
    if _value(b) == 1.0:
        return a
    return _binary("*", a, b)


def _div(a: Expr, b: Expr) -> Expr:
    if _value(a) == 0.0:
        return _const(0.0)
    if isinstance(a, Const) and isinstance(b, Const) and b.value != 0:
        return _const(a.value / b.value)
    if _value(b) == 1.0:
        return a
    return _binary("/", a, b)


def _neg(a: Expr) -> Expr:
    value = _value(a)
    if value is not None:
        return _const(-value)
    return Unary(a.dims, a.tensor, "-", a)


def renamed(e: Expr, old: str, new: str) -> Expr:
    """``e`` reading the local ``new`` wherever it read ``old`` (a score, as a tile)."""
    if isinstance(e, Name):
        return Name(e.dims, e.tensor, new) if e.name == old else e
    if isinstance(e, Unary):
        return Unary(e.dims, e.tensor, e.op, renamed(e.operand, old, new))
    if isinstance(e, Binary):
        return Binary(e.dims, e.tensor, e.op, renamed(e.left, old, new), renamed(e.right, old, new))
    if isinstance(e, Call):
        return Call(e.dims, e.tensor, e.fn, tuple(renamed(a, old, new) for a in e.args))
    return e
