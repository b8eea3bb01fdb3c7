"""Recognise ``@tile``'s loop-nest subset in a function and build its ``Nest`` (tile_ir.py).

The grammar (docs/tile.md has it with examples)::

    def f(out, x, b, alpha):              # tensor and scalar parameters
        M, N = x.shape                    # sizes: NAME, ... = t.shape | NAME = t.shape[d]
        for i in range(M):                # 1-3 perfectly nested loops: range(stop) | range(start, stop)
            for j in range(N):            #   bound: size | size +- int | int
                v = x[i, j] + b[j]        # locals; loads t[i, j + 1, 0] (loop variable +- int, or int)
                out[i, j] = v * alpha     # stores index every parallel loop variable once

The innermost body may also hold inner loops over one more variable (rows of a
softmax), whose statements reduce into locals defined before them (``s += e``,
``m = max(m, e)``, ``m = min(m, e)``, or an online softmax's max and rescaled
sum), store along the inner variable, or accumulate ``out[i] += e``; such a
loop may hold one more level of loops (a score's reduction over ``k`` inside
the loop over ``j``). A last loop whose variable no store uses, holding
only ``out[...] += e`` (``acc += a[i, k] * b[k, j]`` too), is such a reduction.

Anything else is a ``MacroError`` at the construct, saying what is supported.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import libcst as cst

from macrogen.macro import MacroError, find
from macrogen.macros.tile.expressions import ExpressionReader, Scope, code_of, contains, negate
from macrogen.macros.tile.ir import (
    Accum,
    Binary,
    Bound,
    Call,
    Const,
    Dot,
    Expr,
    InnerLoop,
    Let,
    Loop,
    Name,
    Nest,
    Size,
    Statement,
    Store,
    Unary,
)
from macrogen.macros.tile.names import loads_in, vars_in

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def analyze(
    fn: cst.FunctionDef, constants: Mapping[str, Any], taken: set[str] | None = None
) -> Nest:
    """The ``Nest`` of ``fn`` (its decorator already removed), or a MacroError.

    ``taken``: ``words(fn)``, when the caller has them."""
    return _Analyzer(fn, constants, words(fn) if taken is None else taken).nest()


def words(fn: cst.FunctionDef, text: str | None = None) -> set[str]:
    """Every identifier-like word of the function's code (comments and strings too):
    names the generated code must not take. ``text``: its source text, when the pass
    has it (``Context.source_text``: the same words, without printing the tree)."""
    return set(_IDENT.findall(code_of(fn) if text is None else text))


class _Analyzer(ExpressionReader):
    def __init__(self, fn: cst.FunctionDef, constants: Mapping[str, Any], taken: set[str]):
        self.fn = fn
        self.constants = constants
        self.params = self._params()
        self.ndim: dict[str, int] = {}  # tensor parameter -> number of indices
        self.scalars: list[str] = []
        self.sizes: dict[str, Size] = {}
        self.loop_vars: set[str] = set()
        self.stored: dict[str, cst.CSTNode] = {}
        self.taken = set(taken)
        self.outputs = self._outputs(fn.body)
        self.index_tensors: set[str] = set()  # tensors read as indices (integers)
        self.value_tensors: set[str] = set()  # tensors read as values
        self.values: dict[str, Expr] = {}  # each local's latest value (an online softmax's start)

    # -- the function ----------------------------------------------------------------
    def _params(self) -> tuple[str, ...]:
        p = self.fn.params
        for star in (p.star_arg, p.star_kwarg):
            if isinstance(star, cst.Param):
                raise MacroError(
                    "@tile functions take named parameters only, not *args/**kwargs", star
                )
        return tuple(q.name.value for q in (*p.posonly_params, *p.params, *p.kwonly_params))

    def nest(self) -> Nest:
        if self.fn.asynchronous is not None:
            raise MacroError("@tile functions can't be async", self.fn.asynchronous)
        body = self.fn.body
        if not isinstance(body, cst.IndentedBlock):
            raise MacroError("put the @tile loop nest in an indented function body", body)
        stmts = list(body.body)
        if stmts and is_docstring(stmts[0]):
            stmts = stmts[1:]
        while stmts and not isinstance(stmts[0], cst.For):
            self._size_binding(stmts.pop(0))
        if not stmts:
            raise MacroError(
                "an @tile function must end with a loop nest: for i in range(M): ...", self.fn.name
            )
        if len(stmts) > 1:
            raise MacroError("nothing may follow the loop nest in an @tile function", stmts[1])
        first = stmts[0]
        assert isinstance(first, cst.For)  # the loop above stopped at it
        chain, block = self._chain(first)
        if self._is_reduction_suffix(chain, block):
            grid = tuple(chain[:-1])
            scope = Scope(tuple(loop.var for loop in grid), {})
            body_ir: list[Statement] = [
                *self._inner_loop(chain[-1], self._last_for, block, scope, grid)
            ]
        else:
            grid = tuple(chain)
            body_ir = self._grid_body(block, grid)
        if not self.stored:
            raise MacroError(
                "this loop nest stores nothing: an @tile body writes its results with out[i, ...] = ...",
                self.fn.name,
            )
        tensors = tuple((p, self.ndim[p]) for p in self.params if p in self.ndim)
        return Nest(
            name=self.fn.name.value,
            params=self.params,
            tensors=tensors,
            scalars=tuple(s for s in self.params if s in self.scalars),
            sizes=tuple(self.sizes.values()),
            grid=grid,
            body=tuple(body_ir),
            outputs=tuple(p for p in self.params if p in self.stored),
            index_tensors=tuple(p for p in self.params if p in self.index_tensors),
        )

    def _outputs(self, body: cst.CSTNode) -> set[str]:
        """Every tensor the function stores into (known before any load is read)."""
        found: set[str] = set()

        for node in find(body, (cst.AssignTarget, cst.AugAssign)):
            target = node.target
            if isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name):
                found.add(target.value.value)
        return found

    def _size_binding(self, stmt: cst.BaseStatement) -> None:
        usage = (
            "before the loop nest only sizes may be bound (M, N = x.shape or N = x.shape[1]);"
            " compute other values inside the loops"
        )
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
            raise MacroError(self._unsupported(stmt) or usage, stmt)
        assign = stmt.body[0]
        if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
            raise MacroError(self._unsupported(assign) or usage, assign)
        target, value = assign.targets[0].target, assign.value
        if isinstance(target, (cst.Tuple, cst.List)) and _is_shape(value):
            tensor = self._tensor_param(value.value)
            names = []
            for el in target.elements:
                if not isinstance(el.value, cst.Name) or isinstance(el, cst.StarredElement):
                    raise MacroError("unpack .shape into plain names: M, N = x.shape", el)
                names.append(el.value)
            self._use_tensor(tensor, len(names), value)
            for dim, name in enumerate(names):
                if name.value != "_":
                    self._bind_size(name, tensor, dim)
            return
        if (
            isinstance(target, cst.Name)
            and isinstance(value, cst.Subscript)
            and _is_shape(value.value)
            and len(value.slice) == 1
            and isinstance(value.slice[0].slice, cst.Index)
            and isinstance(value.slice[0].slice.value, cst.Integer)
        ):
            tensor = self._tensor_param(value.value.value)
            self._bind_size(target, tensor, int(value.slice[0].slice.value.value))
            return
        raise MacroError(usage, assign)

    def _tensor_param(self, node: cst.BaseExpression) -> str:
        if not isinstance(node, cst.Name) or node.value not in self.params:
            raise MacroError("sizes come from a tensor parameter's .shape", node)
        return node.value

    def _bind_size(self, name: cst.Name, tensor: str, dim: int) -> None:
        if name.value in self.params or name.value in self.sizes:
            raise MacroError(f"{name.value!r} is already bound; give each size its own name", name)
        self.sizes[name.value] = Size(name.value, tensor, dim)

    def _use_tensor(self, tensor: str, ndim: int, node: cst.CSTNode) -> None:
        if tensor in self.scalars:
            raise MacroError(f"{tensor!r} is used as a number elsewhere; here it is a tensor", node)
        known = self.ndim.setdefault(tensor, ndim)
        if known != ndim:
            raise MacroError(
                f"{tensor!r} has {known} dimensions elsewhere in this function, {ndim} here", node
            )

    # -- loops -------------------------------------------------------------------------
    def _chain(self, first: cst.For) -> tuple[list[Loop], list[cst.BaseStatement]]:
        """The perfectly nested loops from ``first`` down, and the innermost body."""
        chain, node = [self._loop(first)], first
        while True:
            block = self._block(node)
            self._last_for = node
            if len(block) == 1 and isinstance(block[0], cst.For):
                node = block[0]
                chain.append(self._loop(node))
                if chain[-1].var in (loop.var for loop in chain[:-1]):
                    raise MacroError(
                        f"loop variable {chain[-1].var!r} is already bound; use a new name",
                        node.target,
                    )
                if len(chain) > 3:
                    raise MacroError("@tile supports at most 3 nested loops", node)
                continue
            return chain, block

    def _block(self, node: cst.For) -> list[cst.BaseStatement]:
        return _suite(node.body)

    def _loop(self, node: cst.For) -> Loop:
        usage = (
            "@tile loops are for VAR in range(stop), range(start, stop) or range(start, stop, step)"
        )
        if node.asynchronous is not None:
            raise MacroError("async for is not supported in @tile", node)
        if node.orelse is not None:
            raise MacroError("for ... else is not supported in @tile", node.orelse)
        if not isinstance(node.target, cst.Name):
            raise MacroError(usage, node.target)
        var = node.target.value
        if var in self.params or var in self.sizes:
            raise MacroError(f"loop variable {var!r} is already bound; use a new name", node.target)
        it = node.iter
        if not (
            isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range"
        ):
            raise MacroError(usage, it)
        if not 1 <= len(it.args) <= 3 or any(a.keyword or a.star for a in it.args):
            raise MacroError(usage, it)
        bounds = [self._bound(a.value) for a in it.args[:2]]
        start = bounds[0] if len(bounds) == 2 else Bound(None, 0)
        step = self._step(it.args[2].value) if len(it.args) == 3 else 1
        self.loop_vars.add(var)
        return Loop(var, start, bounds[-1], step)

    def _step(self, node: cst.BaseExpression) -> int:
        """A positive integer constant: a literal or a define()d int."""
        value: object = None
        if isinstance(node, cst.Integer):
            value = int(node.value)
        elif isinstance(node, cst.Name):
            value = self.constants.get(node.value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MacroError(
                "a range step in @tile is a positive integer constant (a literal or a define()d"
                " int): tiles are laid out at compile time; for a reversed loop index n - 1 - i",
                node,
            )
        return value

    def _bound(self, node: cst.BaseExpression) -> Bound:
        usage = (
            "a loop bound is a size (N from .shape, x.shape[d], x.size(d), len(x)), an integer"
            " parameter, either +- an integer, or an integer"
        )
        if isinstance(node, cst.Integer):
            return Bound(None, int(node.value))
        if isinstance(node, cst.Name) and isinstance(self.constants.get(node.value), int):
            return Bound(None, self.constants[node.value])
        size = self._size_of(node)
        if size is not None:
            return Bound(size, 0)
        if isinstance(node, cst.BinaryOperation) and isinstance(
            node.operator, (cst.Add, cst.Subtract)
        ):
            left, const = node.left, node.right
            if isinstance(left, cst.Integer) and isinstance(node.operator, cst.Add):
                left, const = const, left
            size = self._size_of(left)
            if size is not None and isinstance(const, cst.Integer):
                sign = -1 if isinstance(node.operator, cst.Subtract) else 1
                return Bound(size, sign * int(const.value))
        if isinstance(node, cst.Name):
            raise MacroError(f"{node.value!r} is not a size or a parameter; {usage}", node)
        if contains(node, cst.Subscript) and not _is_shape_subscript(node):
            raise MacroError(f"a loop bound may not depend on tensor values; {usage}", node)
        raise MacroError(usage, node)

    def _size_of(self, node: cst.BaseExpression) -> str | None:
        """The name of the size ``node`` reads: a bound size, an integer parameter,
        ``x.shape[d]``, ``x.size(d)`` or ``len(x)`` (named here), else None."""
        if isinstance(node, cst.Name):
            if node.value in self.sizes:
                return node.value
            if node.value in self.params and node.value not in self.ndim:
                if node.value not in self.scalars:
                    self.scalars.append(node.value)  # a scalar argument: the kernel takes it
                return node.value
            return None
        tensor_dim = _shape_read(node)
        if tensor_dim is None:
            return None
        tensor_node, dim = tensor_dim
        tensor = self._tensor_param(tensor_node)
        for size in self.sizes.values():
            if (size.tensor, size.dim) == (tensor, dim):
                return size.name
        name = self._fresh(f"{tensor}_size{dim}")
        self.sizes[name] = Size(name, tensor, dim)
        return name

    def _is_reduction_suffix(self, chain: list[Loop], block: list[cst.BaseStatement]) -> bool:
        """``for k`` last, holding only ``out[...] += e`` that never index k: a reduction over k."""
        if len(chain) < 2 or any(not isinstance(s, cst.SimpleStatementLine) for s in block):
            return False
        stores = [
            small
            for s in block
            if isinstance(s, cst.SimpleStatementLine)
            for small in s.body
            if isinstance(small, (cst.Assign, cst.AugAssign)) and _subscript_target(small)
        ]
        last = chain[-1].var
        return bool(stores) and all(last not in _index_names(_subscript_target(s)) for s in stores)

    # -- bodies ------------------------------------------------------------------------
    def _grid_body(self, block: list[cst.BaseStatement], grid: tuple[Loop, ...]) -> list[Statement]:
        scope = Scope(tuple(loop.var for loop in grid), {})
        out: list[Statement] = []
        for stmt in block:
            if isinstance(stmt, cst.For):
                loop = self._loop(stmt)
                out.extend(self._inner_loop(loop, stmt, self._block(stmt), scope, grid))
                continue
            if isinstance(stmt, cst.If):
                out.extend(self._if(stmt, scope, self._grid_statement))
                continue
            for small in self._smalls(stmt):
                out.extend(self._grid_statement(small, scope))
        return out

    def _smalls(self, stmt: cst.BaseStatement) -> list[cst.BaseSmallStatement]:
        if isinstance(stmt, cst.SimpleStatementLine):
            return [s for s in stmt.body if not isinstance(s, cst.Pass)]
        raise MacroError(self._unsupported(stmt), stmt)

    def _grid_statement(self, small: cst.BaseSmallStatement, scope: Scope) -> list[Statement]:
        target, value, add = self._assignment(small)
        if isinstance(target, cst.Name):
            name = self._local_name(target)
            if add is not None:
                if name not in scope.local:
                    raise MacroError(f"{name!r} is read before it is assigned", target)
                expr = self._binary(
                    "+" if add else "-", scope.local[name], self._expr(value, scope)
                )
            else:
                expr = self._expr(value, scope)
            scope.local[name] = Name(expr.dims, expr.tensor, name)
            self.values[name] = expr
            return [Let(name, expr)]
        index = self._store_index(target, scope.loop_vars)
        expr = self._expr(value, scope)
        if add is False:
            expr = Unary(expr.dims, expr.tensor, "-", expr)
        return [Store(_tensor_of(target), index, expr, add is not None)]

    def _inner_loop(
        self,
        loop: Loop,
        loop_node: cst.For,
        block: list[cst.BaseStatement],
        outer: Scope,
        grid: tuple[Loop, ...],
        depth: int = 1,
        fixed: frozenset[str] = frozenset(),
    ) -> list[Statement]:
        """A loop over one more variable inside the grid body (depth 1) or inside such a loop
        (depth 2): reductions and stores along it. ``fixed``: the locals of the scope
        outside the enclosing inner loop, which a depth-2 loop may not reduce into."""
        outer_vars = outer.loop_vars
        if loop.var in outer_vars:
            raise MacroError(
                f"loop variable {loop.var!r} is already bound by an outer loop; use a new name",
                loop_node,
            )
        scope = Scope((*outer_vars, loop.var), dict(outer.local))
        scope.gone = outer.gone
        scope.carried = self._carried(block, outer)
        for name in sorted(scope.carried & fixed):
            raise MacroError(
                f"{name!r} is defined outside the loop over {outer_vars[-1]} and reduced in the"
                f" loop over {loop.var} inside it: a reduction over two loops is not supported;"
                f" reduce into a local defined in the loop over {outer_vars[-1]}, then reduce that",
                loop_node,
            )
        online = self._online_softmax(block, scope)
        before: list[Statement] = []
        after: list[Statement] = []
        ops: dict[str, str] = {}

        def reduce(
            name: str, op: str, expr: Expr, node: cst.CSTNode, shift: str | None = None
        ) -> list[Statement]:
            if loop.var not in expr.dims:
                raise MacroError(
                    f"the value reduced into {name!r} does not depend on {loop.var!r};"
                    " compute it after the loop",
                    node,
                )
            if ops.setdefault(name, op) != op:
                raise MacroError(
                    f"{name!r} is reduced with both {ops[name]} and {op} in this loop", node
                )
            return [Accum(name, op, expr, shift)]

        def handle(small: cst.BaseSmallStatement, scope: Scope) -> list[Statement]:
            if id(small) in online:
                plan = online[id(small)]
                if plan is None:
                    return []
                name, op, value, shift = plan
                return reduce(name, op, self._expr(value, scope), value, shift)
            target, value, add = self._assignment(small)
            if isinstance(target, cst.Subscript):
                index_names = _index_names(target)
                if loop.var in index_names:
                    index = self._store_index(target, scope.loop_vars)
                    expr = self._expr(value, scope)
                    if add is False:
                        expr = Unary(expr.dims, expr.tensor, "-", expr)
                    return [Store(_tensor_of(target), index, expr, add is not None)]
                if add is None:
                    raise MacroError(
                        f"this store does not index {loop.var!r}, so every iteration of the loop"
                        f" over {loop.var} writes the same element; accumulate with +=",
                        small,
                    )
                index = self._store_index(target, outer_vars)
                tensor = _tensor_of(target)
                acc = self._fresh(f"{tensor}_acc")
                expr = self._expr(value, scope)
                before.append(Let(acc, Const(frozenset(), False, 0.0)))
                after.append(Store(tensor, index, Name(frozenset(outer_vars), True, acc), True))
                ops[acc] = "sum"
                return [Accum(acc, "sum", expr if add else negate(expr))]
            name = self._local_name(target)
            if name in scope.carried:
                op, expr = self._accumulation(name, target, value, add, scope)
                return reduce(name, op, expr, value)
            if add is not None:
                if name not in scope.local or name in outer.local:
                    raise MacroError(f"{name!r} is read before it is assigned", target)
                expr = self._binary(
                    "+" if add else "-", scope.local[name], self._expr(value, scope)
                )
            else:
                expr = self._expr(value, scope)
            scope.local[name] = Name(expr.dims, expr.tensor, name)
            self.values[name] = expr
            return [Let(name, expr)]

        body: list[Statement] = []
        for stmt in block:
            if isinstance(stmt, cst.For):
                if depth >= 2:
                    raise MacroError(
                        "a loop inside a loop inside the parallel loops is not supported: @tile"
                        " takes at most two levels of inner loops under the parallel loops",
                        stmt,
                    )
                body.extend(
                    self._inner_loop(
                        self._loop(stmt),
                        stmt,
                        self._block(stmt),
                        scope,
                        grid,
                        depth + 1,
                        frozenset(outer.local),
                    )
                )
                continue
            if isinstance(stmt, cst.If):
                body.extend(self._if(stmt, scope, handle))
                continue
            for small in self._smalls(stmt):
                body.extend(handle(small, scope))
        for name in scope.local:
            if name not in outer.local:
                outer.gone[name] = (
                    f"{name!r} is assigned inside the loop over {loop.var}; its value is not available after the loop"
                )
        outer.gone[loop.var] = f"loop variable {loop.var!r} is only defined inside its loop"
        for name in ops:
            if name in outer.local:
                init = outer.local[name]
                outer.local[name] = Name(
                    init.dims | frozenset(outer_vars) & _dims_of(body, name), True, name
                )
        dot = self._dot(loop, body, tuple(g.var for g in grid)) if depth == 1 else None
        return [*before, InnerLoop(loop, tuple(body), dot), *after]

    def _online_softmax(self, block: list[cst.BaseStatement], scope: Scope) -> dict[int, Any]:
        """The statements of an online softmax in this loop, by id: what each becomes.

        ``m_new = max(m, e); s = s * exp(m - m_new) + exp(e2 - m_new); m = m_new``
        (or ``m_old = m; m = max(m, e); s = s * exp(m_old - m) + exp(e2 - m)``), with
        ``m`` and ``s`` defined before the loop as -inf and 0: ``m`` is the max of ``e``
        and ``s`` the sum of ``exp(e2 - m)``, computed in one pass. Each statement maps
        to (name, op, value, shift) or None (it becomes nothing).
        """
        smalls = [
            small
            for stmt in block
            if isinstance(stmt, cst.SimpleStatementLine)
            for small in stmt.body
        ]
        plan: dict[int, Any] = {}

        def assign(small: cst.BaseSmallStatement) -> tuple[str, cst.BaseExpression] | None:
            if (
                isinstance(small, cst.Assign)
                and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name)
            ):
                return small.targets[0].target.value, small.value
            return None

        def is_name(node: cst.BaseExpression, name: str) -> bool:
            return isinstance(node, cst.Name) and node.value == name

        def running_max(value: cst.BaseExpression, m: str) -> cst.BaseExpression | None:
            if isinstance(value, cst.Call) and len(value.args) == 2:
                if self._function_name(value.func) == "max":
                    return _other_operand(m, value.args[0].value, value.args[1].value)
            return None

        def exp_of(node: cst.BaseExpression) -> cst.BaseExpression | None:
            if (
                isinstance(node, cst.Call)
                and len(node.args) == 1
                and self._function_name(node.func) == "exp"
            ):
                return node.args[0].value
            return None

        def rescaled(
            value: cst.BaseExpression, s: str, old: str, new: str
        ) -> cst.BaseExpression | None:
            """e2 of ``s * exp(old - new) + exp(e2 - new)`` (terms in either order), else None."""
            if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add)):
                return None
            for scaled, term in ((value.left, value.right), (value.right, value.left)):
                if not (
                    isinstance(scaled, cst.BinaryOperation)
                    and isinstance(scaled.operator, cst.Multiply)
                ):
                    continue
                factor = _other_operand(s, scaled.left, scaled.right)
                arg = exp_of(factor) if factor is not None else None
                shifted = exp_of(term)
                if (
                    isinstance(arg, cst.BinaryOperation)
                    and isinstance(arg.operator, cst.Subtract)
                    and is_name(arg.left, old)
                    and is_name(arg.right, new)
                    and isinstance(shifted, cst.BinaryOperation)
                    and isinstance(shifted.operator, cst.Subtract)
                    and is_name(shifted.right, new)
                ):
                    return shifted.left
            return None

        for a, first in enumerate(smalls):
            head = assign(first)
            if head is None:
                continue
            for b, second in enumerate(smalls[a + 1 :], a + 1):
                pair = assign(second)
                if pair is None:
                    continue
                for third in smalls[b + 1 :]:
                    last = assign(third)
                    if last is None:
                        continue
                    # m_new = max(m, e); s = s*exp(m - m_new) + exp(e2 - m_new); m = m_new
                    t, m = head[0], last[0]
                    e = running_max(head[1], m)
                    if e is not None and is_name(last[1], t) and m in scope.carried:
                        s = pair[0]
                        e2 = rescaled(pair[1], s, m, t)
                        if e2 is not None and s in scope.carried and s != m:
                            self._online_start(m, s, second)
                            plan[id(first)] = (m, "max", e, None)
                            plan[id(second)] = (s, "expsum", e2, m)
                            plan[id(third)] = None
                            return plan
                # m_old = m; m = max(m, e); s = s*exp(m_old - m) + exp(e2 - m)
                t = head[0]
                m = pair[0]
                if not (is_name(head[1], m) and m in scope.carried):
                    continue
                e = running_max(pair[1], m)
                if e is None:
                    continue
                for third in smalls[b + 1 :]:
                    last = assign(third)
                    if last is None or last[0] not in scope.carried or last[0] == m:
                        continue
                    e2 = rescaled(last[1], last[0], t, m)
                    if e2 is not None:
                        self._online_start(m, last[0], third)
                        plan[id(first)] = None
                        plan[id(second)] = (m, "max", e, None)
                        plan[id(third)] = (last[0], "expsum", e2, m)
                        return plan
        return plan

    def _online_start(self, m: str, s: str, node: cst.CSTNode) -> None:
        """An online softmax starts from m = -inf, s = 0 (what its single pass assumes)."""
        start_m, start_s = self.values.get(m), self.values.get(s)
        if not (
            isinstance(start_m, Const)
            and start_m.value == -math.inf
            and isinstance(start_s, Const)
            and start_s.value == 0
        ):
            raise MacroError(
                f"an online softmax starts from {m} = float('-inf') and {s} = 0.0: assign them"
                " so right before its loop",
                node,
            )

    def _if(
        self,
        node: cst.If,
        scope: Scope,
        handle: Callable[[cst.BaseSmallStatement, Scope], list[Statement]],
    ) -> list[Statement]:
        """``if``/``elif``/``else`` as straight-line code, each branch computed on the whole tile.

        A condition is bound to a fresh local; each branch's assignments go to
        fresh names; then every local a branch assigns becomes
        ``where(c1, v_1, where(c2, v_2, v))``, reductions reduce such a chain
        (the identity where the taken branch does not reduce), and an output
        stored in every branch stores one; stored only in the first branch, it is
        a store masked by its condition. No early exits: every lane runs every
        branch, and ``where`` picks.
        """
        out: list[Statement] = []
        branches: list[tuple[Name | None, list[cst.BaseStatement]]] = []
        current: cst.If | cst.Else | None = node
        while isinstance(current, cst.If):
            test = self._condition(current.test, scope)
            cname = self._fresh("cond")
            out.append(Let(cname, test))
            branches.append((Name(test.dims, test.tensor, cname), _suite(current.body)))
            current = current.orelse
        if isinstance(current, cst.Else):
            branches.append((None, _suite(current.body)))
        local, stored = dict(scope.local), dict(self.stored)
        stored_after = dict(stored)
        results = []  # per branch: (renamed locals, accumulations, stores)
        for _, stmts in branches:
            scope.local, self.stored = dict(local), dict(stored)  # each branch may store an output
            ir: list[Statement] = []
            for stmt in stmts:
                if isinstance(stmt, cst.For):
                    raise MacroError(
                        "a loop inside an if is not supported in @tile; put the if inside the loop",
                        stmt,
                    )
                if isinstance(stmt, cst.If):
                    ir.extend(self._if(stmt, scope, handle))
                    continue
                for small in self._smalls(stmt):
                    ir.extend(handle(small, scope))
            stored_after.update(self.stored)
            renamed, lets, accums, stores = self._rename_branch(ir)
            out.extend(lets)
            results.append((renamed, accums, stores, {n: scope.local[n] for n in renamed}))
        scope.local, self.stored = local, stored_after
        complete = branches[-1][0] is None
        conds = [c for c, _ in branches]
        # locals: a where chain over the branches
        for name in dict.fromkeys(n for r in results for n in r[0]):
            default: Expr | None = local.get(name)
            if default is None and not (complete and all(name in r[0] for r in results)):
                scope.gone[name] = (
                    f"{name!r} is assigned in only some branches of the if above and not before it"
                )
                continue
            values = [
                Name(r[3][name].dims, r[3][name].tensor, r[0][name]) if name in r[0] else default
                for r in results
            ]
            chain = _where_chain(conds, values, default)
            scope.local[name] = Name(chain.dims, chain.tensor, name)
            out.append(Let(name, chain))
        # reductions: the value the taken branch reduces, or the identity
        for name in dict.fromkeys(n for r in results for n in r[1]):
            ops = {r[1][name][0] for r in results if name in r[1]}
            if len(ops) > 1:
                raise MacroError(f"{name!r} is reduced with both {' and '.join(sorted(ops))}", node)
            op = ops.pop()
            identity = Const(frozenset(), False, _IDENTITY[op])
            values = [r[1][name][1] if name in r[1] else identity for r in results]
            out.append(Accum(name, op, _where_chain(conds, values, identity)))
        # stores
        for tensor in dict.fromkeys(t for r in results for t in r[2]):
            mine = [r[2].get(tensor) for r in results]
            first = next(s for s in mine if s is not None)
            if any(s is not None and (s.index, s.add) != (first.index, first.add) for s in mine):
                raise MacroError(
                    f"store {tensor!r} the same way (same indices, = or +=) in every branch", node
                )
            if any(s is not None and s.cond is not None for s in mine):
                raise MacroError(
                    f"{tensor!r} is stored under a nested if; assign a local in the branches and store it once",
                    node,
                )
            if first.add or (complete and all(s is not None for s in mine)):
                zero = Const(frozenset(), False, 0.0)
                values = [s.value if s is not None else zero for s in mine]
                chain = _where_chain(conds, values, zero)
                out.append(Store(tensor, first.index, chain, first.add))
            elif mine[0] is not None and all(s is None for s in mine[1:]):
                out.append(Store(tensor, first.index, first.value, False, conds[0]))
            else:
                raise MacroError(
                    f"store {tensor!r} in every branch of this if/elif/else or only under its first"
                    " condition (or assign a local in the branches and store it after the if)",
                    node,
                )
        return out

    def _condition(self, test: cst.BaseExpression, scope: Scope) -> Expr:
        """An if's test: an expression, with ``and``/``or`` as ``&``/``|``."""
        if isinstance(test, cst.BooleanOperation):
            op = "&" if isinstance(test.operator, cst.And) else "|"
            left, right = self._condition(test.left, scope), self._condition(test.right, scope)
            return self._binary(op, left, right)
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            raise MacroError("not is not supported in an @tile if; swap the branches", test)
        return self._expr(test, scope)

    def _rename_branch(
        self, ir: list[Statement]
    ) -> tuple[dict[str, str], list[Statement], dict[str, tuple[str, Expr]], dict[str, Store]]:
        """A branch's statements with its locals renamed apart: (new names, lets, reductions, stores)."""
        renamed: dict[str, str] = {}
        lets: list[Statement] = []
        accums: dict[str, tuple[str, Expr]] = {}
        stores: dict[str, Store] = {}
        for st in ir:
            if isinstance(st, Let):
                value = _rename(st.value, renamed)
                renamed[st.name] = self._fresh(st.name)
                lets.append(Let(renamed[st.name], value))
            elif isinstance(st, Accum):
                accums[st.name] = (st.op, _rename(st.value, renamed))
            elif isinstance(st, Store):
                cond = _rename(st.cond, renamed) if st.cond is not None else None
                stores[st.tensor_name] = dataclasses.replace(
                    st, value=_rename(st.value, renamed), cond=cond
                )
            else:
                lets.append(st)
        return renamed, lets, accums, stores

    def _carried(self, block: list[cst.BaseStatement], outer: Scope) -> set[str]:
        """Names defined before the loop that it assigns: they may only be reduced into."""
        carried = set()
        for stmt in block:
            if isinstance(stmt, cst.If):  # the branches of an if, elif and else
                node: cst.BaseSuite | cst.If | cst.Else | None = stmt
                while isinstance(node, (cst.If, cst.Else)):
                    carried |= self._carried(_suite(node.body), outer)
                    node = node.orelse if isinstance(node, cst.If) else None
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, (cst.Assign, cst.AugAssign)):
                        target = (
                            small.targets[0].target
                            if isinstance(small, cst.Assign)
                            else small.target
                        )
                        if isinstance(target, cst.Name) and target.value in outer.local:
                            carried.add(target.value)
        return carried

    def _accumulation(
        self,
        name: str,
        target: cst.Name,
        value: cst.BaseExpression,
        add: bool | None,
        scope: Scope,
    ) -> tuple[str, Expr]:
        """``s += e``, ``s -= e``, ``s = s + e``, ``m = max(m, e)``, ``m = min(e, m)``: (op, e)."""
        if add is not None:
            expr = self._expr(value, scope)
            return "sum", expr if add else negate(expr)
        other: cst.BaseExpression | None = None
        op = ""
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
            op, other = "sum", _other_operand(name, value.left, value.right)
        elif isinstance(value, cst.Call) and len(value.args) == 2:
            fn = self._function_name(value.func)
            if fn in ("max", "min"):
                op, other = fn, _other_operand(name, value.args[0].value, value.args[1].value)
        if other is None:
            raise MacroError(
                f"{name!r} is defined before the loop and assigned in it: a value carried from one"
                f" iteration to the next is supported only as a reduction ({name} += e,"
                f" {name} = max({name}, e), {name} = min({name}, e))",
                target,
            )
        return op, self._expr(other, scope)

    def _dot(self, loop: Loop, body: list[Statement], grid_vars: tuple[str, ...]) -> Dot | None:
        """``acc += a[i, k] * b[k, j]``, alone in its loop under two grid loops: a tl.dot."""
        if len(grid_vars) != 2 or len(body) != 1 or not isinstance(body[0], Accum):
            return None
        acc = body[0]
        e = acc.value
        if vars_in(e) or any(ix.gather for ld in loads_in(e) for ix in ld.index):
            return None  # a loop variable's value, or a gather: the operands are not plain tiles
        if acc.op != "sum" or not isinstance(e, Binary) or e.op != "*":
            return None
        k = loop.var
        rows, cols = frozenset((grid_vars[0], k)), frozenset((k, grid_vars[1]))
        if e.left.dims == rows and e.right.dims == cols:
            return Dot(acc.name, e.left, e.right)
        if e.right.dims == rows and e.left.dims == cols:
            return Dot(acc.name, e.right, e.left)
        return None

    # -- statements' parts -------------------------------------------------------------
    def _assignment(
        self, small: cst.BaseSmallStatement
    ) -> tuple[cst.Name | cst.Subscript, cst.BaseExpression, bool | None]:
        """(target, value, add): add is None for ``=``, True for ``+=``, False for ``-=``."""
        if isinstance(small, cst.Assign):
            if len(small.targets) != 1:
                raise MacroError("assign one target at a time in @tile", small)
            target = small.targets[0].target
            add = None
        elif isinstance(small, cst.AugAssign):
            if not isinstance(small.operator, (cst.AddAssign, cst.SubtractAssign)):
                raise MacroError(
                    f"augmented assignment {code_of(small.operator).strip()} is not supported; use += or -=",
                    small.operator,
                )
            target, add = small.target, isinstance(small.operator, cst.AddAssign)
        else:
            raise MacroError(self._unsupported(small), small)
        if isinstance(target, cst.Subscript):
            if not isinstance(target.value, cst.Name) or target.value.value not in self.params:
                raise MacroError("stores go into a tensor parameter: out[i, j] = ...", target)
            tensor = target.value.value
            if tensor in self.stored:
                raise MacroError(
                    f"{tensor!r} is stored more than once; store each output once (accumulate in a local first)",
                    small,
                )
            self.stored[tensor] = small
        elif not isinstance(target, cst.Name):
            raise MacroError("assign to a local name or store to out[i, j]", target)
        return target, small.value, add

    def _store_index(self, target: cst.Subscript, loop_vars: tuple[str, ...]) -> tuple[str, ...]:
        names = []
        for el in target.slice:
            sl = el.slice
            if isinstance(sl, cst.Index) and contains(sl.value, cst.Subscript):
                raise MacroError(
                    f"indirect writes are not supported: {code_of(sl.value)} may send two iterations"
                    " to one element (a race between tiles); stores are indexed by loop variables,"
                    " indirect reads are supported",
                    sl.value,
                )
            if not (
                isinstance(sl, cst.Index)
                and isinstance(sl.value, cst.Name)
                and sl.value.value in loop_vars
            ):
                raise MacroError(
                    "a store is indexed by plain loop variables: out[i, j] (no offsets or constants)",
                    el,
                )
            names.append(sl.value.value)
        if len(set(names)) != len(names) or set(names) != set(loop_vars):
            raise MacroError(
                f"this store must index each of the loop variables {', '.join(loop_vars)} exactly once,"
                " so that each element is written by one iteration",
                target,
            )
        self._use_tensor(_tensor_of(target), len(names), target)
        return tuple(names)

    def _local_name(self, target: cst.Name) -> str:
        name = target.value
        if name in self.params or name in self.sizes or name in self.loop_vars:
            raise MacroError(
                f"{name!r} is a parameter, size or loop variable; assign to a new local name",
                target,
            )
        return name

    def _fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self.taken:
            n += 1
            name = f"{hint}_{n}"
        self.taken.add(name)
        return name

    # -- expressions ---------------------------------------------------------------------
    def _unsupported(self, node: cst.CSTNode) -> str:
        if isinstance(node, (cst.Return, cst.Break, cst.Continue)):
            kind = type(node).__name__.lower()
            return (
                f"early exits ({kind}) are not supported in @tile: every iteration runs to the end"
            )
        if isinstance(node, cst.While):
            return "while loops are not supported in @tile; use for VAR in range(...)"
        if isinstance(node, cst.If):
            return "an if is supported inside the loops of @tile, not here"
        if isinstance(node, cst.Expr):
            return "an expression statement does nothing here; @tile bodies assign locals and store to outputs"
        return f"{type(node).__name__} statements are not supported in @tile"


_IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def _where_chain(
    conds: Sequence[Name | None], values: Sequence[Expr | None], default: Expr | None
) -> Expr:
    """``where(c1, v1, where(c2, v2, v3))``: v3 is the else branch's value, or ``default``."""
    pairs = list(zip(conds, values))
    if conds[-1] is None:
        result, pairs = values[-1], pairs[:-1]
    else:
        result = default
    assert result is not None
    for cond, value in reversed(pairs):
        assert cond is not None and value is not None
        result = Call(
            cond.dims | value.dims | result.dims,
            cond.tensor or value.tensor or result.tensor,
            "where",
            (cond, value, result),
        )
    return result


def _rename(e: Expr, names: dict[str, str]) -> Expr:
    """``e`` reading ``names[n]`` wherever it read the local ``n``."""
    if isinstance(e, Name) and e.name in names:
        return dataclasses.replace(e, name=names[e.name])
    if isinstance(e, Unary):
        return dataclasses.replace(e, operand=_rename(e.operand, names))
    if isinstance(e, Binary):
        return dataclasses.replace(e, left=_rename(e.left, names), right=_rename(e.right, names))
    if isinstance(e, Call):
        return dataclasses.replace(e, args=tuple(_rename(a, names) for a in e.args))
    return e


def _dims_of(body: list[Statement], acc: str) -> frozenset[str]:
    return frozenset().union(
        *(s.value.dims for s in body if isinstance(s, Accum) and s.name == acc)
    )


