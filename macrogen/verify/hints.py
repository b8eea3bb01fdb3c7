"""What a failing verify points at beyond its numbers: head counts left undivided.

A layer sharded colwise computes a slice of its features on each rank; a module that
splits those features into heads by an attribute (``q.view(B, T, self.n_head, -1)``)
then needs that attribute divided by the tensor-parallel degree, or its attention mixes
the wrong features (issue 43: such a plan trained without a word). Such an attribute is
named here when verify fails, so the verdict can say which plan entry is missing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch.nn as nn

from macrogen.verify.compare import path_pattern


def undivided_head_counts(
    model: nn.Module, plan: Sequence[tuple[str, str]], tp: int
) -> list[tuple[str, int]]:
    """``(path, value)`` of each int attribute named like a head count (``n_head``,
    ``num_key_value_heads``) of a module holding sharded layers, that the plan does not
    divide and ``tp`` divides."""
    if tp <= 1:
        return []
    sharded = [path for path, style in plan if style.split()[0] in _SHARDING]
    divided = [path_pattern(path) for path, style in plan if style == "divide"]
    parents = sorted({path.rpartition(".")[0] for path in sharded})
    found: dict[str, int] = {}  # the plan's path for it ("layers.*.attn.n_head") -> value
    for name, module in model.named_modules():
        parent = next((p for p in parents if re.fullmatch(path_pattern(p), name)), None)
        if parent is None:
            continue
        for attr, value in vars(module).items():
            if (
                type(value) is int
                and _HEADS.search(attr)
                and value >= tp
                and value % tp == 0
                and not any(re.fullmatch(d, f"{name}.{attr}") for d in divided)
            ):
                found.setdefault(f"{parent}.{attr}" if parent else attr, value)
    return list(found.items())


_SHARDING = ("colwise", "rowwise")
_HEADS = re.compile(r"heads?$")  # n_head, num_heads, num_key_value_heads (not head_dim)
