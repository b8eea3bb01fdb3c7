"""What @tile's tile sizes must satisfy beyond being powers of two, in one place.

Expansion refuses a violating tile (``too_big``); autotune can ask the same
question of a candidate configuration before measuring it.
"""

from __future__ import annotations

import math

from macrogen.macros.tile.ir import Nest

MAX_TILE_ELEMENTS = 1 << 20  # Triton's limit on the elements of one block (TRITON_MAX_TENSOR_NUMEL)


def block_shape(nest: Nest, tiles: dict[str, int]) -> list[int]:
    """The largest block the kernel holds: the grid tile, times the widest inner-loop tile."""
    shape = [tiles[g.var] for g in nest.grid]
    if nest.inner_axis:
        shape.append(max(tiles[s.loop.var] for s in nest.inner_loops))
    return shape


def too_big(shape: list[int]) -> str | None:
    """Why a block of ``shape`` cannot be a Triton block, or None."""
    if math.prod(shape) <= MAX_TILE_ELEMENTS:
        return None
    return (
        f"a tile of {'x'.join(map(str, shape))} elements is more than Triton's"
        f" {MAX_TILE_ELEMENTS}; use smaller tiles"
    )
