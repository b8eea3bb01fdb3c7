"""The head of an @tile function: sizes bound from shapes, and the ranges its loops run over.

    M, N = x.shape                  # sizes: NAME, ... = t.shape | NAME = t.shape[d]
    for i in range(M):              # range(stop) | range(start, stop) | range(start, stop, step)
        for j in range(1, N - 1):   #   bound: size | x.shape[d] | x.size(d) | len(x) | an int
                                    #   parameter, each +- int; an int; a define()d int

A mixin of the analysis (analysis.py), which owns the tables it fills.
"""

from __future__ import annotations

import libcst as cst

from macrogen.macro import MacroError
from macrogen.macros.tile.code import name, plus
from macrogen.macros.tile.expressions import ExpressionReader, code_of, contains
from macrogen.macros.tile.ir import Bound, Index, Loop, Size
from macrogen.macros.tile.syntax import is_shape, is_shape_subscript, shape_read


class LoopReader(ExpressionReader):
    """Reads size bindings and ``range(...)`` loops into ``Size`` and ``Loop``."""

    def _fresh(self, hint: str) -> str:
        """A local name nothing in the function uses."""
        raise NotImplementedError

    def _unsupported(self, node: cst.CSTNode) -> str:
        """Why a statement is not part of the subset."""
        raise NotImplementedError

    def _size_binding(self, stmt: cst.BaseStatement) -> None:
        usage = (
            "before the loop nest only sizes may be bound (M, N = x.shape or N = x.shape[1]);"
            " compute other values inside the loops"
        )
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
            raise MacroError(self._unsupported(stmt) or usage, stmt)
        assign = stmt.body[0]
        if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
            raise MacroError(self._unsupported(assign) or usage, assign)
        target, value = assign.targets[0].target, assign.value
        if isinstance(target, (cst.Tuple, cst.List)) and is_shape(value):
            tensor = self._tensor_param(value.value)
            names = []
            for el in target.elements:
                if not isinstance(el.value, cst.Name) or isinstance(el, cst.StarredElement):
                    raise MacroError("unpack .shape into plain names: M, N = x.shape", el)
                names.append(el.value)
            self._use_tensor(tensor, len(names), value)
            for dim, name in enumerate(names):
                if name.value != "_":
                    self._bind_size(name, tensor, dim)
            return
        if (
            isinstance(target, cst.Name)
            and isinstance(value, cst.Subscript)
            and is_shape(value.value)
            and len(value.slice) == 1
            and isinstance(value.slice[0].slice, cst.Index)
            and isinstance(value.slice[0].slice.value, cst.Integer)
        ):
            tensor = self._tensor_param(value.value.value)
            self._bind_size(target, tensor, int(value.slice[0].slice.value.value))
            return
        raise MacroError(usage, assign)

    def _tensor_param(self, node: cst.BaseExpression) -> str:
        if not isinstance(node, cst.Name) or node.value not in self.params:
            raise MacroError("sizes come from a tensor parameter's .shape", node)
        return node.value

    def _bind_size(self, name: cst.Name, tensor: str, dim: int) -> None:
        if name.value in self.params or name.value in self.sizes:
            raise MacroError(f"{name.value!r} is already bound; give each size its own name", name)
        self.sizes[name.value] = Size(name.value, tensor, dim)

    def _loop(self, node: cst.For) -> Loop:
        usage = (
            "@tile loops are for VAR in range(stop), range(start, stop) or range(start, stop, step)"
        )
        if node.asynchronous is not None:
            raise MacroError("async for is not supported in @tile", node)
        if node.orelse is not None:
            raise MacroError("for ... else is not supported in @tile", node.orelse)
        if not isinstance(node.target, cst.Name):
            raise MacroError(usage, node.target)
        var = node.target.value
        if var in self.params or var in self.sizes:
            raise MacroError(f"loop variable {var!r} is already bound; use a new name", node.target)
        it = node.iter
        if not (
            isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range"
        ):
            raise MacroError(usage, it)
        if not 1 <= len(it.args) <= 3 or any(a.keyword or a.star for a in it.args):
            raise MacroError(usage, it)
        bounds = [self._bound(a.value) for a in it.args[:2]]
        start = bounds[0] if len(bounds) == 2 else Bound(None, 0)
        step = self._step(it.args[2].value) if len(it.args) == 3 else 1
        self.loop_vars.add(var)
        self.loops[var] = Loop(var, start, bounds[-1], step)
        return self.loops[var]

    def _step(self, node: cst.BaseExpression) -> int:
        """A positive integer constant: a literal or a define()d int."""
        value: object = None
        if isinstance(node, cst.Integer):
            value = int(node.value)
        elif isinstance(node, cst.Name):
            value = self.constants.get(node.value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MacroError(
                "a range step in @tile is a positive integer constant (a literal or a define()d"
                " int): tiles are laid out at compile time; for a reversed loop index n - 1 - i",
                node,
            )
        return value

    def _bound(self, node: cst.BaseExpression) -> Bound:
        usage = (
            "a loop bound is a size (N from .shape, x.shape[d], x.size(d), len(x)), an integer"
            " parameter, either +- an integer, or an integer"
        )
        if isinstance(node, cst.Integer):
            return Bound(None, int(node.value))
        if isinstance(node, cst.Name) and isinstance(self.constants.get(node.value), int):
            return Bound(None, self.constants[node.value])
        size = self._size_of(node)
        if size is not None:
            return Bound(size, 0)
        if isinstance(node, cst.BinaryOperation) and isinstance(
            node.operator, (cst.Add, cst.Subtract)
        ):
            left, const = node.left, node.right
            if isinstance(left, cst.Integer) and isinstance(node.operator, cst.Add):
                left, const = const, left
            size = self._size_of(left)
            if size is not None and isinstance(const, cst.Integer):
                sign = -1 if isinstance(node.operator, cst.Subtract) else 1
                return Bound(size, sign * int(const.value))
        if isinstance(node, cst.Name):
            raise MacroError(f"{node.value!r} is not a size or a parameter; {usage}", node)
        if contains(node, cst.Subscript) and not is_shape_subscript(node):
            raise MacroError(f"a loop bound may not depend on tensor values; {usage}", node)
        raise MacroError(usage, node)

    def _size_of(self, node: cst.BaseExpression) -> str | None:
        """The name of the size ``node`` reads: a bound size, an integer parameter,
        ``x.shape[d]``, ``x.size(d)`` or ``len(x)`` (named here), else None."""
        if isinstance(node, cst.Name):
            if node.value in self.sizes:
                return node.value
            if node.value in self.params and node.value not in self.ndim:
                if node.value not in self.scalars:
                    self.scalars.append(node.value)  # a scalar argument: the kernel takes it
                return node.value
            return None
        tensor_dim = shape_read(node)
        if tensor_dim is None:
            return None
        tensor_node, dim = tensor_dim
        tensor = self._tensor_param(tensor_node)
        for size in self.sizes.values():
            if (size.tensor, size.dim) == (tensor, dim):
                return size.name
        name = self._fresh(f"{tensor}_size{dim}")
        self.sizes[name] = Size(name, tensor, dim)
        return name

    def _index_in_range(
        self, subscript: cst.Subscript, dim: int, index: Index, node: cst.CSTNode
    ) -> None:
        """Refuse ``x[i - 1]`` where ``i`` starts at 0, and ``x[i + 1]`` where ``i`` runs to
        ``x.shape[0]``: the first reads ``x[-1]``, which Python counts from the end of the
        dimension and the tiled versions cannot; the second makes the loop raise IndexError.
        Ranges known only at run time are checked there (checks.py)."""
        if index.var is None:
            return
        loop = self.loops[index.var]
        tensor = code_of(subscript.value)
        if loop.start.size is None and loop.start.offset + index.offset < 0:
            first = loop.start.offset
            raise MacroError(
                f"{code_of(subscript)} reads index {first + index.offset} of dimension {dim} of"
                f" {tensor} at {index.var} = {first}: Python counts a negative index from the end"
                f" of the dimension, @tile does not wrap it; start the loop at {-index.offset}"
                " or index inside the range",
                node,
            )
        size = self.sizes.get(loop.stop.size or "")
        if (
            loop.step == 1
            and size is not None
            and (size.tensor, size.dim) == (tensor, dim)
            and loop.stop.offset + index.offset >= 1
        ):
            last = plus(name(size.name), loop.stop.offset - 1).text
            raise MacroError(
                f"{code_of(subscript)} reads past the end of dimension {dim} of {tensor} at the"
                f" last {index.var} ({index.var} = {last}): the loop raises IndexError there; stop"
                f" the loop {loop.stop.offset + index.offset} earlier",
                node,
            )
