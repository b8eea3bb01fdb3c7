"""The data x tensor mesh: which ranks share a tensor-parallel group, which a data group.

With world size W and tensor-parallel size T, ranks form a (W/T) x T grid:

    tensor groups (contiguous):  [0, 1], [2, 3]        (W = 4, T = 2)
    data groups (strided):       [0, 2], [1, 3]

Contiguous tensor groups keep the chatty tensor-parallel collectives on
neighbouring ranks (the same node, under torchrun). The mesh is made once per
program, the first time a tensor-parallel module is built; every rank builds
its modules in the same order, so every rank calls ``new_group`` in the same
order, as torch.distributed requires. Making it also tells data-parallel modules
(``groups.set_data_parallel_group``) to reduce over the data group only:
different tensor-parallel ranks hold different shards, never to be averaged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from macrogen.runtime import groups

SIZE_ENV = "MACROGEN_TP_SIZE"  # the tensor-parallel degree when the plan gives no size= (else 1)


@dataclass(frozen=True)
class Mesh:
    data_size: int  # ranks holding the same shards (data-parallel replicas)
    tensor_size: int  # ranks splitting one layer (the tensor-parallel degree)
    tensor_group: dist.ProcessGroup | None  # this rank's tensor group; None: degree 1 or serial
    data_group: dist.ProcessGroup | None  # this rank's data group; None: the default group
    data_rank: int = 0  # which share of the data this rank trains on: rank // tensor_size


_mesh: Mesh | None = None


def tensor_parallel_size(requested: int | None, world: int) -> int:
    """``size=`` from the plan, else $MACROGEN_TP_SIZE from the launch, else 1.

    Not the world size by default: with ``@data_parallel`` in the same program
    that would silently make every rank a tensor-parallel peer fed different
    data. Like Megatron-LM and torchtitan, tensor parallelism is asked for.
    """
    if requested is None:
        env = os.environ.get(SIZE_ENV, "").strip()
        if env and (not env.isdigit() or int(env) < 1):
            raise ValueError(f"{SIZE_ENV}={env!r}: expected a positive integer")
        requested = int(env) if env else 1
    if requested < 1 or world % requested:
        raise ValueError(
            f"tensor-parallel size {requested} does not divide the world size {world}:"
            f" launch a multiple of {requested} processes (data x tensor)"
        )
    return requested


def mesh(size: int | None = None) -> Mesh:
    """The program's mesh, made on first use; later calls must ask for the same size."""
    global _mesh
    if not groups.ensure_initialized():
        return Mesh(1, 1, None, None)  # run without torchrun: serial
    world = dist.get_world_size()
    tensor_size = tensor_parallel_size(size, world)
    if _mesh is not None:
        if _mesh.tensor_size != tensor_size:
            raise ValueError(
                f"this program already uses tensor-parallel size {_mesh.tensor_size};"
                f" a module asks for {tensor_size}: one mesh per program"
            )
        return _mesh
    data_size, rank = world // tensor_size, dist.get_rank()
    if tensor_size == 1:  # data parallel (or replicated) only: the default group is the data group
        _mesh = Mesh(data_size, 1, None, None, rank)
        groups.set_data_parallel_group(None)
        return _mesh
    tensor_group = data_group = None
    for d in range(data_size):  # same order on every rank
        g = dist.new_group([d * tensor_size + t for t in range(tensor_size)])
        if rank // tensor_size == d:
            tensor_group = g
    for t in range(tensor_size):
        g = dist.new_group([d * tensor_size + t for d in range(data_size)])
        if rank % tensor_size == t:
            data_group = g
    _mesh = Mesh(data_size, tensor_size, tensor_group, data_group, rank // tensor_size)
    groups.set_data_parallel_group(data_group)
    return _mesh


def tensor_parallel_group(size: int | None = None) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (None when serial or when the degree is 1)."""
    m = mesh(size)
    return m.tensor_group if m.tensor_size > 1 else None


def reset() -> None:
    """Forget the mesh (tests that build several programs in one process)."""
    global _mesh
    _mesh = None
    groups.set_data_parallel_group(None)
