"""The small frozen IR that ``@tile``'s analysis builds and its emitters read.

A ``Nest`` is one program per tile of the *grid* loops (the loops whose
variables index every store); its body runs once per grid point, straight-line,
and may hold *inner* loops over one more variable (two levels deep at most):
reductions (``s += e``, ``m = max(m, e)``, an online softmax), stores along
the inner variable, or a matmul-shaped ``acc += a[i, k] * b[k, j]`` (``dot``). Every expression knows the loop
variables it depends on (``dims``) and whether it is a tensor or a Python
scalar (``tensor``): broadcasting in both emitted paths is derived from these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """``size + offset`` (``size`` None: the integer ``offset`` alone)."""

    size: str | None
    offset: int


@dataclass(frozen=True)
class Loop:
    var: str
    start: Bound
    stop: Bound
    step: int = 1  # a positive constant


@dataclass(frozen=True)
class Size:
    """``name = tensor.shape[dim]``."""

    name: str
    tensor: str
    dim: int


# -- expressions -----------------------------------------------------------------
@dataclass(frozen=True)
class Expr:
    dims: frozenset[str]  # loop variables the value varies along
    tensor: bool  # a tensor (True) or a Python scalar (False) in the reference


@dataclass(frozen=True)
class Const(Expr):
    value: float | int


@dataclass(frozen=True)
class Name(Expr):
    """A scalar argument, a size, or a local variable."""

    name: str


@dataclass(frozen=True)
class Var(Expr):
    """A loop variable's value (``j <= i``): the tile's index vector, or an arange."""

    name: str


@dataclass(frozen=True)
class Index:
    """One subscript of a load or store: ``var + offset`` (``var`` None: the constant ``offset``),
    or ``gather``: the value of an integer load (``table[idx[i], j]``)."""

    var: str | None
    offset: int
    gather: Load | None = None


@dataclass(frozen=True)
class Load(Expr):
    tensor_name: str
    index: tuple[Index, ...]


@dataclass(frozen=True)
class Unary(Expr):
    op: str  # "-", "+"
    operand: Expr


@dataclass(frozen=True)
class Binary(Expr):
    op: str  # "+", "-", "*", "/", "**", "<", "<=", ">", ">=", "==", "!=", "&", "|"
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Call(Expr):
    fn: str  # exp, log, sqrt, tanh, sigmoid, abs (expressions.py), where, max, min
    args: tuple[Expr, ...]


# -- statements ----------------------------------------------------------------------
@dataclass(frozen=True)
class Let:
    name: str
    value: Expr


@dataclass(frozen=True)
class Accum:
    """``name += value`` (op "sum"), ``name = max(name, value)`` ("max") or min ("min").

    Op "expsum" is the sum half of an online softmax: after the loop ``name`` is
    the sum of ``exp(value - shift)``, ``shift`` being the local that a "max"
    Accum of the same loop reduces (the loop rescales as its running max grows).
    """

    name: str
    op: str
    value: Expr
    shift: str | None = None


@dataclass(frozen=True)
class Store:
    tensor_name: str
    index: tuple[str, ...]  # loop variables, in the tensor's dimension order
    value: Expr
    add: bool  # ``out[...] += value``
    cond: Expr | None = None  # stored only where this holds (under an ``if`` without ``else``)


@dataclass(frozen=True)
class Dot:
    """``acc += left @ right`` over the inner loop: left varies along (grid[0], k), right along (k, grid[1])."""

    acc: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class InnerLoop:
    """A loop inside the grid body (depth 1), or inside such a loop (depth 2)."""

    loop: Loop
    body: tuple[Let | Accum | Store | InnerLoop, ...]
    dot: Dot | None = None  # set when the whole body is one matmul-shaped accumulation

    @property
    def depth(self) -> int:
        """1 for a loop holding no loops, 2 for one holding loops."""
        return 1 + max((s.depth for s in self.body if isinstance(s, InnerLoop)), default=0)


Statement = Let | Accum | Store | InnerLoop


@dataclass(frozen=True)
class Nest:
    name: str  # the function's name
    params: tuple[str, ...]  # its parameters, in order
    tensors: tuple[tuple[str, int], ...]  # (parameter, ndim) of every tensor argument
    scalars: tuple[str, ...]  # parameters used as numbers
    sizes: tuple[Size, ...]
    grid: tuple[Loop, ...]  # one program per tile of these
    body: tuple[Statement, ...]
    outputs: tuple[str, ...]  # tensors the nest stores into
    index_tensors: tuple[str, ...] = ()  # integer tensors read only as indices of others

    @property
    def inner_loops(self) -> tuple[InnerLoop, ...]:
        return tuple(s for s in self.body if isinstance(s, InnerLoop))

    @property
    def all_inner_loops(self) -> tuple[InnerLoop, ...]:
        """Every inner loop, nested ones too, outer before inner."""
        out: list[InnerLoop] = []
        _inner_loops(self.body, out)
        return tuple(out)

    @property
    def depth(self) -> int:
        """Levels of inner loops under the grid: 0, 1 or 2."""
        return max((s.depth for s in self.inner_loops), default=0)

    @property
    def dot(self) -> Dot | None:
        loops = self.inner_loops
        return loops[0].dot if len(loops) == 1 else None

    @property
    def inner_axis(self) -> bool:
        """Whether tiles carry an extra trailing axis for the inner loops (not for a dot)."""
        return bool(self.inner_loops) and self.dot is None

    @property
    def rank(self) -> int:
        """Axes of a tile: one per grid loop, then one per level of inner loops."""
        return len(self.grid) + (self.depth if self.inner_axis else 0)


def _inner_loops(body: tuple[Statement, ...], out: list[InnerLoop]) -> None:
    # (not a closure that calls itself: that is a reference cycle, freed only by the
    # cycle collector, with all it holds)
    for s in body:
        if isinstance(s, InnerLoop):
            out.append(s)
            _inner_loops(s.body, out)
