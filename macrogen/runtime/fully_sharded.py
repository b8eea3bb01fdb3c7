"""``mg.parallelize(model, dp="fsdp")`` and ``@mg.data_parallel(shard="full")``: parameters,
gradients and optimizer state sharded over the data ranks, on torch's FSDP2 (``fully_shard``), as
torchtitan shards every model.

    apply_fully_sharded(model, mesh, FullyShardedConfig(...), where="train.py:12")

shards each block of the model's repeated layer list (the ``nn.ModuleList`` of
one class holding the most parameters: HF's ``model.layers``, GPT-2's
``transformer.h``, nanoGPT's ``transformer.h``), or the paths ``shard_units``
names, then the root. Each unit's parameters are gathered for its forward and
backward and freed after (``reshard_after_forward``); gradients are
reduce-scattered, so each rank keeps 1/world of parameters, gradients and
AdamW state: ZeRO-3, with no runtime of macrogen's own.

``dp_replicate=R`` is HSDP: a (replicate x shard) mesh of R x world/R ranks,
parameters sharded within a group of world/R and replicated across the R groups.
``accumulate=k`` skips the gradient reduction on k-1 of every k forwards
(``set_requires_gradient_sync``), as FSDP users do by hand.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from macrogen.runtime import groups
from macrogen.runtime.blocks import repeated_layers
from macrogen.runtime.eager import eager
from macrogen.runtime.mesh import Mesh, carry
from macrogen.runtime.parallelize import is_tensor_parallel, local_forward_per_unit, path_pattern

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class FullyShardedConfig:
    reshard_after_forward: bool = True  # free each unit's gathered parameters after its forward
    mixed_precision: str | None = None  # "bf16"/"fp16": compute in it, reduce gradients in fp32
    cpu_offload: bool = False  # keep the sharded parameters and their gradients in CPU memory
    shard_units: tuple[str, ...] | None = None  # the modules to shard one by one (None: found)
    dp_replicate: int = 1  # > 1: HSDP, that many replicas of a sharded group
    accumulate: int = 1  # reduce gradients on every k-th forward only


def _units(
    model: nn.Module, paths: Sequence[str] | None, where: str
) -> list[tuple[str, nn.Module]]:
    """The modules to shard one by one (``where``: "mg.parallelize at train.py:12")."""
    if paths is None:
        return repeated_layers(model)
    named = dict(model.named_modules())
    found: list[tuple[str, nn.Module]] = []
    problems = []
    for path in paths:
        pattern = path_pattern(path)
        hits = [(n, m) for n, m in named.items() if n and pattern.fullmatch(n)]
        if not hits:
            problems.append(f"shard_units: {path!r} matches no submodule of {type(model).__name__}")
        found += hits
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return found


def _data_mesh(
    mesh: Mesh,
    replicate: int,
    where: str,
    *,
    pipelined: bool = False,
    tensor_parallel: bool = False,
) -> DeviceMesh:
    """The DeviceMesh FSDP shards over: the data dim, or (replicate, shard) for HSDP."""
    whole: DeviceMesh = mesh.device_mesh
    if mesh.pipeline_size > 1:
        if not pipelined:
            raise ValueError(f"{where}: FSDP with pp > 1 shards a @mg.pipeline model only")
        if replicate != 1:
            raise ValueError(
                f"{where}: FSDP of a pipelined model with dp_replicate > 1 is not supported yet"
            )
        if mesh.tensor_size > 1 and not tensor_parallel:  # @tensor_parallel's plain shards
            raise ValueError(
                f"{where}: FSDP of a @mg.pipeline model with @mg.tensor_parallel layers is not"
                " supported yet (mg.parallelize(model, pp=..., tp=..., dp='fsdp', tp_plan=...)"
                " shards a model of undecorated classes)"
            )
        return whole["data"]  # each stage's data group (tensor-parallel DTensors: its 2-D)
    if mesh.tensor_size > 1:  # FSDP x TP: shard over the data dim of the one 2-D mesh
        if replicate != 1:
            raise ValueError(f"{where}: dp_replicate with tp > 1 (HSDP x TP) is not supported yet")
        return whole["data"]
    world = dist.get_world_size()
    if replicate < 1 or world % replicate:
        raise ValueError(
            f"{where}: dp_replicate={replicate} does not divide the world size"
            f" {world}: launch a multiple of {replicate} processes"
        )
    if replicate == 1:
        return whole
    from torch.distributed.device_mesh import init_device_mesh

    device_type = torch.device(groups.placement().device).type
    return init_device_mesh(
        device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


def apply_fully_sharded(
    model: nn.Module,
    mesh: Mesh,
    config: FullyShardedConfig,
    *,
    where: str,
    macro: str = "mg.parallelize",
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (see the module docstring); returns ``model``.

    ``macro`` names the site in errors: ``mg.parallelize``, or ``@mg.data_parallel`` for a
    class of the user's own (``shard="full"``, which calls this at the end of ``__init__``).
    """
    where = f"{macro} at {where}"
    name = type(model).__name__  # (fully_shard makes it FSDP<name>)
    carry(model, mesh)  # (mg.mesh(model))
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from macrogen.runtime.materialize import PENDING

    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta and PENDING not in model.__dict__:  # (mg.parallelize's init= materializes after)
        raise ValueError(
            f"{where}: {len(meta)} parameters are on the meta device ({meta[0]},"
            " ...): build the model on a device, or materialize it first (model.to_empty(device=...)"
            " and the model's own init, as torchtitan does), then parallelize it; or give"
            ' mg.parallelize init=mg.load(path) or init="model"'
        )
    from macrogen.runtime.pipeline import pipeline_of

    pipe = pipeline_of(model)
    if pipe is not None and pipe.layout is not None:
        units = []  # (each stage's, below)
    else:
        units = _units(model, config.shard_units, where)
    if mesh.device_mesh is None:  # serial: one rank holds everything, as the serial program
        return model
    device_mesh = _data_mesh(
        mesh,
        config.dp_replicate,
        where,
        pipelined=pipe is not None,
        tensor_parallel=is_tensor_parallel(model),
    )
    mp = MixedPrecisionPolicy()
    if config.mixed_precision is not None:
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[config.mixed_precision], reduce_dtype=torch.float32
        )
    offload = OffloadPolicy()
    if (
        config.cpu_offload
    ):  # pinned host memory copies fast to an accelerator; without one, can't pin
        offload = CPUOffloadPolicy(pin_memory=device_mesh.device_type != "cpu")
    options: dict[str, Any] = dict(mesh=device_mesh, mp_policy=mp, offload_policy=offload)
    if pipe is not None and pipe.layout is not None:
        return _shard_stages(model, pipe, config, options, where)
    from macrogen.runtime.expert_parallel import expert_parallel_of

    experts = expert_parallel_of(model)
    if experts is not None:  # ep: the experts first, over their replica group
        experts.fully_shard_experts(
            {"reshard_after_forward": config.reshard_after_forward, **options}
        )
    for _, unit in units:
        fully_shard(unit, reshard_after_forward=config.reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, **options)
    model.register_forward_hook(_VisibleOutputs(where))
    _CompileNotice.watch(model, name, units, where)
    _save_pretrained_gathers(model, mesh.tensor_size, device_mesh.size(), config.dp_replicate)
    if is_tensor_parallel(model):  # tensor parallel first (torchtitan's order)
        local_forward_per_unit(model, [unit for _, unit in units] + [model])
    if config.accumulate > 1:
        model.register_forward_pre_hook(_Accumulate(config.accumulate), prepend=True)
    return model


