"""Recognise ``@tile``'s loop-nest subset in a function and build its ``Nest`` (ir.py).

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

Anything else is a ``MacroError`` at the construct, saying what is supported. The
analysis is one class made of mixins, one concern each: sizes and loop ranges
(loops.py), expressions (expressions.py), ``if`` chains (branches.py), the online
softmax (online.py); libcst helpers in syntax.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import libcst as cst

from macrogen.macro import MacroError, find
from macrogen.macros.tile.branches import BranchReader
from macrogen.macros.tile.expressions import Scope, code_of, contains, negate
from macrogen.macros.tile.ir import (
    Accum,
    Binary,
    Const,
    Dot,
    Expr,
    Index,
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
from macrogen.macros.tile.loops import LoopReader
from macrogen.macros.tile.names import loads_in, vars_in
from macrogen.macros.tile.online import OnlineSoftmaxReader
from macrogen.macros.tile.syntax import (
    index_names,
    is_docstring,
    other_operand,
    subscript_target,
    suite,
    tensor_of,
)

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


class _Analyzer(BranchReader, OnlineSoftmaxReader, LoopReader):
    def __init__(self, fn: cst.FunctionDef, constants: Mapping[str, Any], taken: set[str]):
        self.fn = fn
        self.constants = constants
        self.params = self._params()
        self.ndim: dict[str, int] = {}  # tensor parameter -> number of indices
        self.scalars: list[str] = []
        self.sizes: dict[str, Size] = {}
        self.loop_vars: set[str] = set()
        self.loops: dict[str, Loop] = {}  # loop variable -> its loop (the latest one read)
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
        return suite(node.body)

    def _is_reduction_suffix(self, chain: list[Loop], block: list[cst.BaseStatement]) -> bool:
        """``for k`` last, holding only ``out[...] += e`` that never index k: a reduction over k."""
        if len(chain) < 2 or any(not isinstance(s, cst.SimpleStatementLine) for s in block):
            return False
        stores = [
            small
            for s in block
            if isinstance(s, cst.SimpleStatementLine)
            for small in s.body
            if isinstance(small, (cst.Assign, cst.AugAssign)) and subscript_target(small)
        ]
        last = chain[-1].var
        return bool(stores) and all(last not in index_names(subscript_target(s)) for s in stores)

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
        return [Store(tensor_of(target), index, expr, add is not None)]

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
                indexed = index_names(target)
                if loop.var in indexed:
                    index = self._store_index(target, scope.loop_vars)
                    expr = self._expr(value, scope)
                    if add is False:
                        expr = Unary(expr.dims, expr.tensor, "-", expr)
                    return [Store(tensor_of(target), index, expr, add is not None)]
                if add is None:
                    raise MacroError(
                        f"this store does not index {loop.var!r}, so every iteration of the loop"
                        f" over {loop.var} writes the same element; accumulate with +=",
                        small,
                    )
                index = self._store_index(target, outer_vars)
                tensor = tensor_of(target)
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

    def _carried(self, block: list[cst.BaseStatement], outer: Scope) -> set[str]:
        """Names defined before the loop that it assigns: they may only be reduced into."""
        carried = set()
        for stmt in block:
            if isinstance(stmt, cst.If):  # the branches of an if, elif and else
                node: cst.BaseSuite | cst.If | cst.Else | None = stmt
                while isinstance(node, (cst.If, cst.Else)):
                    carried |= self._carried(suite(node.body), outer)
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
            op, other = "sum", other_operand(name, value.left, value.right)
        elif isinstance(value, cst.Call) and len(value.args) == 2:
            fn = self._function_name(value.func)
            if fn in ("max", "min"):
                op, other = fn, other_operand(name, value.args[0].value, value.args[1].value)
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
        for dim, (el, var) in enumerate(zip(target.slice, names)):
            self._index_in_range(target, dim, Index(var, 0), el)
        if len(set(names)) != len(names) or set(names) != set(loop_vars):
            raise MacroError(
                f"this store must index each of the loop variables {', '.join(loop_vars)} exactly once,"
                " so that each element is written by one iteration",
                target,
            )
        self._use_tensor(tensor_of(target), len(names), target)
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


def _dims_of(body: list[Statement], acc: str) -> frozenset[str]:
    return frozenset().union(
        *(s.value.dims for s in body if isinstance(s, Accum) and s.name == acc)
    )
