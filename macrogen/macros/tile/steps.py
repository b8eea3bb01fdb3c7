"""The statement IR of @tile's generated functions, which the templates render.

The kernel and the torch path are lists of these steps; ``templates/tile_kernel.py.j2``
and ``tile_torch.py.j2`` turn each kind into one line (a loop into its block).
``drop_dead_stores`` removes what the straight-line emitters leave behind
(``m = float("-inf")`` overwritten by the reduction that never read it).
Expressions are ``code.Parsed``: checked text that knows the names it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from macrogen.macros.tile.code import Parsed


@dataclass(frozen=True)
class Assign:
    target: str
    value: Parsed
    kind: str = "assign"


@dataclass(frozen=True)
class TritonStore:
    pointer: Parsed
    value: Parsed
    mask: Parsed | None
    kind: str = "store"


@dataclass(frozen=True)
class TorchStore:
    target: Parsed  # out[i_lo:i_hi, ...]
    value: Parsed
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
    stride: Parsed  # BLOCK_J, or BLOCK_J * step
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


@dataclass(frozen=True)
class Branch:
    """``if FLAG: then else: orelse`` on a constexpr: the kernel's variants, one compiled per launch
    (a persistent reduction, its row in registers, or the looped one). Nothing follows it."""

    flag: str
    then: tuple[Step, ...]
    orelse: tuple[Step, ...]
    comment: str
    kind: str = "branch"


Step = Assign | TritonStore | TorchStore | LoopBlock | Widen | Branch


class _Reads:
    """The names each step reads, worked out once per step (``drop_dead_stores`` asks
    about every step again after each assignment it drops)."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[Step, frozenset[str]]] = {}  # id(step) -> (step, names)

    def __call__(self, step: Step) -> frozenset[str]:
        hit = self.known.get(id(step))
        if hit is not None and hit[0] is step:
            return hit[1]
        names = self._of(step)
        self.known[id(step)] = (step, names)  # the step is kept alive: its id stays its own
        return names

    def _of(self, step: Step) -> frozenset[str]:
        if isinstance(step, Assign):
            return step.value.names
        if isinstance(step, TritonStore):
            mask = step.mask.names if step.mask is not None else frozenset()
            return step.pointer.names | step.value.names | mask
        if isinstance(step, TorchStore):
            return step.target.names | step.value.names
        if isinstance(step, Widen):
            return frozenset({*step.names, step.flag})
        if isinstance(step, Branch):
            return frozenset({step.flag}).union(*map(self, (*step.then, *step.orelse)))
        inside = (*step.before, *step.setup, *step.body, *step.after)
        return frozenset({step.lo, step.hi, step.block}.union(*map(self, inside)))


def _live(name: str, later: list[Step], reads: _Reads | None = None) -> bool:
    """Whether ``name``'s value is read by ``later`` before an assignment overwrites it."""
    reads = _Reads() if reads is None else reads
    for step in later:
        after: list[Step]
        if isinstance(step, Branch):  # (conservative: live if either variant reads it)
            if name in reads(step):
                return True
            continue
        if isinstance(step, LoopBlock):  # runs 0+ times; its ``after`` always runs
            inner = (*step.before, *step.setup, *step.body)
            if name in (step.lo, step.hi) or any(name in reads(s) for s in inner):
                return True
            after = list(step.after)
        else:
            after = [step]
        for s in after:
            if name in reads(s):
                return True
            if isinstance(s, Assign) and s.target == name:
                return False
    return False


def drop_dead_stores(
    steps: list[Step], keep: frozenset[str] = frozenset(), reads: _Reads | None = None
) -> list[Step]:
    """``steps`` without the assignments whose value nothing reads (to a fixed point).

    Only straight-line assignments are dropped; they have no side effects in
    either path (loads, views and arithmetic). ``keep``: names read by code
    after ``steps`` that they cannot see.
    """
    reads = _Reads() if reads is None else reads
    out = list(steps)
    changed = True
    while changed:
        changed = False
        for t, step in enumerate(out):
            if (
                isinstance(step, Assign)
                and step.target not in keep
                and not _live(step.target, out[t + 1 :], reads)
            ):
                del out[t]
                changed = True
                break
            if isinstance(step, LoopBlock):
                body = drop_dead_stores(list(step.body), _loop_keep(step, reads), reads)
                if len(body) != len(step.body):
                    out[t] = replace(step, body=tuple(body))
                    changed = True
                    break
    return out


def _loop_keep(step: LoopBlock, reads: _Reads) -> frozenset[str]:
    """What a loop body must keep: what its accumulators carry to the next tile and the ``after``."""
    carried = {a.target for a in step.before}
    return frozenset(carried.union(*map(reads, step.after)))
