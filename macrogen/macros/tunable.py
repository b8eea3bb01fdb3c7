"""``tunable(default, choices=[...])``: a parameter that ``macrogen autotune`` chooses.

As a module constant:

    BLOCK = mg.tunable(64, choices=[32, 64, 128])   ->   # tunable BLOCK: choices [32, 64, 128], default 64
                                                          BLOCK = 128

As a whole macro argument, ``@mg.tile(i=mg.tunable(64, choices=[32, 64]))``, the
macro receives the value. The tuning key is the constant's name, or the site's
qualified name and the argument (``bias_gelu.i``). Without a tuning entry the
default is used.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from macrogen.expand.args import Evaluator
from macrogen.expand.context import Context
from macrogen.expand.site import Site
from macrogen.macros.define import literal_assignment

FORMS = ("assign", "argument")
USAGE = (
    "tunable() is a whole macro argument, @tile(i=tunable(64, choices=[32, 64])),"
    " or a module constant, BLOCK = tunable(64, choices=[32, 64])"
)


def constant(name: str, call: cst.Call, evaluator: Evaluator) -> Any:
    return evaluator.tunable(call, name)


def expand(site: Site, ctx: Context) -> cst.BaseStatement:
    t = ctx.tunables[site.qualname]
    how = "tuned" if site.qualname in ctx.options.tuning else "the default"
    note = f"# tunable {t.key} = {t.value!r} ({how}); choices {list(t.choices)}"
    return literal_assignment(site, ctx, [cst.EmptyLine(comment=cst.Comment(note))])
