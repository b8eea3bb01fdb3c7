"""Rank agreement: every rank must have built the same model before gradients are averaged.

Ranks that disagree on a parameter's name, shape or dtype, or on the bucket
layout, would all-reduce buffers of different sizes: a hang or silent garbage.
``check_agreement`` gathers each rank's fingerprint (one collective, which every
rank reaches whatever its model) and raises the same clear error on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from macrogen.runtime import groups


class RankMismatchError(RuntimeError):
    """Ranks built different models (or data-parallel settings)."""


@dataclass(frozen=True)
class Fingerprint:
    """What must be equal on every rank (picklable: it is gathered with all_gather_object)."""

    params: tuple[str, ...]  # "'blocks.0.attn.qkv.weight' float32 (192, 64) in bucket 1", in order
    settings: str  # the data-parallel settings (bucket sizes, compression, accumulation)


def fingerprint(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[str],
    bucket_of: Sequence[int],
    settings: str,
) -> Fingerprint:
    params = tuple(
        f"{name!r} {dtype} {tuple(shape)} in bucket {bucket}"
        for name, shape, dtype, bucket in zip(names, shapes, dtypes, bucket_of)
    )
    return Fingerprint(params, settings)


def first_difference(reference: Fingerprint, other: Fingerprint) -> tuple[str, str, str] | None:
    """(what, on the reference, on the other) where two fingerprints first differ, else None."""
    for i in range(max(len(reference.params), len(other.params))):
        ref = reference.params[i] if i < len(reference.params) else "absent"
        got = other.params[i] if i < len(other.params) else "absent"
        if ref != got:
            return f"parameter {i}", ref, got
    if reference.settings != other.settings:
        return "the data_parallel setting", reference.settings, other.settings
    return None


def check_agreement(mine: Fingerprint, *, group: dist.ProcessGroup | None, where: str) -> None:
    """Raise ``RankMismatchError`` on every rank if any rank's fingerprint differs from rank 0's."""
    groups.barrier(f"data_parallel at {where}: the rank-agreement check", group)
    gathered: list[Fingerprint | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    reference = gathered[0]
    assert reference is not None
    for rank, other in enumerate(gathered[1:], start=1):
        assert other is not None
        diff = first_difference(reference, other)
        if diff is not None:
            what, on_zero, on_rank = diff
            raise RankMismatchError(
                f"data_parallel at {where}: rank {rank} built a different model than rank 0:"
                f" {what} is {on_zero} on rank 0 but {on_rank} on rank {rank}"
                f" (raised on rank {dist.get_rank(group)}; every rank must build the same model)"
            )
