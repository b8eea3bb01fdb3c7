"""``@toy_pipeline(stages=2)`` on an ``nn.Module`` class: a subclass that knows its stages.

    @mg.toy_pipeline(stages=2)        ->   # macrogen: toy_pipeline at t.py:5
    class Net(nn.Module): ...              class _Net_stage(nn.Module): ...

                                           class Net(_Net_stage):
                                               toy_stages = 2

It keeps the user's name on the generated subclass (as ``@pipeline`` once did), so
the two stack: ``@data_parallel`` above it wraps the class it leaves.
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, render_statements

NAME = "toy_pipeline"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = "@toy_pipeline(stages=2) decorates an nn.Module class"


def expand(site: Site, ctx: Context) -> Expanded:
    if not isinstance(site.node, cst.ClassDef):
        raise MacroError(f"toy_pipeline() decorates a class: {USAGE}", site.call)
    args = site.args.bind({"stages": 2})
    stages = args["stages"].value if "stages" in args else 2
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise MacroError(f"stages must be a positive int, not {stages!r}", args["stages"].node)
    name = site.node.name.value
    base = ctx.names.fresh(f"_{name}_stage")
    generated = render_statements("toy_pipeline.py.j2", name=name, base=base, stages=stages)
    blank = [cst.EmptyLine(), cst.EmptyLine()]
    return Expanded(
        [
            site.node.with_changes(name=cst.Name(base)),
            generated[0].with_changes(leading_lines=blank),
        ]
    )
