"""The attention nest's torch paths and its autograd function (a part of flash_output.py).

``_attention_torch`` is the CPU path: eager softmax attention on the part of the
tensors the nest reads (templates/tile_flash_torch.py.j2). ``_attention_backward_torch``
computes dq, dk and dv the same way on any device, and ``_attention_autograd`` is the
``autograd.Function`` the function routes to when a tensor argument requires grad
(templates/tile_flash_autograd.py.j2): the kernels on CUDA, the torch paths elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from macrogen.macro import render
from macrogen.macros.tile.code import Code, binary, method, name, parse
from macrogen.macros.tile.flash import Flash
from macrogen.macros.tile.ir import Const, Load, Loop, Nest, Store
from macrogen.macros.tile.logit import derivative, linear_scale, renamed
from macrogen.macros.tile.names import Namer, Names
from macrogen.macros.tile.printer import TorchPrinter

ROLES = ("q", "kk", "v", "out")


class TorchOutput:
    """The torch-side renderers of FlashOutput, which holds the names they share."""

    f: Flash
    nest: Nest
    names: Names
    mods: Mapping[str, str]
    fns: dict[str, str]
    common: dict[str, object]
    tensor: dict[str, str]  # role -> the tensor parameter playing it
    access: dict[str, Load | Store]
    walk: dict[str, tuple[str, str]]  # role -> the variables along its rows and columns
    loops: list[Loop]
    grads: list[dict[str, object]]

    def _shared_params(self) -> dict[str, object]:
        raise NotImplementedError

    def _offset(self, printer: TorchPrinter) -> Code | None:
        raise NotImplementedError

    def _shifted(self, code: Code, sign: int, extra: int, offset: Code) -> Code:
        raise NotImplementedError

    def _batch_count(self) -> Code:
        raise NotImplementedError

    # -- the torch backward and the autograd function ------------------------------------------
    def autograd(self) -> str:
        f, torch = self.f, self.mods["torch"]
        n = fresh_locals(
            self.names.fork().namer,
            "dout s z p dp ds q_view kk_view v_view o_view do_view ctx lse d_out",
        )
        canonical = {role: self._canonical(role) for role in ROLES}
        views = self._views(
            n, [("o_view", "out", self.tensor["out"]), ("do_view", "out", n["dout"])]
        )
        printer = TorchPrinter({}, torch)
        logit, causal = self._softmax_input(n, printer)
        slope = derivative(f.logit, f.score)
        values = {
            "q": binary("@", name(n["ds"]), name(n["kk_view"])),
            "kk": binary("@", Code(f"{n['ds']}.mT"), name(n["q_view"])),
            "v": binary("@", Code(f"{n['p']}.mT"), name(n["do_view"])),
        }
        grads = []
        for g in self.grads:
            role = str(g["role"])
            value: Code = grouped(values[role])
            if g["shared"]:
                value = method(value, "sum", "0")
            order = self._order(role)
            perm = [canonical[role].index(v) for v in order]
            if perm != sorted(perm):
                value = method(value, "permute", *map(str, perm))
            value = method(value, "to", f"{g['of']}.dtype")
            grads.append(
                {
                    "name": str(g["local"]),
                    "of": g["of"],
                    "target": parse(Code(f"{g['local']}[{self._slices(role)}]")),
                    "value": parse(value),
                }
            )
        by_tensor: dict[str, list[str]] = {}
        for g in grads:
            by_tensor.setdefault(str(g["of"]), []).append(str(g["name"]))
        returned = []
        for p in self.nest.params:
            if p == self.tensor["out"]:
                returned.append(parse(name(n["d_out"])))
            elif p in by_tensor:
                returned.append(parse(Code(" + ".join(by_tensor[p]))))
            else:
                returned.append(parse(Code("None")))
        params = {
            **self._shared_params(),
            **self.common,
            "n": n,
            "torch": torch,
            "views": views,
            "logit": parse(logit),
            "causal": parse(causal) if causal is not None else None,
            "derivative": parse(printer.expr(renamed(slope, f.score, n["s"])))
            if slope != Const(frozenset(), False, 1.0)
            else None,
            "grads": grads,
            "launch": self.fns.get("launch", ""),
            "backward_launcher": self.fns.get("backward_launcher", ""),
            "use_triton": self.mods.get("use_triton", ""),
            "first": self.tensor["out"],
            "batch_count": parse(self._batch_count()),
            "tensors": [t for t, _ in self.nest.tensors],
            # the arguments that are no tensors, read by the nest or not: the backward gets them
            "others": [p for p in self.nest.params if p not in dict(self.nest.tensors)],
            "out_index": self.nest.params.index(self.tensor["out"]),
            "d_out_target": parse(Code(f"{n['d_out']}[{self._slices('out')}]")),
            "returned": returned,
        }
        return render("tile_flash_autograd.py.j2", **params)

    def _views(
        self, n: dict[str, str], extra: list[tuple[str, str, str]]
    ) -> list[dict[str, object]]:
        """q, kk, v (and ``extra``: (local, role, tensor)) as the torch paths compute on them:
        the part the nest reads, in (batch, rows, columns) order, at least float32."""
        views = []
        roles = [("q_view", "q", self.tensor["q"]), ("kk_view", "kk", self.tensor["kk"])]
        roles += [("v_view", "v", self.tensor["v"]), *extra]
        for local, role, tensor in roles:
            canonical = self._canonical(role)
            views.append(
                {
                    "name": n[local],
                    "tensor": tensor,
                    "code": parse(self._view(role, tensor, canonical)),
                    "shape": "(" + ", ".join(canonical) + ")",
                }
            )
        return views

    def _softmax_input(self, n: dict[str, str], printer: TorchPrinter) -> tuple[Code, Code | None]:
        """(the logit f(s) of the scores ``n["s"]``, the causal mask's keys to drop or None)."""
        f, torch = self.f, printer.torch
        logit = printer.expr(renamed(f.logit, f.score, n["s"]))
        offset = self._offset(printer)
        if offset is None:
            return logit, None
        query, keys = self.names.bounds[f.query], self.names.bounds[f.keys]
        device = f"device={n['s']}.device"
        key = Code(f"{torch}.arange({keys.lo}, {keys.hi}, {device})[None, :]")
        row = Code(f"{torch}.arange({query.lo}, {query.hi}, {device})[:, None]")
        return logit, binary(">", key, self._shifted(row, 1, 0, offset))

    def torch_path(self) -> str:
        """The CPU path: the nest as eager softmax attention (the scores, the masked logits,
        their softmax, its product with v), written into out."""
        n = fresh_locals(self.names.fork().namer, "s z p q_view kk_view v_view")
        printer = TorchPrinter({}, self.mods["torch"])
        logit, causal = self._softmax_input(n, printer)
        c = linear_scale(self.f.logit, self.f.score)
        if c is not None:  # s * c: the scores' own buffer, scaled in place
            logit = method(name(n["s"]), "mul_", printer.expr(c))
        value = grouped(binary("@", name(n["p"]), name(n["v_view"])))
        order, canonical = self._order("out"), self._canonical("out")
        perm = [canonical.index(v) for v in order]
        if perm != sorted(perm):
            value = method(value, "permute", *map(str, perm))
        params = {
            **self._shared_params(),
            **self.common,
            "n": n,
            "torch": self.mods["torch"],
            "views": self._views(n, []),
            "logit": parse(logit),
            "causal": parse(causal) if causal is not None else None,
            "out_target": parse(Code(f"{self.tensor['out']}[{self._slices('out')}]")),
            "value": parse(method(value, "to", f"{self.tensor['out']}.dtype")),
        }
        return render("tile_flash_torch.py.j2", **params)

    def _order(self, role: str) -> list[str]:
        """The loop variables indexing ``role``'s tensor, in its dimension order."""
        access = self.access[role]
        index = access.index if isinstance(access, Store) else [ix.var for ix in access.index]
        return [str(v) for v in index]

    def _canonical(self, role: str) -> list[str]:
        """The order the torch backward computes in: (batch, rows, columns)."""
        rows, cols = self.walk[role]
        batch = [self.f.batch.var] if self.f.batch and self.f.batch.var in self._order(role) else []
        return [*batch, rows, cols]

    def _slices(self, role: str) -> str:
        """``lo:hi`` of each dimension of ``role``'s tensor: the part the nest reads or writes."""
        loops = {loop.var: self.names.bounds[loop] for loop in self.loops}
        return ", ".join(f"{loops[v].lo}:{loops[v].hi}" for v in self._order(role))

    def _view(self, role: str, tensor: str, canonical: list[str]) -> Code:
        order = self._order(role)
        code = Code(f"{tensor}[{self._slices(role)}]")
        perm = [order.index(v) for v in canonical]
        return method(code, "permute", *map(str, perm)) if perm != sorted(perm) else code


def fresh_locals(namer: Namer, hints: str) -> dict[str, str]:
    """Fresh names for a generated function's locals (none is a name of the user's)."""
    return {hint: namer(hint) for hint in hints.split()}


def grouped(code: Code) -> Code:
    """``code`` as one operand: parenthesized unless it is an atom."""
    return code if code.prec >= 100 else Code(f"({code.text})")
