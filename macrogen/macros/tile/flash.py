"""The attention nest, recognised: what its FlashAttention kernels (flash_output.py) need to know.

The nest (docs/tile.md, *Attention*) computes a row's scores once per pass: the
max, the sum and the weighted sum of ``v`` (three passes), or an online softmax
and the weighted sum (two). Recognised here in exactly that shape::

    for b in range(B):                 # optional: one program per batch (x head) element
      for i in range(M):               # queries
        for e in range(E):             # out's columns
            m = float("-inf")
            for j: s = 0.0; for k: s += q[b, i, k] * kk[b, j, k];  if j <= i: m = max(m, f(s))
            l = 0.0
            for j: s = 0.0; for k: s += q[b, i, k] * kk[b, j, k];  if j <= i: l += exp(f(s) - m)
            acc = 0.0
            for j: s = 0.0; for k: ...;  if j <= i: acc += exp(f(s) - m) * v[b, j, e]
            out[b, i, e] = acc / l

``f`` is arithmetic on ``s``, scalars, sizes and numbers (``s * scale``); the
``if`` (the same in every pass, or in none) is a causal mask ``j <= i + c``
(``c`` an integer: a number, sizes, their sums), written in any of the ways
that say so (``i >= j``, ``j < i + 1``, ``j - i <= N - M``). ``kk`` and ``v``
may leave out the batch variable (one set of keys for every query head).
Anything else keeps the elementwise kernel (kernel.py) and the general torch path
(torch_path.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from macrogen.macros.tile.ir import (
    Accum,
    Binary,
    Call,
    Const,
    Expr,
    InnerLoop,
    Let,
    Load,
    Loop,
    Name,
    Nest,
    Statement,
    Store,
    Unary,
    Var,
)
from macrogen.macros.tile.names import loads_in, names_in

MIN_DOT = 16  # tl.dot's smallest M, N and K: smaller query or key tiles keep the elementwise kernel
_IDENTITY = {"max": float("-inf"), "sum": 0.0, "expsum": float("-inf")}  # what a masked lane adds


@dataclass(frozen=True)
class Flash:
    """The parts of a recognised attention nest."""

    query: Loop  # the grid loop of the queries (i)
    column: Loop  # the grid loop of v's and out's columns (e)
    batch: Loop | None  # the grid loop of the batch (x head) elements, if any (b)
    keys: Loop  # the loop over keys (j)
    depth: Loop  # the loop of the scores' dot products (k)
    q: Load  # q[b, i, k]
    kk: Load  # kk[b, j, k]
    v: Load  # v[b, j, e]
    score: str  # the local holding a score (s)
    logit: Expr  # f(s): what the softmax exponentiates
    causal: Expr | None  # c of the mask ``j <= i + c`` (an integer expression), or None
    out: Store

    def axes(self, load: Load | Store) -> dict[str, int]:
        """Which dimension of ``load``'s tensor each of its variables indexes."""
        index = load.index if isinstance(load, Store) else tuple(ix.var for ix in load.index)
        return {var: d for d, var in enumerate(index) if var is not None}