def _save_pretrained_gathers(model: nn.Module, tp: int, dp: int, replicate: int) -> None:
    """A transformers model's ``save_pretrained``, called on every rank as for HF's own FSDP,
    writes the serial weights: its config says the model is sharded (so every rank gathers
    and rank 0 writes, then all wait), and the gather is ``dtensor_whole.full_tensor``'s,
    which keeps the rows of an FSDP x TP packed layer in order (DCP's full state dict, which
    transformers would use, permutes them in torch 2.13). Without this, safetensors is given
    the DTensor shards and fails ("invalid python storage")."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "gather_sharded_state_dict_for_save"):
        return
    from transformers.distributed.configuration_utils import DistributedConfig

    config.distributed_config = DistributedConfig(
        tp_size=tp, fsdp_size=dp // replicate, dp_replicate_size=replicate
    )
    # an attribute of this instance: the model keeps its class, and only its save changes
    model.__dict__["gather_sharded_state_dict_for_save"] = _gathered_for_save


def _gathered_for_save(
    model: nn.Module, state_dict: dict[str, Any], distributed_config: Any, **_: Any
) -> dict[str, torch.Tensor]:
    """The state dict transformers is about to write, whole, on rank 0's CPU ({} on the other
    ranks): one tensor at a time, in the state dict's order, which is the same on every rank."""
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.dtensor_whole import full_tensor

    writer = dist.get_rank() == 0
    whole: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        gathered = full_tensor(value) if isinstance(value, DTensor) else value
        if writer:
            whole[key] = gathered.detach().cpu()
    return whole


