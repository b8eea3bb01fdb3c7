"""The steps of ``mg.parallelize``'s generated function around tensor parallelism: the model
taken once, the mesh, and data parallelism over the mesh's data dim."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from macrogen.runtime import groups
from macrogen.runtime.mesh import SERIAL, Mesh, carry, mesh
from macrogen.runtime.parallelize.local import local_forward_per_block
from macrogen.vocabulary import DP_MODES

APPLIED_AT = "_mg_parallelized_at"  # on a model mg.parallelize took: the site that took it


def parallelize_once(model: nn.Module, *, where: str) -> None:
    """The model (or a module in it) taken by ``mg.parallelize`` before is an error naming the
    first site: a second application would shard shards, or average gradients twice."""
    for name, module in model.named_modules():
        first = module.__dict__.get(APPLIED_AT)
        if first is not None:
            what = "this model" if not name else f"{name}, a module of this model,"
            raise RuntimeError(
                f"mg.parallelize at {where}: {what} was parallelized already, at {first}: apply"
                " mg.parallelize once, with every degree and the whole plan in one call"
            )
    from macrogen.runtime.materialize import PENDING, check_init

    check_init(model, model.__dict__.get(PENDING), where=where)  # a meta model without init=
    model.__dict__[APPLIED_AT] = where


def device_mesh(*, tp: int = 1, pp: int = 1, planned: bool = False, where: str) -> Mesh:
    """The program's (pipeline x) data x tensor mesh, agreed by every rank before any group:
    the generated function's mesh step, which hands the mesh to every step after it.

    A product of degrees that does not divide the world size is an error on every rank
    before any group is made; ``tp=1`` with a plan in a job of several ranks is a warning
    (the plan would leave every layer whole). ``pp > 1`` tells the mesh its pipeline dim
    first (``@mg.pipeline``'s order: pipeline outermost, tensor innermost).
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mg.parallelize at {where}: {name}={value!r}: expected an int >= 1")
    if not groups.ensure_initialized():
        return SERIAL
    world = dist.get_world_size()
    if world % (tp * pp):  # the same inputs on every rank: the same error, before any group
        what = f"tp={tp}" if pp == 1 else f"pp x tp = {pp} x {tp}"
        launch = "(data x tensor)" if pp == 1 else "(pipeline x data x tensor)"
        raise ValueError(
            f"mg.parallelize at {where}: {what} does not divide the world size {world}:"
            f" launch a multiple of {tp * pp} processes {launch}"
        )
    if planned and tp == 1 and world > 1:
        warnings.warn(
            f"mg.parallelize at {where}: a tensor-parallel plan with tp=1 in a job of {world}"
            " ranks leaves every layer whole; pass tp=N to shard it",
            stacklevel=3,
        )
    try:  # the program's mesh when it has these degrees (made now if none is), else an error
        return mesh(tp, pipeline=pp)
    except ValueError as e:
        raise ValueError(f"mg.parallelize at {where}: {e}") from None


def no_data_parallel(model: nn.Module, mesh: Mesh, *, where: str) -> None:
    """``dp="none"``: nothing keeps the data ranks' replicas equal, so on several they diverge
    (each trains on its own data): a warning naming the site, once per program. The model
    carries its mesh all the same (``mg.mesh(model)``)."""
    carry(model, mesh)
    if mesh.data_size > 1:
        warnings.warn(
            f"mg.parallelize at {where}: dp='none' on {mesh.data_size} data ranks: each trains"
            " its own replica on its own data, and nothing averages their gradients, so the"
            " replicas diverge; pass dp='replicate' (or 'zero1', 'fsdp') to train one model",
            stacklevel=2,
        )


def apply_data_parallel(
    model: nn.Module, mesh: Mesh, mode: str, *, where: str, config: Any = None
) -> nn.Module:
    """Average ``model``'s gradients over the mesh's data dim (``replicate``), or leave the
    optimizer to (``zero1``: ``mg.shard_optimizer`` then reduce-scatters them; with tp > 1,
    each tensor rank's local shards over the data ranks)."""
    from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync

    if mode not in DP_MODES or mode == "fsdp":  # fsdp: macrogen.runtime.fully_sharded
        modes = tuple(m for m in DP_MODES if m != "fsdp")
        raise ValueError(f"mg.parallelize at {where}: dp={mode!r}: expected one of {modes}")
    if mode == "none":
        no_data_parallel(model, mesh, where=where)
        return model
    carry(model, mesh)
    sync = GradientSync(model, config or DataParallelConfig(), where=where, mesh=mesh)
    model.__dict__["_mg_gradient_sync"] = sync
    if mesh.data_size > 1:
        local_forward_per_block(model)
    return model
