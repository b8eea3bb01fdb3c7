"""The macro protocol: what the pass hands a macro, and what the macro hands back.

A macro is a module (or any object) with these attributes; docs/macros.md has
a worked example of adding one.

    NAME: str                    # "shard_optimizer": the name users write, mg.shard_optimizer
    FORMS: frozenset[Form]       # the places it may stand (below)
    USAGE: str                   # one line showing the supported syntax, for error messages
    def expand(site: Site, ctx: Context) -> Expanded

and optionally the members of ``Hooks`` (below: ``CODE_ARGUMENTS``, ``BUILT``,
``constant``, ``argument``, ``tuning_constraint``, ``tuning_no_effect``), each
typed there with the default a macro that lacks it has.

The forms, with the node the macro gets as ``site.node`` and what it returns:

    "decorator"  @m(...) on a def or class   the definition  -> statements
    "with"       with m(...): body           the With        -> statements
    "loop"       for x in m(...): body       the For         -> statements
    "assign"     x = m(...)                  the statement   -> statements
    "if"/"elif"  if m(...): / elif m(...):   the If          -> statements (an elif: one If)
    "call"       m(...) anywhere else        the Call        -> an expression
    "argument"   other(x=m(...))             (no expand: the ``argument`` hook)

A site whose statement form the macro does not declare falls back to "call"
when the macro declares that (``x = m(...)`` is then the call form); else it is
an error that shows ``USAGE``.

Stacked macro decorators expand bottom-up, as Python applies decorators: each
one above gets the definition carrying the user's name among the statements the
one below returned (``expand/transform.py``). The same macro twice on one
definition is an error at the second. The registry (``macrogen.macros.MODULES``)
names every macro that ships with macrogen; a macro imports what it uses from
the pass through ``macrogen.macro`` (the SDK) only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, cast

import libcst as cst

from macrogen.expand.args import Args, ArgumentHook, Evaluator

if TYPE_CHECKING:
    from macrogen.expand.context import Context

Form = Literal["decorator", "with", "loop", "assign", "if", "elif", "call", "argument"]
FORMS: tuple[Form, ...] = ("decorator", "with", "loop", "assign", "if", "elif", "call", "argument")


@dataclass(frozen=True)
class Site:
    """One use of a macro in the user's file."""

    macro: str
    form: Form
    # The node the macro replaces (see the table above), inner sites already expanded
    # and, for a decorator, every macro decorator removed. Build the replacement from it.
    node: cst.CSTNode
    # The same node as it is in the source: analyse it, and raise errors at its parts
    # (only the source's nodes have positions).
    original: cst.CSTNode
    call: cst.Call | None  # the macro call (None for a bare decorator)
    args: Args  # the call's arguments, evaluated
    qualname: str  # "GPT", "Block.forward", "sync_metrics.fused_allreduce", "BLOCK"
    line: int  # 1-based line of the macro call in the source
    col: int
    scope: str = ""  # the enclosing functions and classes: "Trainer.step"; "" at module level
    # What the file's code reaches by name at this site: local name -> module, from
    # the file's plain imports (``import torch.distributed as dist`` -> "dist":
    # "torch.distributed") and ``from`` imports (``from torch.distributed import
    # all_reduce`` -> "all_reduce": "torch.distributed.all_reduce"), minus the names
    # the enclosing functions and classes bind themselves.
    names: Mapping[str, str] = field(default_factory=dict)

    def qualified(self, expr: cst.BaseExpression) -> str | None:
        """``torch.distributed.all_reduce`` for ``dist.all_reduce`` (through ``names``), else None."""
        parts: list[str] = []
        while isinstance(expr, cst.Attribute):
            parts.append(expr.attr.value)
            expr = expr.value
        if not isinstance(expr, cst.Name) or expr.value not in self.names:
            return None
        return ".".join([self.names[expr.value], *reversed(parts)])


class Import(str):
    """A name generated code uses, and the import that binds it.

    The string is the local name, so it goes straight into templates and f-strings.
    """

    module: str  # "macrogen.runtime.fused"
    name: str | None  # "all_reduce_fused"; None for ``import module``
    statement: str | None  # "from macrogen.runtime.fused import all_reduce_fused"; None: the file's

    def __new__(cls, local: str, module: str, name: str | None, statement: str | None) -> Import:
        imp = super().__new__(cls, local)
        imp.module, imp.name, imp.statement = module, name, statement
        return imp

    @property
    def local(self) -> str:
        return str.__str__(self)


Replacement = Sequence[cst.BaseStatement] | cst.BaseExpression


