"""``with toy_span("fwd") as span:``: a timed block (the with form, keeping ``as``).

with mg.toy_span("fwd") as span:   ->   # macrogen: toy_span at t.py:4
    y = f(x)                            with _toy_span_l4("fwd") as span:
                                            y = f(x)
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, render

NAME = "toy_span"
FORMS: frozenset[Form] = frozenset({"with"})
USAGE = 'with toy_span("name") as span: ...'


def expand(site: Site, ctx: Context) -> Expanded:
    args = site.args.bind({"name": None}, positional=("name",))
    if "name" not in args or not isinstance(args["name"].value, str):
        raise MacroError(f"toy_span() takes a name: {USAGE}", site.call)
    block = site.node
    assert isinstance(block, cst.With)
    contextmanager = ctx.import_from("contextlib", "contextmanager")
    fn = ctx.names.fresh(f"_toy_span_l{site.line}")
    helper = render("toy_span.py.j2", fn=fn, contextmanager=contextmanager)
    item = block.items[0]
    call = cst.Call(cst.Name(fn), [cst.Arg(cst.SimpleString(repr(args["name"].value)))])
    return Expanded(
        [block.with_changes(items=[item.with_changes(item=call)])],
        helpers=(helper,),
    )
