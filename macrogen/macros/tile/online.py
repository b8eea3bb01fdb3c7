"""The online softmax, as people write it in a loop: a running max and a rescaled sum in one pass.

    m = float("-inf")
    s = 0.0
    for j in range(N):
        m_new = max(m, x[i, j])
        s = s * torch.exp(m - m_new) + torch.exp(x[i, j] - m_new)
        m = m_new

(or ``m_old = m; m = max(m, e); s = s * exp(m_old - m) + exp(e2 - m)``) becomes
two reductions of one loop: ``Accum(m, "max", e)`` and ``Accum(s, "expsum", e2,
shift=m)`` (ir.py). A mixin of the analysis (analysis.py), which owns the
tables it reads.
"""

from __future__ import annotations

import math
from typing import Any

import libcst as cst

from macrogen.macro import MacroError
from macrogen.macros.tile.expressions import ExpressionReader, Scope
from macrogen.macros.tile.ir import Const, Expr
from macrogen.macros.tile.syntax import other_operand


class OnlineSoftmaxReader(ExpressionReader):
    """Recognises an online softmax among an inner loop's statements."""

    values: dict[str, Expr]  # each local's latest value (an online softmax's start)

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
                    return other_operand(m, value.args[0].value, value.args[1].value)
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
                factor = other_operand(s, scaled.left, scaled.right)
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
