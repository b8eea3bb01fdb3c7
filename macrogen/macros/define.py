"""``define(value)``: an expansion-time constant.

    D_MODEL = mg.define(256)          ->   # macrogen: define at model.py:3
                                           D_MODEL = 256

Macro arguments that name ``D_MODEL`` get 256 at expansion time (the
``constant`` hook runs before any site expands); ordinary code keeps reading
the module variable.
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Evaluator, Expanded, Form, InternalError, MacroError, Site, py

NAME = "define"
FORMS: frozenset[Form] = frozenset({"assign"})
USAGE = "define() is assigned to a module-level name: D_MODEL = define(256)"


def constant(name: str, call: cst.Call, evaluator: Evaluator) -> object:
    args = evaluator.call_args(call, name).bind({"value": None}, positional=("value",))
    if "value" not in args:
        raise MacroError("define() takes the value: define(256)", call)
    return args["value"].value


def expand(site: Site, ctx: Context) -> Expanded:
    return Expanded([literal_assignment(site, ctx)])


def check_module_constant(site: Site) -> str:
    """The constant's name: ``NAME = macro(...)`` at module level, one name (else an error)."""
    stmt = site.original
    assert isinstance(stmt, cst.SimpleStatementLine)
    assign = stmt.body[0]
    if "." in site.qualname or site.call is None:
        raise MacroError(f"{site.macro}() must be assigned to a name at module level", site.call)
    if not (
        isinstance(assign, cst.Assign)
        and len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
    ):
        raise MacroError(
            f"{site.macro}() must be assigned to one name: NAME = {site.macro}(...)", stmt
        )
    return assign.targets[0].target.value


def literal_assignment(
    site: Site, ctx: Context, leading: list[cst.EmptyLine] | None = None
) -> cst.BaseStatement:
    """``NAME = <literal>``, keeping the line's own trailing comment."""
    name = check_module_constant(site)
    if name not in ctx.constants:  # its evaluation failed; that error is already reported
        raise MacroError(f"{name} has no value", site.original)
    try:
        literal = _literal(ctx.constants[name])
    except InternalError as e:
        raise MacroError(
            f"{site.macro}() value can't be written back as a literal: {e}", site.original
        ) from None
    stmt = site.node
    assert isinstance(stmt, cst.SimpleStatementLine)
    assign = stmt.body[0]
    assert isinstance(assign, cst.Assign)
    return stmt.with_changes(body=[assign.with_changes(value=literal)], leading_lines=leading or [])


def _literal(value: object) -> cst.BaseExpression:
    """The node libcst parses from ``py(value)``: built at once for a plain int or str."""
    if type(value) is int and value >= 0:
        return cst.Integer(py(value))
    if type(value) is str:
        return cst.SimpleString(py(value))
    return cst.parse_expression(py(value))
