"""The two-level attention nest as a FlashAttention kernel: ``tl.dot`` over tiles of keys.

The nest (docs/tile.md, *Two levels*) computes a row's scores three times, one
pass each for the max, the sum and the weighted sum of ``v``. Recognised here in
exactly that shape::

    m = float("-inf")
    for j: s = 0.0; for k: s += q[i, k] * kk[j, k];  m = max(m, f(s))
    l = 0.0
    for j: s = 0.0; for k: s += q[i, k] * kk[j, k];  l += exp(f(s) - m)
    acc = 0.0
    for j: s = 0.0; for k: s += q[i, k] * kk[j, k];  acc += exp(f(s) - m) * v[j, e]
    out[i, e] = acc / l

(``f`` reads ``s``, scalars, sizes and numbers: ``s * scale``), the kernel is
one pass over the keys: per tile of keys, the scores ``q @ kk.T`` as a
``tl.dot`` per tile of ``k``, an online softmax (running max and sum, the
accumulator rescaled as the max grows) and ``acc += p @ v`` as a ``tl.dot``,
all in float32. Anything else keeps the elementwise kernel (kernel.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from macrogen.macros.tile.code import Code, binary, call, chain, method, name, parse, suffix
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
    Store,
    Unary,
)
from macrogen.macros.tile.names import Names, loads_in, names_in
from macrogen.macros.tile.printer import TritonPrinter
from macrogen.macros.tile.steps import Assign, LoopBlock, Step, TritonStore, Widen

MIN_DOT = 16  # tl.dot's smallest M, N and K: smaller tiles keep the elementwise kernel


@dataclass(frozen=True)
class Flash:
    """The parts of a recognised attention nest."""

    query: str  # the grid variable of the queries (i)
    column: str  # the grid variable of v's and out's columns (e)
    keys: Loop  # the loop over keys (j)
    depth: Loop  # the loop of the scores' dot products (k)
    q: Load  # q[i, k]
    kk: Load  # kk[j, k]
    v: Load  # v[j, e]
    score: str  # the local holding a score (s)
    logit: Expr  # f(s): what the softmax exponentiates
    out: Store


def match(nest: Nest) -> Flash | None:
    """The attention nest's parts, or None if the nest is not exactly one of its two shapes:
    three passes (max; sum; weighted sum) or two (an online softmax; the weighted sum)."""
    if len(nest.grid) != 2 or nest.index_tensors or not isinstance(nest.body[-1], Store):
        return None
    store = nest.body[-1]
    lets = [s for s in nest.body if isinstance(s, Let)]
    passes = [s for s in nest.body if isinstance(s, InnerLoop)]
    if len(lets) != 3 or len(lets) + len(passes) + 1 != len(nest.body):
        return None
    starts = {s.name: s.value.value if isinstance(s.value, Const) else None for s in lets}
    # each pass: the same score loop, then its reductions
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
    grid = [g.var for g in nest.grid]
    q, kk = _pair(product.left, product.right, depth, keys)
    if q is None or kk is None:
        return None
    query = grid[0]  # the queries' tile is the grid's first axis: a column [BLOCK_I, 1]
    if q.dims != {query, depth}:
        return None
    column = grid[1 - grid.index(query)]
    # the reductions: max of f(s) into m, sum of exp(f(s) - m) into l (a second pass, or the
    # online softmax's "expsum" in the first), sum of exp(f(s) - m) * v[j, e] into acc (last)
    reductions = [[r for r in p.body[2:] if isinstance(r, Accum)] for p in passes]
    online = [len(r) for r in reductions] == [2, 1]
    if [len(r) for r in reductions] == [1, 1, 1]:
        (red_m,), (red_l,), (red_acc,) = reductions
        if red_l.op != "sum" or red_l.shift is not None:
            return None
    elif [len(r) for r in reductions] == [2, 1]:
        (red_m, red_l), (red_acc,) = reductions
        if red_l.op != "expsum" or red_l.shift != red_m.name or red_l.value != red_m.value:
            return None
    else:
        return None
    if any(len(p.body) != 2 + len(r) for p, r in zip(passes, reductions)):
        return None  # (a pass holding anything but its reductions)
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
    if not (_same(p, shifted) and isinstance(v, Load) and _plain(v) and v.dims == {keys, column}):
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
        and set(store.index) == {query, column}
        and _same(store.value, ratio)
    ):
        return None
    return Flash(query, column, first.loop, score_loop.loop, q, kk, v, score_let.name, logit, store)


def wanted(nest: Nest, tiles: dict[str, int]) -> Flash | None:
    """The attention nest's parts when its kernel is a FlashAttention one: tl.dot needs
    tiles of at least 16 along each of its axes (smaller ones stay elementwise)."""
    flash = match(nest)
    if flash is None:
        return None
    axes = (flash.query, flash.column, flash.keys.var, flash.depth.var)
    return flash if all(tiles[v] >= MIN_DOT for v in axes) else None


def _plain(e: Expr) -> bool:
    """A load whose indices are distinct loop variables, no offsets, no gathers."""
    if not isinstance(e, Load) or len(e.index) != 2:
        return False
    vars_ = [ix.var for ix in e.index]
    ok = all(ix.var is not None and ix.offset == 0 and ix.gather is None for ix in e.index)
    return ok and len(set(vars_)) == 2


def _product(e: Expr) -> bool:
    return isinstance(e, Binary) and e.op == "*" and _plain(e.left) and _plain(e.right)


def _pair(a: Expr, b: Expr, depth: str, keys: str) -> tuple[Load | None, Load | None]:
    """(q, kk) from the score's two factors, in either order: kk is the one along the keys."""
    if not (isinstance(a, Load) and isinstance(b, Load)):
        return None, None
    q, kk = (b, a) if keys in a.dims else (a, b)
    if kk.dims != {keys, depth} or keys in q.dims or depth not in q.dims:
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


