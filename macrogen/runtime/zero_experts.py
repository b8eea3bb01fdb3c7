"""ZeRO-1 over an expert-parallel model (``mg.parallelize(ep=E, dp="zero1")``, tp=1).

With ep, a rank holds its expert group's share of the experts (``Shard(0)`` over "ep"), as do
the D/E ranks of its replica group; every other parameter is whole on all D data ranks. So
the sharded optimizer cuts two kinds of buckets:

    the rest      over the D data ranks       (ZeRO-1 as without ep)
    the experts   over the D/E replica ranks  (each steps 1/(D/E) of its experts, gathers the rest)

An expert's gradient on its rank is already the sum over its expert group's tokens:
``ExpertParameters`` divides it by E and leaves the replica group's average to the experts'
reduce-scatter here (which divides by D/E): the serial gradient on the global batch. Every
expert element then lies in exactly one rank's chunk over the D data ranks (its replica's chunk
of its expert group's experts), so a norm summed over the data group counts it once; and
``state_dict`` takes an expert's pieces from the ranks of its own expert position only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from macrogen.runtime import groups


@dataclass(frozen=True)
class Cut:
    """The group a kind of bucket is cut over, and this rank's place in it."""

    group: dist.ProcessGroup | None
    world: int
    rank: int


@dataclass(frozen=True)
class ExpertCut:
    """The experts' buckets' cut, and which of the optimizer's parameters are experts."""

    cut: Cut
    experts: frozenset[int]  # indices (the optimizer's order) of the experts' parameters
    position: int  # this rank's place in its expert group (whose experts it holds)


def expert_cut(model: nn.Module, order: list[torch.Tensor], where: str) -> ExpertCut | None:
    """The experts' cut for a sharded optimizer over ``order`` (None: no expert parameters);
    from now on the experts' gradients are averaged over their replicas by the optimizer."""
    from macrogen.runtime.expert_modules import AVERAGED_HERE
    from macrogen.runtime.expert_parallel import expert_parallel_of

    experts = frozenset(i for i, p in enumerate(order) if getattr(p, AVERAGED_HERE, False))
    if not experts:
        return None
    state = expert_parallel_of(model)
    if state is None or state.fully_sharded or state.device_mesh.ndim != 2:
        raise ValueError(
            f"{where}: the optimizer holds expert-parallel experts of a model this ZeRO-1 does"
            ' not shard: it runs over mg.parallelize(model, ep=E, dp="zero1") with tp=1'
        )
    state.reduced_by_optimizer = True
    group = state.replica_group
    return ExpertCut(Cut(group, state.replicas, groups.rank(group)), experts, state.rank)
