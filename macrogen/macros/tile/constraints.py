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


# arguments that are not tile sizes
OPTIONS = frozenset(
    {
        "num_warps",
        "num_stages",
        "dot_precision",
        "group_size",
        "backward_block",
        "backward_step",
        "backward_warps",
        "backward_stages",
    }
)


def tuning_per_device(argument: str) -> bool:
    """Every argument but ``dot_precision`` sizes only this rank's kernel (its blocks, warps,
    stages: Triton constexprs): a rank of a mixed job takes its own device's winner.
    ``dot_precision`` changes the numbers, so every rank keeps one."""
    return argument != "dot_precision"


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """On CUDA, a candidate whose tiles no kernel can hold (the CPU path is torch).

    The constraint sees the site's arguments, not its loop nest, and which tiles share a
    block depends on the nest: an elementwise kernel's block is the product of its grid's
    tiles and one per level of inner loops, a tl.dot's and the attention kernel's are 2-D
    (64x64 each for ``@tile(i=64, e=64, j=64, k=64)``, not one 64^4 block). So it refuses
    what every kernel would: two tiles whose product is past Triton's block; expansion
    checks the nest's own block (autotune records a candidate past it as a failed
    expansion)."""
    tiles = sorted(
        (
            v
            for k, v in arguments.items()
            if k not in OPTIONS and isinstance(v, int) and not isinstance(v, bool)
        ),
        reverse=True,
    )
    if env.target != "cuda" or not tiles:
        return None
    widest = tiles[:2]
    numel = math.prod(widest)
    if numel <= MAX_TILE_ELEMENTS:
        return None
    shape = "x".join(map(str, widest))
    return f"a {shape} tile has {numel} elements, more than Triton's {MAX_TILE_ELEMENTS}"