def match(nest: Nest) -> Flash | None:
    """The attention nest's parts, or None if the nest is not exactly one of its two shapes:
    three passes (max; sum; weighted sum) or two (an online softmax; the weighted sum)."""
    if len(nest.grid) not in (2, 3) or nest.index_tensors or not isinstance(nest.body[-1], Store):
        return None
    store = nest.body[-1]
    lets = [s for s in nest.body if isinstance(s, Let)]
    passes = [s for s in nest.body if isinstance(s, InnerLoop)]
    if len(lets) != 3 or len(lets) + len(passes) + 1 != len(nest.body):
        return None
    starts = {s.name: s.value.value if isinstance(s.value, Const) else None for s in lets}
    # each pass: the same score loop, then (under the same condition, or none) its reductions
    first = passes[0]
    if len(first.body) < 3 or first.loop.step != 1:
        return None
    score_let, score_loop = first.body[:2]
    if any(p.loop != first.loop or p.body[:2] != (score_let, score_loop) for p in passes):
        return None
    if not isinstance(score_loop, InnerLoop) or score_loop.loop.step != 1:
        return None
    if not (isinstance(score_let, Let) and score_let.value == Const(frozenset(), False, 0.0)):
        return None
    if len(score_loop.body) != 1 or not isinstance(score_loop.body[0], Accum):
        return None
    dot = score_loop.body[0]
    product = dot.value
    if dot.name != score_let.name or dot.op != "sum" or not _product(product):
        return None
    assert isinstance(product, Binary)
    keys, depth = first.loop.var, score_loop.loop.var
    q, kk = _pair(product.left, product.right, depth, keys)
    if q is None or kk is None:
        return None
    split = [_conditioned(p.body[2:]) for p in passes]
    if any(s is None for s in split):
        return None
    conditions = {_strip(c) if c is not None else None for c, _ in split}  # type: ignore[misc]
    if len(conditions) != 1:
        return None  # a mask in some passes only, or different masks
    condition = split[0][0]  # type: ignore[index]
    reductions = [r for _, r in split]  # type: ignore[misc]
    # the reductions: max of f(s) into m, sum of exp(f(s) - m) into l (a second pass, or the
    # online softmax's "expsum" in the first), sum of exp(f(s) - m) * v[j, e] into acc (last)
    online = [len(r) for r in reductions] == [2, 1]
    if [len(r) for r in reductions] == [1, 1, 1]:
        (red_m,), (red_l,), (red_acc,) = reductions
        if red_l.op != "sum" or red_l.shift is not None:
            return None
    elif online:
        (red_m, red_l), (red_acc,) = reductions
        if red_l.op != "expsum" or red_l.shift != red_m.name or red_l.value != red_m.value:
            return None
    else:
        return None
    names = (red_m.name, red_l.name, red_acc.name)
    if len(set(names)) != 3 or [starts.get(n) for n in names] != [float("-inf"), 0.0, 0.0]:
        return None
    if red_m.shift is not None or red_acc.shift is not None:
        return None
    init_m, init_l, init_acc = (next(s for s in lets if s.name == n) for n in names)
    if (red_m.name, red_m.op) != (init_m.name, "max"):
        return None
    logit = red_m.value
    if not _logit(logit, score_local=score_let.name, nest=nest):
        return None
    grid = {g.var: g for g in nest.grid}
    roles = _roles(nest, q, kk, keys, depth)
    if roles is None:
        return None
    query, batch_var = roles
    (column,) = [v for v in grid if v not in (query, batch_var)]
    shifted = Call(
        frozenset({query, keys}),
        True,
        "exp",
        (
            Binary(
                frozenset({query, keys}),
                True,
                "-",
                logit,
                Name(frozenset({query}), True, init_m.name),
            ),
        ),
    )
    if not online and not _same(red_l.value, shifted):
        return None
    if red_acc.op != "sum":
        return None
    weighted = red_acc.value
    if not (isinstance(weighted, Binary) and weighted.op == "*"):
        return None
    v = weighted.right if _same(weighted.left, shifted) else weighted.left
    p = weighted.left if v is weighted.right else weighted.right
    batched = {batch_var} if batch_var is not None else set()
    if not (_same(p, shifted) and isinstance(v, Load) and _plain(v)):
        return None
    if not {keys, column} <= v.dims <= {keys, column} | batched:
        return None
    ratio = Binary(
        frozenset({query, column}),
        True,
        "/",
        Name(frozenset({query, column}), True, init_acc.name),
        Name(frozenset({query}), True, init_l.name),
    )
    if not (
        isinstance(store, Store)
        and not store.add
        and store.cond is None
        and set(store.index) == {query, column} | batched
        and _same(store.value, ratio)
    ):
        return None
    causal = None
    if condition is not None:
        causal = _causal(condition, query, keys, nest)
        if causal is None:
            return None
    return Flash(
        grid[query],
        grid[column],
        grid[batch_var] if batch_var is not None else None,
        first.loop,
        score_loop.loop,
        q,
        kk,
        v,
        score_let.name,
        logit,
        causal,
        store,
    )


