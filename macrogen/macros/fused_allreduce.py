"""``with fused_allreduce(): dist.all_reduce(t0) ... dist.all_reduce(tK)``: one collective.

    def sync_metrics(loss, correct, seen):      def sync_metrics(loss, correct, seen):
        with mg.fused_allreduce():          ->      # macrogen: fused_allreduce at train.py:12
            dist.all_reduce(loss)                   _fused_allreduce_l12(loss, correct, seen)
            dist.all_reduce(correct)
            dist.all_reduce(seen)

``_fused_allreduce_l12`` (in the generated helpers) is a ``runtime.fused.FusedAllReduce``:
it packs the K tensors into one flat buffer per dtype, all-reduces each buffer
once, and unpacks in place, with buffers planned at its first call (one
``_foreach_copy_`` launch each way, the same code on CPU and CUDA).

The calls are recognised by what they name through the file's imports, not by
their spelling: ``dist.all_reduce`` after ``import torch.distributed as dist``,
``torch.distributed.all_reduce``, or ``all_reduce`` after ``from
torch.distributed import all_reduce``. Anything else (``comm.all_reduce(a)`` on
the user's own object) is refused, since fusing it would change what it does.

Every call must use the same ``op`` and ``group`` (written the same way); mixed
dtypes are fine (one collective each). ``async_op=True`` is rejected: the block
issues its collectives and waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, TuningEnv, render

NAME = "fused_allreduce"
FORMS: frozenset[Form] = frozenset({"with"})
USAGE = "fused_allreduce() opens a with block of dist.all_reduce(tensor) calls: with fused_allreduce(): ..."

_ALL_REDUCE_PARAMS = ("tensor", "op", "group", "async_op")
MAX_BLOCK = 2**20  # Triton's largest block (TRITON_MAX_TENSOR_NUMEL)
ALL_REDUCE = "torch.distributed.all_reduce"  # the one function a block may call


@dataclass(frozen=True)
class Spec:
    tensors: tuple[cst.BaseExpression, ...]  # the user's tensor expressions, in order
    op: cst.BaseExpression | None
    group: cst.BaseExpression | None
    block: int  # accepted, no effect: the runtime packs with a foreach copy, not a Triton kernel


def tuning_no_effect(argument: str, env: TuningEnv) -> str | None:
    """Autotune's hook: ``block`` is accepted for old files but sizes nothing any more."""
    if argument == "block":
        return "block has no effect: the buffers are packed by a foreach copy on every device"
    return None


def validate(site: Site) -> Spec:
    assert isinstance(site.original, cst.With)
    item = site.original.items[0]
    if item.asname is not None:
        raise MacroError("fused_allreduce() takes no 'as' target", item.asname)
    args = site.args.bind({"block": 1024})
    block = args["block"].value if "block" in args else 1024
    node = args["block"].node if "block" in args else site.call
    if not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1):
        raise MacroError(f"block must be a power of two >= 16, not {block!r}", node)
    if block > MAX_BLOCK:
        raise MacroError(
            f"block must be at most 2**20 (Triton's largest block), not 2**{block.bit_length() - 1}",
            node,
        )
    body = site.original.body
    if not isinstance(body, cst.IndentedBlock):
        raise MacroError("put each dist.all_reduce(...) call on its own line", body)
    calls = [_all_reduce_call(stmt, site) for stmt in body.body]
    tensors, ops, groups = [], [], []
    for call in calls:
        bound = _bind(call)
        if "tensor" not in bound:
            raise MacroError("dist.all_reduce() needs the tensor to reduce", call)
        tensors.append(bound["tensor"])
        ops.append(bound.get("op"))
        group = bound.get("group")
        is_default = isinstance(group, cst.Name) and group.value == "None"
        groups.append(None if is_default else group)  # group=None is the default group
        async_op = bound.get("async_op")
        if async_op is not None and not (
            isinstance(async_op, cst.Name) and async_op.value == "False"
        ):
            raise MacroError(
                "async_op=True is not supported in fused_allreduce: the block issues one collective and waits for it",
                async_op,
            )
    _distinct(tensors)
    return Spec(tuple(tensors), _same(ops, "op"), _same(groups, "group"), block)


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site)
    k = len(spec.tensors)
    fn = ctx.names.fresh(f"_fused_allreduce_l{site.line}")
    runtime = ctx.import_from("macrogen.runtime", "FusedAllReduce")
    helper = render(
        "fused_allreduce.py.j2",
        location=ctx.location(site.line),
        k=k,
        fn=fn,
        runtime=runtime,
    )
    call_args = [cst.Arg(t) for t in spec.tensors]
    if spec.op is not None:
        call_args.append(_keyword("op", spec.op))
    if spec.group is not None:
        call_args.append(_keyword("group", spec.group))
    call = cst.Call(cst.Name(fn), call_args)
    return Expanded(
        [cst.SimpleStatementLine([cst.Expr(call)])],
        helpers=(helper,),
    )