@dataclass(frozen=True)
class Expanded:
    """What a macro's ``expand`` returns.

    ``replacement`` takes the site's place: statements for a statement form (an
    empty sequence leaves ``pass``), one ``cst.If`` for an "elif", an expression
    for "call". ``helpers`` are module-level code blocks (rendered templates) for
    the generated-helpers block after the file's imports, in the order given.
    The imports they use are the ones the macro asked the context for
    (``ctx.import_from``/``ctx.import_module``) while it expanded this site: the
    pass writes those statements.
    """

    replacement: Replacement
    helpers: tuple[str, ...] = ()
    # (the name of a top-level class of the file, a decorator's text with its comment lines):
    # put above that class (``@tensor_parallel``'s plan-less decorator on a class that builds
    # and re-initializes a decorated one); once per class, the first site's
    decorates: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TuningEnv:
    """What a tuning constraint may depend on: the machine the candidates run on."""

    target: str  # "cpu" or "cuda"
    world_size: int  # ranks per measured run
    device_name: str


Constraint = Callable[[Mapping[str, object], TuningEnv], "str | None"]
ConstantHook = Callable[[str, cst.Call, Evaluator], object]
NoEffect = Callable[[str, TuningEnv], "str | None"]
PerDevice = Callable[[str], bool]


class Hooks(Protocol):
    """The optional members of a macro, each with the default a macro without it has.

    A macro module defines the ones it needs; the pass and autotune read them with the
    functions below (``code_arguments(macro)``, ...), which fall back to the default here.
    """

    # Arguments that are the program's own code, not expansion-time values: keyword
    # names, or positions "0", "1"... (shard_optimizer's optimizer expression).
    # ``site.args`` holds them as expressions (``Arg.code``); take the expanded
    # expression from ``site.node``.
    CODE_ARGUMENTS: frozenset[str] = frozenset()
    # A decorator macro: how to apply it to a built object ('parallelize(model,
    # dp="replicate")'), shown when a user calls the decorator on one: m()(obj).
    BUILT: str | None = None
    # ``NAME = m(...)`` at module level gives NAME an expansion-time value (define,
    # tunable): ``constant(name, call, evaluator) -> value``. Runs before any expand.
    constant: ConstantHook | None = None
    # An "argument" site, the macro's call a whole argument of another macro
    # (tunable): ``argument(call, key, evaluator) -> (value, tuning key or None)``.
    argument: ArgumentHook | None = None
    # Why this combination of a site's arguments can't run on env (autotune skips
    # the candidate): ``tuning_constraint(arguments, env) -> reason | None``.
    tuning_constraint: Constraint | None = None
    # Why tuning one argument on env would measure only noise (autotune leaves it
    # at its default): ``tuning_no_effect(argument, env) -> reason | None``.
    tuning_no_effect: NoEffect | None = None
    # Whether a rank of a job on several device kinds may take its own kind's winner for
    # this argument (the import hook's lookup): it shapes only this rank's own computation,
    # never what ranks exchange: ``tuning_per_device(argument) -> bool``.
    tuning_per_device: PerDevice | None = None


class Macro(Hooks, Protocol):
    """Every macro: the four required members, and the optional ``Hooks``."""

    @property
    def NAME(self) -> str: ...

    @property
    def FORMS(self) -> frozenset[Form]: ...

    @property
    def USAGE(self) -> str: ...

    def expand(self, site: Site, ctx: Context, /) -> Expanded: ...


# -- the optional members, read at each use (so a test may patch a module) ------------------
def code_arguments(macro: object) -> frozenset[str]:
    return frozenset(cast("frozenset[str]", _hook(macro, "CODE_ARGUMENTS")))


def built(macro: object) -> str | None:
    found = _hook(macro, "BUILT")
    return found if isinstance(found, str) else None


def constant_hook(macro: object) -> ConstantHook | None:
    return cast("ConstantHook | None", _callable(macro, "constant"))


def argument_hook(macro: object) -> ArgumentHook | None:
    return cast("ArgumentHook | None", _callable(macro, "argument"))


def tuning_constraint(macro: object) -> Constraint | None:
    return cast("Constraint | None", _callable(macro, "tuning_constraint"))


def tuning_no_effect(macro: object) -> NoEffect | None:
    return cast("NoEffect | None", _callable(macro, "tuning_no_effect"))


def tuning_per_device(macro: object) -> PerDevice | None:
    return cast("PerDevice | None", _callable(macro, "tuning_per_device"))


def _hook(macro: object, name: str) -> object:
    """The macro's optional member ``name``, else its default in ``Hooks``."""
    found = getattr(macro, name, None)
    return getattr(Hooks, name) if found is None else found


def _callable(macro: object, name: str) -> object:
    found = _hook(macro, name)
    return found if callable(found) else None


__all__ = [
    "ArgumentHook",
    "ConstantHook",
    "Constraint",
    "Expanded",
    "Form",
    "Hooks",
    "Import",
    "Macro",
    "NoEffect",
    "PerDevice",
    "Site",
    "argument_hook",
    "built",
    "code_arguments",
    "constant_hook",
    "tuning_constraint",
    "tuning_no_effect",
    "tuning_per_device",
]