def wanted(nest: Nest, tiles: dict[str, int]) -> Flash | None:
    """The attention nest's parts when its kernel is a FlashAttention one: tl.dot needs tiles
    of at least 16 along the queries and the keys (the head dimensions are taken whole, padded
    to a power of two of at least 16); smaller ones stay elementwise."""
    flash = match(nest)
    if flash is None:
        return None
    return flash if all(tiles[v.var] >= MIN_DOT for v in (flash.query, flash.keys)) else None


def _roles(nest: Nest, q: Load, kk: Load, keys: str, depth: str) -> tuple[str, str | None] | None:
    """(the query variable, the batch variable or None): q varies along the query and the
    batch, kk along the keys and, optionally, the batch."""
    grid = [g.var for g in nest.grid]
    rest = sorted(q.dims - {depth}, key=grid.index) if q.dims - {depth} <= set(grid) else None
    if rest is None or len(rest) != len(grid) - 1:
        return None
    if len(rest) == 1:
        return rest[0], None
    # two candidates: the batch is the one kk has too (or, if kk has neither, the outer one)
    shared = [v for v in rest if v in kk.dims]
    batch = shared[0] if len(shared) == 1 else rest[0] if not shared else None
    if batch is None:
        return None
    query = next(v for v in rest if v != batch)
    if not {keys, depth} <= kk.dims <= {keys, depth, batch}:
        return None
    return query, batch


def _conditioned(body: tuple[Statement, ...]) -> tuple[Expr | None, list[Accum]] | None:
    """A pass's statements after its score: its reductions, and the condition they are all
    taken under (``if cond:`` around them: ``Let(cond, test)`` then each reduction as
    ``where(cond, value, identity)``), or None when they are something else."""
    condition: Expr | None = None
    cond_name = None
    rest = list(body)
    if rest and isinstance(rest[0], Let):
        condition, cond_name = rest[0].value, rest[0].name
        rest = rest[1:]
    if not rest or not all(isinstance(r, Accum) for r in rest):
        return None
    out: list[Accum] = []
    for r in rest:
        assert isinstance(r, Accum)
        if cond_name is None:
            out.append(r)
            continue
        w = r.value
        if not (
            isinstance(w, Call)
            and w.fn == "where"
            and isinstance(w.args[0], Name)
            and w.args[0].name == cond_name
            and isinstance(w.args[2], Const)
            and w.args[2].value == _IDENTITY.get(r.op)
        ):
            return None
        out.append(dataclasses.replace(r, value=w.args[1]))
    return condition, out


def _causal(condition: Expr, query: str, keys: str, nest: Nest) -> Expr | None:
    """c of ``j <= i + c`` when ``condition`` says exactly that (c: integers and sizes)."""
    if not (isinstance(condition, Binary) and condition.op in ("<", "<=", ">", ">=")):
        return None
    left, right = _linear(condition.left, nest), _linear(condition.right, nest)
    if left is None or right is None:
        return None
    # left - right, as {variable: coefficient} and the constant terms [(sign, expr)]
    coefficients = dict(left[0])
    for var, c in right[0].items():
        coefficients[var] = coefficients.get(var, 0) - c
    terms = left[1] + [(-sign, e) for sign, e in right[1]]
    coefficients = {v: c for v, c in coefficients.items() if c}
    op = condition.op
    if coefficients == {keys: -1, query: 1}:  # i - j + C op 0: j op' i + C
        op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
        terms = [(-sign, e) for sign, e in terms]
    elif coefficients != {keys: 1, query: -1}:
        return None
    # now j - i + C op 0, i.e. j op i - C
    if op not in ("<", "<="):
        return None  # keys after the query: not a causal mask
    offset: Expr = Const(frozenset(), False, -1 if op == "<" else 0)
    for sign, e in terms:
        offset = Binary(frozenset(), False, "+" if sign < 0 else "-", offset, e)
    return offset


