"""The generated functions of an attention nest (flash.py): FlashAttention kernels and autograd.

For ``attention(out, q, kk, v, scale)`` the expansion writes, besides the shapes
function every nest gets:

- ``_attention_torch`` (the CPU path, tile_flash_torch.py.j2): eager softmax
  attention, one fused softmax, written into out;
- ``_attention_kernel`` (templates/tile_flash_kernel.py.j2): one program per
  tile of queries (and batch element); q's tile loaded once; the keys it sees
  walked ``BLOCK_J`` at a time in base 2 (``exp2``, the logit's scale folded
  into one multiply): first the steps every query of the tile sees, with no
  masks, then those across the causal diagonal and the ragged last one, masked;
  key blocks wholly past the diagonal are never visited. It stores each row's
  logsumexp when training asks for it;
- ``_attention_backward_kernel`` (tile_flash_backward.py.j2): dq, dk and dv,
  FlashAttention-2's way: a program computes dk and dv of a block of keys (the
  queries that see them a step at a time), or dq of a block of queries; no
  atomics, and no program reads anything twice;
- ``_attention_launch`` (lse or None), ``_attention_triton`` (the function's
  signature), ``_attention_backward_triton`` (tile_flash_launcher.py.j2);
- ``_attention_backward_torch`` and ``_attention_autograd``, an
  ``autograd.Function`` the function routes to when a tensor argument requires
  grad, so that training differentiates the nest (tile_flash_autograd.py.j2).

The head dimensions (the scores' depth and out's columns) are taken whole, a
power of two of at least 16 and at most MAX_HEAD (the launchers say so beyond).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from macrogen.macro import render
from macrogen.macros.tile.code import Code, Parsed, binary, call, method, name, number, parse, plus
from macrogen.macros.tile.flash import Flash
from macrogen.macros.tile.flash_torch import ROLES, TorchOutput, fresh_locals, grouped
from macrogen.macros.tile.ir import Const, Load, Loop, Nest, Store
from macrogen.macros.tile.logit import derivative, linear_scale, renamed
from macrogen.macros.tile.names import LoopBounds, Namer, Names
from macrogen.macros.tile.printer import TorchPrinter, TritonPrinter

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)
MAX_HEAD = 256  # the widest head dimension the kernels hold in registers


@dataclass(frozen=True)
class Options:
    """The site's launch options for its attention kernels (tile() arguments)."""

    block_i: int  # queries per forward program
    block_j: int  # keys per forward step
    num_warps: int
    num_stages: int
    backward_block: int  # keys (dk, dv) and queries (dq) per backward program
    backward_step: int  # queries (dk, dv) and keys (dq) per backward step
    backward_warps: int
    backward_stages: int


