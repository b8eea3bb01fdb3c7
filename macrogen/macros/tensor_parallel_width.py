"""Width arithmetic in a tensor-parallel class's ``forward``: full width -> this rank's width.

nanoGPT's attention takes its width from the input and reshapes with it::

    B, T, C = x.size()                                            # C: the full width
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)            # sharded: C / tp each
    k = k.view(B, T, self.n_head, C // self.n_head)               # n_head divided
    y = y.transpose(1, 2).contiguous().view(B, T, C)              # y sharded

Under tensor parallelism ``x`` is full but ``k`` and ``y`` hold this rank's
share, so each such use of ``C`` becomes ``C // self.tp_size`` (``tp_size``:
1 serially and until the shards are cut). A use is rewritten where it is
unambiguous:

- an argument of ``view``/``reshape``/``split``/``unflatten``/``expand`` of a
  tensor computed from a colwise layer's output: local;
- in arithmetic with a divided attribute (``C // self.n_head``): local;
- an argument of those methods on a tensor that is not sharded (``x.view(B, T,
  C)``): full, unchanged.

Any other use (``torch.zeros(B, T, C)``, ``assert C == ...``) is an error at
expansion with its position and the fix, never a run-time shape error.
Tensors are followed by name through ``forward``'s assignments: a name is
sharded once assigned from a colwise layer's call or from a sharded name, and
full again once assigned through a rowwise layer.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst

from macrogen.macro import MacroError, Visitor, dotted, find, leaf, walk
from macrogen.macros.tensor_parallel_outputs import CROSS_ENTROPY, GATHER, colwise_outputs

SHAPE_METHODS = ("view", "reshape", "split", "unflatten", "expand")
CROSS_ENTROPY_OPTIONS = ("ignore_index", "reduction")
COMPREHENSIONS = (cst.GeneratorExp, cst.ListComp, cst.SetComp, cst.DictComp)


def rewrite_forward(
    forward: cst.FunctionDef,
    colwise: set[str],
    rowwise: set[str],
    divided: set[str],
    packed: set[str],
    runtime: Callable[[str], str],
) -> cst.FunctionDef:
    """``forward`` with full-width names rewritten to the local width where they meet a shard,
    ``F.cross_entropy`` of vocabulary-sharded logits made vocab-parallel, and colwise outputs
    that forward returns gathered (tensor_parallel_outputs).

    ``runtime(name)`` gives the name generated code calls for a function of
    ``macrogen.runtime.collectives`` (imported on use).
    """
    params = [p.name.value for p in (*forward.params.posonly_params, *forward.params.params)]
    if len(params) < 2 or not colwise:
        return forward
    me = params[0]
    inputs = feeding(forward, me, set(params[1:]), colwise)  # whose last dim is the width
    full = _full_width_names(forward, me, inputs)
    wrap = colwise_outputs(forward, me, colwise, packed)
    if (
        not full
        and not wrap
        and not any(dotted(c.func) in CROSS_ENTROPY for c in find(forward, cst.Call))
    ):
        return forward  # nothing to rewrite nor to report: spare the transform's rebuild
    rewritten = forward.visit(_Widths(me, full, colwise, rowwise, divided, wrap, runtime))
    assert isinstance(rewritten, cst.FunctionDef)
    return rewritten


def feeding(forward: cst.FunctionDef, me: str, inputs: set[str], colwise: set[str]) -> set[str]:
    """The inputs passed to a colwise layer (``self.c_attn(x)``): their last dim is the width
    the layer splits; other inputs (token ids) have no width to rewrite."""
    found: set[str] = set()
    for call in find(forward, cst.Call):
        func = call.func
        if (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value == me
            and func.attr.value in colwise
        ):
            for arg in call.args:
                found.update(_names(arg.value) & inputs)
    return found


def _full_width_names(forward: cst.FunctionDef, me: str, inputs: set[str]) -> dict[str, str]:
    """Names bound to an input's last dimension: ``B, T, C = x.size()``, ``C = x.shape[-1]``."""
    found: dict[str, str] = {}

    for node in find(forward, cst.Assign):
        if len(node.targets) != 1:
            continue
        target, value = node.targets[0].target, node.value
        source = _whole_shape_of(value)
        if source in inputs and isinstance(target, (cst.Tuple, cst.List)) and target.elements:
            last = target.elements[-1].value
            if isinstance(last, cst.Name):
                found[last.value] = source
        elif _last_dim_of(value) in inputs and isinstance(target, cst.Name):
            found[target.value] = _last_dim_of(value)  # type: ignore[assignment]
    return found