class _CompileNotice:
    """Under ``torch.compile`` of the whole model, the forward that calls the sharded units is
    not compiled whole, and the model says so once, at its first compiled forward.

    FSDP2 runs its hooks around each unit's forward eagerly (``torch._dynamo.disable``,
    torch 2.13), so dynamo breaks the graph at each unit's call; called in a loop (a block
    list), that break is one dynamo can't resume from: it runs the whole top-level forward
    eagerly and compiles each unit's own ``forward`` on its own. Nothing is wrong in the
    numbers; the top-level layers (embedding, final norm, head, loss) are simply eager.

    How it knows: a forward pre-hook on the first unit's first submodule, which dynamo
    traces where it compiles that unit's forward (``torch.compiler.is_compiling()``), notes
    the compile; the root's eager forward hook then tells, unless the user compiled the units
    themselves (``block.compile()``, torchtitan's way), where the top-level forward is eager
    by their choice."""

    def __init__(self, name: str, units: list[tuple[str, nn.Module]], where: str):
        self.name = name  # the model's class
        self.units = units  # (path, module) of each sharded unit
        self.where = where
        self.compiled = False  # a unit's forward was traced by dynamo
        self.told = False

    @classmethod
    def watch(
        cls, model: nn.Module, name: str, units: list[tuple[str, nn.Module]], where: str
    ) -> None:
        inner = next((m for m in units[0][1].children()), None) if units else None
        if inner is None:
            return
        notice = cls(name, units, where)
        inner.register_forward_pre_hook(notice.traced)
        model.register_forward_hook(notice.tell)

    def traced(self, module: nn.Module, args: object) -> None:
        # traced where dynamo compiles the unit's forward (a constant True there), a no-op
        # in eager runs
        if torch.compiler.is_compiling():
            self.compiled = True

    @eager
    def tell(self, module: nn.Module, args: object, output: object) -> None:
        if not self.compiled or self.told:
            return
        self.told = True
        if any(getattr(u, "_compiled_call_impl", None) is not None for _, u in self.units):
            return  # the user compiled the units: the eager top level is theirs
        paths = self.units[0][0] + (", ..." if len(self.units) > 1 else "")
        warnings.warn(
            f"{self.where}: under torch.compile, {self.name}.forward runs eagerly: FSDP2 runs"
            f" its hooks around each of the {len(self.units)} sharded units ({paths}) outside"
            " dynamo, which breaks the graph at each unit's call, and dynamo compiles no"
            " forward that calls them in a loop; each unit's own forward is compiled. To"
            " compile just the units and say so, compile each of them before training, as"
            " torchtitan does (`block.compile()`)",
            stacklevel=_user_level(),
        )


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside torch and macrogen: the program's line
    that called the model (the warning points there, not into torch's hooks)."""
    import macrogen

    libraries = (str(Path(torch.__file__).parent), str(Path(macrogen.__file__).parent))
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(libraries):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level


class _VisibleOutputs:
    """FSDP2 finds the tensors of the root's output by pytree (tensors, tuples, lists, dicts,
    dataclasses, HF's ModelOutput) to gather its parameters again for backward. An object
    that keeps its tensors as plain attributes hides them, and backward would fail later
    inside FSDP ("storage of size 0"): say so at the forward, naming the attributes."""

    def __init__(self, where: str):
        self.where = where

    @eager
    def __call__(self, module: nn.Module, args: object, output: Any) -> None:
        from torch.utils._pytree import tree_leaves

        if not torch.is_grad_enabled() or any(
            isinstance(x, torch.Tensor) for x in tree_leaves(output)
        ):
            return
        found = {**vars(type(output)), **getattr(output, "__dict__", {})}
        hidden = [k for k, v in found.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if hidden:
            raise ValueError(
                f"{self.where}: {type(module).__name__}.forward returned a"
                f" {type(output).__name__} whose tensors ({', '.join(hidden)}) FSDP cannot see:"
                " return a tensor, tuple, dict or dataclass (as HF's ModelOutput is)"
            )


class _Accumulate:
    """Gradients are reduced on the k-th training forward of every k (FSDP2's
    ``set_requires_gradient_sync``): the k-1 before accumulate unreduced, sharded by nothing."""

    def __init__(self, k: int):
        self.k, self.seen = k, 0

    @eager
    def __call__(self, module: nn.Module, args: object) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        module.set_requires_gradient_sync(self.seen % self.k == self.k - 1)  # type: ignore[operator]
        self.seen += 1


def _shard_stages(
    model: nn.Module, pipe: Any, config: FullyShardedConfig, options: dict[str, Any], where: str
) -> nn.Module:
    """A ``@mg.pipeline`` model cut to this rank's stages: each stage's blocks (or its
    ``shard_units``), then the stage's module (the schedule's root), sharded within the
    stage's data group. torch's ``PipelineStage`` sees an FSDP module and reduces gradients
    once per step, after the last micro-batch."""
    from torch.distributed.fsdp import fully_shard

    from macrogen.runtime.pipeline_parts import part_at

    if config.accumulate > 1:
        raise ValueError(
            f"{where}: accumulate with a @mg.pipeline model: the pipeline's micro-batches"
            " accumulate already (pipeline(microbatches=...))"
        )
    named = _units(model, config.shard_units, where) if config.shard_units else None
    # FSDP puts new (sharded) parameters in the modules: the pipeline's tied parameters (a
    # weight stages share, its gradients summed over them) are found again after
    tied = [(_holder(model, param), group) for param, group in pipe.tied]
    sharded: list[nn.Module] = []
    for s in pipe.stages:
        stage = pipe.stage_module(s)
        if named is None:  # the repeated blocks this stage runs
            units = [part_at(model, name) for name in pipe.cut.blocks(s)]
        else:
            held = {id(m) for part in stage.parts for m in part.modules()}
            units = [m for _, m in named if id(m) in held]
        for unit in units:
            fully_shard(unit, reshard_after_forward=config.reshard_after_forward, **options)
        sharded += units
        # a bare parameter part stays the model's own attribute: FSDP leaves it, and the
        # pipeline averages its gradient over the data group as without FSDP
        ignored = set(stage.params)
        fully_shard(
            stage,
            reshard_after_forward=config.reshard_after_forward,
            ignored_params=ignored or None,
            **options,
        )
    pipe.tied = [(owner._parameters[key], group) for (owner, key), group in tied]
    pipe.fully_sharded = True
    if is_tensor_parallel(model):  # each unit swaps its gathered DTensors, the stage the rest
        from macrogen.runtime.parallelize_pipeline import local_forward_per_stage

        local_forward_per_stage(model, pipe, sharded)
    return model


def _holder(model: nn.Module, param: nn.Parameter) -> tuple[nn.Module, str]:
    """A module of ``model`` holding ``param``, and its name there."""
    for owner in model.modules():
        for key, held in owner._parameters.items():
            if held is param:
                return owner, key
    raise AssertionError("a tied parameter of the pipeline is in no module of this stage")
