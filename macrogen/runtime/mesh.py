"""The program's one mesh: torch's ``DeviceMesh`` over (pipeline x) data x tensor.

With world size W and tensor-parallel size T, ranks form a (W/T) x T grid:

    tensor groups (contiguous):  [0, 1], [2, 3]        (W = 4, T = 2)
    data groups (strided):       [0, 2], [1, 3]

Contiguous tensor groups keep the chatty tensor-parallel collectives on
neighbouring ranks (the same node, under torchrun). Every runtime piece takes
its group from the dimension it needs: tensor-parallel layers from the
mesh's ``tensor_group``, data-parallel modules from its ``data_group``
(different tensor-parallel ranks hold different shards, never to be averaged).

A pipelined program asks for its mesh with its pipeline stages
(``mesh(size, pipeline=P)``: ``mg.parallelize(pp=P)``'s ``device_mesh``, a
``@pipeline`` class once its ``__init__`` ran, before its tensor-parallel
layers are cut): P x D x T, pipeline outermost, tensor innermost: rank =
(stage * D + data rank) * T + tensor rank. With P = 2, D = 1, T = 2, tensor
groups are [0, 1] and [2, 3] (one per stage), pipeline groups [0, 2] and
[1, 3] (the peers that send each other activations). The pipeline receives
that mesh; nothing declares stages ahead of it.

The mesh is made once per program, by the first apply step that asks for it
(``mesh``: ``mg.parallelize``'s ``device_mesh``, the class decorators' construction
end, the parameter servers' split), and the same one is given to the next model; a
model asking for another shape is an error. Only those apply steps and the user's
``mg.mesh()`` call ``mesh``: nothing finds a mesh through it. Each step hands the mesh
on to what it sets up (a ``GradientSync``, the pipeline, FSDP's mesh), and the model
carries it (``carry``, set where its plan is applied; ``mg.mesh(model)`` reads it), so
what runs a model reads its groups from the model it holds. Before any group is
made, every rank shows the others what it asks for (``size=``,
``$MACROGEN_TP_SIZE`` and the pipeline stages): ranks that disagree get the
same clear error, instead of some waiting in ``new_group`` while others wait in
a collective. A monitored barrier first names a rank that is stopped or hung
(``MACROGEN_TIMEOUT``), and every group gets that timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime import environment, groups

SIZE_ENV = "MACROGEN_TP_SIZE"  # the tensor-parallel degree when the plan gives no size= (else 1)


class MeshMismatchError(RuntimeError):
    """Ranks asked for different meshes (tensor-parallel sizes)."""


@dataclass(frozen=True)
class Mesh:
    data_size: int  # ranks holding the same shards (data-parallel replicas)
    tensor_size: int  # ranks splitting one layer (the tensor-parallel degree)
    tensor_group: dist.ProcessGroup | None  # this rank's tensor group; None: degree 1 or serial
    data_group: dist.ProcessGroup | None  # this rank's data group; None: the default group
    data_rank: int = 0  # which share of the data this rank trains on: (rank // T) % D
    pipeline_size: int = 1  # pipeline stages (@pipeline's)
    pipeline_group: dist.ProcessGroup | None = None  # this rank's pipeline group; None: 1 stage
    # torch's DeviceMesh, dims ("data",), ("data", "tensor"), ("pipeline", "data") or
    # ("pipeline", "data", "tensor"); None: serial
    device_mesh: Any = None
    pipeline_rank: int = 0  # this rank's stage: rank // (D * T)

    def __deepcopy__(self, memo: dict[int, Any]) -> Mesh:
        """A copy of a model that carries its mesh (an EMA twin) runs on the same mesh: process
        groups are the job's, not copied."""
        return self

    @property
    def shape(self) -> tuple[int, int, int]:
        """(pipeline, data, tensor) sizes."""
        return (self.pipeline_size, self.data_size, self.tensor_size)


SERIAL = Mesh(1, 1, None, None)

CARRIED = "_mg_mesh"  # on a model: the mesh its plan was applied on (mg.parallelize, the classes)


def carry(model: Any, mesh: Mesh) -> None:
    """``model`` holds the mesh it was parallelized on: what it runs with reads it from there."""
    model.__dict__[CARRIED] = mesh


