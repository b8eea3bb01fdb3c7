"""Which names in a file mean macrogen's macros, scope by scope.

Names resolve through the file's own imports (``import macrogen as mg``,
``from macrogen import tile as t``, and the same through ``macrogen.markers``:
``import macrogen.markers as mm``, ``import macrogen.markers`` then
``macrogen.markers.tile``, ``from macrogen import markers``) with Python's
scoping rules: a name a function binds itself (a parameter, an assignment,
another import) shadows the module's import inside that function, so it is not
a macro there. A comprehension's ``for`` names are its own (Python 3): they
shadow nothing outside it.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field

import libcst as cst

from macrogen import macros
from macrogen.expand.errors import MacroError
from macrogen.expand.walk import Visitor, walk
from macrogen.markers import NON_MACRO_NAMES

PACKAGE = "macrogen"


MARKERS_MODULE = f"{PACKAGE}.markers"


@dataclass(frozen=True)
class Binding:
    """What a name bound by an import of macrogen means."""

    macro: str | None  # the macro's name, or None when the name is a module (below)
    module: str = PACKAGE  # for a module: macrogen or macrogen.markers


MODULE = Binding(None)
MARKERS = Binding(None, MARKERS_MODULE)  # macrogen.markers: the same macros, no other names
COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)
Comprehension = cst.ListComp | cst.SetComp | cst.GeneratorExp | cst.DictComp


def nfkc(name: str) -> str:
    """A name as Python reads it: identifiers are NFKC-normalized (``ｍg`` is ``mg``)."""
    return name if name.isascii() else unicodedata.normalize("NFKC", name)


def dotted(node: cst.CSTNode) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return nfkc(node.value)
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{nfkc(node.attr.value)}"
    return None


def may_call_with_arguments(text: str | None, func: str) -> bool:
    """Whether code ``text`` may call ``func`` (a plain name) with arguments: False only when
    every occurrence of the word is followed by ``()``, so a walk for such calls can be
    skipped (``super(Cls, self)`` checks: classes call ``super().__init__()``)."""
    if text is None:
        return True
    empty = re.compile(rf"\b{re.escape(func)}\b(?![ \t]*\(\))")
    return empty.search(text) is not None


def did_you_mean(name: str, known: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_macro(name: str, node: cst.CSTNode) -> MacroError:
    names = macros.names()
    return MacroError(
        f"macrogen has no macro {name!r}{did_you_mean(name, names)} (macros: {', '.join(names)})",
        node,
    )


def imported_names(stmt: cst.Import | cst.ImportFrom) -> dict[str, str]:
    """What an absolute import binds: local name -> the module or object it names."""
    out: dict[str, str] = {}
    if isinstance(stmt, cst.Import):
        for alias in stmt.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None:
                out[dotted(alias.asname.name) or ""] = full
            else:
                top = full.split(".", 1)[0]
                out[top] = top
        return out
    if stmt.relative or stmt.module is None or isinstance(stmt.names, cst.ImportStar):
        return out
    module = dotted(stmt.module) or ""
    for alias in stmt.names:
        name = dotted(alias.name) or ""
        local = dotted(alias.asname.name) if alias.asname is not None else name
        out[local or name] = f"{module}.{name}"
    return out


def import_bindings(
    stmt: cst.Import | cst.ImportFrom, errors: list[MacroError]
) -> dict[str, Binding | None]:
    """Names an import binds: a Binding for macrogen's, None for anything else."""
    out: dict[str, Binding | None] = {}
    if isinstance(stmt, cst.Import):
        for alias in stmt.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None:
                local = dotted(alias.asname.name) or ""
                out[local] = _MODULES.get(full)
            else:
                top = full.split(".", 1)[0]
                out[top] = MODULE if top == PACKAGE else None
        return out
    module = dotted(stmt.module) if stmt.module is not None else None
    from_macrogen = stmt.relative == () or len(stmt.relative) == 0
    from_macrogen = from_macrogen and module in (PACKAGE, MARKERS_MODULE)
    known = macros.names()
    if isinstance(stmt.names, cst.ImportStar):
        if from_macrogen:
            out.update({name: Binding(name) for name in known})
        return out
    for alias in stmt.names:
        name = dotted(alias.name) or ""
        local = (dotted(alias.asname.name) or "") if alias.asname is not None else name
        if not from_macrogen:
            out[local or name] = None
        elif name in known:
            out[local or name] = Binding(name)
        elif module == PACKAGE and name == "markers":  # from macrogen import markers
            out[local or name] = MARKERS
        elif name in NON_MACRO_NAMES or module != PACKAGE:
            out[local or name] = None
        else:
            errors.append(unknown_macro(name, alias.name))
            out[local or name] = None
    return out