class FlashOutput(TorchOutput):
    """Renders an attention nest's kernels, launchers and autograd function from one set of names."""

    def __init__(
        self,
        flash: Flash,
        nest: Nest,
        names: Names,
        mods: Mapping[str, str],
        fns: dict[str, str],
        common: dict[str, object],
        options: Options,
        dot_precision: str,
        precision_value: Parsed,
    ):
        self.f, self.nest, self.names, self.mods, self.fns = flash, nest, names, mods, fns
        self.common, self.options = common, options
        self.dot_precision, self.precision_value = dot_precision, precision_value
        f = flash
        self.loops = [*([f.batch] if f.batch else []), f.query, f.column, f.keys, f.depth]
        self.access: dict[str, Load | Store] = {"q": f.q, "kk": f.kk, "v": f.v, "out": f.out}
        self.tensor = {role: a.tensor_name for role, a in self.access.items()}
        # what the kernel walks each tensor along: (rows, columns)
        self.walk = {
            "q": (f.query.var, f.depth.var),
            "kk": (f.keys.var, f.depth.var),
            "v": (f.keys.var, f.column.var),
            "out": (f.query.var, f.column.var),
        }
        namer = names.namer  # names the kernels' parameters and the launchers share
        self.constexpr = {h: namer(h) for h in ("HEAD_K", "HEAD_E", "STORE_LSE", "BLOCK", "STEP")}
        self.lse: dict[str, object] = {
            "ptr": namer("lse_ptr"),
            "batch": namer("stride_lse_batch"),  # (a launch argument even without a batch loop)
        }
        out_ndim = len(f.out.index)
        self.dout = self._strided("dout", "out", out_ndim, namer, shared=False)
        self.grads = [
            self._strided(
                f"d{self.tensor[role]}", role, self._ndim(role), namer, self._shared(role)
            )
            for role in ("q", "kk", "v")
        ]

    # -- shared pieces -----------------------------------------------------------------------
    def _ndim(self, role: str) -> int:
        return len(self.access[role].index)

    def _shared(self, role: str) -> bool:
        """kk or v without the batch variable: every batch element reads the same one."""
        b = self.f.batch
        return b is not None and b.var not in self.f.axes(self.access[role])

    def _axes(self, role: str) -> dict[str, int]:
        return self.f.axes(self.access[role])

    def _strided(
        self, label: str, role: str, ndim: int, namer: Namer, shared: bool
    ) -> dict[str, object]:
        """A tensor the backward adds (dout, dq, dk, dv): kernel names laid out like ``role``'s;
        a shared one (kk or v without the batch) gets a leading batch dimension."""
        base = label.strip("_") or "t"
        strides = [namer(f"stride_{base}{d}") for d in range(ndim + shared)]
        axes = {v: d + shared for v, d in self._axes(role).items()}
        rows, cols = self.walk[role]
        batch = self.f.batch
        return {
            "of": self.tensor[role],
            "role": role,
            "ptr": namer(f"{base}_ptr"),
            "local": namer(base),  # the launchers' and the torch backward's local
            "strides": strides,
            "ndim": ndim + shared,
            "rows": strides[axes[rows]],
            "cols": strides[axes[cols]],
            "batch": strides[0]
            if shared
            else strides[axes[batch.var]]
            if batch and batch.var in axes
            else None,
            "shared": shared,
        }

    def _role(self, role: str) -> dict[str, object]:
        """A forward tensor's pointer and strides, by what the kernels walk it along."""
        tensor = self.tensor[role]
        strides = self.names.strides[tensor]
        axes, (rows, cols), batch = self._axes(role), self.walk[role], self.f.batch
        return {
            "name": tensor,
            "ptr": self.names.ptr[tensor],
            "strides": strides,
            "rows": strides[axes[rows]],
            "cols": strides[axes[cols]],
            "batch": strides[axes[batch.var]] if batch and batch.var in axes else None,
        }

    def _loop(self, loop: Loop) -> dict[str, object]:
        b = self.names.bounds[loop]
        return {"var": loop.var, "lo": b.lo, "hi": b.hi, "block": self.names.block[loop.var]}

    def _shared_params(self) -> dict[str, object]:
        f = self.f
        return {
            **{role: self._role(role) for role in ROLES},
            "query": {**self._loop(f.query), "block_value": self.options.block_i},
            "column": self._loop(f.column),
            "keys": self._loop(f.keys),
            "depth": self._loop(f.depth),
            "batch": self._loop(f.batch) if f.batch else None,
            "lse": self.lse,
            "dout": self.dout,
            "grads": self.grads,
            "head_k": self.constexpr["HEAD_K"],
            "head_e": self.constexpr["HEAD_E"],
            "store_lse": self.constexpr["STORE_LSE"],
            "block": self.constexpr["BLOCK"],
            "step": self.constexpr["STEP"],
            "dot_precision": self.dot_precision,
            "wide": self.names.wide,
            "scalars": self.nest.scalars,
            "sizes": [s.name for s in self.nest.sizes],
            "bounds": [self.names.bounds[loop] for loop in self.loops],
            "causal": self.f.causal is not None,
            "q_name": self.tensor["q"],
            "kk_name": self.tensor["kk"],
            "v_name": self.tensor["v"],
            "out_name": self.tensor["out"],
        }

    def _logit(
        self, tl: str, score: str, scale_local: str
    ) -> tuple[Code | None, Code, Code | None]:
        """(the base-2 scale c * log2(e) when f(s) = s * c, else None; the base-2 logit of the
        tile ``score``; f'(score) when f is not linear (the backward multiplies dq and dk by c))."""
        f = self.f
        printer = TritonPrinter({}, tl)
        c = linear_scale(f.logit, f.score)
        if c is not None:
            scale = binary("*", grouped(printer.expr(c)), number(LOG2E))
            return scale, binary("*", name(score), name(scale_local)), None
        logit = printer.expr(renamed(f.logit, f.score, score))
        slope = printer.expr(renamed(derivative(f.logit, f.score), f.score, score))
        return None, binary("*", grouped(logit), number(LOG2E)), slope

    def _natural_scale(self, tl: str) -> Code | None:
        c = linear_scale(self.f.logit, self.f.score)
        if c is None or c == Const(frozenset(), False, 1.0):
            return None
        return grouped(TritonPrinter({}, tl).expr(c))

    def _offset(self, printer: TritonPrinter | TorchPrinter) -> Code | None:
        """c of the causal mask ``j <= i + c``, as code (None: no mask)."""
        return grouped(printer.expr(self.f.causal)) if self.f.causal is not None else None

    def _shifted(self, code: Code, sign: int, extra: int, offset: Code) -> Code:
        """``code + c + extra`` (sign 1) or ``code - c + extra`` (sign -1); a number c folds in."""
        c = self.f.causal
        if isinstance(c, Const) and isinstance(c.value, int):
            return plus(code, sign * c.value + extra)
        return plus(binary("+" if sign > 0 else "-", code, offset), extra)

    def _bases(
        self, n: dict[str, str], which: dict[str, dict[str, object]]
    ) -> list[dict[str, object]]:
        """Each tensor's pointer moved to this program's batch element (``n["b"]``): by its batch
        stride, or none (kk or v shared by the batch); lse, by the batch's index from its start."""
        out = []
        batch = self.f.batch
        for local, t in which.items():
            code = name(str(t["ptr"]))
            if batch is not None and t["batch"] is not None:
                index = name(n["b"])
                if local == "lse_base":
                    index = grouped(binary("-", index, name(self.names.bounds[batch].lo)))
                code = binary("+", code, binary("*", index, name(str(t["batch"]))))
            out.append({"name": n[local], "code": parse(code)})
        return out

    # -- the forward kernel ------------------------------------------------------------------
    def kernel(self) -> str:
        f, tl = self.f, self.mods["tl"]
        n = fresh_locals(
            self.names.fork().namer,
            "pid tiles pid_i i_start i i_mask k_row k_col e j_row j_col b k_row_mask k_col_mask"
            " e_mask q_base kk_base v_base out_base lse_base q_tile qk_scale m_run l_run acc"
            " j_full j_start j_end kk_step s z key m_next p alpha v_step",
        )
        scale, logit2, _ = self._logit(tl, n["s"], n["qk_scale"])
        offset = self._offset(TritonPrinter({}, tl))
        keys = self.names.bounds[f.keys]
        block_i, block_j = self.names.block[f.query.var], self.names.block[f.keys.var]
        in_range = binary("<", name(n["key"]), name(keys.hi))
        if offset is not None:  # key j is seen by query i when j <= i + c
            seen = binary("<=", name(n["key"]), self._shifted(name(n["i"]), 1, 0, offset))
            masked = binary("&", grouped(in_range), grouped(seen))
            first_unseen = self._shifted(name(n["i_start"]), 1, 1, offset)
            j_full = _whole_steps(tl, keys, call(f"{tl}.minimum", keys.hi, first_unseen), block_j)
            past = self._shifted(binary("+", name(n["i_start"]), name(block_i)), 1, 0, offset)
            j_end: Code = call(f"{tl}.minimum", keys.hi, past)
        else:
            masked, j_end = in_range, name(keys.hi)
            j_full = _whole_steps(tl, keys, name(keys.hi), block_j)
        roles = {role: self._role(role) for role in ROLES}
        which = {f"{role}_base": roles[role] for role in ROLES}
        which["lse_base"] = self.lse
        return render(
            "tile_flash_kernel.py.j2",
            triton=self.mods["triton"],
            tl=tl,
            n=n,
            **self._shared_params(),
            tensors=self.common["tensors"],
            widened=[n[v] for v in ("i", "k_row", "k_col", "e", "j_row", "j_col")]
            + ([n["b"]] if f.batch else []),
            bases=self._bases(n, which),
            scale=parse(scale) if scale is not None else None,
            logit2=parse(logit2),
            masked_test=parse(masked),
            j_full=parse(j_full),
            j_end=parse(j_end),
            kernel=self.fns["kernel"],
            location=self.common["location"],
        )

    # -- the backward kernel -----------------------------------------------------------------
    def backward_kernel(self) -> str:
        f, tl = self.f, self.mods["tl"]
        n = fresh_locals(
            self.names.fork().namer,
            "pid tiles_kv tiles pid_n k_row e b k_row_mask e_mask q_base kk_base v_base out_base dout_base"
            " lse_base dq_base dk_base dv_base qk_scale n_start j j_mask kk_tile v_tile dk dv"
            " i_first i_full i_whole lo hi i_start i_col i_row q_step s lse_step p do_step o_step"
            " delta dp ds m_start i i_mask q_tile do_tile o_tile lse_tile dq j_full j_start j_col"
            " j_row kk_step v_step",
        )
        scale, logit2, slope = self._logit(tl, n["s"], n["qk_scale"])
        offset = self._offset(TritonPrinter({}, tl))
        query, keys = self.names.bounds[f.query], self.names.bounds[f.keys]
        block, step = self.constexpr["BLOCK"], self.constexpr["STEP"]
        q_lo = name(query.lo)
        # dk, dv: masked where a query of the step is past the end, or does not see the key
        rows_ok = binary("<", name(n["i_col"]), name(query.hi))
        # dq: masked where a key is past the end, or not seen
        keys_ok = binary("<", name(n["j_col"]), name(keys.hi))
        if offset is not None:
            dkdv_test = binary(
                "&",
                grouped(rows_ok),
                grouped(binary("<=", name(n["j"]), self._shifted(name(n["i_col"]), 1, 0, offset))),
            )
            dq_test = binary(
                "&",
                grouped(keys_ok),
                grouped(binary("<=", name(n["j_col"]), self._shifted(name(n["i"]), 1, 0, offset))),
            )
            first = binary("-", self._shifted(name(n["n_start"]), -1, 0, offset), q_lo)
            i_first = binary(
                "+",
                q_lo,
                binary(
                    "*", binary("//", call(f"{tl}.maximum", first, "0"), name(step)), name(step)
                ),
            )
            last = self._shifted(binary("+", name(n["n_start"]), name(block)), -1, -1, offset)
            i_full = binary(
                "+",
                q_lo,
                binary(
                    "*",
                    call(
                        f"{tl}.cdiv",
                        call(f"{tl}.maximum", binary("-", last, q_lo), "0"),
                        name(step),
                    ),
                    name(step),
                ),
            )
            first_unseen = self._shifted(name(n["m_start"]), 1, 1, offset)
            j_full = _whole_steps(tl, keys, call(f"{tl}.minimum", keys.hi, first_unseen), step)
            past = self._shifted(binary("+", name(n["m_start"]), name(block)), 1, 0, offset)
            j_end: Code = call(f"{tl}.minimum", keys.hi, past)
        else:
            dkdv_test, dq_test = rows_ok, keys_ok
            i_first = i_full = q_lo
            j_full = _whole_steps(tl, keys, name(keys.hi), step)
            j_end = name(keys.hi)
        ds = binary("*", name(n["p"]), grouped(binary("-", name(n["dp"]), name(n["delta"]))))
        ds_t = binary(
            "*", name(n["p"]), grouped(binary("-", name(n["dp"]), Code(f"{n['delta']}[None, :]")))
        )
        if slope is not None:
            ds, ds_t = binary("*", ds, grouped(slope)), binary("*", ds_t, grouped(slope))
        c = self._natural_scale(tl)
        stored = {}  # each gradient as its tensor's dtype; dq and dk times c when f(s) = s * c
        for local, g in zip(("dq", "dk", "dv"), self.grads):
            value = (
                binary("*", name(n[local]), c)
                if c is not None and local != "dv"
                else name(n[local])
            )
            stored[local] = method(grouped(value), "to", f"{g['ptr']}.dtype.element_ty")
        roles = {role: self._role(role) for role in ROLES}
        which = {f"{role}_base": roles[role] for role in ROLES}
        which["dout_base"] = self.dout
        which["lse_base"] = self.lse
        for g, local in zip(self.grads, ("dq_base", "dk_base", "dv_base")):
            which[local] = g
        return render(
            "tile_flash_backward.py.j2",
            triton=self.mods["triton"],
            tl=tl,
            n=n,
            **self._shared_params(),
            tensors=self.common["tensors"],
            dq=self.grads[0],
            dk=self.grads[1],
            dv=self.grads[2],
            widened=[n["k_row"], n["e"]] + ([n["b"]] if f.batch else []),
            bases=self._bases(n, which),
            scale=parse(scale) if scale is not None else None,
            logit2=parse(logit2),
            logit2_t=parse(logit2),
            ds=parse(ds),
            ds_t=parse(ds_t),
            dkdv_test=parse(dkdv_test),
            dq_test=parse(dq_test),
            i_first=parse(i_first),
            i_full=parse(i_full),
            j_full=parse(j_full),
            j_end=parse(j_end),
            dq_value=parse(stored["dq"]),
            dk_value=parse(stored["dk"]),
            dv_value=parse(stored["dv"]),
            kernel=self.fns["backward_kernel"],
            location=self.common["location"],
        )

    # -- the launchers ------------------------------------------------------------------------
    def _batch_count(self) -> Code:
        """How many batch elements the nest runs over (1 without a batch loop)."""
        if self.f.batch is None:
            return number(1)
        b = self.names.bounds[self.f.batch]
        return call("max", binary("-", name(b.hi), name(b.lo)), "0")

    def launchers(self) -> str:
        n = fresh_locals(self.names.fork().namer, "lse dout head_k head_e batch programs")
        grads = [
            {"name": str(g["local"]), "of": g["of"], "shared": g["shared"], "ndim": g["ndim"]}
            for g in self.grads
        ]
        depth, column = self.names.bounds[self.f.depth], self.names.bounds[self.f.column]
        o = self.options
        launcher = self.fns["launcher"]
        params = {
            **self._shared_params(),
            **self.common,
            "n": n,
            "triton": self.mods["triton"],
            "torch": self.mods["torch"],
            "interpreting": self.mods["interpreting"],
            "int64_offsets": self.mods["int64_offsets"],
            "first": self.tensor["out"],
            "device_message": f"{launcher} runs on CUDA tensors (or CPU tensors under"
            " TRITON_INTERPRET=1), not ",
            "dtype_message": f"{launcher} takes float16, bfloat16 or float32 tensors, not ",
            "dot_message": f"the operands of a tl.dot must have one dtype: {self.tensor['q']}"
            f" and {self.tensor['kk']}",
            "max_head": MAX_HEAD,
            "head_message": f"the attention kernel takes whole head dimensions up to {MAX_HEAD}"
            f" ({depth.var} and {column.var}), not %d and %d; the torch path takes any",
            "batch_count": parse(self._batch_count()),
            "lse_doc": "lse: each row's logsumexp for the backward, or None",
            "grads": grads,
            "block_i": o.block_i,
            "block_j": o.block_j,
            "num_warps": o.num_warps,
            "num_stages": o.num_stages,
            "backward_block": o.backward_block,
            "backward_step": o.backward_step,
            "backward_warps": o.backward_warps,
            "backward_stages": o.backward_stages,
            "precision": self.precision_value,
            "out_ndim": len(self.f.out.index),
        }
        return render("tile_flash_launcher.py.j2", **params)


def _whole_steps(tl: str, keys: LoopBounds, stop: Code, block: str) -> Code:
    """``lo`` plus the whole ``block``-steps that fit from ``lo`` to ``stop``."""
    span = call(f"{tl}.maximum", binary("-", stop, name(keys.lo)), "0")
    return binary("+", name(keys.lo), binary("*", binary("//", span, name(block)), name(block)))