def _linear(e: Expr, nest: Nest) -> tuple[dict[str, int], list[tuple[int, Expr]]] | None:
    """``e`` as loop variables' coefficients and integer terms (sizes, integer numbers)."""
    sizes = {s.name for s in nest.sizes}
    if isinstance(e, Var):
        return {e.name: 1}, []
    if isinstance(e, Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return {}, [(1, e)]
    if isinstance(e, Name) and e.name in sizes:
        return {}, [(1, e)]
    if isinstance(e, Unary) and e.op == "-":
        inner = _linear(e.operand, nest)
        if inner is None:
            return None
        return {v: -c for v, c in inner[0].items()}, [(-s, t) for s, t in inner[1]]
    if isinstance(e, Binary) and e.op in ("+", "-"):
        left, right = _linear(e.left, nest), _linear(e.right, nest)
        if left is None or right is None:
            return None
        sign = 1 if e.op == "+" else -1
        coefficients = dict(left[0])
        for v, c in right[0].items():
            coefficients[v] = coefficients.get(v, 0) + sign * c
        return coefficients, left[1] + [(sign * s, t) for s, t in right[1]]
    return None


def _plain(e: Expr) -> bool:
    """A load whose indices are distinct loop variables, no offsets, no gathers."""
    if not isinstance(e, Load) or len(e.index) not in (2, 3):
        return False
    vars_ = [ix.var for ix in e.index]
    ok = all(ix.var is not None and ix.offset == 0 and ix.gather is None for ix in e.index)
    return ok and len(set(vars_)) == len(vars_)


def _product(e: Expr) -> bool:
    return isinstance(e, Binary) and e.op == "*" and _plain(e.left) and _plain(e.right)


def _pair(a: Expr, b: Expr, depth: str, keys: str) -> tuple[Load | None, Load | None]:
    """(q, kk) from the score's two factors, in either order: kk is the one along the keys."""
    if not (isinstance(a, Load) and isinstance(b, Load)):
        return None, None
    q, kk = (b, a) if keys in a.dims else (a, b)
    if not {keys, depth} <= kk.dims or keys in q.dims or depth not in q.dims:
        return None, None
    return q, kk


def _logit(e: Expr, score_local: str, nest: Nest) -> bool:
    """f(s): arithmetic on the score, scalars, sizes and numbers (no loads, no loop values)."""
    allowed = {score_local, *nest.scalars, *(s.name for s in nest.sizes)}
    if loads_in(e) or not names_in(e) <= allowed or score_local not in names_in(e):
        return False
    return _arithmetic(e)


def _arithmetic(e: Expr) -> bool:
    if isinstance(e, (Const, Name)):
        return True
    if isinstance(e, Unary):
        return _arithmetic(e.operand)
    if isinstance(e, Binary):
        if e.op == "**":
            return _arithmetic(e.left)
        return e.op in ("+", "-", "*", "/") and _arithmetic(e.left) and _arithmetic(e.right)
    if isinstance(e, Call):
        return e.fn in ("exp", "log", "sqrt", "tanh", "sigmoid", "abs") and all(
            _arithmetic(a) for a in e.args
        )
    return False


def _same(a: Expr, b: Expr) -> bool:
    """Equal expressions, whatever dims the analysis gave the names in them."""
    return _strip(a) == _strip(b)


def _strip(e: Expr) -> Expr:
    fields: dict[str, object] = {}
    for f in dataclasses.fields(e):
        value = getattr(e, f.name)
        if isinstance(value, Expr):
            value = _strip(value)
        elif isinstance(value, tuple) and value and isinstance(value[0], Expr):
            value = tuple(_strip(x) for x in value)
        fields[f.name] = value
    fields["dims"] = frozenset()
    fields["tensor"] = True
    return type(e)(**fields)  # type: ignore[arg-type]
