"""What one expansion knows besides the tree: options, tuning values, fresh names.

Nothing here reads files or the environment: the CLI, the import hook and
autotune build ``Options`` and the pass stays a pure function of its inputs.
"""

from __future__ import annotations

import copy
import keyword
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import libcst as cst

from macrogen.expand import codegen
from macrogen.expand.args import Arg, Args
from macrogen.expand.errors import InternalError, MacroError
from macrogen.expand.protocol import Import

RUNTIME = "macrogen.runtime"  # what expanded files import: the runtime's interface


def _runtime_exports() -> frozenset[str]:
    from macrogen.runtime import EXPORTS  # (a table: no torch)

    return frozenset(EXPORTS)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Options:
    """How to expand a file."""

    path: str = "<string>"  # shown in errors and in the generated header
    target: str | None = None  # "cpu" or "cuda" fixes target() branches; None checks at run time
    tuning: Mapping[str, Any] = field(default_factory=dict)  # tunable key -> chosen value


@dataclass(frozen=True)
class Tunable:
    """One ``tunable(default, choices=[...])`` and the value expansion used."""

    key: str  # "BLOCK" for a module constant, "GPT.bucket_mb" for a macro argument
    default: Any
    choices: tuple[Any, ...]
    value: Any
    line: int

    @property
    def tuned(self) -> bool:
        return bool(self.value != self.default)


def same_value(a: Any, b: Any) -> bool:
    """Equal and of the same type, all the way down: ``True != 1``, ``4.0 != 4``, ``[1] != (1,)``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


@dataclass(frozen=True)
class SiteArguments:
    """A site's arguments as expanded: what autotune's constraints see."""

    macro: str
    qualname: str
    values: Mapping[str, Any]  # argument (keyword, or position "0", "1"...) -> value
    tunables: Mapping[str, str]  # argument -> its tuning key, for tunable() arguments

    @classmethod
    def of(cls, macro: str, qualname: str, args: Args) -> SiteArguments:
        named = {**{str(i): a for i, a in enumerate(args.positional)}, **args.keywords}
        named = {k: a for k, a in named.items() if not a.code}  # code has no value to check
        return cls(
            macro,
            qualname,
            {k: a.value for k, a in named.items()},
            {k: a.tunable for k, a in named.items() if a.tunable is not None},
        )


@dataclass(frozen=True)
class Position:
    line: int  # 1-based
    col: int  # 1-based
    width: int = 1


class Names:
    """Fresh identifiers that collide with nothing in the user's file (hygiene)."""

    def __init__(self, source: str):
        # Every identifier-like word of the source, strings and comments included:
        # an over-approximation, so a fresh name can never capture a user's name.
        self._taken = set(_IDENT.findall(source)) | set(keyword.kwlist)

    def fresh(self, hint: str) -> str:
        base = hint if hint.isidentifier() else "_mg"
        name, n = base, 1
        while name in self._taken:
            n += 1
            name = f"{base}_{n}"
        self._taken.add(name)
        return name

    def is_free(self, name: str) -> bool:
        return name not in self._taken