def _whole_shape_of(value: cst.BaseExpression) -> str | None:
    """``x`` for ``x.size()`` or ``x.shape``."""
    if isinstance(value, cst.Call) and not value.args:
        value = value.func
        if isinstance(value, cst.Attribute) and value.attr.value == "size":
            return value.value.value if isinstance(value.value, cst.Name) else None
        return None
    if isinstance(value, cst.Attribute) and value.attr.value == "shape":
        return value.value.value if isinstance(value.value, cst.Name) else None
    return None


def _last_dim_of(value: cst.BaseExpression) -> str | None:
    """``x`` for ``x.size(-1)`` or ``x.shape[-1]``."""
    if (
        isinstance(value, cst.Call)
        and len(value.args) == 1
        and _is_minus_one(value.args[0].value)
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "size"
        and isinstance(value.func.value, cst.Name)
    ):
        return value.func.value.value
    if (
        isinstance(value, cst.Subscript)
        and len(value.slice) == 1
        and isinstance(value.slice[0].slice, cst.Index)
        and _is_minus_one(value.slice[0].slice.value)
        and isinstance(value.value, cst.Attribute)
        and value.value.attr.value == "shape"
        and isinstance(value.value.value, cst.Name)
    ):
        return value.value.value.value
    return None


def _is_minus_one(node: cst.BaseExpression) -> bool:
    return (
        isinstance(node, cst.UnaryOperation)
        and isinstance(node.operator, cst.Minus)
        and isinstance(node.expression, cst.Integer)
        and node.expression.value == "1"
    )


