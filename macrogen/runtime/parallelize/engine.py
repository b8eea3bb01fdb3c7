"""``apply_tensor_parallel``: a plan ``{path: style}`` applied to a built model on one DeviceMesh.

The one entry point every front end lowers onto (``mg.parallelize`` today; the class
decorators' plans next). In order:

1. the plan is resolved against the model (``layout.resolve``: every problem at once) and
   every rank shows the others what it plans (the same plan, the same serial shapes);
2. each layer whose forward is not a known one answers a small random input serially
   (``checks.serial_probe``), before anything is cut;
3. each cut parameter becomes this rank's shard as a DTensor (``Shard(d)``, or
   ``_StridedShard(d, k)`` for k packed blocks) in every module holding it, and every other
   parameter a replicated DTensor, so that whole-model tools (``numel``, ``state_dict``,
   ``save_pretrained``, DCP, ``clip_grad_norm_``) see the serial model;
4. divided attributes are divided, summed gradients marked, planned forwards wrapped
   (``styles``) and the model's forward set to run on local tensors (``local``), with the
   replicated-gradient check on its first backwards (``checks.GradientCheck``);
5. the probed layers answer again on their shards; any difference refuses the plan.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from macrogen.runtime.agreement import Fingerprint, check_agreement
from macrogen.runtime.mesh import Mesh, carry
from macrogen.runtime.parallelize.checks import (
    GradientCheck,
    NoDropout,
    check_probes,
    guard_first_forward,
    needs_probe,
    no_sharded_outputs,
    parallel_problem,
    quietly,
    serial_probe,
)
from macrogen.runtime.parallelize.layout import Cut, Layout, resolve
from macrogen.runtime.parallelize.local import (
    COLWISE,
    TENSOR_PARALLEL,
    attach,
    is_tensor_parallel,
    mark_summed,
)
from macrogen.runtime.parallelize.styles import install


def apply_tensor_parallel(
    model: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, Any],
    *,
    where: str,
    check_gradients: bool = True,
) -> nn.Module:
    """Shard ``model``'s planned layers over the mesh's tensor dim (in place; returns ``model``)."""
    tp = mesh.tensor_size
    layout = resolve(model, plan, tp)  # the checks run serially too: a plan that can't fit
    _check_ranks(model, layout, mesh, where)
    carry(model, mesh)  # (what runs the model later reads its mesh from it)
    if tp == 1:
        return model
    if is_tensor_parallel(model):
        raise RuntimeError(f"mg.parallelize at {where}: this model is tensor-parallel already")
    cut = next((n for n, m in model.named_modules() if is_tensor_parallel(m)), None)
    if cut is not None:  # a @tensor_parallel class's model, sharded when it was built
        raise RuntimeError(
            f"mg.parallelize at {where}: {cut} is a @tensor_parallel class whose shards were cut"
            " when it was built: give the tensor-parallel plan in one place (the decorators, or"
            " tp_plan= on a model of undecorated classes)"
        )
    group, tensor_mesh = mesh.tensor_group, mesh.device_mesh["tensor"]
    assert group is not None  # tp > 1
    # a model built on the meta device has no values to probe with (docs/parallelize.md, init=)
    meta = any(p.is_meta for p in model.parameters())
    if not meta:
        same_on_every_rank(model, group, tensor_mesh.device_type)
    probed = [w for w in layout.wraps if needs_probe(w) and not meta]
    generator = torch.Generator().manual_seed(0)
    with quietly([w.module for w in probed]):
        probes = [serial_probe(w, generator) for w in probed]
    _shard(model, layout, group, tensor_mesh)
    names = {id(m): n for n, m in model.named_modules()}
    check = GradientCheck(group, names, where) if check_gradients else None
    # dropout in the first training forward of the model (or of each FSDP unit, pipeline stage)
    attach(model, list(model.modules()), check, functools.partial(NoDropout, where))
    guard_first_forward(model, names, where)
    model.__dict__[TENSOR_PARALLEL] = True
    with quietly([w.module for w in probed]):
        check_probes(probes, group, where, lambda: [p for p in (parallel_problem(probe, group)
                                                                for probe in probes) if p])  # fmt: skip
    colwise = [(w.name, w.module) for w in layout.wraps if w.style.kind == "colwise"]
    if colwise:
        model.__dict__[COLWISE] = colwise  # (a pipeline's last stage checks its output too)
        model.register_forward_hook(functools.partial(no_sharded_outputs, colwise, where))
    _tell_transformers(model, tp)
    return model


def same_on_every_rank(model: nn.Module, group: dist.ProcessGroup, device_type: str) -> None:
    """Group rank 0's parameters and buffers on every rank of ``group``, before anything is cut
    (torch's ``distribute_tensor`` scatters from rank 0 the same way, DDP broadcasts): ranks that
    built the model from different seeds would otherwise each keep a shard of a different model.
    In place, one broadcast per tensor: no flat copy of the whole model beside it at the build."""
    src, seen = dist.get_global_rank(group, 0), set()
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in seen or t.device.type != device_type:  # (another device: refused below)
                continue
            seen.add(id(t))
            data = t.detach()
            data = data.view(torch.uint8) if data.dtype == torch.bool else data
            sent = data if data.is_contiguous() else data.contiguous()
            dist.broadcast(sent, src=src, group=group)
            if sent is not data:
                data.copy_(sent)


def _shard(model: nn.Module, layout: Layout, group: dist.ProcessGroup, tensor_mesh: Any) -> None:
    tp = dist.get_world_size(group)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in model.modules():
        for key, p in owner._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((owner, key))
    for cut in layout.cuts:
        _cut(cut, group, tensor_mesh, holders)
    replicate_the_rest(model, tensor_mesh)
    for module, key, _ in layout.summed:
        mark_summed(module, key, group)
    for owner, attr, _ in layout.divides:
        object.__setattr__(owner, attr, getattr(owner, attr) // tp)
    for owner, experts in layout.expert_owners.values():
        if isinstance(getattr(owner, "num_experts", None), int):  # its forward: its experts
            object.__setattr__(owner, "num_experts", experts // tp)
        object.__setattr__(
            owner, "_is_expert_parallel", True
        )  # transformers' experts: masked routes
    for wrap in layout.wraps:
        install(wrap, group)


def _cut(cut: Cut, group: dist.ProcessGroup, tensor_mesh: Any, holders: dict[int, Any]) -> None:
    """``module.key`` becomes this rank's shard, as a DTensor parameter, in every module holding it."""
    full = cut.module._parameters[cut.key]
    assert full is not None
    if isinstance(full, DTensor):  # tied to a parameter cut already (the same way: layout._ties)
        return
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    data = full.detach()
    local = torch.cat([b.chunk(size, dim=cut.dim)[rank]
                       for b in data.chunk(cut.blocks, dim=cut.dim)], dim=cut.dim)  # fmt: skip
    placement: Any = (
        Shard(cut.dim) if cut.blocks == 1 else _StridedShard(cut.dim, split_factor=cut.blocks)
    )
    param = dtensor_parameter(full, local.contiguous(), placement, tensor_mesh)
    for owner, held in holders.get(id(full), [(cut.module, cut.key)]):
        owner._parameters[held] = param


def dtensor_parameter(
    full: torch.Tensor, local: torch.Tensor, placement: Any, tensor_mesh: Any
) -> nn.Parameter:
    """``local`` as this rank's part of ``full``: a DTensor parameter with ``placement`` (one, or
    a list of one per mesh dim) on ``tensor_mesh``."""
    if local.device.type not in (tensor_mesh.device_type, "meta"):  # meta: materialized after
        raise RuntimeError(
            f"the model's parameters are on {local.device.type} and the mesh on"
            f" {tensor_mesh.device_type}: move the model to its device (model.to(run.device))"
            " before mg.parallelize"
        )
    placements = list(placement) if isinstance(placement, (list, tuple)) else [placement]
    dt = DTensor.from_local(
        local, tensor_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    return nn.Parameter(dt, requires_grad=full.requires_grad)


def replicate_the_rest(model: nn.Module, device_mesh: Any) -> None:
    """Every parameter not sharded becomes a DTensor replicated on every dim of ``device_mesh``
    (one kind for whole-model tools; tied parameters stay tied). Tensor parallelism's mesh,
    and expert parallelism's (replica x expert) grid."""
    replicated = [Replicate()] * device_mesh.ndim
    onto_mesh(
        model.modules(),
        device_mesh,
        lambda p: None if isinstance(p, DTensor) else (p.detach(), replicated),
    )


def onto_mesh(
    owners: Iterable[nn.Module],
    device_mesh: Any,
    place: Callable[[nn.Parameter], tuple[torch.Tensor, list[Any]] | None],
) -> None:
    """Each parameter of ``owners`` for which ``place`` gives (its local tensor, placements)
    becomes that DTensor on ``device_mesh``; None leaves it. A tied parameter is placed once,
    and every owner holds the one DTensor."""
    made: dict[int, nn.Parameter] = {}
    for owner in owners:
        for key, p in list(owner._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                placed = place(p)
                if placed is None:
                    continue
                made[id(p)] = dtensor_parameter(p, *placed, device_mesh)
            owner._parameters[key] = made[id(p)]


def _check_ranks(model: nn.Module, layout: Layout, mesh: Mesh, where: str) -> None:
    """Every rank must plan the same: the plan, the serial shapes, and divided attributes' serial
    values (``n_head`` 8 on one rank and 4 on another gives equal shapes, different attention)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = tuple(f"{n} {tuple(p.shape)} {p.dtype}" for n, p in model.named_parameters())
    check_agreement(
        Fingerprint(params + tuple(layout.entries), f"tp={mesh.tensor_size}"), group=None,
        where=where,
    )  # fmt: skip


def check_outputs(model: nn.Module, module: nn.Module, *, where: str) -> None:
    """``module`` (a pipeline's last stage) must not send on a colwise layer's sharded output."""
    colwise = model.__dict__.get(COLWISE)
    if colwise:
        module.register_forward_hook(functools.partial(no_sharded_outputs, colwise, where))


def _tell_transformers(model: nn.Module, tp: int) -> None:
    """A transformers model's ``save_pretrained`` gathers DTensor shards into the serial weights
    when its config says it is tensor-parallel (called on every rank, as for HF's own TP)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained"):
        return
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:  # transformers < 5 has no such config: save with state_dict=
        return
    if getattr(config, "distributed_config", None) is None:
        config.distributed_config = DistributedConfig(tp_size=tp)
