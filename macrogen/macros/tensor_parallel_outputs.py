"""Where a colwise layer's output goes in a tensor-parallel class's ``forward``.

A colwise layer's output is sharded on its last dim (a vocabulary-split LM head:
this rank's slice of the logits). nanoGPT's forward uses its head both ways::

    if targets is not None:
        logits = self.lm_head(x)                          # into the loss: stays sharded
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    else:
        logits = self.lm_head(x[:, [-1], :])              # out to generate(): gathered
        loss = None
    return logits, loss

Each assignment ``name = self.<colwise>(...)`` is followed through the
branches of ``forward`` (if/else, loops, try, with) to the uses it reaches:

- a ``return`` (the name itself, or an element of a returned tuple), never the
  substituted cross-entropy: the call is wrapped in ``gather_last_dim`` (torch's
  ``ColwiseParallel`` default output, ``Replicate()``), so every rank returns the
  serial logits;
- the substituted cross-entropy and a ``return``: it becomes a ``DTensor``
  sharded on the last dim (``as_sharded_dtensor``, no communication): the loss
  takes its local part, and whoever uses the returned logits sees the serial
  tensor (``.full_tensor()``) or a loud mixed-tensor error, never a slice;
- the loss alone: plain and sharded, as before.

A returned colwise call (``return self.head(x)``) is gathered too. A colwise
output that reaches a ``return`` any other way (computed on first, ``return
logits.softmax(-1)``; a packed qkv layer) can't be decided here: an error
naming the layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from macrogen.macro import MacroError, Visitor, dotted, find, walk

CROSS_ENTROPY = (
    "F.cross_entropy",
    "torch.nn.functional.cross_entropy",
    "nn.functional.cross_entropy",
)
GATHER = "gather_last_dim"  # returned, not into the loss
DTENSOR = "as_sharded_dtensor"  # into the loss and returned

# name -> the outputs it may hold: (def index, derived: computed on since the layer's call)
State = dict[str, frozenset[tuple[int, bool]]]


@dataclass
class _Output:
    call: cst.Call  # self.<layer>(...)
    layer: str
    loss: bool = False  # reaches the substituted cross-entropy
    returned: bool = False  # reaches a return as it is


def colwise_outputs(
    forward: cst.FunctionDef, me: str, colwise: set[str], packed: set[str]
) -> dict[int, tuple[str, str]]:
    """``id(call)`` of each colwise call to wrap -> (runtime function, layer)."""
    flow = _Flow(me, colwise)
    flow.block(forward.body.body, {})
    wrap = {}
    for out in flow.outputs:
        if not out.returned:
            continue
        if out.layer in packed:
            raise MacroError(
                f"self.{out.layer}'s output (packed blocks, each split over the tensor-parallel"
                " ranks) is returned from forward: macrogen gathers a returned colwise output"
                " only for an unpacked layer; split it (q, k, v = ...) and return what follows",
                out.call,
            )
        wrap[id(out.call)] = (DTENSOR if out.loss else GATHER, out.layer)
    return wrap


class _Flow:
    """A walk of forward's statements carrying which colwise outputs each name may hold."""

    def __init__(self, me: str, colwise: set[str]):
        self.me, self.colwise = me, colwise
        self.outputs: list[_Output] = []

    # -- statements ----------------------------------------------------------------------
    def block(self, body: Iterable[cst.CSTNode], state: State | None) -> State | None:
        """The state after ``body`` (None: it always returns)."""
        for stmt in body:
            if state is None:
                return None
            state = self.statement(stmt, state)
        return state

    def statement(self, stmt: cst.CSTNode, state: State) -> State | None:
        if isinstance(stmt, cst.SimpleStatementLine):
            out: State | None = state
            for small in stmt.body:
                if out is None:
                    break
                out = self.small(small, out)
            return out
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            return state  # their own scope
        if isinstance(stmt, cst.If):
            self.uses(stmt.test, state)
            then = self.block(stmt.body.body, dict(state))
            orelse = stmt.orelse
            if isinstance(orelse, cst.If):
                other = self.statement(orelse, dict(state))
            elif orelse is not None:
                other = self.block(orelse.body.body, dict(state))
            else:
                other = dict(state)
            return _merge(then, other)
        if isinstance(stmt, (cst.For, cst.While)):
            self.uses(stmt.iter if isinstance(stmt, cst.For) else stmt.test, state)
            if isinstance(stmt, cst.For):
                self.bind(stmt.target, frozenset(), state)
            entry: State | None = state
            for _ in range(2):  # a second pass sees what the first assigned
                entry = _merge(entry, self.block(stmt.body.body, dict(entry or {})))
            if stmt.orelse is not None:
                return _merge(entry, self.block(stmt.orelse.body.body, dict(entry or {})))
            return entry
        if isinstance(stmt, cst.With):
            for item in stmt.items:
                self.uses(item.item, state)
            return self.block(stmt.body.body, state)
        if isinstance(stmt, (cst.Try, cst.TryStar)):
            after = self.block(stmt.body.body, dict(state))
            merged = _merge(state, after)
            for handler in stmt.handlers:
                merged = _merge(merged, self.block(handler.body.body, dict(merged or {})))
            if stmt.orelse is not None and after is not None:
                merged = _merge(merged, self.block(stmt.orelse.body.body, dict(after)))
            if stmt.finalbody is not None:
                return self.block(stmt.finalbody.body.body, merged)
            return merged
        self.uses(stmt, state)  # anything else (match): its uses, no bindings followed
        return state

    def small(self, stmt: cst.BaseSmallStatement, state: State) -> State | None:
        if isinstance(stmt, cst.Return):
            if stmt.value is not None:
                self.uses(stmt.value, state)
                self.returned(stmt.value, state)
            return None
        if isinstance(stmt, cst.Assign):
            self.uses(stmt.value, state)
            if (
                len(stmt.targets) == 1
                and isinstance(stmt.targets[0].target, cst.Name)
                and self._colwise_call(stmt.value)
            ):
                assert isinstance(stmt.value, cst.Call)
                held = frozenset({(self._output(stmt.value), False)})
            else:
                held = self.sources(stmt.value, state)
            for target in stmt.targets:
                self.bind(target.target, held, state)
            return state
        if isinstance(stmt, (cst.AnnAssign, cst.AugAssign)):
            if stmt.value is not None:
                self.uses(stmt.value, state)
                held = self.sources(stmt.value, state)
                if isinstance(stmt, cst.AugAssign):
                    held |= self.sources(stmt.target, state)
                self.bind(stmt.target, held, state)
            return state
        self.uses(stmt, state)
        return state

    # -- expressions ---------------------------------------------------------------------
    def bind(
        self, target: cst.BaseExpression, held: frozenset[tuple[int, bool]], state: State
    ) -> None:
        derived = frozenset((i, True) for i, _ in held)
        whole = isinstance(target, cst.Name)
        for node in find(target, cst.Name):
            if held:
                state[node.value] = held if whole else derived
            else:
                state.pop(node.value, None)

    def uses(self, node: cst.CSTNode, state: State) -> None:
        """Marks the outputs that reach a cross-entropy (the vocab-parallel loss)."""
        for call in find(node, cst.Call):
            if dotted(call.func) in CROSS_ENTROPY and call.args:
                for i, _ in self.sources(call.args[0].value, state):
                    self.outputs[i].loss = True

    def returned(self, value: cst.BaseExpression, state: State) -> None:
        parts = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        for part in parts:
            if isinstance(part, cst.Name) and part.value in state:
                held = state[part.value]
            elif self._colwise_call(part):
                assert isinstance(part, cst.Call)
                held = frozenset({(self._output(part), False)})
            else:
                held = self.sources(part, state)
            for i, derived in held:
                out = self.outputs[i]
                if derived:
                    raise MacroError(
                        f"self.{out.layer}'s output is split over the tensor-parallel ranks"
                        " (its last dim), and forward returns something computed from it:"
                        " macrogen gathers a colwise output where forward returns it as the"
                        f" layer gave it (logits = self.{out.layer}(x); ...; return logits);"
                        " return that, or plan the layer 'rowwise' for whole outputs",
                        part,
                    )
                out.returned = True

    def sources(self, node: cst.CSTNode, state: State) -> frozenset[tuple[int, bool]]:
        """The colwise outputs ``node`` is computed from (derived), outside a loss and calls of
        self's other layers (a rowwise layer gives whole outputs)."""
        found: set[tuple[int, bool]] = set()
        flow = self

        class _Find(Visitor):
            def visit_Call(self, call: cst.Call) -> bool:
                if flow._colwise_call(call):
                    found.add((flow._output(call), True))
                    return True
                # a loss; a rowwise layer's whole output; another submodule of ours, which
                # takes what it is given (its own plan, or the user's model, says how)
                return dotted(call.func) not in CROSS_ENTROPY and not flow._self_call(call)

            def visit_Name(self, name: cst.Name) -> None:
                found.update((i, True) for i, _ in state.get(name.value, ()))

            def visit_Attribute(self, node: cst.Attribute) -> bool:
                walk(node.value, self)
                return False

        walk(node, _Find())
        return frozenset(found)

    def _self_call(self, node: cst.CSTNode, layers: set[str] | None = None) -> bool:
        """``self.<layer>(...)`` (any attribute of self without ``layers``)."""
        func = node.func if isinstance(node, cst.Call) else None
        return (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value == self.me
            and (layers is None or func.attr.value in layers)
        )

    def _colwise_call(self, node: cst.CSTNode) -> bool:
        return self._self_call(node, self.colwise)

    def _output(self, call: cst.Call) -> int:
        for i, out in enumerate(self.outputs):
            if out.call is call:
                return i
        assert isinstance(call.func, cst.Attribute)
        self.outputs.append(_Output(call, call.func.attr.value))
        return len(self.outputs) - 1


def _merge(a: State | None, b: State | None) -> State | None:
    if a is None or b is None:
        return b if a is None else a
    return {k: a.get(k, frozenset()) | b.get(k, frozenset()) for k in a.keys() | b.keys()}
