"""The statement IR of @tile's generated functions, which the templates render.

The kernel and the torch path are lists of these steps; ``templates/tile_kernel.py.j2``
and ``tile_torch.py.j2`` turn each kind into one line (a loop into its block).
``drop_dead_stores`` removes what the straight-line emitters leave behind
(``m = float("-inf")`` overwritten by the reduction that never read it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import libcst as cst


@dataclass(frozen=True)
class Assign:
    target: str
    value: cst.BaseExpression
    kind: str = "assign"


@dataclass(frozen=True)
class TritonStore:
    pointer: cst.BaseExpression
    value: cst.BaseExpression
    mask: cst.BaseExpression | None
    kind: str = "store"


@dataclass(frozen=True)
class TorchStore:
    target: cst.BaseExpression  # out[i_lo:i_hi, ...]
    value: cst.BaseExpression
    add: bool
    direct: bool = False  # ``value`` is a call that writes ``target`` itself (``out=``)
    kind: str = "store"


@dataclass(frozen=True)
class LoopBlock:
    """``for start in range(lo, hi, block)`` over the tiles of one inner loop."""

    start: str  # the tile's first index
    lo: str
    hi: str
    block: str  # the BLOCK_ constexpr
    stride: cst.BaseExpression  # BLOCK_J, or BLOCK_J * step
    step: int
    before: tuple[Assign, ...]  # accumulator tiles
    setup: tuple[Step, ...]  # index vectors and masks (and their widening), once per tile
    body: tuple[Step, ...]
    after: tuple[Assign, ...]  # fold the tiles into the locals
    var: str
    dot: bool
    kind: str = "loop"


@dataclass(frozen=True)
class Widen:
    """``if FLAG: v = v.to(tl.int64)`` for each name: 64-bit offsets where the launcher
    finds a tensor too large for int32 ones (a constexpr, so each kernel compiles once per case)."""

    names: tuple[str, ...]
    flag: str
    kind: str = "widen"


Step = Assign | TritonStore | TorchStore | LoopBlock | Widen


def _reads(node: cst.CSTNode | None) -> set[str]:
    found: set[str] = set()
    if node is None:
        return found

    class _Names(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

    node.visit(_Names())
    return found


def _step_reads(step: Step) -> set[str]:
    if isinstance(step, Assign):
        return _reads(step.value)
    if isinstance(step, TritonStore):
        return _reads(step.pointer) | _reads(step.value) | _reads(step.mask)
    if isinstance(step, TorchStore):
        return _reads(step.target) | _reads(step.value)
    if isinstance(step, Widen):
        return {*step.names, step.flag}
    inside = (*step.before, *step.setup, *step.body, *step.after)
    return {step.lo, step.hi, step.block}.union(*(_step_reads(s) for s in inside))


def _live(name: str, later: list[Step]) -> bool:
    """Whether ``name``'s value is read by ``later`` before an assignment overwrites it."""
    for step in later:
        after: list[Step]
        if isinstance(step, LoopBlock):  # runs 0+ times; its ``after`` always runs
            inner = (*step.before, *step.setup, *step.body)
            if name in {step.lo, step.hi}.union(*(_step_reads(s) for s in inner)):
                return True
            after = list(step.after)
        else:
            after = [step]
        for s in after:
            if name in _step_reads(s):
                return True
            if isinstance(s, Assign) and s.target == name:
                return False
    return False


def drop_dead_stores(steps: list[Step], keep: frozenset[str] = frozenset()) -> list[Step]:
    """``steps`` without the assignments whose value nothing reads (to a fixed point).

    Only straight-line assignments are dropped; they have no side effects in
    either path (loads, views and arithmetic). ``keep``: names read by code
    after ``steps`` that they cannot see.
    """
    out = list(steps)
    changed = True
    while changed:
        changed = False
        for t, step in enumerate(out):
            if (
                isinstance(step, Assign)
                and step.target not in keep
                and not _live(step.target, out[t + 1 :])
            ):
                del out[t]
                changed = True
                break
            if isinstance(step, LoopBlock):
                body = drop_dead_stores(list(step.body), keep=_loop_keep(step))
                if len(body) != len(step.body):
                    out[t] = replace(step, body=tuple(body))
                    changed = True
                    break
    return out


def _loop_keep(step: LoopBlock) -> frozenset[str]:
    """What a loop body must keep: what its accumulators carry to the next tile and the ``after``."""
    carried = {a.target for a in step.before}
    return frozenset(carried | set().union(*(_step_reads(a) for a in step.after)))