_MODULES = {PACKAGE: MODULE, MARKERS_MODULE: MARKERS}  # import X as name: what name is


def _target_names(node: cst.CSTNode, into: set[str]) -> None:
    if isinstance(node, cst.Name):
        into.add(nfkc(node.value))
    elif isinstance(node, (cst.Tuple, cst.List)):
        for el in node.elements:
            _target_names(el.value, into)
    elif isinstance(node, cst.StarredElement):
        _target_names(node.value, into)


@dataclass
class Scope:
    """Names one scope binds itself, and which of them are macrogen imports."""

    kind: str  # "module", "function", "class"
    name: str
    bound: set[str] = field(default_factory=set)
    macros: dict[str, Binding] = field(default_factory=dict)
    globals: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)  # bound by imports alone -> what


class _ScopeCollector(Visitor):
    """Collects the names bound directly in one scope (not in scopes inside it)."""

    def __init__(self, scope: Scope, errors: list[MacroError]):
        self.scope = scope
        self.errors = errors
        self.others: set[str] = set()  # names also bound by something else than macrogen
        self.imported: dict[str, str] = {}  # names an import binds -> what it names
        self.bound_otherwise: set[str] = set()  # names also bound by something else than an import

    def _bind(self, name: str, binding: Binding | None = None, *, imported: bool = False) -> None:
        self.scope.bound.add(name)
        if not imported:
            self.bound_otherwise.add(name)
        if binding is not None:
            self.scope.macros[name] = binding
        else:
            self.others.add(name)

    def finish(self) -> Scope:
        # A name that the scope binds both to macrogen and to something else is
        # ambiguous; it is a macro only where macrogen is all it can be.
        for name in self.others:
            self.scope.macros.pop(name, None)
        self.scope.imports = {
            n: q for n, q in self.imported.items() if n not in self.bound_otherwise
        }
        return self.scope

    # Nested scopes: their name is bound here, their body is not visited.
    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._bind(nfkc(node.name.value))
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._bind(nfkc(node.name.value))
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Import(self, node: cst.Import) -> bool:
        for name, binding in import_bindings(node, self.errors).items():
            self._bind(name, binding, imported=True)
        self.imported.update(imported_names(node))
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return self.visit_Import(node)  # type: ignore[arg-type]

    def visit_Global(self, node: cst.Global) -> None:
        self.scope.globals.update(nfkc(n.name.value) for n in node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.scope.globals.update(nfkc(n.name.value) for n in node.names)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._targets(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._targets(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._targets(node.target)

    # (A comprehension's ``for`` targets are its own scope's: ``comprehension_scope``.
    # What else it binds, ``:=``, binds here: its walk goes on.)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._targets(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._targets(node.target)

    def visit_Param(self, node: cst.Param) -> None:
        self._bind(nfkc(node.name.value))

    def visit_Del(self, node: cst.Del) -> None:
        self._targets(node.target)

    def _targets(self, target: cst.CSTNode) -> None:
        names: set[str] = set()
        _target_names(target, names)
        for name in names - self.scope.globals:
            self._bind(name)


def comprehension_scope(node: Comprehension) -> Scope:
    """The names a comprehension binds: its ``for`` targets, local to it (Python 3)."""
    scope = Scope("comprehension", "")
    for_in: cst.CompFor | None = node.for_in
    while for_in is not None:
        _target_names(for_in.target, scope.bound)
        for_in = for_in.inner_for_in
    return scope


def collect_scope(
    kind: str, name: str, nodes: list[cst.CSTNode], errors: list[MacroError]
) -> Scope:
    collector = _ScopeCollector(Scope(kind, name), errors)
    for node in nodes:
        walk(node, collector)  # reads only: libcst's visit would rebuild every node
    return collector.finish()


class ScopeStack:
    """Python's name lookup, reduced to the question 'is this name a macro here?'."""

    def __init__(self, module_scope: Scope):
        self.stack = [module_scope]

    def push(self, scope: Scope) -> None:
        self.stack.append(scope)

    def pop(self) -> None:
        self.stack.pop()

    @property
    def qualname(self) -> str:
        return ".".join(s.name for s in self.stack[1:] if s.kind != "comprehension")

    def import_map(self, module_imports: Mapping[str, str]) -> dict[str, str]:
        """What names reach by import here: the module's imports, then each enclosing scope's."""
        names = dict(module_imports)
        innermost = self.stack[-1]
        for scope in self.stack[1:]:
            if scope.kind == "class" and scope is not innermost:
                continue  # class bodies are not visible from the functions inside them
            for name in scope.bound - scope.globals:
                if name in scope.imports:
                    names[name] = scope.imports[name]
                else:
                    names.pop(name, None)
        return names

    def locally_bound(self) -> frozenset[str]:
        """Names bound by the enclosing functions and classes (not the module)."""
        return frozenset().union(*(s.bound - s.globals for s in self.stack[1:]))

    def resolve(self, name: str) -> Binding | None:
        innermost = self.stack[-1]
        for scope in reversed(self.stack):
            if scope.kind == "class" and scope is not innermost:
                continue  # class bodies are not visible from the functions inside them
            if name in scope.globals:
                return self.stack[0].macros.get(name)
            if name in scope.bound:
                return scope.macros.get(name)
        return None

    def macro_of(self, expr: cst.CSTNode) -> str | None:
        """The macro an expression names: ``tile`` for ``mg.tile`` or ``t`` (from-import)."""
        if isinstance(expr, cst.Call):
            expr = expr.func
        if isinstance(expr, cst.Name):
            binding = self.resolve(nfkc(expr.value))
            return binding.macro if binding is not None else None
        if isinstance(expr, cst.Attribute) and self.module_of(expr.value) is not None:
            attr = nfkc(expr.attr.value)
            if attr in macros.names():
                return attr
        return None

    def module_of(self, expr: cst.CSTNode) -> Binding | None:
        """MODULE or MARKERS where ``expr`` names that module here (``mg``, ``macrogen.markers``)."""
        if isinstance(expr, cst.Name):
            binding = self.resolve(nfkc(expr.value))
            return binding if binding is not None and binding.macro is None else None
        if isinstance(expr, cst.Attribute) and nfkc(expr.attr.value) == "markers":
            return MARKERS if self.module_of(expr.value) is MODULE else None
        return None

    def check_attribute(self, node: cst.Attribute) -> None:
        """``mg.tlie`` is an error with a did-you-mean; ``mg.hook`` is fine."""
        module = self.module_of(node.value)
        if module is None:
            return
        attr = nfkc(node.attr.value)
        if attr in macros.names():
            return
        if attr not in (NON_MACRO_NAMES if module is MODULE else _markers_names()):
            raise unknown_macro(attr, node.attr)


def _markers_names() -> frozenset[str]:
    """What ``macrogen.markers`` has besides macros (``pipeline_step``, ``TARGETS``...)."""
    from macrogen import markers

    return frozenset(dir(markers))