def carried(model: Any) -> Mesh | None:
    """The mesh ``model`` was parallelized on (None: no plan applied to it yet)."""
    found = model.__dict__.get(CARRIED)
    return found if isinstance(found, Mesh) else None


def mesh_of(model: Any = None) -> Mesh:
    """``mg.mesh(model)``: the mesh ``model`` was parallelized on (its ``data_rank`` of
    ``data_size`` is the share of the data this rank trains on); in a serial run, where the
    markers apply nothing (the unexpanded program), ``SERIAL``. ``mg.mesh()``: the program's
    mesh, made now if no model made it yet (every rank must call it then)."""
    if model is None:
        return mesh()
    found = carried(model)
    if found is not None:
        return found
    if not groups.ensure_initialized() or dist.get_world_size() == 1:
        return SERIAL
    raise ValueError(
        f"mg.mesh(model): this {type(model).__name__} carries no mesh: it was not parallelized"
        " (mg.parallelize(model, ...), or a class decorator's plan applied when it was built);"
        " mg.mesh() is the program's mesh"
    )


_mesh: Mesh | None = None  # the program's mesh, once made (like torch's own mesh registry)


def tensor_parallel_size(requested: int | None, world: int, pipeline_size: int = 1) -> int:
    """``size=`` from the plan, else $MACROGEN_TP_SIZE from the launch, else 1.

    Not the world size by default: with ``@data_parallel`` in the same program
    that would silently make every rank a tensor-parallel peer fed different
    data. Like Megatron-LM and torchtitan, tensor parallelism is asked for.
    """
    if requested is None:
        requested = environment.whole(SIZE_ENV, 1, low=1, blank_is_unset=True)
    if pipeline_size > 1 and requested >= 1 and (world // pipeline_size) % requested:
        raise ValueError(
            f"tensor-parallel size {requested} does not divide the {world // pipeline_size} ranks"
            f" of each of {pipeline_size} pipeline stages: launch a multiple of"
            f" {pipeline_size * requested} processes (pipeline x data x tensor)"
        )
    if requested < 1 or world % requested:
        raise ValueError(
            f"tensor-parallel size {requested} does not divide the world size {world}:"
            f" launch a multiple of {requested} processes (data x tensor)"
        )
    return requested


def mesh(size: int | None = None, *, pipeline: int | None = None) -> Mesh:
    """The program's mesh, made on first use; a later ``size`` (or ``pipeline``) must be the
    mesh's. For apply steps, which hand it on, and ``mg.mesh()``; never to look a mesh up.

    ``size=None`` takes the mesh as it is, or, when none exists yet, makes it with
    $MACROGEN_TP_SIZE (else 1); ``pipeline`` is its pipeline stages (None: as it is, else 1).
    With one rank the program is serial: any pipeline stages stay whole.
    """
    global _mesh
    if not groups.ensure_initialized():
        return SERIAL  # run without torchrun: serial
    world = dist.get_world_size()
    if world == 1:
        pipeline = None  # one rank holds every stage
    if _mesh is not None:
        if size is not None and size != _mesh.tensor_size:
            raise ValueError(
                f"this program already uses tensor-parallel size {_mesh.tensor_size};"
                f" a module asks for {size}: one mesh per program"
            )
        if pipeline is not None and pipeline != _mesh.pipeline_size:
            raise ValueError(
                f"this program's mesh (pipeline, data, tensor) = {_mesh.shape} has"
                f" {_mesh.pipeline_size} pipeline stage(s), and a model asks for {pipeline}:"
                " one mesh per program, made by its first parallel module (or mg.mesh()):"
                " build the pipelined model first"
            )
        return _mesh
    stages = pipeline or 1
    if world % stages:
        raise ValueError(
            f"world size {world} does not divide into {stages} pipeline stages:"
            f" launch a multiple of {stages} processes (pipeline x data)"
        )
    tensor_size = agree_on_tensor_size(size, world, stages)
    _mesh = build(world, tensor_size, stages)
    return _mesh


def agree_on_tensor_size(size: int | None, world: int, pipeline_size: int = 1) -> int:
    """Every rank's request, compared on every rank before any group exists; the agreed size."""
    request = (size, environment.text(SIZE_ENV) or "", pipeline_size)
    if world > 1:
        groups.barrier("macrogen: building the data x tensor mesh")
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, request)
        if any(r != gathered[0] for r in gathered):
            asks = "; ".join(f"rank {r}: {_describe(q)}" for r, q in enumerate(gathered))
            what = "tensor-parallel sizes" if len({q[2] for q in gathered}) == 1 else "meshes"
            raise MeshMismatchError(
                f"ranks ask for different {what} ({asks}). Set {SIZE_ENV}"
                f" the same on every rank (torchrun passes one environment to all)"
                f" (raised on rank {dist.get_rank()})"
            )
    # same inputs on every rank: same size or same error
    return tensor_parallel_size(size, world, pipeline_size)


