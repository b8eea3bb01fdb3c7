"""Per-check results from spawned ranks, for tests that spawn once and assert many things.

A spawn costs seconds, so one spawned run makes many checks; each check's figures go back to
the parent, where a test of its own (or a message naming the check) asserts them, so a
failure names what broke. ``run_check`` keeps one failing check from hiding the others.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch


def run_check(report: dict[str, Any], name: str, check: Callable[[], Any]) -> None:
    """``report[name] = check()``, or ``{"error": <the exception, one line, and where>}``."""
    try:
        report[name] = check()
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        report[name] = {"error": f"{type(e).__name__}: {e} (at {where.name}:{where.lineno})"}


def closeness(
    got: torch.nn.Module,
    want: torch.nn.Module,
    *,
    rtol: float,
    atol: float,
    skip: Iterable[str] = (),
) -> tuple[float, str | None]:
    """The worst |got - want| / (atol + rtol |want|) over the parameters, and its parameter's name.

    At most 1 where ``torch.testing.assert_close(got, want, rtol=rtol, atol=atol)`` passes for
    every parameter; NaN (which it refuses) stays NaN; a parameter list that differs is inf.
    """
    worst, where = 0.0, None
    with torch.no_grad():
        for (name, a), (name_b, b) in zip(got.named_parameters(), want.named_parameters()):
            if name != name_b:
                return float("inf"), f"{name} vs {name_b}"
            if name in skip:
                continue
            ratio = ((a - b).abs() / (atol + rtol * b.abs())).max().item()
            if ratio != ratio:  # NaN
                return ratio, name
            if ratio > worst:
                worst, where = ratio, name
    return worst, where


def each_rank(results: list[dict[str, Any]], name: str) -> list[Any]:
    """Check ``name``'s result on every rank; fails, naming the check and rank, where it raised."""
    out = []
    for rank, report in enumerate(results):
        value = report[name]
        if isinstance(value, dict) and set(value) == {"error"}:
            raise AssertionError(f"{name}: rank {rank} raised {value['error']}")
        out.append(value)
    return out


def tensor_closeness(got: torch.Tensor, want: torch.Tensor, *, rtol: float, atol: float) -> float:
    """The worst |got - want| / (atol + rtol |want|) of two tensors: at most 1 where
    ``torch.testing.assert_close`` passes; inf where shapes or dtypes differ (which it refuses);
    with rtol = atol = 0, 0 where equal and inf where not; NaN stays NaN."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    with torch.no_grad():
        if rtol == 0 and atol == 0:
            return 0.0 if torch.equal(got, want) else float("inf")
        if got.numel() == 0:
            return 0.0
        diff = (got - want).abs()
        ratio = torch.where(diff == 0, 0.0, diff / (atol + rtol * want.abs())).max().item()
    return float(ratio)


def dict_closeness(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rtol: float, atol: float
) -> tuple[float, str | None]:
    """``tensor_closeness`` over ``want``'s keys: the worst, and its key (inf where one is missing)."""
    worst, where = 0.0, None
    for key, value in want.items():
        if key not in got:
            return float("inf"), f"{key} missing"
        ratio = tensor_closeness(got[key], value, rtol=rtol, atol=atol)
        if ratio != ratio:
            return ratio, key
        if ratio > worst:
            worst, where = ratio, key
    return worst, where


def assert_within(figure: tuple[float, str | None] | float, what: str) -> None:
    """Fails, naming ``what`` (and the worst key), where a closeness figure is over 1 or NaN."""
    worst, where = figure if isinstance(figure, tuple) else (figure, None)
    at = f" at {where}" if where is not None else ""
    assert worst <= 1, f"{what}: off by {worst:.3g} x the tolerance{at}"
