"""``@tensor_parallel(plan={...}, size=None)`` on an ``nn.Module`` class: sharded layers.

    @mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"})
    class MLP(nn.Module):                          # macrogen: tensor_parallel at model.py:7
        def __init__(self, d):                     class _MLP_serial(nn.Module):
            super().__init__()              ->         ... (the user's class, unchanged)
            self.fc = nn.Linear(d, 4 * d)
            self.proj = nn.Linear(4 * d, d)        class MLP(_MLP_serial):
        ...                                            def __init__(self, *args, **kwargs):
                                                           super().__init__(*args, **kwargs)
                                                           tp = tensor_parallel_group(None)
                                                           self.fc = ColwiseLinear(self.fc, tp)
                                                           self.proj = RowwiseLinear(self.proj, tp)

The generated class first builds the serial module (same layers, same random
initialization), then replaces each planned layer by this rank's shard (a
module from ``macrogen.runtime.tensor_parallel`` holding plain tensors under
the serial parameter names, calling the autograd collectives of
``macrogen.runtime.collectives``). ``forward`` is the user's, unchanged.

Styles: ``colwise`` (or ``("colwise", 3)`` for a fused q, k, v output of 3
packed blocks, each split on its own) and ``rowwise`` on ``nn.Linear``, ``vocab`` on
``nn.Embedding``, ``divide`` on an int attribute (``n_head``: forward's reshapes
then use the local count), ``replicate`` on anything (the default). Plan keys
are attributes the class's ``__init__`` assigns (``self.fc = ...``), or dotted
paths into submodules (``"mlp.fc"``). ``size=`` is the tensor-parallel degree (a
literal or ``tunable``); without it, $MACROGEN_TP_SIZE from the launch, else 1.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst

from macrogen import codegen
from macrogen.expand.context import Context
from macrogen.expand.errors import MacroError
from macrogen.expand.protocol import Expanded, Form, Site, TuningEnv
from macrogen.expand.sites import did_you_mean, dotted

NAME = "tensor_parallel"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = (
    "@tensor_parallel(plan={'attr': 'colwise' | 'rowwise' | 'vocab' | 'divide' | 'replicate'},"
    " size=N) on an nn.Module class"
)

STYLES = ("colwise", "rowwise", "vocab", "divide", "replicate")
SUPPORTED = (
    "colwise and rowwise on nn.Linear, vocab on nn.Embedding, divide on an int attribute,"
    " replicate on anything"
)
_NEEDS = {"colwise": "Linear", "rowwise": "Linear", "vocab": "Embedding"}


@dataclass(frozen=True)
class Entry:
    path: tuple[str, ...]  # ("mlp", "fc") for "mlp.fc"
    style: str
    blocks: int = 1  # colwise: packed output blocks, each split on its own (3 for a fused qkv)


@dataclass(frozen=True)
class Spec:
    name: str  # the decorated class
    entries: tuple[Entry, ...]  # in plan order
    size: int | None  # the tensor-parallel degree; None: from the launch


def validate(site: Site, ctx: Context) -> Spec:
    if not isinstance(site.original, cst.ClassDef):
        raise MacroError(f"tensor_parallel() decorates an nn.Module class: {USAGE}", site.call)
    args = site.args.bind({"plan": None, "size": None}, positional=("plan",))
    anchor = site.call  # None for a bare decorator: the pass then points at it
    if "plan" not in args:
        raise MacroError(f"tensor_parallel() needs a plan: {USAGE}", anchor)
    size = args["size"].value if "size" in args else None
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise MacroError(f"size must be a positive int, not {size!r}", args["size"].node)
    plan, node = args["plan"].value, args["plan"].node
    if not isinstance(plan, dict) or not plan:
        raise MacroError(
            "plan must be a non-empty dict of attribute name -> style, e.g."
            " {'fc': 'colwise', 'proj': 'rowwise'}",
            node,
        )
    classes = _module_classes("\n".join(ctx.lines))
    entries = []
    for key, style in plan.items():
        key_node, style_node = _element(node, key)
        if not isinstance(key, str) or not all(p.isidentifier() for p in key.split(".")):
            raise MacroError(
                f"plan keys are attribute names or dotted paths ('mlp.fc'), not {key!r}", key_node
            )
        blocks = 1
        if isinstance(style, (tuple, list)):  # ("colwise", 3): a fused output of 3 packed blocks
            if not (
                len(style) == 2
                and style[0] == "colwise"
                and isinstance(style[1], int)
                and not isinstance(style[1], bool)
                and style[1] >= 1
            ):
                raise MacroError(
                    "a packed style is ('colwise', blocks): e.g. ('colwise', 3) for a fused q, k, v"
                    f" projection whose forward chunks its output in 3; not {style!r}",
                    style_node,
                )
            style, blocks = "colwise", style[1]
        if style not in STYLES:
            raise MacroError(
                f"unknown style {style!r}{did_you_mean(str(style), list(STYLES))}"
                f" (styles: {', '.join(STYLES)})",
                style_node,
            )
        path = tuple(key.split("."))
        _check_fits(site.original, path, style, classes, key_node)
        entries.append(Entry(path, style, blocks))
    _check_super_calls(site.original)
    return Spec(site.original.name.value, tuple(entries), size)


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """A tensor-parallel size must divide the world size."""
    size = arguments.get("size")
    if isinstance(size, int) and (size < 1 or env.world_size % size):
        return f"size={size} does not divide the world size {env.world_size}"
    return None


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    serial = ctx.names.fresh(f"_{spec.name}_serial")
    runtime = "macrogen.runtime.tensor_parallel"
    layer = {"colwise": "ColwiseLinear", "rowwise": "RowwiseLinear", "vocab": "VocabEmbedding"}
    layers = {s: ctx.import_from(runtime, layer[s]) for s in _styles(spec) if s in layer}
    sharded = [
        (e.path, e.style, layers[e.style], ".".join((spec.name, *e.path)), e.blocks)
        for e in spec.entries
        if e.style in layer
    ]
    divided = [
        (e.path, ".".join((spec.name, *e.path))) for e in spec.entries if e.style == "divide"
    ]
    group = ctx.import_from("macrogen.runtime.mesh", "tensor_parallel_group")
    divide = ctx.import_from(runtime, "local_count") if divided else None
    gather = ctx.import_from(runtime, "full_state_dict")
    scatter = ctx.import_from(runtime, "load_full_state_dict")
    generated = codegen.render_statements(
        "tensor_parallel_class.py.j2",
        name=spec.name,
        serial=serial,
        size=spec.size,
        sharded=sharded,
        divided=divided,
        replicated=[e.path for e in spec.entries if e.style == "replicate"],
        group=group,
        divide=divide,
        gather=gather,
        scatter=scatter,
    )
    blank = [cst.EmptyLine()] * (1 if "." in site.qualname else 2)
    generated[0] = generated[0].with_changes(leading_lines=blank)
    assert isinstance(site.node, cst.ClassDef)
    imports = (*layers.values(), group, *([divide] if divide else []), gather, scatter)
    return Expanded([site.node.with_changes(name=cst.Name(serial)), *generated], imports=imports)


def _styles(spec: Spec) -> list[str]:
    """The styles of the plan, in order of first use (so imports are asked for in that order)."""
    return list(dict.fromkeys(e.style for e in spec.entries))


# -- what __init__ assigns ------------------------------------------------------------


def _check_fits(
    cls: cst.ClassDef,
    path: tuple[str, ...],
    style: str,
    classes: dict[str, cst.ClassDef],
    key_node: cst.CSTNode,
) -> None:
    """The attribute at ``path`` is assigned in ``__init__`` and its value fits ``style``."""
    value: cst.BaseExpression | None = None
    for i, attr in enumerate(path):
        assigned = _init_assignments(cls, classes)
        if assigned is None:
            raise MacroError(
                f"{cls.name.value} defines no __init__ (nor does a base class in this file):"
                " the plan names attributes that __init__ assigns (self.fc = nn.Linear(...))",
                key_node,
            )
        if attr not in assigned:
            known = ", ".join(assigned) or "none"
            raise MacroError(
                f"{'.'.join(path[: i + 1])!r} is not an attribute assigned in"
                f" {cls.name.value}.__init__{did_you_mean(attr, list(assigned))}"
                f" (assigned there: {known})",
                key_node,
            )
        value = assigned[attr]
        if i + 1 < len(path):
            callee = dotted(value.func) if isinstance(value, cst.Call) else None
            if callee is not None and callee.split(".")[0] in ("nn", "torch"):
                raise MacroError(
                    f"self.{attr} is {callee}(...), a torch layer: plan entries name whole layers"
                    f" ({'.'.join(path[: i + 1])!r}), or paths through submodules of your classes",
                    key_node,
                )
            inner = _constructed_class(value, classes)
            if inner is None:  # built by code we can't see: checked at construction instead
                return
            cls = inner
    assert value is not None
    what = _describe(value)
    needed = _NEEDS.get(style)
    if needed is not None and _callee_leaf(value) != needed:
        raise MacroError(
            f"{style} needs self.{path[-1]} = nn.{needed}(...) in __init__, but it is {what}"
            f" (supported: {SUPPORTED})",
            key_node,
        )
    if style == "divide" and not _may_be_int(value):
        raise MacroError(
            f"divide needs an int attribute (like n_head), but self.{path[-1]} is {what}"
            f" (supported: {SUPPORTED})",
            key_node,
        )


def _init_assignments(
    cls: cst.ClassDef, classes: dict[str, cst.ClassDef], seen: frozenset[str] = frozenset()
) -> dict[str, cst.BaseExpression] | None:
    """``self.<attr> = value`` in ``__init__``: attr -> last value (bases of this file first).

    None when neither the class nor a base of this file defines ``__init__``.
    """
    found: dict[str, cst.BaseExpression] | None = None
    for base in cls.bases:  # super().__init__() runs theirs; a missing __init__ inherits it
        name = dotted(base.value)
        if name in classes and name not in seen:
            inherited = _init_assignments(classes[name], classes, seen | {cls.name.value})
            if inherited is not None:
                found = {**(found or {}), **inherited}
    own = _own_init_assignments(cls)
    if own is None:
        return found
    return {**(found or {}), **own}


def _own_init_assignments(cls: cst.ClassDef) -> dict[str, cst.BaseExpression] | None:
    """``self.<attr> = value`` anywhere in the class's own ``__init__``: attr -> last value."""
    init = next(
        (s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"),
        None,
    )
    if init is None:
        return None
    params = init.params.params or init.params.posonly_params
    me = params[0].name.value if params else "self"
    found: dict[str, cst.BaseExpression] = {}

    class _Assignments(cst.CSTVisitor):
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

    init.visit(_Assignments())
    return found


def _callee_leaf(value: cst.BaseExpression) -> str | None:
    """``Linear`` for ``nn.Linear(...)``, ``torch.nn.Linear(...)`` or ``Linear(...)``."""
    if isinstance(value, cst.Call):
        name = dotted(value.func)
        if name is not None:
            return name.rsplit(".", 1)[-1]
    return None


def _describe(value: cst.BaseExpression) -> str:
    if isinstance(value, cst.Call):
        name = dotted(value.func)
        return f"{name}(...)" if name else "a call"
    text = cst.Module([]).code_for_node(value).strip()
    return text if len(text) <= 40 else text[:37] + "..."


def _may_be_int(value: cst.BaseExpression) -> bool:
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
    leaf = _callee_leaf(value)
    return leaf is None or not leaf[:1].isupper()  # a class call builds an object, not an int


def _constructed_class(
    value: cst.BaseExpression, classes: dict[str, cst.ClassDef]
) -> cst.ClassDef | None:
    """The class of this file that ``value`` constructs (``MLP(...)``), if any."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
        return classes.get(value.func.value)
    return None


@functools.lru_cache(maxsize=8)
def _module_classes(source: str) -> dict[str, cst.ClassDef]:
    """Top-level classes of the file, for dotted plan paths into submodules."""
    module = cst.parse_module(source)
    return {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}


def _element(plan: cst.BaseExpression, key: object) -> tuple[cst.CSTNode, cst.CSTNode]:
    """The key and value nodes of ``key`` in a literal plan dict (else the whole plan)."""
    if isinstance(plan, cst.Dict):
        for el in reversed(plan.elements):  # the last one wins, as in the dict
            if isinstance(el, cst.DictElement) and _literal(el.key) == key:
                return el.key, el.value
    return plan, plan


def _literal(node: cst.BaseExpression) -> object:
    if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
        return node.evaluated_value
    return None


def _check_super_calls(cls: cst.ClassDef) -> None:
    """``super(Cls, self)`` would name the generated subclass once the serial class is renamed."""
    name = cls.name.value

    class _Super(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if (
                isinstance(node.func, cst.Name)
                and node.func.value == "super"
                and node.args
                and isinstance(node.args[0].value, cst.Name)
                and node.args[0].value.value == name
            ):
                raise MacroError(
                    f"write super() without arguments in a tensor_parallel class: {name} becomes"
                    " the generated subclass, so super("
                    + name
                    + ", self) would skip the serial class",
                    node,
                )

    cls.visit(_Super())