def _describe(request: tuple[int | None, str, int]) -> str:
    size, env, stages = request
    env_text = f"{SIZE_ENV}={env}" if env else f"{SIZE_ENV} unset"
    text = f"size={size}, {env_text}" if size is not None else env_text
    return text if stages == 1 else f"{text}, {stages} pipeline stages"


def build(world: int, tensor_size: int, pipeline_size: int = 1) -> Mesh:
    """The groups of a P x world/(P T) x T mesh and torch's DeviceMesh over them (on every rank)."""
    if pipeline_size > 1:
        return _build_3d(world, tensor_size, pipeline_size)
    data_size, rank = world // tensor_size, dist.get_rank()
    device_type = torch.device(groups.placement().device).type
    if tensor_size == 1:  # data parallel (or replicated) only: the default group is the data group
        device_mesh = _device_mesh(device_type, dist.group.WORLD, torch.arange(world), ("data",))
        return Mesh(data_size, 1, None, None, rank, device_mesh=device_mesh)
    grid = torch.arange(world).view(data_size, tensor_size)  # (data, tensor)
    # One group per row (tensor) and per column (data), made in the same order on every rank.
    # Even a data size of 1 gets its (one-rank) groups: the default group would mix shards.
    tensor_group = data_group = None
    for line in grid.tolist():
        g = dist.new_group(line, timeout=groups.timeout())
        if rank in line:
            tensor_group = g
    for line in grid.t().tolist():
        g = dist.new_group(line, timeout=groups.timeout())
        if rank in line:
            data_group = g
    device_mesh = _device_mesh(device_type, [data_group, tensor_group], grid, ("data", "tensor"))
    return Mesh(data_size, tensor_size, tensor_group, data_group, rank // tensor_size,
                device_mesh=device_mesh)  # fmt: skip


def _build_3d(world: int, tensor_size: int, stages: int) -> Mesh:
    """(pipeline, data, tensor), pipeline outermost: each stage's ranks are a data x tensor mesh.

    Every dimension gets its groups, even of one rank (the default group would mix
    stages or shards), made dimension by dimension in the same order on every rank.
    """
    data_size, rank = world // (stages * tensor_size), dist.get_rank()
    grid = torch.arange(world).view(stages, data_size, tensor_size)
    dims = [0, 1, 2] if tensor_size > 1 else [0, 1]  # no tensor dim: @pipeline's 2-D mesh
    mine: list[Any] = []
    for dim in dims:
        lines = grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
        for line in lines:
            g = dist.new_group(line, timeout=groups.timeout())
            if rank in line:
                mine.append(g)
    names = ("pipeline", "data", "tensor")[: len(dims)]
    device_type = torch.device(groups.placement().device).type
    shaped = grid if tensor_size > 1 else grid[:, :, 0]
    device_mesh = _device_mesh(device_type, mine, shaped, names)
    pipeline_group, data_group = mine[0], mine[1]
    return Mesh(data_size, tensor_size, mine[2] if tensor_size > 1 else None, data_group,
                (rank // tensor_size) % data_size, stages, pipeline_group, device_mesh,
                rank // (data_size * tensor_size))  # fmt: skip


def _device_mesh(
    device_type: str, dim_groups: Any, grid: torch.Tensor, names: tuple[str, ...]
) -> Any:
    """torch's DeviceMesh over groups already made (for DTensor users); None when serial."""
    if grid.numel() == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dim_groups, device_type, mesh=grid, mesh_dim_names=names)


def reset() -> None:
    """Forget the mesh (tests that build several programs in one process)."""
    global _mesh
    _mesh = None
