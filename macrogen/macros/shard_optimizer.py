"""``mg.shard_optimizer(optimizer)``: optimizer state sharded over the data-parallel ranks (ZeRO-1).

    opt = mg.shard_optimizer(                     # macrogen: shard_optimizer at train.py:40
        torch.optim.AdamW(groups, lr=6e-4)   ->   opt = shard_optimizer(
    )                                                 torch.optim.AdamW(groups, lr=6e-4),
                                                      where='train.py:40',
                                                  )

Unexpanded, the marker returns the optimizer: the serial reference. Expanded,
``macrogen.runtime.zero.shard_optimizer`` wraps it in a ``ShardedOptimizer``
(the optimizer itself at world size 1): gradients reduce-scattered, each rank
steps its share, parameters all-gathered (docs/data_parallel.md). The optimizer
expression is the program's own code and is kept as written (inner macro sites
expanded); the call may stand anywhere an expression may.
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, render
from macrogen.macros import redundant

NAME = "shard_optimizer"
FORMS: frozenset[Form] = frozenset({"call"})  # ``opt = mg.shard_optimizer(...)`` is a call site
USAGE = "opt = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=...))"
CODE_ARGUMENTS = frozenset({"0"})  # the optimizer expression runs in the program
PLACEHOLDER = "_mg_optimizer"  # where the template puts the user's expression


def expand(site: Site, ctx: Context) -> Expanded:
    args = site.args.bind({"optimizer": None}, positional=("optimizer",))
    if "optimizer" not in args:
        raise MacroError(f"shard_optimizer() takes the optimizer: {USAGE}", site.call)
    call = site.node
    assert isinstance(call, cst.Call)
    redundant.sharded_optimizer(ctx, site.call or call, site.line)
    shard = ctx.import_from("macrogen.runtime", "shard_optimizer")
    text = render(
        "shard_optimizer.py.j2",
        shard=shard,
        placeholder=PLACEHOLDER,
        location=ctx.location(site.line),
    )
    rendered = cst.parse_expression(text.strip())
    assert isinstance(rendered, cst.Call)
    # the user's argument as written (its comments too); the template's other arguments after it
    user = call.args[0]
    if isinstance(user.comma, cst.MaybeSentinel):
        user = user.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    rest = [a for a in rendered.args if not _is_placeholder(a.value)]
    after = user.comma.whitespace_after if isinstance(user.comma, cst.Comma) else None
    before = call.whitespace_before_args
    if isinstance(after, cst.ParenthesizedWhitespace) and isinstance(
        before, cst.ParenthesizedWhitespace
    ):  # one argument per line, as the user wrote it: ours on a line of its own
        indented = after.with_changes(last_line=before.last_line)
        assert isinstance(user.comma, cst.Comma)  # given one above
        user = user.with_changes(comma=user.comma.with_changes(whitespace_after=indented))
        plain = after.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=())
        rest[-1] = rest[-1].with_changes(comma=cst.Comma(whitespace_after=plain))
    return Expanded(call.with_changes(func=rendered.func, args=[user, *rest]))


def _is_placeholder(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == PLACEHOLDER