def _other_operand(
    name: str, a: cst.BaseExpression, b: cst.BaseExpression
) -> cst.BaseExpression | None:
    if isinstance(a, cst.Name) and a.value == name:
        return b
    if isinstance(b, cst.Name) and b.value == name:
        return a
    return None


def is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _shape_read(node: cst.BaseExpression) -> tuple[cst.BaseExpression, int] | None:
    """(tensor, dim) of ``x.shape[d]``, ``x.size(d)`` or ``len(x)`` (d a non-negative integer)."""
    if (
        isinstance(node, cst.Subscript)
        and _is_shape(node.value)
        and len(node.slice) == 1
        and isinstance(node.slice[0].slice, cst.Index)
        and isinstance(node.slice[0].slice.value, cst.Integer)
    ):
        return node.value.value, int(node.slice[0].slice.value.value)
    if isinstance(node, cst.Call) and len(node.args) == 1 and not node.args[0].keyword:
        arg = node.args[0].value
        if (
            isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "size"
            and isinstance(arg, cst.Integer)
        ):
            return node.func.value, int(arg.value)
        if isinstance(node.func, cst.Name) and node.func.value == "len":
            return arg, 0
    return None


def _is_shape_subscript(node: cst.BaseExpression) -> bool:
    return _shape_read(node) is not None


def _is_shape(node: cst.BaseExpression) -> TypeGuard[cst.Attribute]:
    return isinstance(node, cst.Attribute) and node.attr.value == "shape"


def _subscript_target(small: cst.BaseSmallStatement) -> cst.Subscript | None:
    target = (
        small.targets[0].target if isinstance(small, cst.Assign) else getattr(small, "target", None)
    )
    return target if isinstance(target, cst.Subscript) else None


def _index_names(target: cst.Subscript | None) -> set[str]:
    """Every name that appears in the subscript (offsets included)."""
    if target is None:
        return set()
    return {node.value for el in target.slice for node in find(el, cst.Name)}


def _suite(body: cst.BaseSuite) -> list[cst.BaseStatement]:
    """The statements of a block; ``for ...: a; b`` on one line is one line of them."""
    if isinstance(body, cst.IndentedBlock):
        return list(body.body)
    assert isinstance(body, cst.SimpleStatementSuite)
    return [cst.SimpleStatementLine(body.body)]


def _tensor_of(target: cst.Subscript) -> str:
    """The tensor parameter a store writes (``_assignment`` checked it is a name)."""
    assert isinstance(target.value, cst.Name)
    return target.value.value
