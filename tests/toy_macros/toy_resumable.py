"""``for step in toy_resumable(range(n), every=2):``: a loop that records its progress.

    for step in mg.toy_resumable(range(n), every=2):   ->   # macrogen: toy_resumable at t.py:4
        train(step)                                         for step in _toy_resumable_l4(range(n)):
                                                                train(step)

The generated generator appends every ``every``-th item to ``CHECKPOINTS``
(a stand-in for a real checkpoint).
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, render

NAME = "toy_resumable"
FORMS: frozenset[Form] = frozenset({"loop"})
USAGE = "for step in toy_resumable(range(n), every=2): ..."
CODE_ARGUMENTS = frozenset({"0"})


def expand(site: Site, ctx: Context) -> Expanded:
    args = site.args.bind({"steps": None, "every": 1}, positional=("steps",))
    every = args["every"].value if "every" in args else 1
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise MacroError(f"every must be a positive int, not {every!r}", args["every"].node)
    loop = site.node
    assert isinstance(loop, cst.For) and isinstance(loop.iter, cst.Call)
    fn = ctx.names.fresh(f"_toy_resumable_l{site.line}")
    helper = render("toy_resumable.py.j2", fn=fn, every=every, location=ctx.location(site.line))
    steps = loop.iter.args[0].value
    return Expanded(
        [loop.with_changes(iter=cst.Call(cst.Name(fn), [cst.Arg(steps)]))], helpers=(helper,)
    )
