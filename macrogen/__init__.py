"""macrogen: expand macros in PyTorch training code into parallel code and Triton kernels.

Import the markers from here (``import macrogen as mg``); they are no-ops at run
time. ``expand_source`` is the pass the CLI, the import hook and autotune share.
"""

from typing import Any

from macrogen.markers import (
    data_parallel,
    define,
    fused_allreduce,
    outer_sgd,
    parallelize,
    pipeline,
    pipeline_step,
    resumable,
    shard,
    shard_optimizer,
    target,
    tensor_parallel,
    tile,
    tunable,
)
from macrogen.version import __version__


def __getattr__(name: str) -> Any:
    # Lazy so that importing the markers does not import libcst and jinja2.
    if name in ("expand_source", "ExpansionError"):
        from macrogen import expand

        return getattr(expand, name)
    if name == "launch":  # rank, world size and device (docs/launching.md); imports torch
        from macrogen.runtime.launch import launch

        return launch
    if name == "load":  # init=mg.load(path) of mg.parallelize: a checkpoint folder's values
        from macrogen.runtime.load import load

        return load
    if name == "mesh":  # mg.mesh(model): the mesh it was parallelized on (.data_rank, ...)
        from macrogen.runtime.mesh import mesh_of

        return mesh_of
    if name == "clip_grad_norm_":  # the serial norm: sharded optimizers, several meshes
        from macrogen.runtime.clip import clip_grad_norm_

        return clip_grad_norm_
    raise AttributeError(f"module 'macrogen' has no attribute {name!r}")


__all__ = [
    "ExpansionError",
    "__version__",
    "clip_grad_norm_",
    "data_parallel",
    "define",
    "expand_source",
    "fused_allreduce",
    "launch",
    "load",
    "mesh",
    "outer_sgd",
    "parallelize",
    "pipeline",
    "pipeline_step",
    "resumable",
    "shard",
    "shard_optimizer",
    "target",
    "tensor_parallel",
    "tile",
    "tunable",
]
