"""``opt = toy_shard(optimizer, tag="x")``: wraps an optimizer (the sharded optimizer's forms).

    opt = mg.toy_shard(torch.optim.SGD(p, lr=0.1))   ->   # macrogen: toy_shard at t.py:5
                                                          opt = _toy_shard_l5(torch.optim.SGD(p, lr=0.1))
                                                          opt.toy_name = 'opt'

As a call anywhere else, ``step(mg.toy_shard(o))``, the call alone is replaced.
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, render

NAME = "toy_shard"
FORMS: frozenset[Form] = frozenset({"assign", "call"})
USAGE = 'opt = toy_shard(torch.optim.SGD(...), tag="x")'
CODE_ARGUMENTS = frozenset({"0"})  # the optimizer expression runs in the program


def expand(site: Site, ctx: Context) -> Expanded:
    args = site.args.bind({"optimizer": None, "tag": "toy"}, positional=("optimizer",))
    if "optimizer" not in args:
        raise MacroError(f"toy_shard() takes the optimizer: {USAGE}", site.call)
    tag = args["tag"].value if "tag" in args else "toy"
    if not isinstance(tag, str):
        raise MacroError(f"tag must be a string, not {tag!r}", args["tag"].node)
    torch = ctx.import_module("torch")
    fn = ctx.names.fresh(f"_toy_shard_l{site.line}")
    helper = render(
        "toy_shard.py.j2", fn=fn, torch=torch, tag=tag, location=ctx.location(site.line)
    )
    call = _call(site)
    wrapped = cst.Call(cst.Name(fn), [cst.Arg(call.args[0].value)])
    if site.form == "call":
        return Expanded(wrapped, helpers=(helper,))
    stmt = site.node
    assert isinstance(stmt, cst.SimpleStatementLine)
    assign = stmt.body[0]
    if not (isinstance(assign, cst.Assign) and isinstance(assign.targets[0].target, cst.Name)):
        raise MacroError(f"toy_shard() is assigned to one name: {USAGE}", site.original)
    name = assign.targets[0].target.value
    note = cst.parse_statement(f"{name}.toy_name = {name!r}")
    return Expanded(
        [stmt.with_changes(body=[assign.with_changes(value=wrapped)]), note],
        helpers=(helper,),
    )


def _call(site: Site) -> cst.Call:
    """The macro call in the expanded node: its code argument has inner sites expanded."""
    node = site.node
    if isinstance(node, cst.SimpleStatementLine):
        small = node.body[0]
        assert isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None
        node = small.value
    assert isinstance(node, cst.Call)
    return node
