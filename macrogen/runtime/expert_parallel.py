"""``mg.parallelize(model, ep=E)``: whole experts dealt over E ranks, tokens routed to them.

The data ranks form a (replica x expert) grid: with D data ranks and ``ep=E``, expert groups
are E contiguous data ranks ([0, 1], [2, 3] for D = 4, E = 2) and replica groups the ranks
holding the same experts ([0, 2], [1, 3]). Every rank trains on its own tokens, as data
parallel does; what changes is where the experts live:

- each experts module (transformers 5's MoE experts: stacked ``(experts, ...)`` parameters,
  called as ``experts(hidden, top_k_index, top_k_weights)`` with global expert ids) keeps the
  experts of its rank of the expert group: its parameters become DTensors ``Shard(0)`` over
  the expert dim (``(Replicate(), Shard(0))`` on the grid), so ``numel``, ``state_dict`` and
  ``clip_grad_norm_`` see the serial model; its forward routes each (token, slot) pair to its
  expert's rank and back (``expert_routing``); experts in an ``nn.ModuleList`` looped over
  in their block's forward are stacked and routed by ``expert_modules``;
- every other parameter is a replicated DTensor on the same grid (one kind of tensor for
  whole-model tools) and the model's forward runs on local tensors (``parallelize.local``);
  data parallel averages those gradients over all D data ranks, as without ``ep``.

With tp > 1 (``expert_tensor``) the grid is made once per tensor rank, ("ep_replicate", "ep",
"tensor"): the experts keep the tensor-parallel plan's cut inside each expert, their routing
runs inside the plan's experts wrapper, and every other parameter keeps its tensor-parallel
placement on the grid.

With ``dp="fsdp"`` the experts are ``Shard(0)`` over ``ep`` alone and FSDP2 shards each experts
module over its replica group, the rest of the model over every data rank (torchtitan's
layout; ``ExpertParallel.fully_shard_experts``, called by ``apply_fully_sharded``). A model built
on the meta device is dealt the same way, and ``init=`` then gives each rank's experts values.

Gradients: a rank's loss is the mean over its own tokens, the serial loss the mean over the D
ranks' tokens. An expert's gradient on its rank is already the sum over its expert group's
tokens (the reverse all-to-all brings every token's gradient to it), so it is summed over the
replica group and divided by D: the serial model's gradient on the global batch. With
``dp="zero1"`` the sharded optimizer's reduce-scatter over the replica group does the sum
(``zero_experts``), and the experts' backward divides by E alone.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.func import functional_call

from macrogen.runtime import groups
from macrogen.runtime.eager import eager
from macrogen.runtime.expert_modules import (
    AVERAGED_HERE,
    deal_expert_lists,
    expert_lists,
    list_problem,
)
from macrogen.runtime.expert_routing import ExpertRouter, Traffic
from macrogen.runtime.expert_tensor import rest_onto_grid, tensor_cut, tensor_problem
from macrogen.runtime.mesh import Mesh, carry
from macrogen.runtime.parallelize.engine import dtensor_parameter, replicate_the_rest
from macrogen.runtime.parallelize.local import OWN_SWAP, attach, weakly_bound
from macrogen.runtime.parallelize.styles import unstyled, wrap_inside

EXPERT_PARALLEL = "_mg_expert_parallel"  # on the model: its ExpertParallel
SWAPPED = "_mg_expert_swap"  # on an experts module: (name, DTensor) while its forward runs


@dataclass
class ExpertParallel:
    """What ``apply_expert_parallel`` did to a model: its groups, experts and routing traffic."""

    size: int  # E: ranks of an expert group
    replicas: int  # D / E: copies of each expert
    rank: int  # this rank's place in its expert group
    group: dist.ProcessGroup
    replica_group: dist.ProcessGroup
    device_mesh: Any  # ("ep_replicate", "ep"), with tp > 1 ("ep_replicate", "ep", "tensor")
    experts: list[tuple[str, nn.Module]] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    fully_sharded: bool = False  # dp="fsdp": each experts module FSDP over its replica group
    # dp="zero1": a sharded optimizer averages the experts' gradients over the replica group
    # (its reduce-scatter), and ExpertParameters divides by E alone (zero_experts)
    reduced_by_optimizer: bool = False

    def fully_shard_experts(self, options: dict[str, Any]) -> None:
        """``dp="fsdp"``: each experts module sharded by FSDP over the replica group (before the
        blocks holding it, so theirs leave it out), as torchtitan shards experts over the data
        ranks modulo ep. FSDP averages over the replicas; an expert's unsharded gradient is
        already the sum over its expert group's tokens, so its forward divides the gradient by
        E (``_to_local``): 1/D of the sum over every data rank's tokens, the serial gradient.
        (Not FSDP's ``set_gradient_divide_factor``: torch 2.13 divides twice on one replica.)"""
        from torch.distributed.fsdp import fully_shard

        replicas = self.device_mesh["ep_replicate"]
        for _, module in self.experts:
            fully_shard(module, **{**options, "mesh": replicas})


def expert_parallel_of(model: nn.Module) -> ExpertParallel | None:
    """The model's expert parallelism (its groups and routing traffic), None without ``ep``."""
    found: ExpertParallel | None = model.__dict__.get(EXPERT_PARALLEL)
    return found


def apply_expert_parallel(
    model: nn.Module, mesh: Mesh, *, ep: int, where: str, dp: str = "replicate"
) -> nn.Module:
    """Deal ``model``'s experts over ``ep`` ranks of the mesh's data dim (in place; returns it).
    ``dp="fsdp"``: the experts are ``Shard(0)`` over ``ep`` alone, and FSDP (applied next, by
    ``apply_fully_sharded``) shards them over the replica group and the rest over every data
    rank; with "replicate" every other parameter is a replicated DTensor on the grid."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"mg.parallelize at {where}: ep={ep!r}: expected an int >= 1")
    if expert_parallel_of(model) is not None:
        raise RuntimeError(f"mg.parallelize at {where}: this model is expert-parallel already")
    found = experts_modules(model)
    lists = expert_lists(model)  # experts in an nn.ModuleList: expert_modules
    if not found and not lists:
        raise ValueError(f"mg.parallelize at {where}: ep={ep}: {_no_experts()}")
    for name, block in lists:
        n = len(block._modules["experts"])  # type: ignore[arg-type]
        problem = list_problem(block) if n % ep == 0 else f"ep={ep} does not divide its {n} experts"
        if problem is not None:
            raise ValueError(f"mg.parallelize at {where}: ep={ep}: {name}: {problem}")
    for name, module in found:
        n = module.__dict__["num_experts"]
        if n % ep:
            raise ValueError(
                f"mg.parallelize at {where}: ep={ep} does not divide the {n} experts of {name}:"
                " pass an ep that divides the expert count"
            )
        problem = weighted_output_problem(module)
        if problem is not None:
            raise ValueError(f"mg.parallelize at {where}: ep={ep}: {name}: {problem}")
    carry(model, mesh)  # (mg.mesh(model))
    if ep == 1 or not groups.ensure_initialized() or dist.get_world_size() == 1:
        return model
    if mesh.pipeline_size > 1:
        raise ValueError(
            f"mg.parallelize at {where}: ep={ep} with pp={mesh.pipeline_size} is not supported"
            " yet: expert parallelism runs with pp=1"
        )
    if mesh.data_size % ep:
        raise ValueError(
            f"mg.parallelize at {where}: ep={ep} does not divide the {mesh.data_size} data ranks:"
            f" launch a multiple of {ep} processes"
        )
    if dp not in ("replicate", "fsdp", "zero1"):
        raise ValueError(
            f"mg.parallelize at {where}: ep={ep} with dp={dp!r} is not supported yet: expert"
            ' parallelism runs with dp="replicate", "zero1" or "fsdp"'
        )
    if mesh.tensor_size > 1:  # tp inside the experts (expert_tensor)
        problem = tensor_problem(found, lists, dp)
        if problem is not None:
            raise ValueError(
                f"mg.parallelize at {where}: ep={ep} with tp={mesh.tensor_size}: {problem}"
            )
    if lists and dp == "fsdp":
        raise ValueError(
            f"mg.parallelize at {where}: ep={ep}: {lists[0][0]}: ep over an nn.ModuleList of"
            ' experts runs with dp="replicate" or "zero1" (stack the experts into one experts'
            ' module for dp="fsdp")'
        )
    state = _groups(ep, mesh)
    state.experts = found
    state.fully_sharded = dp == "fsdp"
    for _, module in found:
        _shard_experts(module, state)
    state.experts += deal_expert_lists(lists, state, ExpertParameters)
    if not state.fully_sharded:  # (FSDP makes the rest DTensors over the data ranks)
        expert_ids = {id(sub) for _, m in state.experts for sub in m.modules()}
        scope = [m for m in model.modules() if id(m) not in expert_ids]
        if mesh.tensor_size > 1:  # tensor parallel's DTensors onto the grid, its swap rescoped
            rest_onto_grid(model, scope, state.device_mesh)
        else:
            replicate_the_rest(model, state.device_mesh)
            attach(model, scope, None)  # the rest of the model runs on local tensors
    model.__dict__[EXPERT_PARALLEL] = state
    _tell_transformers(model, ep)
    return model


def _tell_transformers(model: nn.Module, ep: int) -> None:
    """A transformers model's ``save_pretrained`` (called on every rank) gathers its DTensor
    parameters (``full_tensor``) into the serial weights when its config says it is sharded;
    transformers reads that from a ``DistributedConfig`` with a tensor-parallel size above 1
    (its ``ep_size`` asks for an FSDP mesh we do not use). The config never saves it."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained"):
        return
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:  # transformers < 5: save with state_dict=
        return
    if getattr(config, "distributed_config", None) is None:
        config.distributed_config = DistributedConfig(tp_size=ep)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding stacked experts: an int ``num_experts``, every parameter of their
    own ``(num_experts, ...)``, a forward taking ``(hidden, top_k_index, top_k_weights)``."""
    found = []
    for name, module in model.named_modules():
        n = module.__dict__.get("num_experts")
        params = [p for p in module._parameters.values() if p is not None]
        if not (isinstance(n, int) and not isinstance(n, bool) and n > 0 and params):
            continue
        if all(p.dim() >= 3 and p.shape[0] == n for p in params) and _routed_call(module):
            found.append((name, module))
    return found


def _routed_call(module: nn.Module) -> bool:
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return False
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    return len(positional) >= 4  # self, hidden, top_k_index, top_k_weights


def _no_experts() -> str:
    return (
        "the model has no experts module (stacked (experts, ...) parameters, an int num_experts,"
        " called as experts(hidden, top_k_index, top_k_weights)) and no block with an"
        " nn.ModuleList named experts: ep applies to mixture-of-experts models"
    )


def weighted_output_problem(module: nn.Module) -> str | None:
    """Why ``module``'s output is not the router-weighted sum of its experts' unit-weight
    outputs (routing applies the weights on the tokens' ranks), or None: checked serially, in
    float64 on a copy of its first two experts (a bf16 model's rounding would hide nothing),
    on a small random input, before anything is cut. A model built on the meta device is probed
    with random experts of its shapes (the two properties are the forward's, not its values')."""
    hidden = _hidden_size(module)
    device = next(p for p in module.parameters()).device
    meta = device.type == "meta"
    if hidden is None or (meta and any(b.is_meta for b in module.buffers())):
        return None  # nothing to probe with; the parity tests cover the known families
    k, generator = min(2, module.__dict__["num_experts"]), torch.Generator().manual_seed(0)
    if meta:
        device = torch.device("cpu")
    params = {
        key: _probe_value(p, k, generator) for key, p in module.named_parameters(recurse=False)
    }
    x = torch.randn(5, hidden, generator=generator, dtype=torch.float64).to(device)
    index = torch.stack([torch.randperm(k, generator=generator) for _ in range(5)]).to(device)
    weights = torch.rand(5, k, generator=generator, dtype=torch.float64).to(device)
    n = module.__dict__["num_experts"]
    object.__setattr__(module, "num_experts", k)  # the copy's experts
    try:  # (tp > 1: without the plan's collectives, on whole experts)
        with torch.no_grad(), unstyled(module):
            whole = functional_call(module, params, (x, index, weights))
            parts = [functional_call(module, params, (x, index[:, j : j + 1], weights[:, :1] * 0 + 1))
                     * weights[:, j : j + 1] for j in range(k)]  # fmt: skip
            some = functional_call(module, params, (x[:3], index[:3], weights[:3]))
    finally:
        object.__setattr__(module, "num_experts", n)
    scale = whole.abs().max().item() + 1e-30
    if (whole - sum(parts)).abs().max().item() > 1e-9 * scale:
        return (
            "its output is not the router-weighted sum of its experts' outputs (the weights"
            " are applied inside the experts), which expert parallelism needs"
        )
    if (whole[:3] - some).abs().max().item() > 1e-9 * scale:
        return (
            "a token's output depends on the other tokens of the call (a capacity or batch"
            " statistics inside the experts): expert parallelism runs each rank's experts on"
            " the tokens routed to them, from every rank"
        )
    return None


def _probe_value(p: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """The first ``k`` experts of ``p`` in float64; random ones of its shape when it has no values.
    A tensor-parallel cut of them (a DTensor, cut on another dim) is gathered (every rank
    probes alike)."""
    if isinstance(p, DTensor):
        if p.to_local().is_meta:
            return _probe_value(torch.empty(p.shape, device="meta"), k, generator)
        shape = torch.Size((k, *p.shape[1:]))
        first = DTensor.from_local(p.to_local().detach()[:k], p.device_mesh, p.placements,
                                   run_check=False, shape=shape,
                                   stride=torch.empty(shape, device="meta").stride())  # fmt: skip
        return first.full_tensor().to(torch.float64)
    if not p.is_meta:
        return p.detach()[:k].to(torch.float64)
    scale = 1.0 / math.sqrt(max(p.shape[-1], 1))
    return torch.randn((k, *p.shape[1:]), generator=generator, dtype=torch.float64) * scale


def _hidden_size(module: nn.Module) -> int | None:
    for owner in (module, getattr(module, "config", None)):
        for attr in ("hidden_dim", "hidden_size"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _groups(ep: int, mesh: Mesh) -> ExpertParallel:
    """The (replica x expert [x tensor]) grid's groups, made in the same order on every rank:
    a data rank's tensor ranks are consecutive (``mesh``), so rank = data rank x T + tensor
    rank, and each tensor rank has its own expert and replica groups."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, data_size, tp = dist.get_rank(), mesh.data_size, mesh.tensor_size
    grid = torch.arange(data_size * tp).view(data_size // ep, ep, tp)
    expert_group = replica_group = None
    for line in grid.transpose(1, 2).reshape(-1, ep).tolist():
        g = dist.new_group(line, timeout=groups.timeout())
        if rank in line:
            expert_group = g
    for line in grid.permute(1, 2, 0).reshape(-1, data_size // ep).tolist():
        g = dist.new_group(line, timeout=groups.timeout())
        if rank in line:
            replica_group = g
    assert expert_group is not None and replica_group is not None
    device_type = torch.device(groups.placement().device).type
    dims: list[Any] = [replica_group, expert_group]
    names: tuple[str, ...] = ("ep_replicate", "ep")
    if tp > 1:
        dims, names = [*dims, mesh.tensor_group], (*names, "tensor")
    device_mesh = DeviceMesh.from_group(
        dims, device_type, mesh=grid if tp > 1 else grid[:, :, 0], mesh_dim_names=names
    )
    return ExpertParallel(ep, data_size // ep, (rank // tp) % ep, expert_group, replica_group,
                          device_mesh)  # fmt: skip


def _shard_experts(module: nn.Module, state: ExpertParallel) -> None:
    """The module's stacked parameters become this rank's experts, ``Shard(0)`` over ``ep``;
    its forward routes tokens to them."""
    for key, p in list(module._parameters.items()):
        assert p is not None
        # tp > 1: this tensor rank's cut of every expert (expert_tensor), then its experts
        source, inner = tensor_cut(p, state.device_mesh)
        # a copy, not a view of the serial tensor: the rank keeps its experts' bytes only, and
        # a DTensor over a view at an offset has a nonzero data_ptr() without storage, which
        # DCP's async staging takes for a plain tensor's (resumable's save failed on rank 1)
        chunk = source.chunk(state.size, dim=0)[state.rank]
        local = chunk.clone(memory_format=torch.contiguous_format)
        if state.fully_sharded:  # FSDP adds the replica dim
            param = dtensor_parameter(p, local, [Shard(0)], state.device_mesh["ep"])
        else:
            param = dtensor_parameter(p, local, [Replicate(), Shard(0), *inner], state.device_mesh)
        setattr(param, AVERAGED_HERE, True)
        module._parameters[key] = param
    local_experts = module.__dict__["num_experts"] // state.size
    object.__setattr__(module, "num_experts", local_experts)  # its own forward: local ids
    router = ExpertRouter(state.group, state.rank, state.size, local_experts, state.traffic)
    # tensor parallel's experts wrapper (moe_experts) keeps its collectives around the routing
    if not wrap_inside(module, functools.partial(Routed, router)):
        module.forward = weakly_bound(_routed_forward, module, router, type(module).forward)
    module.register_forward_pre_hook(functools.partial(_to_local, state))
    module.__dict__[OWN_SWAP] = True  # (a recomputed block's swap leaves the experts to it)
    module.register_forward_hook(_restore, always_call=True)


def _routed_forward(
    me: nn.Module,
    router: ExpertRouter,
    forward: Any,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    recv, routes = router.dispatch(hidden, top_k_index)
    ones = torch.ones((recv.shape[0], 1), dtype=top_k_weights.dtype, device=recv.device)
    if recv.shape[0]:
        out = forward(me, recv, routes.recv_experts, ones)
    else:  # no tokens here: one row of zeros keeps the experts in backward (zero gradients,
        # as serially) and the reverse all-to-all in step with the other ranks'
        row = routes.recv_experts.new_zeros((1, 1))
        out = forward(me, recv.sum(dim=0, keepdim=True), row, ones.new_ones((1, 1)))[:0]
    return router.combine(out, routes, top_k_index, top_k_weights, hidden)


@dataclass(frozen=True)
class Routed:
    """``own``, the experts' forward, called on the tokens routed to this rank's experts."""

    router: ExpertRouter
    own: Any  # own(module, hidden, top_k_index, top_k_weights)

    def __call__(self, me: nn.Module, *args: Any) -> torch.Tensor:
        return _routed_forward(me, self.router, self.own, *args)


class ExpertParameters(torch.autograd.Function):
    """The experts' local tensors; backward: the gradient summed over the replica group and
    divided by the data ranks (the serial gradient on the global batch), as a DTensor."""

    @staticmethod
    def forward(ctx: Any, state: ExpertParallel, *params: Any) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.specs = [p._spec for p in params]
        ctx.set_materialize_grads(False)
        return tuple(p.to_local().view_as(p.to_local()) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        state: ExpertParallel = ctx.state
        out: list[Any] = [None]
        present = [g for g in grads if g is not None]
        if state.reduced_by_optimizer:  # ZeRO-1's reduce-scatter averages over the replicas
            scale = 1.0 / state.size
        elif present and state.replicas > 1:
            flat = torch.cat([g.reshape(-1) for g in present])
            dist.all_reduce(flat, group=state.replica_group)
            present = [p.view_as(g) for p, g in zip(flat.split([g.numel() for g in present]),
                                                    present)]  # fmt: skip
        if not state.reduced_by_optimizer:
            scale = 1.0 / (state.size * state.replicas)
        summed = iter(present)
        for g, spec in zip(grads, ctx.specs):
            out.append(None if g is None else DTensor(next(summed) * scale, spec,
                                                      requires_grad=False))  # fmt: skip
        return tuple(out)


class ScaledGradients(torch.autograd.Function):
    """The tensors as they are; backward: their gradients times ``scale``."""

    @staticmethod
    def forward(ctx: Any, scale: float, *tensors: Any) -> tuple[torch.Tensor, ...]:
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        return (None, *(None if g is None else g * ctx.scale for g in grads))


@eager
def _to_local(state: ExpertParallel, module: nn.Module, args: Any) -> None:
    _restore(module)
    held: list[tuple[str, Any]] = [
        (k, p) for k, p in module._parameters.items() if isinstance(p, DTensor)
    ]
    if not held:
        return
    params = [p for _, p in held]
    if state.fully_sharded:  # FSDP's unsharded parameters; it averages over the replicas
        scaled = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        tensors = [p.to_local() for p in params]
        if scaled:
            tensors = ScaledGradients.apply(1.0 / state.size, *tensors)  # type: ignore[no-untyped-call]
    elif torch.is_grad_enabled() and any(p.requires_grad for p in params):
        tensors = ExpertParameters.apply(state, *params)  # type: ignore[no-untyped-call]
    else:
        tensors = [p.to_local() for p in params]
    for (key, _), t in zip(held, tensors):
        module._parameters[key] = t
    module.__dict__[SWAPPED] = held


@eager
def _restore(module: nn.Module, *_: Any) -> None:
    for key, p in module.__dict__.pop(SWAPPED, ()):
        module._parameters[key] = p
