"""Memory traffic of Triton kernels on CPU: bytes loaded and stored, counted under TRITON_INTERPRET=1.

    with Meter() as meter:              # TRITON_INTERPRET=1 set before triton is imported
        _softmax_triton(out, x)
    meter.launches[-1].loaded, .stored  # bytes, masked lanes excluded

What makes a memory-bound kernel fast is how many bytes it moves, and that is
visible without a GPU: the interpreter runs every program of a launch in turn
and calls its builder's ``create_masked_load``/``create_masked_store`` with
the lanes' addresses and mask. ``Meter`` wraps those two (and ``set_grid_dim``
/``set_grid_idx``, to know where a launch and a program start) and counts
bytes of the lanes the mask lets through.

The model of memory behind the count (``Launch.loaded``): a byte a program
loads counts unless an *earlier program of the same launch* loaded it (a
bias row or a norm's weight read by every program stays in L2 after the
first), while a program's own re-reads count every time (a three-pass softmax
reads its rows three times: its working set is what registers do not hold).
Stores always count. ``Launch.raw_loaded`` counts every load of every lane.
Compulsory traffic (``compulsory``) is each input element read once and
each output written once: ``traffic / compulsory`` is 1.0 for a kernel that
moves nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PAGE = 16  # bits of an address within one page of the ``seen`` bitmap


@dataclass
class Launch:
    """Bytes one kernel launch moved (masked lanes excluded)."""

    grid: tuple[int, int, int]
    loaded: int = 0  # loads not already made by an earlier program of this launch
    raw_loaded: int = 0  # every load of every lane
    stored: int = 0
    # the addresses earlier programs loaded: page -> a flag per byte address
    seen: dict[int, np.ndarray] = field(default_factory=dict)
    current: list[np.ndarray] = field(default_factory=list)  # this program's loads so far

    @property
    def traffic(self) -> int:
        return self.loaded + self.stored

    def count_load(self, addresses: np.ndarray, size: int) -> None:
        self.raw_loaded += addresses.size * size
        self.loaded += int((~self._marked(addresses)).sum()) * size
        self.current.append(addresses)

    def _marked(self, addresses: np.ndarray) -> np.ndarray:
        out = np.zeros(addresses.shape, bool)
        pages = addresses >> PAGE
        for page in np.unique(pages):
            flags = self.seen.get(int(page))
            if flags is not None:
                here = pages == page
                out[here] = flags[addresses[here] & ((1 << PAGE) - 1)]
        return out

    def end_program(self) -> None:
        if not self.current:
            return
        addresses = np.concatenate(self.current)
        self.current = []
        pages = addresses >> PAGE
        for page in np.unique(pages):
            flags = self.seen.setdefault(int(page), np.zeros(1 << PAGE, bool))
            flags[addresses[pages == page] & ((1 << PAGE) - 1)] = True


def _element_size(ptrs: Any) -> int:
    return int(ptrs.get_element_ty().primitive_bitwidth) // 8


class Meter:
    """A context manager counting the bytes of every interpreted launch into ``launches``."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __enter__(self) -> Meter:
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        self._builder = builder
        self._saved = {
            name: getattr(builder, name)
            for name in (
                "create_masked_load",
                "create_masked_store",
                "set_grid_dim",
                "set_grid_idx",
            )
        }
        saved, meter = self._saved, self

        def set_grid_dim(b: Any, nx: int, ny: int, nz: int) -> Any:
            meter._end()
            meter.launches.append(Launch((nx, ny, nz)))
            return saved["set_grid_dim"](b, nx, ny, nz)

        def set_grid_idx(b: Any, x: int, y: int, z: int) -> Any:
            if meter.launches:
                meter.launches[-1].end_program()
            return saved["set_grid_idx"](b, x, y, z)

        def load(b: Any, ptrs: Any, mask: Any, other: Any, *rest: Any) -> Any:
            lanes = np.broadcast_to(mask.data, ptrs.data.shape)
            addresses = ptrs.data[lanes].astype(np.uint64).ravel()
            meter.launches[-1].count_load(addresses, _element_size(ptrs))
            return saved["create_masked_load"](b, ptrs, mask, other, *rest)

        def store(b: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
            lanes = np.broadcast_to(mask.data, ptrs.data.shape)
            meter.launches[-1].stored += int(lanes.sum()) * _element_size(ptrs)
            return saved["create_masked_store"](b, ptrs, value, mask, *rest)

        builder.create_masked_load = load
        builder.create_masked_store = store
        builder.set_grid_dim = set_grid_dim
        builder.set_grid_idx = set_grid_idx
        return self

    def _end(self) -> None:
        if self.launches:
            self.launches[-1].end_program()

    def __exit__(self, *exc: object) -> None:
        self._end()
        for name, fn in self._saved.items():
            setattr(self._builder, name, fn)

    @property
    def loaded(self) -> int:
        return sum(launch.loaded for launch in self.launches)

    @property
    def raw_loaded(self) -> int:
        return sum(launch.raw_loaded for launch in self.launches)

    @property
    def stored(self) -> int:
        return sum(launch.stored for launch in self.launches)

    @property
    def traffic(self) -> int:
        return self.loaded + self.stored


def compulsory(inputs: list[Any], outputs: list[Any]) -> int:
    """Bytes of each input read once and each output written once (torch tensors)."""
    return sum(t.numel() * t.element_size() for t in [*inputs, *outputs])


def matmul_ideal_bytes_per_flop(block_m: int, block_n: int, element_size: int) -> float:
    """Bytes loaded per FLOP by a (block_m x block_n) output tile that walks K: per K step it
    loads block_m + block_n elements per k and does 2 * block_m * block_n FLOPs per k."""
    return element_size * (block_m + block_n) / (2 * block_m * block_n)
