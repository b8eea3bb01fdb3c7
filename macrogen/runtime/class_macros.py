"""What ``@data_parallel`` and ``@pipeline`` expand to: decorators of the user's class (it keeps
its name and identity) that run its ``__init__`` inside the construction record of
``macrogen.runtime.class_plans`` (tensor-parallel layers built in it are cut when it ends), then
make the model data-parallel (or fully sharded, or served) or pipelined.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from macrogen.runtime.class_plans import construction, materialize, mesh_for
from macrogen.runtime.mesh import carry


def data_parallel_class(
    config: Any, *, where: str, fully_sharded: Any = None, servers: Any = None
) -> Callable[[type], type]:
    """What ``@data_parallel`` expands to: the class's ``__init__`` run inside ``construction``
    (tensor-parallel layers built in it are cut when it ends), then the model's
    ``GradientSync``; ``_apply`` (``.to()``, ``.half()``) plans new buckets at the next forward.
    ``fully_sharded`` (a ``FullyShardedConfig``, ``shard="full"``): FSDP2's apply instead, as
    ``mg.parallelize(dp="fsdp")``; ``servers`` (paths, a ``ServerConfig``): those tables on
    parameter-server ranks, the rest averaged over the workers. The class object itself is
    returned, under its name."""
    from macrogen.runtime.data_parallel import GradientSync

    def decorate(cls: type) -> type:
        init, apply = cls.__init__, cls._apply  # type: ignore[misc, attr-defined]

        @functools.wraps(init)
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            with construction(self):
                init(self, *args, **kwargs)
            # every parameter exists and tensor-parallel layers are cut: the mesh they were cut
            # on (else the program's, made now) gives the data-parallel group
            mesh = mesh_for(self)
            carry(self, mesh)
            if fully_sharded is not None:
                from macrogen.runtime.fully_sharded import apply_fully_sharded

                apply_fully_sharded(
                    self, mesh, fully_sharded, where=where, macro="@mg.data_parallel"
                )
            elif servers is not None:  # (a server rank does not return from here)
                from macrogen.runtime.param_server import apply_server_tables

                paths, server_config = servers
                apply_server_tables(
                    self, list(paths), server_config, where=where, data_parallel=config
                )
                self.__dict__[_SYNC] = self.__dict__.get("_mg_gradient_sync")
            else:
                self.__dict__[_SYNC] = GradientSync(self, config, where=where, mesh=mesh)
                if mesh.data_size > 1:  # a tensor-parallel model's blocks swap their own
                    from macrogen.runtime.parallelize.local import local_forward_per_block

                    local_forward_per_block(self)

        @functools.wraps(apply)
        def _apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            module = apply(self, *args, **kwargs)
            sync = self.__dict__.get(_SYNC)
            if sync is not None:
                sync.restart()
            return module

        cls.__init__ = __init__  # type: ignore[misc]
        cls._apply = _apply  # type: ignore[attr-defined]
        return cls

    return decorate


_SYNC = "_mg_data_parallel"  # a @data_parallel model's GradientSync


def pipeline_class(config: Any, forward: Any, *, ranks: int, where: str) -> Callable[[type], type]:
    """What ``@pipeline`` expands to: the class's ``__init__`` run inside ``construction`` (the
    whole model, initialized as in a serial run), then, still inside it, the program's mesh
    made with ``ranks`` pipeline ranks (its tensor-parallel layers take their tensor group
    within their stage), the cut planned on the serial layers, the tensor-parallel shards cut,
    and this rank's stage kept (``attach``, given the mesh). The class object itself is
    returned, under its name."""
    from macrogen.runtime import pipeline
    from macrogen.runtime.parallelize.local import is_tensor_parallel
    from macrogen.runtime.parallelize_pipeline import local_forward_per_stage
    from macrogen.runtime.pipeline_plan import forward_cut

    def decorate(cls: type) -> type:
        init = cls.__init__  # type: ignore[misc]

        @functools.wraps(init)
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            pipeline.check_config(config, where=where)
            with construction(self):
                init(self, *args, **kwargs)
                try:  # with its tensor-parallel plans' size=
                    mesh = mesh_for(self, pipeline=ranks)
                    # balanced by the serial layers' parameter counts, as the expansion says
                    cut = forward_cut(self, config.stages, config.split, forward)
                except ValueError as e:
                    raise ValueError(f"pipeline at {where}: {e}") from None
                # the stage cut must see the tensor-parallel shards, cut now (every rank still
                # holds every layer: their rank-agreement check runs on the same modules)
                materialize(self, mesh)
                carry(self, mesh)
                pipe = pipeline.attach(self, config, cut, mesh, where=where)
                if is_tensor_parallel(self) and pipe.layout is not None:
                    # the schedule runs this rank's stage modules, never the model's forward:
                    # each stage swaps its own DTensor parameters for their local shards
                    local_forward_per_stage(self, pipe)

        def full_state_dict(self: nn.Module) -> dict[str, torch.Tensor]:
            """The serial module's state dict (same keys, same order), gathered from every stage."""
            return pipeline.full_state_dict(self)

        def load_full_state_dict(
            self: nn.Module, state_dict: dict[str, Any], strict: bool = True
        ) -> Any:
            """Load a serial module's state dict; each stage keeps its own entries."""
            return pipeline.load_full_state_dict(self, state_dict, strict)

        cls.__init__ = __init__  # type: ignore[misc]
        cls.full_state_dict = full_state_dict  # type: ignore[attr-defined]
        cls.load_full_state_dict = load_full_state_dict  # type: ignore[attr-defined]
        return cls

    return decorate
