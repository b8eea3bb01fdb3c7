"""What expanded code imports: the one module generated files name, ``macrogen.runtime``.

    from macrogen.runtime import PipelineConfig, pipeline_class   # as an expanded file reads

Every name a macro's expansion may import is listed in ``EXPORTS`` with the module that
defines it; a macro asks the pass for it (``ctx.import_from("macrogen.runtime", name)``), and
the pass refuses a name not listed here, or a runtime module named directly. The modules
behind them stay the runtime's own concern (one concept each; users step into them): a
name is loaded with its module on first use, so an expanded file that only fuses an
all-reduce imports no pipelining, and importing this package imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the runtime module that defines it (the expansions' imports, by macro)
EXPORTS: dict[str, str] = {
    # @data_parallel, @pipeline: the class decorators
    "data_parallel_class": "class_macros",
    "pipeline_class": "class_macros",
    "DataParallelConfig": "data_parallel",
    "FullyShardedConfig": "fully_sharded",
    "OuterSGD": "local_sgd",
    "ServerConfig": "param_server",
    # @pipeline: forward's statements, as the runtime cuts them
    "PipelineConfig": "pipeline",
    "Forward": "pipeline",
    "Statement": "pipeline",
    # @tensor_parallel: the class decorator (its plan in the engine's styles), forward's collectives
    "tensor_parallel_class": "class_plans",
    "gather_last_dim": "collectives",
    "as_sharded_dtensor": "collectives",
    "vocab_parallel_cross_entropy": "collectives",
    # mg.parallelize: the steps its generated function takes
    "parallelize_once": "parallelize",
    "device_mesh": "parallelize",
    "apply_tensor_parallel": "parallelize",
    "hf_plan": "parallelize",
    "apply_data_parallel": "parallelize",
    "no_data_parallel": "parallelize",
    "apply_recompute": "recompute",
    "serial_copy": "first_forward",
    "check_first_forward": "first_forward",
    "apply_pipeline": "parallelize_pipeline",
    "apply_fully_sharded": "fully_sharded",
    "apply_server_tables": "param_server",
    "apply_expert_parallel": "expert_parallel",
    "check_init": "materialize",  # init=: a meta-device model's values
    "apply_init": "materialize",
    # fused_allreduce, shard_optimizer, resumable
    "FusedAllReduce": "fused",
    "shard_optimizer": "zero",
    "resumable": "checkpoint",
    # @tile: Triton where it runs, the torch path elsewhere
    "triton": "triton_support",
    "tl": "triton_support",
    "use_triton": "triton_support",
    "interpreting": "triton_support",
    "int64_offsets": "triton_support",
}

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    """An exported name, loaded with its module (a submodule's own name is no export: Python
    then imports the submodule)."""
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'macrogen.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # (once: the next lookup is the module's own)
    return value


if TYPE_CHECKING:  # what the names are, for a type checker reading an expanded file
    # (triton and tl: triton's own modules, or stand-ins where triton is missing)
    from macrogen.runtime.checkpoint import resumable as resumable
    from macrogen.runtime.class_macros import data_parallel_class as data_parallel_class
    from macrogen.runtime.class_macros import pipeline_class as pipeline_class
    from macrogen.runtime.class_plans import tensor_parallel_class as tensor_parallel_class
    from macrogen.runtime.collectives import as_sharded_dtensor as as_sharded_dtensor
    from macrogen.runtime.collectives import gather_last_dim as gather_last_dim
    from macrogen.runtime.collectives import (
        vocab_parallel_cross_entropy as vocab_parallel_cross_entropy,
    )
    from macrogen.runtime.data_parallel import DataParallelConfig as DataParallelConfig
    from macrogen.runtime.expert_parallel import apply_expert_parallel as apply_expert_parallel
    from macrogen.runtime.first_forward import check_first_forward as check_first_forward
    from macrogen.runtime.first_forward import serial_copy as serial_copy
    from macrogen.runtime.fully_sharded import FullyShardedConfig as FullyShardedConfig
    from macrogen.runtime.fully_sharded import apply_fully_sharded as apply_fully_sharded
    from macrogen.runtime.fused import FusedAllReduce as FusedAllReduce
    from macrogen.runtime.local_sgd import OuterSGD as OuterSGD
    from macrogen.runtime.materialize import apply_init as apply_init
    from macrogen.runtime.materialize import check_init as check_init
    from macrogen.runtime.parallelize import apply_data_parallel as apply_data_parallel
    from macrogen.runtime.parallelize import apply_tensor_parallel as apply_tensor_parallel
    from macrogen.runtime.parallelize import device_mesh as device_mesh
    from macrogen.runtime.parallelize import hf_plan as hf_plan
    from macrogen.runtime.parallelize import no_data_parallel as no_data_parallel
    from macrogen.runtime.parallelize import parallelize_once as parallelize_once
    from macrogen.runtime.parallelize_pipeline import apply_pipeline as apply_pipeline
    from macrogen.runtime.param_server import ServerConfig as ServerConfig
    from macrogen.runtime.param_server import apply_server_tables as apply_server_tables
    from macrogen.runtime.pipeline import Forward as Forward
    from macrogen.runtime.pipeline import PipelineConfig as PipelineConfig
    from macrogen.runtime.pipeline import Statement as Statement
    from macrogen.runtime.recompute import apply_recompute as apply_recompute
    from macrogen.runtime.triton_support import int64_offsets as int64_offsets
    from macrogen.runtime.triton_support import interpreting as interpreting
    from macrogen.runtime.triton_support import use_triton as use_triton
    from macrogen.runtime.zero import shard_optimizer as shard_optimizer