class _Widths(cst.CSTTransformer):
    def __init__(
        self,
        me: str,
        full: dict[str, str],
        colwise: set[str],
        rowwise: set[str],
        divided: set[str],
        wrap: dict[int, tuple[str, str]],
        runtime: Callable[[str], str],
    ):
        super().__init__()
        self.me, self.full = me, full
        self.colwise, self.rowwise, self.divided = colwise, rowwise, divided
        self.wrap = wrap  # id(colwise call) -> (runtime function, layer): returned outputs
        self.runtime = runtime
        self.sharded: dict[str, str] = {}  # name -> the colwise layer its tensor comes from
        self.stack: list[cst.CSTNode] = []

    # -- following tensors by name -----------------------------------------------------------
    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, COMPREHENSIONS):  # (t.view(...) for t in (q, k, v)): t is sharded
            comp = node.for_in
            layer = self._shard_source(comp.iter)
            if layer is not None:
                self.sharded.update(dict.fromkeys(_names(comp.target), layer))
        self.stack.append(node)
        return not leaf(type(node))  # whitespace, commas, operators: nothing inside to rewrite

    def on_leave(  # type: ignore[override]
        self, original: cst.CSTNode, updated: cst.CSTNode
    ) -> cst.CSTNode:
        self.stack.pop()
        if isinstance(original, cst.Assign):
            targets = set().union(*(_names(t.target) for t in original.targets))
            layer = self._shard_source(original.value)
            for name in targets:
                self.sharded.pop(name, None)
                if layer is not None and not self._calls(original.value, self.rowwise):
                    self.sharded[name] = layer
        if (
            isinstance(original, cst.Name)
            and isinstance(updated, cst.Name)
            and original.value in self.full
        ):
            return self._use(original, updated)
        if (
            isinstance(original, cst.Call)
            and isinstance(updated, cst.Call)
            and dotted(original.func) in CROSS_ENTROPY
        ):
            return self._cross_entropy(original, updated)
        if id(original) in self.wrap and isinstance(updated, cst.Call):
            function, layer = self.wrap[id(original)]
            return cst.Call(
                cst.Name(self.runtime(function)),
                [
                    cst.Arg(updated, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                    cst.Arg(self._group(layer)),
                ],
            )
        return updated

    def _group(self, layer: str) -> cst.BaseExpression:
        """The tensor group the decorated module carries (``tp_group``: None serially)."""
        return cst.parse_expression(f"{self.me}.tp_group")

    def _cross_entropy(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """``F.cross_entropy(logits, target)`` of vocabulary-sharded logits: vocab-parallel."""
        if not original.args:
            return updated
        layer = self._shard_source(original.args[0].value)
        if layer is None:
            return updated
        positional = [a for a in original.args if a.keyword is None]
        options = [a for a in original.args if a.keyword is not None]
        bad = [
            a
            for a in options
            if a.keyword is not None and a.keyword.value not in CROSS_ENTROPY_OPTIONS
        ]
        if len(positional) != 2 or bad or any(a.star for a in original.args):
            raise MacroError(
                f"cross_entropy of self.{layer}'s output, whose vocabulary is split over the"
                " tensor-parallel ranks, becomes a vocab-parallel cross-entropy that takes"
                " (logits, target) and ignore_index=, reduction=; write the call in that form",
                bad[0] if bad else original,
            )
        group = self._group(layer)
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        args = list(updated.args)
        last = len(args) == 2
        args[1] = args[1].with_changes(comma=comma)
        args.insert(2, cst.Arg(group, comma=updated.args[1].comma if last else comma))
        return updated.with_changes(
            func=cst.Name(self.runtime("vocab_parallel_cross_entropy")), args=args
        )

    def _self_attr(self, node: cst.CSTNode, names: set[str]) -> bool:
        return (
            isinstance(node, cst.Attribute)
            and isinstance(node.value, cst.Name)
            and node.value.value == self.me
            and node.attr.value in names
        )

    def _calls(self, node: cst.CSTNode, layers: set[str]) -> bool:
        return any(self._self_attr(call.func, layers) for call in find(node, cst.Call))

    def _shard_source(self, node: cst.CSTNode) -> str | None:
        """The colwise layer whose (sharded) output ``node`` is computed from, if any."""
        found: str | None = next(
            (
                call.func.attr.value
                for call in find(node, cst.Call)
                if self._self_attr(call.func, self.colwise)
                and self.wrap.get(id(call), ("",))[0] != GATHER  # gathered: whole again
            ),
            None,
        )
        if found is None:
            found = next((self.sharded[n] for n in _names(node) if n in self.sharded), None)
        return found

    def _mentions_shard(self, node: cst.CSTNode) -> bool:
        return self._shard_source(node) is not None

    # -- one use of a full-width name --------------------------------------------------------
    def _use(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        child: cst.CSTNode = original
        for parent in reversed(self.stack):
            if isinstance(parent, (cst.AssignTarget, cst.CompFor)) and child is not getattr(
                parent, "iter", None
            ):
                return updated  # a binding, not a use
            if isinstance(parent, cst.BinaryOperation) and self._has_divided(parent):
                return self._local(original, updated)
            if (
                isinstance(parent, cst.Call)
                and isinstance(parent.func, cst.Attribute)
                and parent.func.attr.value in SHAPE_METHODS
                and child is not parent.func
            ):
                if self._mentions_shard(parent.func.value):
                    return self._local(original, updated)
                return updated  # the shape of a full tensor: the full width is right
            if isinstance(parent, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                break
            child = parent
        source = self.full[original.value]
        raise MacroError(
            f"{original.value} is the full width of {source} (its last size), but under tensor"
            f" parallelism this rank holds"
            f" {original.value} // tp_size of a sharded tensor, and macrogen can't tell which is"
            f" meant here (it rewrites view/reshape/split of a sharded tensor and arithmetic"
            f" with a divided attribute): write {original.value} // self.tp_size for this"
            f" rank's width, or take the width from the tensor (t.size(-1))",
            original,
        )

    def _has_divided(self, op: cst.BinaryOperation) -> bool:
        for side in (op.left, op.right):
            if self._self_attr(side, self.divided):
                return True
            if isinstance(side, cst.BinaryOperation) and not side.lpar and self._has_divided(side):
                return True
        return False

    def _local(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        """``C // self.tp_size``, parenthesized where its parent's precedence needs it."""
        parent = self.stack[-1] if self.stack else None
        local = cst.BinaryOperation(
            left=updated,
            operator=cst.FloorDivide(),
            right=cst.Attribute(cst.Name(self.me), cst.Name("tp_size")),
        )
        left_of_division = (
            isinstance(parent, cst.BinaryOperation)
            and isinstance(parent.operator, cst.FloorDivide)
            and parent.left is original
        )
        if isinstance(parent, cst.BinaryOperation) and not left_of_division:
            return local.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return local


def _names(node: cst.CSTNode, loads: bool = False) -> set[str]:
    """Plain names in ``node`` (attribute names excluded: ``self.x`` gives ``self``)."""
    found: set[str] = set()

    class _Find(Visitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            walk(n.value, self)
            return False

    walk(node, _Find())
    return found
