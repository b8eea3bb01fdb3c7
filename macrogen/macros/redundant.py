"""Two sites of one file that contradict each other, reported at expansion.

FSDP (``mg.parallelize(dp="fsdp")``, ``@mg.data_parallel(shard="full")``) already shards
the optimizer state with the parameters: ``mg.shard_optimizer`` on top of it is
redundant (and fails at run time). The error stands at the FSDP argument, whichever
of the two sites the pass meets second, and names the other one's line.

A file may also hold another model that ``mg.shard_optimizer`` is for (a replicated
``@mg.data_parallel`` class, ``mg.parallelize(dp="zero1")``: a benchmark comparing them,
say): once the pass has met such a site, the pair is not an error here; the run time
still refuses a sharded optimizer over FSDP's parameters.
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Arg, Context, MacroError

FSDP = "fully_sharded"
SHARD_OPTIMIZER = "shard_optimizer"
HOST = "replicated"  # a site whose model mg.shard_optimizer can shard the optimizer of


def may_be(ctx: Context, arg: Arg, value: object) -> bool:
    """The argument's value is ``value``, or, for a tunable, one of its choices is."""
    if arg.tunable is not None and arg.tunable in ctx.tunables:
        return value in ctx.tunables[arg.tunable].choices
    return bool(arg.value == value)


def fully_sharded(ctx: Context, arg: Arg, line: int, said: str) -> None:
    """A site shards fully; ``arg`` is where it says so (``said``: 'dp="fsdp"')."""
    ctx.marks.setdefault(FSDP, []).append((arg.node, line, said))
    if HOST in ctx.marks:
        return
    for _, other, _ in ctx.marks.get(SHARD_OPTIMIZER, [])[:1]:
        raise MacroError(_message(ctx, said, other), arg.node)


def replicated(ctx: Context, node: cst.CSTNode, line: int) -> None:
    """A site whose model keeps every parameter on every rank (mg.shard_optimizer's kind)."""
    ctx.marks.setdefault(HOST, []).append((node, line, "replicated"))


def sharded_optimizer(ctx: Context, call: cst.CSTNode, line: int) -> None:
    """A ``mg.shard_optimizer`` site at ``line``."""
    ctx.marks.setdefault(SHARD_OPTIMIZER, []).append((call, line, "mg.shard_optimizer"))
    if HOST in ctx.marks:
        return
    for node, _, said in ctx.marks.get(FSDP, [])[:1]:
        raise MacroError(_message(ctx, said, line), node)


def _message(ctx: Context, said: str, line: int) -> str:
    return (
        f"{said} (FSDP) already shards the optimizer state with the parameters:"
        f" mg.shard_optimizer at {ctx.location(line)} is redundant; remove it, or shard the"
        ' optimizer alone (ZeRO-1: dp="zero1", or @mg.data_parallel without shard=)'
    )
