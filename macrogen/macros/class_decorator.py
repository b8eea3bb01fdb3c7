"""Where a class macro puts its runtime decorator (``@tensor_parallel_class(...)``, ...).

The class keeps its name: each of ``@tensor_parallel``, ``@data_parallel`` and
``@pipeline`` becomes a decorator from ``macrogen.runtime`` on the user's class. Stacked macros expand bottom-up, so a macro above finds the
decorators of those below already on the class: its own goes above them (it
wraps what they made, as the source's order says), below the user's own.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from macrogen.macro import Context, InternalError, dotted, render

# the runtime's class decorators (from macrogen.runtime, the generated code's interface)
DECORATORS = ("tensor_parallel_class", "data_parallel_class", "pipeline_class")


def rendered_decorator(template: str, **params: Any) -> cst.Decorator:
    """The runtime decorator a class macro's template renders above a placeholder class,
    with the comments above it (the template starts with ``pass``, so that the comments
    are the class's leading lines, not the module's header)."""
    body = cst.parse_module(render(template, **params)).body
    cls = body[-1]
    if not (isinstance(cls, cst.ClassDef) and cls.decorators):
        raise InternalError(f"template {template} rendered no decorated class")
    return cls.decorators[0].with_changes(leading_lines=cls.leading_lines)


def decorated(ctx: Context, cls: cst.ClassDef, decorator: cst.Decorator) -> cst.ClassDef:
    """``cls`` with ``decorator`` above the runtime decorators of the macros stacked below."""
    decorators = list(cls.decorators)
    at = next((i for i, d in enumerate(decorators) if _generated(ctx, d)), len(decorators))
    decorators.insert(at, decorator)
    return cls.with_changes(decorators=decorators)


def _generated(ctx: Context, decorator: cst.Decorator) -> bool:
    call = decorator.decorator
    name = dotted(call.func) if isinstance(call, cst.Call) else None
    statement = ctx.generated_import(name) if name is not None else None
    return statement is not None and statement.startswith(
        tuple(f"from macrogen.runtime import {d}" for d in DECORATORS)
    )
