"""The serial step against the parallel one: a row per parameter, a table, a verdict.

A tensor's difference is its largest absolute difference, and that relative to the serial
tensor's largest magnitude (an element-wise ratio would blow up on elements near zero).
It is within tolerance when ``max abs <= atol + rtol * max |serial|``; the default
tolerance follows the serial tensor's dtype: float32 sums in another order when sharded
(rowwise partial sums, all-reduced gradients), so it differs in the last few bits, not
in the fourth digit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch is imported where tensors are compared: the command starts the
    import torch  # ranks first, then imports it)

    from macrogen.verify.program import Snapshot

# (rtol, atol) by dtype: a few hundred ulps of the serial tensor's scale
TOLERANCE = {
    "torch.float64": (1e-9, 1e-12),
    "torch.float32": (1e-4, 1e-6),
    "torch.bfloat16": (5e-2, 1e-3),
    "torch.float16": (1e-2, 1e-4),
}


@dataclass(frozen=True)
class Row:
    name: str  # "loss", or a parameter's serial name
    planned: str  # the plan entry it belongs to ("colwise  layers.*.attn.q"), or ""
    abs_diff: float  # max |parallel - serial|; inf where one side is missing
    rel_diff: float  # abs_diff / max |serial|
    ok: bool  # margin <= 1
    note: str = ""  # why a row fails other than by its numbers ("no gradient in parallel")
    margin: float = math.inf  # abs_diff / (atol + rtol * max |serial|): how near the limit


def compare(
    serial: Snapshot,
    parallel: Snapshot,
    plan: Sequence[tuple[str, str]],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[list[Row], list[Row]]:
    """(rows of the step: the loss, then each gradient; rows of weights that differ before it)."""
    rows = [_row("loss", "", serial.loss, parallel.loss, rtol, atol)]
    for name, grad in serial.grads.items():
        planned = planned_as(name, plan)
        if name not in parallel.grads:
            rows.append(Row(name, planned, math.inf, math.inf, False, "not in the parallel model"))
        elif (grad is None) != (parallel.grads[name] is None):
            where = "parallel" if grad is not None else "serial"
            rows.append(Row(name, planned, math.inf, math.inf, False, f"no gradient in {where}"))
        elif grad is not None:
            other = parallel.grads[name]
            assert other is not None
            rows.append(_row(name, planned, grad, other, rtol, atol))
    for name in parallel.grads.keys() - serial.grads.keys():
        rows.append(Row(name, "", math.inf, math.inf, False, "not in the serial model"))
    weights = [
        _row(name, planned_as(name, plan), w, parallel.weights[name], rtol, atol)
        for name, w in serial.weights.items()
        if name in parallel.weights
    ]
    return rows, [r for r in weights if not r.ok]


def _row(
    name: str,
    planned: str,
    serial: torch.Tensor,
    parallel: torch.Tensor,
    rtol: float | None,
    atol: float | None,
) -> Row:
    if serial.shape != parallel.shape:
        note = f"shape {tuple(parallel.shape)} in parallel, {tuple(serial.shape)} serially"
        return Row(name, planned, math.inf, math.inf, False, note)
    default_rtol, default_atol = TOLERANCE.get(str(serial.dtype), TOLERANCE["torch.float32"])
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a, b = serial.double(), parallel.double()
    abs_diff = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(a.abs().max()) if a.numel() else 0.0
    rel_diff = abs_diff / scale if scale > 0 else (math.inf if abs_diff > 0 else 0.0)
    limit = atol + rtol * scale
    margin = abs_diff / limit if limit > 0 else (math.inf if abs_diff > 0 else 0.0)
    ok = abs_diff <= limit  # (NaN compares False: a NaN fails)
    return Row(name, planned, abs_diff, rel_diff, ok, margin=margin)


def planned_as(name: str, plan: Sequence[tuple[str, str]]) -> str:
    """The plan entry whose layer holds parameter ``name`` (``*`` is one path component)."""
    owner = name.rpartition(".")[0]
    for path, style in plan:
        if re.fullmatch(path_pattern(path), owner):
            return f"{style}  {path}"
    return ""


def path_pattern(path: str) -> str:
    """A plan path as a regular expression over dotted names (``*``: one component)."""
    return r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in path.split("."))


def plan_entries(plan: Mapping[str, object] | None) -> list[tuple[str, str]]:
    """A plan as written (``{path: style}``), each style as text (``("colwise", 3)``: colwise x3)."""
    out = []
    for path, style in (plan or {}).items():
        if isinstance(style, (tuple, list)) and len(style) == 2:
            out.append((path, f"{style[0]} x{style[1]}"))
        else:
            out.append((path, str(style)))
    return out


def table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table, the failing ones marked."""
    width = max(len("parameter"), *(len(r.name) for r in rows))
    planned = max(len("planned"), *(len(r.planned) for r in rows))
    lines = [f"{'parameter':<{width}}  {'planned':<{planned}}  {'max abs':>9}  {'max rel':>9}"]
    for r in rows:
        verdict = "ok" if r.ok else f"DIFFERS {r.note}".rstrip()
        lines.append(
            f"{r.name:<{width}}  {r.planned:<{planned}}  {_number(r.abs_diff):>9}"
            f"  {_number(r.rel_diff):>9}  {verdict}"
        )
    return "\n".join(lines)


def worst(rows: Sequence[Row]) -> Row:
    """The row nearest its limit, or furthest past it (a parameter before the loss when
    both fail: a parameter says where to look)."""
    failing = [r for r in rows if not r.ok]
    pool = [r for r in failing if r.name != "loss"] or failing or list(rows)
    return max(pool, key=lambda r: (math.isnan(r.margin), r.margin, r.rel_diff))


def _number(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:.2e}"
