"""``if``/``elif``/``else`` in an @tile loop body, as straight-line code that ``where`` picks from.

A mixin of the analysis (analysis.py), which owns the tables it reads and the
statement handlers it passes in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import libcst as cst

from macrogen.macro import MacroError
from macrogen.macros.tile.expressions import ExpressionReader, Scope
from macrogen.macros.tile.ir import (
    Accum,
    Binary,
    Call,
    Const,
    Expr,
    Let,
    Name,
    Statement,
    Store,
    Unary,
)
from macrogen.macros.tile.syntax import suite


class BranchReader(ExpressionReader):
    """Reads an ``if`` chain of an @tile body into lets, reductions and stores."""

    stored: dict[str, cst.CSTNode]  # outputs stored so far -> where

    def _smalls(self, stmt: cst.BaseStatement) -> list[cst.BaseSmallStatement]:
        """A simple statement line's small statements (the analysis refuses the rest)."""
        raise NotImplementedError

    def _fresh(self, hint: str) -> str:
        """A local name nothing in the function uses."""
        raise NotImplementedError

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
            branches.append((Name(test.dims, test.tensor, cname), suite(current.body)))
            current = current.orelse
        if isinstance(current, cst.Else):
            branches.append((None, suite(current.body)))
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
            chain = where_chain(conds, values, default)
            scope.local[name] = Name(chain.dims, chain.tensor, name)
            out.append(Let(name, chain))
        # reductions: the value the taken branch reduces, or the identity
        for name in dict.fromkeys(n for r in results for n in r[1]):
            ops = {r[1][name][0] for r in results if name in r[1]}
            if len(ops) > 1:
                raise MacroError(f"{name!r} is reduced with both {' and '.join(sorted(ops))}", node)
            op = ops.pop()
            identity = Const(frozenset(), False, IDENTITY[op])
            values = [r[1][name][1] if name in r[1] else identity for r in results]
            out.append(Accum(name, op, where_chain(conds, values, identity)))
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
                chain = where_chain(conds, values, zero)
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
                value = rename_locals(st.value, renamed)
                renamed[st.name] = self._fresh(st.name)
                lets.append(Let(renamed[st.name], value))
            elif isinstance(st, Accum):
                accums[st.name] = (st.op, rename_locals(st.value, renamed))
            elif isinstance(st, Store):
                cond = rename_locals(st.cond, renamed) if st.cond is not None else None
                stores[st.tensor_name] = dataclasses.replace(
                    st, value=rename_locals(st.value, renamed), cond=cond
                )
            else:
                lets.append(st)
        return renamed, lets, accums, stores


IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def where_chain(
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


def rename_locals(e: Expr, names: dict[str, str]) -> Expr:
    """``e`` reading ``names[n]`` wherever it read the local ``n``."""
    if isinstance(e, Name) and e.name in names:
        return dataclasses.replace(e, name=names[e.name])
    if isinstance(e, Unary):
        return dataclasses.replace(e, operand=rename_locals(e.operand, names))
    if isinstance(e, Binary):
        return dataclasses.replace(
            e, left=rename_locals(e.left, names), right=rename_locals(e.right, names)
        )
    if isinstance(e, Call):
        return dataclasses.replace(e, args=tuple(rename_locals(a, names) for a in e.args))
    return e