class Context:
    """What the macro sites of one file share; each site gets its own view (``for_site``)."""

    def __init__(self, source: str, options: Options, module_imports: Mapping[str, str]):
        self.options = options
        self.lines = source.splitlines()
        self.names = Names(source)
        self.constants: dict[str, Any] = {}  # define()d and tunable module constants
        self.tunables: dict[str, Tunable] = {}
        self.prelude: list[str] = []  # the sites' helpers, in the order they expanded
        self.class_decorators: dict[str, str] = {}  # Expanded.decorates: class name -> text
        self._module_imports = dict(module_imports)  # local name -> module it binds
        self._names: dict[str, str] = {}  # generated import statement -> the name it binds
        self._imports: set[str] = set()  # the statements of the imports the sites returned
        self.requested: list[Import] = []  # a site's view: the imports its macro asked for
        self._sites_per_scope: dict[str, int] = {}
        # What a site leaves for the file's other sites to check against (two sites that
        # contradict each other): a kind -> (the node an error is reported at, its line,
        # what the site is, in words).
        self.marks: dict[str, list[tuple[cst.CSTNode, int, str]]] = {}
        # Names the site being expanded sees bound by its own function or class: a module
        # import of the same name is hidden there, so generated code must not use it.
        self.shadowed: frozenset[str] = frozenset()
        # The text of a statement of the user's file (a site's definition), as libcst
        # prints it but indented where it stands; None where the pass can't tell. A macro
        # that scans a definition's words reads this instead of printing the tree.
        self.source_text: Callable[[cst.CSTNode], str | None] = lambda node: None

    def for_site(self, shadowed: frozenset[str]) -> Context:
        """The view one site's macro gets: the file's state (names, imports, tunables,
        constants) shared, its own ``shadowed`` names and ``requested`` imports."""
        view = copy.copy(self)  # (shallow: the containers are the file's)
        view.shadowed = shadowed
        view.requested = []
        return view

    # -- imports that generated code needs ---------------------------------
    # A macro asks for a name here, uses ``str(imp)`` (its local name) in the code it
    # renders; the pass writes the statements of the imports each expanded site asked for.
    def import_module(self, module: str) -> Import:
        """The name under which generated code reaches ``module`` (``import x as y``)."""
        for local, bound in self._module_imports.items():
            if bound == module and local not in self.shadowed:
                return self._requested_now(Import(local, module, None, self._statement_of(local)))
        leaf = module.rsplit(".", 1)[-1]
        stmt_prefix = f"import {module} as "
        for stmt, local in self._names.items():
            if stmt.startswith(stmt_prefix):
                return self._requested_now(Import(local, module, None, stmt))
        if "." not in module and self.names.is_free(module):
            local = self.names.fresh(module)
            stmt = f"import {module}"
        else:
            local = self.names.fresh(f"_mg_{leaf}")
            stmt = stmt_prefix + local
        self._names[stmt] = local
        self._module_imports[local] = module
        return self._requested_now(Import(local, module, None, stmt))

    def import_from(self, module: str, name: str) -> Import:
        """The name under which generated code reaches ``module.name``. The runtime is reached
        through its interface, ``macrogen.runtime``, for the names it exports only."""
        if module.startswith(RUNTIME + "."):
            raise InternalError(
                f"generated code imports from {RUNTIME} (its interface), not from {module}"
            )
        if module == RUNTIME and name not in _runtime_exports():
            raise InternalError(
                f"{RUNTIME} exports no {name!r}: add it to EXPORTS in macrogen/runtime/__init__.py"
            )
        key = f"from {module} import {name}"
        for stmt, local in self._names.items():
            if stmt == key or stmt.startswith(key + " as "):
                return self._requested_now(Import(local, module, name, stmt))
        if self.names.is_free(name):
            self.names.fresh(name)
            stmt, local = key, name
        else:
            local = self.names.fresh(f"_mg_{name}")
            stmt = f"{key} as {local}"
        self._names[stmt] = local
        return self._requested_now(Import(local, module, name, stmt))

    def generated_import(self, local: str) -> str | None:
        """The generated import statement that binds ``local`` (None: the file's own name)."""
        return self._statement_of(local)

    def _statement_of(self, local: str) -> str | None:
        """The generated statement that binds ``local`` (None: the file's own import)."""
        return next((stmt for stmt, name in self._names.items() if name == local), None)

    def _requested_now(self, imp: Import) -> Import:
        self.requested.append(imp)
        return imp

    def add_imports(self, imports: Iterable[Import]) -> None:
        """The pass: these imports are used by a site that expanded."""
        for imp in imports:
            if imp.statement is not None:
                self._imports.add(imp.statement)

    def import_lines(self) -> list[str]:
        return sorted(self._imports)

    # -- tunables ----------------------------------------------------------
    def check_each_choice(self, name: str, arg: Arg, check: Callable[[Any], str | None]) -> None:
        """A macro argument's value and, for a tunable, every choice (autotune may pick any of
        them) pass ``check`` (None, or what was wanted); else an error at the argument."""
        candidates = [arg.value]
        if arg.tunable is not None and arg.tunable in self.tunables:
            candidates = list(self.tunables[arg.tunable].choices)
        for value in candidates:
            wanted = check(value)
            if wanted is not None:
                what = "a choice of " if arg.tunable is not None else ""
                raise MacroError(f"{name} must be {wanted}, not {what}{value!r}", arg.node)

    def tunable(
        self, key: str, default: Any, choices: tuple[Any, ...], node: cst.CSTNode, line: int
    ) -> Any:
        if key in self.tunables:
            return self.tunables[key].value
        value = self.options.tuning.get(key, default)
        if key in self.options.tuning:  # True is not 1, 4.0 is not 4
            allowed = any(same_value(value, c) for c in choices)
        else:
            allowed = value in choices
        if not allowed:
            raise MacroError(
                f"the tuning database chose {value!r} for {key!r}, which is not one of its choices {list(choices)}",
                node,
            )
        self.tunables[key] = Tunable(key, default, choices, value, line)
        return value

    # -- sites ---------------------------------------------------------------
    def site_key(self, scope: str, macro: str) -> str:
        """A stable name for an anonymous site: ``train.fused_allreduce``, then ``#2``..."""
        base = f"{scope}.{macro}" if scope else macro
        n = self._sites_per_scope.get(base, 0) + 1
        self._sites_per_scope[base] = n
        return base if n == 1 else f"{base}#{n}"

    def source_line(self, line: int) -> str:
        return self.lines[line - 1] if 0 < line <= len(self.lines) else ""

    def location(self, line: int) -> str:
        """``path:line`` for generated comments and docstrings (the path made safe: codegen.text)."""
        return f"{codegen.text(self.options.path)}:{line}"