def _rename(e: Expr, old: str, new: str) -> Expr:
    if isinstance(e, Name):
        return dataclasses.replace(e, name=new) if e.name == old else e
    fields: dict[str, object] = {}
    for f in dataclasses.fields(e):
        value = getattr(e, f.name)
        if isinstance(value, Expr):
            fields[f.name] = _rename(value, old, new)
        elif isinstance(value, tuple) and value and isinstance(value[0], Expr):
            fields[f.name] = tuple(_rename(x, old, new) for x in value)
    return dataclasses.replace(e, **fields)  # type: ignore[arg-type]


class FlashEmitter:
    """The kernel body (steps) after the grid setup: ``i`` is a column ``[BLOCK_I, 1]``,
    ``e`` a row ``[1, BLOCK_E]`` (the grid of a rank-2 nest)."""

    def __init__(self, flash: Flash, names: Names, tl: str, dot_precision: str):
        self.f, self.names, self.tl, self.precision = flash, names, tl, dot_precision

    def steps(self) -> list[Step]:
        f, names, tl = self.f, self.names, self.tl
        namer, block = names.namer, names.block
        bi, be = block[f.query], block[f.column]
        keys, depth = names.bounds[f.keys], names.bounds[f.depth]
        f32 = f"{tl}.float32"
        m_run, l_run, acc = namer("m_run"), namer("l_run"), namer("acc_run")
        out: list[Step] = [
            Widen((f.query, f.column), names.wide),
            Assign(m_run, parse(call(f"{tl}.full", f"[{bi}, 1]", 'float("-inf")', f32))),
            Assign(l_run, parse(call(f"{tl}.zeros", f"[{bi}, 1]", dtype=f32))),
            Assign(acc, parse(call(f"{tl}.zeros", f"[{bi}, {be}]", dtype=f32))),
        ]
        # per tile of keys: j along the scores' columns (kk^T) and along v's rows
        j_start, j_row, j_col = (
            namer(f"{f.keys.var}_start"),
            namer(f"{f.keys.var}_row"),
            namer(f"{f.keys.var}_col"),
        )
        j_row_mask, j_col_mask = namer(f"{j_row}_mask"), namer(f"{j_col}_mask")
        k_start, k_row, k_col = (
            namer(f"{f.depth.var}_start"),
            namer(f"{f.depth.var}_row"),
            namer(f"{f.depth.var}_col"),
        )
        k_row_mask, k_col_mask = namer(f"{k_row}_mask"), namer(f"{k_col}_mask")
        scores = namer(f"{f.score}_tile")
        q_tile, kk_tile, v_tile = (
            namer(f"{f.q.tensor_name}_tile"),
            namer(f"{f.kk.tensor_name}_tile"),
            namer(f"{f.v.tensor_name}_tile"),
        )
        logit, m_next, p, alpha = namer("logit"), namer("m_next"), namer("p"), namer("alpha")

        def along(start: str, size: str, axes: str) -> Code:
            return binary("+", name(start), suffix(call(f"{tl}.arange", "0", size), axes))

        def dot(a: Code, b: Code, acc_: Code) -> Code:
            return call(f"{tl}.dot", a, b, acc_, input_precision=self.precision)

        bj, bk = block[f.keys.var], block[f.depth.var]
        index_q = {f.query: f.query, f.depth.var: k_row}
        index_kk = {f.keys.var: j_row, f.depth.var: k_col}
        index_v = {f.keys.var: j_col, f.column: f.column}
        mask_q = binary("&", name(names.mask[f.query]), name(k_row_mask))
        mask_kk = binary("&", name(j_row_mask), name(k_col_mask))
        mask_v = binary("&", name(j_col_mask), name(names.mask[f.column]))
        depth_loop = LoopBlock(
            start=k_start,
            lo=depth.lo,
            hi=depth.hi,
            block=bk,
            stride=parse(name(bk)),
            step=1,
            before=(Assign(scores, parse(call(f"{tl}.zeros", f"[{bi}, {bj}]", dtype=f32))),),
            setup=(
                Assign(k_row, parse(along(k_start, bk, "[None, :]"))),
                Assign(k_col, parse(along(k_start, bk, "[:, None]"))),
                Widen((k_row, k_col), names.wide),
                Assign(k_row_mask, parse(binary("<", name(k_row), name(depth.hi)))),
                Assign(k_col_mask, parse(binary("<", name(k_col), name(depth.hi)))),
            ),
            body=(
                Assign(q_tile, parse(self._load(f.q, index_q, mask_q))),
                Assign(kk_tile, parse(self._load(f.kk, index_kk, mask_kk))),
                Assign(scores, parse(dot(name(q_tile), name(kk_tile), name(scores)))),
            ),
            after=(),
            var=f.depth.var,
            dot=True,
        )
        printed = TritonPrinter({}, tl).expr(_rename(f.logit, f.score, scores))
        rescaled = binary("*", name(l_run), name(alpha))
        key_loop = LoopBlock(
            start=j_start,
            lo=keys.lo,
            hi=keys.hi,
            block=bj,
            stride=parse(name(bj)),
            step=1,
            before=(),
            setup=(
                Assign(j_row, parse(along(j_start, bj, "[None, :]"))),
                Assign(j_col, parse(along(j_start, bj, "[:, None]"))),
                Widen((j_row, j_col), names.wide),
                Assign(j_row_mask, parse(binary("<", name(j_row), name(keys.hi)))),
                Assign(j_col_mask, parse(binary("<", name(j_col), name(keys.hi)))),
            ),
            body=(
                depth_loop,
                # padding keys at -inf: their p is 0
                Assign(logit, parse(call(f"{tl}.where", j_row_mask, printed, 'float("-inf")'))),
                Assign(
                    m_next,
                    parse(
                        call(
                            f"{tl}.maximum",
                            m_run,
                            call(f"{tl}.max", logit, axis="1", keep_dims="True"),
                        )
                    ),
                ),
                Assign(p, parse(call(f"{tl}.exp", binary("-", name(logit), name(m_next))))),
                Assign(alpha, parse(call(f"{tl}.exp", binary("-", name(m_run), name(m_next))))),
                Assign(
                    l_run,
                    parse(binary("+", rescaled, call(f"{tl}.sum", p, axis="1", keep_dims="True"))),
                ),
                Assign(v_tile, parse(self._load(f.v, index_v, mask_v))),
                # p in v's dtype: a float16 v makes a float16 x float16 dot, accumulated in float32
                Assign(
                    acc,
                    parse(
                        dot(
                            method(name(p), "to", f"{v_tile}.dtype"),
                            name(v_tile),
                            binary("*", name(acc), name(alpha)),
                        )
                    ),
                ),
                Assign(m_run, parse(name(m_next))),
            ),
            after=(),
            var=f.keys.var,
            dot=True,
        )
        out.append(key_loop)
        store = f.out
        pointer = self._address(store.tensor_name, {v: v for v in store.index}, store.index)
        value = binary("/", name(acc), name(l_run))
        ptr = names.ptr[store.tensor_name]
        mask = binary("&", name(names.mask[f.query]), name(names.mask[f.column]))
        out.append(
            TritonStore(
                parse(pointer), parse(method(value, "to", f"{ptr}.dtype.element_ty")), parse(mask)
            )
        )
        return out

    def _address(self, tensor: str, index: dict[str, str], order: tuple[str, ...]) -> Code:
        strides = self.names.strides[tensor]
        terms = [name(self.names.ptr[tensor])]
        terms += [binary("*", name(index[v]), name(strides[d])) for d, v in enumerate(order)]
        return chain("+", terms)

    def _load(self, ld: Load, index: dict[str, str], mask: Code) -> Code:
        """A tile in the tensor's own dtype: tl.dot takes float16/bfloat16 operands as they are."""
        order = tuple(ix.var for ix in ld.index if ix.var is not None)
        address = self._address(ld.tensor_name, index, order)
        return call(f"{self.tl}.load", address, mask=mask, other="0.0")
