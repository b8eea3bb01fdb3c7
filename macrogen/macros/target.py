"""``if target(kind):``: code for one kind of device.

With ``--target cuda`` (or ``cpu``) the branch is chosen at expansion time and
the other one is removed:

    if mg.target("cuda"):        ->   # macrogen: target at train.py:9
        use_triton()                  use_triton()
    else:
        use_torch()

Without ``--target`` it becomes a run-time device check that needs no macrogen:
``if torch.cuda.is_available():`` (``not ...`` for "cpu").
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site
from macrogen.markers import TARGETS

NAME = "target"
FORMS: frozenset[Form] = frozenset({"if", "elif"})
USAGE = 'target() is the whole test of an if statement: if target("cuda"): ...'


def expand(site: Site, ctx: Context) -> Expanded:
    args = site.args.bind({"kind": None}, positional=("kind",))
    if "kind" not in args:
        raise MacroError(f"target() takes the device kind, one of {list(TARGETS)}", site.call)
    kind = args["kind"].value
    if kind not in TARGETS:
        raise MacroError(f"target() takes one of {list(TARGETS)}, not {kind!r}", args["kind"].node)
    node = site.node
    assert isinstance(node, cst.If)
    chosen = ctx.options.target
    if chosen is None:
        torch = ctx.import_module("torch")
        check = cst.parse_expression(f"{torch}.cuda.is_available()")
        test = check if kind == "cuda" else cst.UnaryOperation(cst.Not(), check)
        return Expanded([node.with_changes(test=test)])
    if site.form == "elif":
        raise MacroError(
            "with --target, target() can't be an elif test; nest the if in the else branch",
            site.call,
        )
    if kind == chosen:
        return Expanded(_statements(node.body))
    if node.orelse is None:
        return Expanded([])
    if isinstance(node.orelse, cst.If):  # the elif becomes a plain if
        return Expanded([node.orelse])
    return Expanded(_statements(node.orelse.body))


def _statements(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    if isinstance(suite, cst.SimpleStatementSuite):  # if x: a(); b()
        return [cst.SimpleStatementLine(body=suite.body)]
    assert isinstance(suite, cst.IndentedBlock)
    return list(suite.body)
