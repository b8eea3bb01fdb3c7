"""What the ``@pipeline`` expansion hands the runtime, for a class the tests write plainly.

The runtime never reads source: these tests build the ``Forward`` (one function per
statement of ``forward``) from the class's source, as the macro does at expansion.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap

from macrogen.pipelining import analysis
from macrogen.pipelining.code import unit_function
from macrogen.pipelining.units import Forward


def attach(model, config, *, where: str = ""):
    """``model`` pipelined as a ``@pipeline`` class's ``__init__`` does it: its forward cut."""
    from macrogen.runtime import mesh as meshes
    from macrogen.runtime import pipeline as rp
    from macrogen.runtime.pipeline_plan import forward_cut

    rp.check_config(config, where=where)
    try:
        mesh = meshes.mesh(pipeline=config.ranks)
    except ValueError as e:
        raise ValueError(f"pipeline at {where}: {e}") from None
    cut = forward_cut(model, config.stages, config.split, forward_of(type(model)))
    return rp.attach(model, config, cut, mesh, where=where)


def forward_of(cls: type) -> Forward:
    source = textwrap.dedent(inspect.getsource(cls.forward))
    a = analysis.parse(source)
    namespace = cls.forward.__globals__
    statements = []
    for k, s in enumerate(a.forward.statements):
        local: dict = {}
        name = f"_{cls.__name__}_forward_{k}"
        exec(compile(unit_function(a, k, name), "<forward>", "exec"), namespace, local)
        statements.append(dataclasses.replace(s, fn=local[name]))
    return dataclasses.replace(a.forward, statements=tuple(statements))
