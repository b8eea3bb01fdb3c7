"""The macro SDK: everything a macro module may use from the pass, and nothing else.

A macro (``macrogen/macros/``, a test's, a plug-in's) imports from here only;
``tests/test_house.py`` fails when a module of ``macrogen/macros/`` imports any other
module of ``macrogen/expand/``. docs/macros.md describes each name.

- the protocol: ``Site`` (what ``expand`` gets), ``Expanded`` (what it returns),
  ``Form``, ``Import`` (a name generated code uses), ``TuningEnv``, ``Macro`` and the
  optional members with their defaults (``Hooks``) with their types (``ConstantHook``,
  ``ArgumentHook``, ``Constraint``, ``NoEffect``);
- the per-file ``Context`` (fresh names, imports, tunables, locations);
- arguments: ``Arg``, ``Args``, ``Evaluator`` (the hooks' evaluator), ``evaluated``
  (a literal's value);
- errors: ``MacroError`` (the user's mistake, at a node), ``InternalError`` (a bug);
- rendering: ``render`` (a template's text, checked to be Python),
  ``render_statements`` (the same as statements to splice into the tree), the
  template filters' functions ``ident``, ``py``, ``text``, ``Expression``, and
  ``add_templates`` for a macro whose templates live outside macrogen;
- reading the tree: ``find``, ``walk``, ``Visitor``, ``leaf``, ``dotted``,
  ``did_you_mean``, ``may_call_with_arguments``.
"""

from macrogen.expand.args import Arg, Args, Evaluator
from macrogen.expand.codegen import (
    Expression,
    add_templates,
    ident,
    py,
    render,
    render_statements,
    text,
)
from macrogen.expand.context import Context
from macrogen.expand.errors import InternalError, MacroError
from macrogen.expand.literals import evaluated
from macrogen.expand.protocol import (
    ArgumentHook,
    ConstantHook,
    Constraint,
    Expanded,
    Form,
    Hooks,
    Import,
    Macro,
    NoEffect,
    Site,
    TuningEnv,
)
from macrogen.expand.sites import did_you_mean, dotted, may_call_with_arguments
from macrogen.expand.walk import Visitor, find, leaf, walk

__all__ = [
    "Arg",
    "ArgumentHook",
    "Args",
    "ConstantHook",
    "Constraint",
    "Context",
    "Evaluator",
    "Expanded",
    "Expression",
    "Form",
    "Hooks",
    "Import",
    "InternalError",
    "Macro",
    "MacroError",
    "NoEffect",
    "Site",
    "TuningEnv",
    "Visitor",
    "add_templates",
    "did_you_mean",
    "dotted",
    "evaluated",
    "find",
    "ident",
    "leaf",
    "may_call_with_arguments",
    "py",
    "render",
    "render_statements",
    "text",
    "walk",
]
