"""What @tile's tile sizes must satisfy beyond being powers of two, in one place.

Expansion refuses a violating tile (``too_big``); autotune asks the same
question of a candidate configuration before measuring it (``tuning_constraint``,
the protocol's hook, re-exported by the macro module).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from macrogen.macro import TuningEnv
from macrogen.macros.tile.ir import InnerLoop, Nest

MAX_TILE_ELEMENTS = 1 << 20  # Triton's limit on the elements of one block (TRITON_MAX_TENSOR_NUMEL)


def block_shape(nest: Nest, tiles: dict[str, int]) -> list[int]:
    """The largest block the kernel holds: the grid tile, times the widest inner-loop tile
    of each level of inner loops."""
    shape = [tiles[g.var] for g in nest.grid]
    if nest.inner_axis:
        level = list(nest.inner_loops)
        while level:
            shape.append(max(tiles[s.loop.var] for s in level))
            level = [t for s in level for t in s.body if isinstance(t, InnerLoop)]
    return shape


def too_big(shape: list[int]) -> str | None:
    """Why a block of ``shape`` cannot be a Triton block, or None."""
    if math.prod(shape) <= MAX_TILE_ELEMENTS:
        return None
    return (
        f"a tile of {'x'.join(map(str, shape))} elements is more than Triton's"
        f" {MAX_TILE_ELEMENTS}; use smaller tiles"
    )


OPTIONS = frozenset({"num_warps", "num_stages", "dot_precision", "group_size"})  # not tile sizes


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """On CUDA, the site's tile sizes must fit in one Triton block (the CPU path is torch)."""
    tiles = [
        v
        for k, v in arguments.items()
        if k not in OPTIONS and isinstance(v, int) and not isinstance(v, bool)
    ]
    if env.target != "cuda" or not tiles:
        return None
    numel = math.prod(tiles)
    if numel <= MAX_TILE_ELEMENTS:
        return None
    shape = "x".join(map(str, tiles))
    return f"a {shape} tile has {numel} elements, more than Triton's {MAX_TILE_ELEMENTS}"