def _keyword(name: str, value: cst.BaseExpression) -> cst.Arg:
    """``name=value`` written as PEP 8 writes keyword arguments."""
    no_space = cst.SimpleWhitespace("")
    equal = cst.AssignEqual(whitespace_before=no_space, whitespace_after=no_space)
    return cst.Arg(value, keyword=cst.Name(name), equal=equal)


def _all_reduce_call(stmt: cst.BaseStatement, site: Site) -> cst.Call:
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.Call)
    ):
        call = stmt.body[0].value
        qualified = site.qualified(call.func)
        if qualified == ALL_REDUCE:
            return call
        written = cst.Module([]).code_for_node(call.func)
        supported = (
            f"a fused_allreduce block holds only {ALL_REDUCE}(tensor, ...) calls, reached through"
            " the file's imports (import torch.distributed as dist ... dist.all_reduce(t))"
        )
        looks_like = "all_reduce" in (written.rsplit(".", 1)[-1], (qualified or "").rsplit(".")[-1])
        if qualified is not None and looks_like:
            raise MacroError(f"{written} is {qualified}, not {ALL_REDUCE}: {supported}", call.func)
        if qualified is None and looks_like:
            raise MacroError(
                f"{written} is not {ALL_REDUCE} (it is not reached through an import of"
                f" torch.distributed): {supported}",
                call.func,
            )
    raise MacroError(
        "a fused_allreduce block may hold only dist.all_reduce(tensor, ...) calls, one per line",
        stmt,
    )


def _bind(call: cst.Call) -> dict[str, cst.BaseExpression]:
    bound: dict[str, cst.BaseExpression] = {}
    for i, arg in enumerate(call.args):
        if arg.star:
            raise MacroError("dist.all_reduce() arguments can't be unpacked with * or ** here", arg)
        if arg.keyword is None:
            if i >= len(_ALL_REDUCE_PARAMS):
                raise MacroError("dist.all_reduce() takes at most 4 positional arguments", arg)
            name = _ALL_REDUCE_PARAMS[i]
        else:
            name = arg.keyword.value
            if name not in _ALL_REDUCE_PARAMS:
                raise MacroError(f"dist.all_reduce() has no argument {name!r}", arg.keyword)
        if name in bound:
            raise MacroError(f"argument {name!r} given twice", arg)
        bound[name] = arg.value
    return bound


def _distinct(tensors: list[cst.BaseExpression]) -> None:
    """Serially a tensor reduced twice is reduced twice; fused it would be reduced once."""
    empty = cst.Module([])
    seen: set[str] = set()
    for t in tensors:
        text = empty.code_for_node(t).strip()
        if text in seen:
            raise MacroError(
                f"{text} is all-reduced twice in this block; fused it would be reduced once:"
                " keep one call, or move the second one out of the block",
                t,
            )
        seen.add(text)


def _same(values: list[cst.BaseExpression | None], what: str) -> cst.BaseExpression | None:
    """One op (or group) for the whole block, compared as written."""
    empty = cst.Module([])
    texts = ["" if v is None else empty.code_for_node(v).strip() for v in values]
    for v, text in zip(values, texts):
        if text != texts[0]:
            first = texts[0] or "the default"
            raise MacroError(
                f"every all_reduce in a fused_allreduce block must use the same {what}: this one uses"
                f" {text or 'the default'}, the first uses {first}; split the block by {what}",
                v if v is not None else values[0],
            )
    return values[0]
