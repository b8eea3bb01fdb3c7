"""Generated names of one @tile nest, shared by the shapes function, kernel, launcher and torch path."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from macrogen.macro import ident
from macrogen.macros.tile.code import Code, Parsed, binary, call, name, number, parse, plus
from macrogen.macros.tile.ir import Binary, Bound, Call, Expr, Load, Loop, Name, Nest, Unary, Var


class Namer:
    """Names for generated locals that collide with none of the user's names."""

    def __init__(self, taken: set[str]):
        self.taken = set(taken)

    def __call__(self, hint: str) -> str:
        candidate, n = hint, 1
        while candidate in self.taken:
            n += 1
            candidate = f"{hint}_{n}"
        self.taken.add(candidate)
        return ident(candidate)


@dataclass(frozen=True)
class LoopBounds:
    """``lo``/``hi`` names of one loop and their code in terms of sizes."""

    var: str
    lo: str
    hi: str
    lo_code: Parsed
    hi_code: Parsed
    step: str = ""  # the slice suffix of a stepped loop, ":2"
    # the stop as the shapes function computes it: never below the start, so that
    # an empty range is an empty slice (x[0:-1] is not)
    clamped_hi_code: Parsed | None = None


@dataclass
class Names:
    """Every generated name of one nest, shared by the launcher, kernel and torch path."""

    namer: Namer
    ptr: dict[str, str] = field(default_factory=dict)  # tensor -> pointer argument
    strides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    block: dict[str, str] = field(default_factory=dict)  # loop variable -> BLOCK_ constexpr
    bounds: dict[Loop, LoopBounds] = field(default_factory=dict)
    mask: dict[str, str] = field(default_factory=dict)  # grid variable -> its mask
    wide: str = "INDEX_64"  # the kernel's constexpr: offsets in 64 bits

    def fork(self) -> Names:
        """The same names, with a namer of its own for one generated function's locals."""
        return dataclasses.replace(self, namer=Namer(self.namer.taken))


def make_names(nest: Nest, taken: set[str]) -> Names:
    namer = Namer(taken)
    names = Names(namer)
    for tensor, ndim in nest.tensors:
        names.ptr[tensor] = namer(f"{tensor}_ptr")
        names.strides[tensor] = tuple(namer(f"stride_{tensor}{d}") for d in range(ndim))
    for loop in [*nest.grid, *(s.loop for s in nest.all_inner_loops)]:
        if loop.var not in names.block:
            names.block[loop.var] = namer(f"BLOCK_{loop.var.upper()}")
        if loop not in names.bounds:
            names.bounds[loop] = LoopBounds(
                loop.var,
                namer(f"{loop.var}_lo"),
                namer(f"{loop.var}_hi"),
                parse(bound_code(loop.start)),
                parse(stop_code(loop)),
                f":{loop.step}" if loop.step != 1 else "",
                parse(clamped_stop_code(loop, {s.name for s in nest.sizes})),
            )
    for loop in nest.grid:
        names.mask[loop.var] = namer(f"{loop.var}_mask")
    names.wide = namer("INDEX_64")
    return names


def bound_code(b: Bound) -> Code:
    if b.size is None:
        return number(b.offset)
    return plus(name(b.size), b.offset)


def stop_code(loop: Loop) -> Code:
    """The loop's stop; for a step above 1, one past the last index it visits
    (``lo + (hi - lo - 1) // step * step + 1``), so that range checks are exact."""
    stop = bound_code(loop.stop)
    if loop.step == 1:
        return stop
    start, step = loop.start, number(loop.step)
    if start.size is None and loop.stop.size is None:
        count = len(range(start.offset, loop.stop.offset, loop.step))
        return number(start.offset + (count - 1) * loop.step + 1 if count else start.offset)
    if start.size is None:  # hi - lo - 1 folds into one offset
        assert loop.stop.size is not None
        span = plus(name(loop.stop.size), loop.stop.offset - start.offset - 1)
        return plus(binary("*", binary("//", span, step), step), start.offset + 1)
    span = plus(binary("-", stop, bound_code(start)), -1)
    return plus(binary("+", bound_code(start), binary("*", binary("//", span, step), step)), 1)


def clamped_stop_code(loop: Loop, sizes: set[str]) -> Code:
    """``stop_code``, or ``max(start, stop)`` where the stop may fall below the start."""
    start, stop = loop.start, loop.stop
    if start.size is None and stop.size is None:
        return number(max(start.offset, stop.offset)) if loop.step == 1 else stop_code(loop)
    if start == Bound(None, 0) and stop.size in sizes and stop.offset >= 0 and loop.step == 1:
        return stop_code(loop)  # a size is never negative
    return call("max", bound_code(start), stop_code(loop))


def load_vars(load: Load) -> list[str]:
    """The loop variables a load's tile varies along, in index order (gathered ones too)."""
    out: list[str] = []
    for ix in load.index:
        out += [ix.var] if ix.var is not None else load_vars(ix.gather) if ix.gather else []
    return list(dict.fromkeys(out))


def load_name(load: Load) -> str:
    """``x_ij``, ``x_i_jp1``, ``w_0k``: the tensor and its index pattern."""
    parts = []
    for ix in load.index:
        if ix.gather is not None:
            parts.append(ix.gather.tensor_name)
        elif ix.var is None:
            parts.append(str(ix.offset))
        else:
            sign = "" if ix.offset == 0 else f"{'p' if ix.offset > 0 else 'm'}{abs(ix.offset)}"
            parts.append(ix.var + sign)
    sep = "" if all(len(p) == 1 for p in parts) else "_"
    return f"{load.tensor_name}_{sep.join(parts)}"


def vars_in(e: Expr) -> list[str]:
    """Loop variables whose values ``e`` reads (not as indices), in order."""
    if isinstance(e, Var):
        return [e.name]
    if isinstance(e, Unary):
        return vars_in(e.operand)
    if isinstance(e, Binary):
        return list(dict.fromkeys(vars_in(e.left) + vars_in(e.right)))
    if isinstance(e, Call):
        return list(dict.fromkeys(v for a in e.args for v in vars_in(a)))
    return []


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


def names_in(e: Expr) -> set[str]:
    """The names (locals, scalars, sizes) ``e`` reads."""
    if isinstance(e, Name):
        return {e.name}
    if isinstance(e, Unary):
        return names_in(e.operand)
    if isinstance(e, Binary):
        return names_in(e.left) | names_in(e.right)
    if isinstance(e, Call):
        return set().union(*(names_in(a) for a in e.args))
    return set()
