"""Where a class macro puts its runtime decorator (``@tensor_parallel_class(...)``, ...).

The class keeps its name: each of ``@tensor_parallel``, ``@data_parallel`` and
``@pipeline`` becomes a decorator of ``macrogen.runtime.parallelize`` on the
user's class. Stacked macros expand bottom-up, so a macro above finds the
decorators of those below already on the class: its own goes above them (it
wraps what they made, as the source's order says), below the user's own.
"""

from __future__ import annotations

import libcst as cst

from macrogen.expand.context import Context
from macrogen.expand.sites import dotted

RUNTIME = "macrogen.runtime.parallelize"


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
    return statement is not None and statement.startswith(f"from {RUNTIME} import ")
