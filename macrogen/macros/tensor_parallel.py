"""``@tensor_parallel(plan={...}, size=None)`` on an ``nn.Module`` class: sharded layers.

    @mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"})
    class MLP(nn.Module):                          # macrogen: tensor_parallel at model.py:7
        def __init__(self, d):                     @tensor_parallel_class('MLP', None, {
            super().__init__()              ->         'fc': 'colwise',  # output features split ...
            self.fc = nn.Linear(d, 4 * d)              'proj': 'rowwise',  # input features split ...
            self.proj = nn.Linear(4 * d, d)        })
        ...                                        class MLP(nn.Module):
                                                       ... (the user's class: forward's widths local)

The class keeps its name and identity (registries, factories such as
torchtitan's ``Config.build()`` and ``isinstance`` that captured it see the
tensor-parallel class); the plan is data on it. ``macrogen.runtime.parallelize``
applies it where the outermost decorated model's construction ends: the serial
module is built first (same layers, same random initialization, a decorated
parent's re-initialization included), then the plan (in the engine's styles,
``macrogen.vocabulary``) is applied by the engine ``mg.parallelize`` uses: each
planned parameter becomes this rank's shard as a DTensor, so whole-model tools
(``numel``, ``state_dict``, DCP, ``clip_grad_norm_``) see the serial model, and
each planned layer runs its own forward on its local shard with its style's
collectives around it. ``forward`` is the user's,
with its full widths made local where they meet a shard
(``tensor_parallel_width``), the cross-entropy of a vocab-split head made
vocab-parallel, and a colwise output it returns gathered
(``tensor_parallel_outputs``).

Styles: ``colwise`` (or ``("colwise", 3)`` for a fused q, k, v output of 3
packed blocks, each split on its own) and ``rowwise`` on ``nn.Linear``, ``vocab`` on
``nn.Embedding``, ``divide`` on an int attribute (``n_head``: forward's reshapes
then use the local count), ``replicate`` on anything (the default). Plan keys
are attributes the class's ``__init__`` assigns (``self.fc = ...``), or dotted
paths into submodules (``"mlp.fc"``). Sequence parallelism: ``sequence`` on a layer
norm or dropout (run on this rank's slice of the sequence), ``from sequence`` on
a module (its input gathered on entry), ``colwise from sequence`` and ``rowwise
to sequence`` on ``nn.Linear`` (gather in, reduce-scatter out). ``size=`` is the tensor-parallel degree (a
literal or ``tunable``); without it, $MACROGEN_TP_SIZE from the launch, else 1.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import libcst as cst

from macrogen.macro import (
    Context,
    Expanded,
    Form,
    Import,
    MacroError,
    Site,
    TuningEnv,
    did_you_mean,
    dotted,
    evaluated,
    find,
)
from macrogen.macros.class_decorator import decorated, rendered_decorator
from macrogen.macros.class_init import (
    callee_leaf,
    callee_name,
    constructed_class,
    describe,
    init_assignments,
    may_be_int,
    module_classes,
)
from macrogen.macros.tensor_parallel_builders import builders
from macrogen.macros.tensor_parallel_width import feeding, rewrite_forward

NAME = "tensor_parallel"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = (
    "@tensor_parallel(plan={'attr': 'colwise' | 'rowwise' | 'vocab' | 'divide' | 'replicate'"
    " | 'sequence' | 'from sequence' | 'colwise from sequence' | 'rowwise to sequence'},"
    " size=N) on an nn.Module class"
)
# For an instance (``tensor_parallel(plan=...)(model)``): what applies a plan to a built model.
BUILT = 'parallelize(model, tp=2, tp_plan={"path.to.layer": "colwise", ...})'

# -- styles: each owns its check at expansion and the call it renders ------------------------


@dataclass(frozen=True)
class Style:
    """The expansion side of one parallel style; ``engine`` is the style it is in the one
    vocabulary (``macrogen.vocabulary``), which ``macrogen.runtime.parallelize`` applies."""

    name = ""
    needs: ClassVar[str | None] = None  # "Linear", "Embedding", "int"; None: anything
    comment = ""

    def check(self, value: cst.BaseExpression, attr: str, key_node: cst.CSTNode) -> None:
        what = describe(value)
        if self.needs == "int":
            if not may_be_int(value):
                raise MacroError(
                    f"divide needs an int attribute (like n_head), but self.{attr} is {what}"
                    f" (supported: {SUPPORTED})",
                    key_node,
                )
        elif self.needs is not None and callee_leaf(value) not in ACCEPTS.get(
            self.needs, (self.needs,)
        ):
            raise MacroError(
                f"{self.name} needs self.{attr} = nn.{self.needs}(...) in __init__, but it is"
                f" {what} (supported: {SUPPORTED})",
                key_node,
            )

    @property
    def engine(self) -> str | tuple[str, int]:
        return self.name


@dataclass(frozen=True)
class Colwise(Style):
    blocks: int = 1  # packed output blocks, each split on its own (3 for a fused qkv)
    sequence: bool = False  # "colwise from sequence": the input is a sequence slice, gathered
    needs = "Linear"

    @property
    def name(self) -> str:  # type: ignore[override]
        return "colwise from sequence" if self.sequence else "colwise"

    @property
    def comment(self) -> str:  # type: ignore[override]
        gathered = "input gathered along the sequence; " if self.sequence else ""
        if self.blocks > 1:
            return f"{gathered}output features split in each of {self.blocks} packed blocks; output sharded"
        return f"{gathered}output features split; its output is sharded on the last dim"

    @property
    def engine(self) -> str | tuple[str, int]:
        kind = "colwise_from_sequence" if self.sequence else "colwise"
        return (kind, self.blocks) if self.blocks > 1 else kind


@dataclass(frozen=True)
class Rowwise(Style):
    sequence: bool = False  # "rowwise to sequence": partial outputs reduce-scattered along T
    needs = "Linear"

    @property
    def name(self) -> str:  # type: ignore[override]
        return "rowwise to sequence" if self.sequence else "rowwise"

    @property
    def comment(self) -> str:  # type: ignore[override]
        if self.sequence:
            return "input features split; partial outputs reduce-scattered along the sequence"
        return "input features split; partial outputs all-reduced, bias added once"

    @property
    def engine(self) -> str | tuple[str, int]:
        return "rowwise_to_sequence" if self.sequence else "rowwise"


@dataclass(frozen=True)
class Vocab(Style):
    name = "vocab"
    needs = "Embedding"
    comment = "vocabulary split; other ranks' tokens masked, output all-reduced"


@dataclass(frozen=True)
class Divide(Style):
    name = "divide"
    needs = "int"
    comment = "divided by the tensor-parallel size: forward sees the local count"


@dataclass(frozen=True)
class Replicate(Style):
    name = "replicate"
    comment = "replicated (every rank holds all of it)"


# torch layers that run per token, so on a slice of the sequence ("sequence")
PER_TOKEN = ("LayerNorm", "RMSNorm", "Dropout")


@dataclass(frozen=True)
class Sequence(Style):
    name = "sequence"
    engine = "sequence_slice"
    comment = "runs on this rank's slice of the sequence; parameter gradients summed over ranks"

    def check(self, value: cst.BaseExpression, attr: str, key_node: cst.CSTNode) -> None:
        leaf, callee = callee_leaf(value), callee_name(value)
        torch_layer = callee is not None and callee.split(".")[0] in ("nn", "torch")
        if leaf is None or not leaf[:1].isupper() or (torch_layer and leaf not in PER_TOKEN):
            raise MacroError(
                f"sequence runs a layer norm or dropout on this rank's slice of the sequence, but"
                f" self.{attr} is {describe(value)} (supported: nn.LayerNorm, nn.RMSNorm,"
                " nn.Dropout or a per-token module class of yours; tensor-parallel layers take"
                " 'colwise from sequence' / 'rowwise to sequence')",
                key_node,
            )


@dataclass(frozen=True)
class FromSequence(Style):
    name = "from sequence"
    engine = "from_sequence"
    comment = "its input arrives as a sequence slice: gathered whole on entry"

    def check(self, value: cst.BaseExpression, attr: str, key_node: cst.CSTNode) -> None:
        leaf = callee_leaf(value)
        if leaf == "Linear":
            raise MacroError(
                f"'from sequence' gathers a module's input; self.{attr} is an nn.Linear:"
                " plan it 'colwise from sequence' (gathered inside the layer)",
                key_node,
            )
        if leaf is None or not leaf[:1].isupper():
            raise MacroError(
                f"'from sequence' needs a module (self.{attr} = Attention(...)), but self.{attr}"
                f" is {describe(value)}",
                key_node,
            )


STYLES: dict[str, Callable[[], Style]] = {
    "colwise": Colwise,
    "rowwise": Rowwise,
    "vocab": Vocab,
    "divide": Divide,
    "replicate": Replicate,
    "sequence": Sequence,
    "from sequence": FromSequence,
    "colwise from sequence": functools.partial(Colwise, sequence=True),
    "rowwise to sequence": functools.partial(Rowwise, sequence=True),
}
SUPPORTED = (
    "colwise and rowwise on nn.Linear, vocab on nn.Embedding, divide on an int attribute,"
    " replicate on anything"
)
CONTAINERS = ("ModuleDict", "ModuleList", "Sequential")  # plan paths go through them
# what a layer kind's styles take: HF's Conv1D (GPT-2) is an nn.Linear stored (in, out)
ACCEPTS = {"Linear": ("Linear", "Conv1D")}


@dataclass(frozen=True)
class Entry:
    key: str  # "mlp.fc", "transformer.h.*.attn.c_attn"
    style: Style

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.key.split("."))


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
    if not isinstance(plan, dict):  # {}: a model class whose decorated children it builds
        raise MacroError(  # are cut when its construction ends (after its re-initialization)
            "plan must be a dict of attribute name -> style, e.g."
            " {'fc': 'colwise', 'proj': 'rowwise'}",
            node,
        )
    classes = module_classes(ctx)
    entries = []
    for key, value in plan.items():
        key_node, style_node = _element(node, key)
        if not isinstance(key, str) or not all(_path_part(p) for p in key.split(".")):
            raise MacroError(
                "plan keys are attribute names or dotted paths ('mlp.fc', 'h.0.attn.qkv',"
                f" 'h.*.mlp.fc'), not {key!r}",
                key_node,
            )
        style = _style(value, style_node)
        path = tuple(key.split("."))
        if not path[-1].isidentifier() and not isinstance(
            style, (Colwise, Rowwise, Vocab, Sequence, FromSequence)
        ):
            raise MacroError(f"{style.name} names an attribute, not {path[-1]!r}", key_node)
        _check_fits(site.original, path, style, classes, key_node)
        entries.append(Entry(key, style))
    spec = Spec(site.original.name.value, tuple(entries), size)
    _check_sequence_sizes(site.original, spec)
    return spec


def _path_part(part: str) -> bool:
    return part.isidentifier() or part.isdigit() or part == "*"


def _style(value: object, node: cst.CSTNode) -> Style:
    if isinstance(value, (tuple, list)):  # ("colwise", 3): a fused output of 3 packed blocks
        if not (
            len(value) == 2
            and value[0] in ("colwise", "colwise from sequence")
            and isinstance(value[1], int)
            and not isinstance(value[1], bool)
            and value[1] >= 1
        ):
            raise MacroError(
                "a packed style is ('colwise', blocks): e.g. ('colwise', 3) for a fused q, k, v"
                f" projection whose forward chunks its output in 3; not {value!r}",
                node,
            )
        return Colwise(blocks=value[1], sequence=value[0] != "colwise")
    if value not in STYLES:
        raise MacroError(
            f"unknown style {value!r}{did_you_mean(str(value), list(STYLES))}"
            f" (styles: {', '.join(STYLES)})",
            node,
        )
    return STYLES[value]()


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """A tensor-parallel size must divide the world size."""
    size = arguments.get("size")
    if isinstance(size, int) and (size < 1 or env.world_size % size):
        return f"size={size} does not divide the world size {env.world_size}"
    return None


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    assert isinstance(site.node, cst.ClassDef) and isinstance(site.original, cst.ClassDef)
    entries = [(e.key, e.style.engine, e.style.comment) for e in spec.entries]
    decorator = ctx.import_from("macrogen.runtime", "tensor_parallel_class")
    plan = rendered_decorator(
        "tensor_parallel_class.py.j2",
        name=spec.name,
        size=spec.size,
        entries=entries,
        decorator=decorator,
    )
    used: dict[str, Import] = {}  # collectives forward calls (the vocab-parallel loss, gathers)

    def collective(function: str) -> str:
        if function not in used:
            used[function] = ctx.import_from("macrogen.runtime", function)
        return used[function]

    node_body, original_body = site.node.body.body, site.original.body.body
    if len(node_body) == len(original_body) and all(map(operator.is_, node_body, original_body)):
        # No site inside the class expanded: rewriting the user's nodes gives the errors
        # at the user's positions and the result at once.
        rewritten = rewrite_widths(site.original, spec, collective).body.body
        cls = site.node.with_changes(body=site.node.body.with_changes(body=rewritten))
    else:
        rewrite_widths(site.original, spec, lambda _: "_")  # errors at the user's positions
        cls = rewrite_widths(site.node, spec, collective)
    # the class object itself keeps its name and identity
    cls = decorated(ctx, cls, plan)
    # a class of the file that builds this one and re-initializes it is where the plans apply
    outer = tuple(
        (name, f"# macrogen: {name} builds tensor-parallel classes and re-initializes them:"
               f" their plans apply where its construction ends\n@{decorator}({name!r}, None, {{}})")
        for name in builders(spec.name, module_classes(ctx))
    )  # fmt: skip
    return Expanded([cls], decorates=outer)


# -- what __init__ assigns ------------------------------------------------------------


def _check_fits(
    cls: cst.ClassDef,
    path: tuple[str, ...],
    style: Style,
    classes: Mapping[str, cst.ClassDef],
    key_node: cst.CSTNode,
) -> None:
    """The attribute at ``path`` is assigned in ``__init__`` and its value fits ``style``.

    A path into a ModuleDict/ModuleList/Sequential, or into a class of another
    file, is checked at construction instead (the runtime resolves it).
    """
    value: cst.BaseExpression | None = None
    for i, attr in enumerate(path):
        assigned = init_assignments(cls, classes)
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
            if callee is not None and callee.rsplit(".", 1)[-1] in CONTAINERS:
                return  # keys and indices of a container: resolved at construction
            if callee is not None and callee.split(".")[0] in ("nn", "torch"):
                raise MacroError(
                    f"self.{attr} is {callee}(...), a torch layer: plan entries name whole layers"
                    f" ({'.'.join(path[: i + 1])!r}), or paths through submodules of your classes",
                    key_node,
                )
            inner = constructed_class(value, classes)
            if inner is None:  # built by code we can't see: checked at construction instead
                return
            cls = inner
    assert value is not None
    style.check(value, path[-1], key_node)


def _element(plan: cst.BaseExpression, key: object) -> tuple[cst.CSTNode, cst.CSTNode]:
    """The key and value nodes of ``key`` in a literal plan dict (else the whole plan)."""
    if isinstance(plan, cst.Dict):
        for el in reversed(plan.elements):  # the last one wins, as in the dict
            if isinstance(el, cst.DictElement) and _literal(el.key) == key:
                return el.key, el.value
    return plan, plan


def _literal(node: cst.BaseExpression) -> object:
    if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
        return evaluated(node)
    return None


def _check_sequence_sizes(cls: cst.ClassDef, spec: Spec) -> None:
    """An input fed to a 'colwise from sequence' layer is a slice of the sequence: sizes read
    from it in ``forward`` (``B, T, C = x.size()``) are local, the layer's output is whole."""
    gathered = {
        e.key
        for e in spec.entries
        if len(e.path) == 1 and isinstance(e.style, Colwise) and e.style.sequence
    }
    forward = next(
        (s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"),
        None,
    )
    if not gathered or forward is None:
        return
    params = [p.name.value for p in (*forward.params.posonly_params, *forward.params.params)]
    if len(params) < 2:
        return
    sliced = feeding(forward, params[0], set(params[1:]), gathered)

    for node in find(forward, cst.Attribute):
        if (
            node.attr.value in ("size", "shape")
            and isinstance(node.value, cst.Name)
            and node.value.value in sliced
        ):
            raise MacroError(
                f"{node.value.value} reaches a 'colwise from sequence' layer, so it is this"
                f" rank's slice of the sequence: its .{node.attr.value} gives T / tp where"
                " that layer's output has the whole sequence; plan the layer 'colwise' and this"
                " module 'from sequence' in its parent (its input is then gathered on entry)",
                node,
            )


def rewrite_widths(cls: cst.ClassDef, spec: Spec, collective: Callable[[str], str]) -> cst.ClassDef:
    """The class with its ``forward``'s full-width arithmetic made local, its vocab-sharded
    loss vocab-parallel and its returned colwise outputs gathered (tensor_parallel_width)."""
    mine = {e.key for e in spec.entries if len(e.path) == 1}  # forward sees its own layers
    colwise = {e.key for e in spec.entries if e.key in mine and isinstance(e.style, Colwise)}
    rowwise = {e.key for e in spec.entries if e.key in mine and isinstance(e.style, Rowwise)}
    divided = {e.key for e in spec.entries if e.key in mine and isinstance(e.style, Divide)}
    packed = {
        e.key
        for e in spec.entries
        if e.key in colwise and isinstance(e.style, Colwise) and e.style.blocks > 1
    }
    body = []
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            stmt = rewrite_forward(stmt, colwise, rowwise, divided, packed, collective)
        body.append(stmt)
    return cls.with_changes(body=cls.body.with_changes(body=body))
