"""What the file's classes are and what their ``__init__`` assigns, read from the source:
``@tensor_parallel`` checks its plan against them (``self.fc = nn.Linear(...)`` for a colwise
``fc``) and finds the classes that build a decorated one (``tensor_parallel_builders``).
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterator, Mapping

import libcst as cst

from macrogen.macro import Context, Visitor, dotted, walk


def init_assignments(
    cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef], seen: frozenset[str] = frozenset()
) -> dict[str, cst.BaseExpression] | None:
    """``self.<attr> = value`` in ``__init__``: attr -> last value (bases of this file first).

    None when neither the class nor a base of this file defines ``__init__``.
    """
    found: dict[str, cst.BaseExpression] | None = None
    for base in cls.bases:  # super().__init__() runs theirs; a missing __init__ inherits it
        name = dotted(base.value)
        if name is not None and name in classes and name not in seen:
            inherited = init_assignments(classes[name], classes, seen | {cls.name.value})
            if inherited is not None:
                found = {**(found or {}), **inherited}
    own = own_init_assignments(cls)
    if own is None:
        return found
    return {**(found or {}), **own}


@functools.lru_cache(maxsize=16)  # by the node itself: asked once per plan entry of a site
def own_init_assignments(cls: cst.ClassDef) -> dict[str, cst.BaseExpression] | None:
    """``self.<attr> = value`` anywhere in the class's own ``__init__``: attr -> last value
    (not to be changed: it is shared)."""
    init = next(
        (s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"),
        None,
    )
    if init is None:
        return None
    params = init.params.params or init.params.posonly_params
    me = params[0].name.value if params else "self"
    found: dict[str, cst.BaseExpression] = {}

    class _Assignments(Visitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is init  # nested functions assign their own locals

        def visit_ClassDef(self, node: cst.ClassDef) -> bool:
            return False

        def visit_Assign(self, node: cst.Assign) -> None:
            for target in node.targets:
                self._target(target.target, node.value)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            if node.value is not None:
                self._target(node.target, node.value)

        def _target(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
            if (
                isinstance(target, cst.Attribute)
                and isinstance(target.value, cst.Name)
                and target.value.value == me
            ):
                found[target.attr.value] = value

    walk(init, _Assignments())
    return found


def callee_name(value: cst.BaseExpression) -> str | None:
    """``nn.LayerNorm`` for ``nn.LayerNorm(...)``."""
    return dotted(value.func) if isinstance(value, cst.Call) else None


def callee_leaf(value: cst.BaseExpression) -> str | None:
    """``Linear`` for ``nn.Linear(...)``, ``torch.nn.Linear(...)`` or ``Linear(...)``."""
    if isinstance(value, cst.Call):
        name = dotted(value.func)
        if name is not None:
            return name.rsplit(".", 1)[-1]
    return None


def describe(value: cst.BaseExpression) -> str:
    if isinstance(value, cst.Call):
        name = dotted(value.func)
        return f"{name}(...)" if name else "a call"
    text = cst.Module([]).code_for_node(value).strip()
    return text if len(text) <= 40 else text[:37] + "..."


def may_be_int(value: cst.BaseExpression) -> bool:
    """Whether the value could be an int: not a layer, not another literal kind."""
    if isinstance(value, cst.Integer):
        return True
    if isinstance(
        value,
        (cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString),
    ):
        return False
    if isinstance(value, (cst.List, cst.Tuple, cst.Dict, cst.Set, cst.Lambda)):
        return False
    if isinstance(value, cst.Name) and value.value in ("True", "False", "None"):
        return False
    leaf = callee_leaf(value)
    return leaf is None or not leaf[:1].isupper()  # a class call builds an object, not an int


def constructed_class(
    value: cst.BaseExpression, classes: Mapping[str, cst.ClassDef]
) -> cst.ClassDef | None:
    """The class of this file that ``value`` constructs (``MLP(...)``), if any."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
        return classes.get(value.func.value)
    return None


_CLASSES: weakref.WeakKeyDictionary[Context, ModuleClasses] = weakref.WeakKeyDictionary()


def module_classes(ctx: Context) -> ModuleClasses:
    """Top-level classes of the file, for dotted plan paths into submodules and base classes."""
    if ctx not in _CLASSES:
        _CLASSES[ctx] = ModuleClasses("\n".join(ctx.lines))
    return _CLASSES[ctx]


class ModuleClasses(Mapping[str, cst.ClassDef]):
    """The file's top-level classes by name. libcst parses the whole file only when a plan
    path or a base class names one of them: most plans name their own class's layers."""

    _CLASS = re.compile(r"^class\b(?:[ \t]+(\w+))?", re.M)

    def __init__(self, source: str):
        self.source = source
        found = [m.group(1) for m in self._CLASS.finditer(source)]
        # the names on lines that start with ``class`` (None: one is written another way)
        self.candidates: set[str] | None = None if None in found else set(found)
        self._classes: dict[str, cst.ClassDef] | None = None

    def _all(self) -> dict[str, cst.ClassDef]:
        if self._classes is None:
            module = cst.parse_module(self.source)
            self._classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
        return self._classes

    def _may_have(self, name: object) -> bool:
        return self.candidates is None or name in self.candidates

    def __getitem__(self, name: str) -> cst.ClassDef:
        if not self._may_have(name):
            raise KeyError(name)
        return self._all()[name]

    def __contains__(self, name: object) -> bool:
        return self._may_have(name) and name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())
