"""``mg.launch()``: rank, world size and device, before the model is built.

    import macrogen as mg

    run = mg.launch()                 # under torchrun, or plain `python train.py`
    model = GPT(config).to(run.device)
    x = x[run.rank :: run.world_size]  # this rank's share of the data

Under torchrun it initializes the default process group from torchrun's
environment (``runtime.groups.placement``: one GPU per rank with
``cpu:gloo,cuda:nccl``, gloo on CPUs) and makes this rank's GPU current. Run
without torchrun it is world size 1, and it still makes a process group of one
rank (on an in-memory store), so ``dist.all_reduce`` in the unexpanded program
works and leaves its tensor as it is, as it does with one rank. Calling it
again returns the same answer. A program that made its own group keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from macrogen.runtime import environment, groups, shutdown


@dataclass(frozen=True)
class Launch:
    rank: int  # this process among all of them (RANK)
    world_size: int  # processes in all (WORLD_SIZE); 1 without torchrun
    local_rank: int  # this process on its node (LOCAL_RANK): which GPU it uses
    local_world_size: int  # processes on this node (LOCAL_WORLD_SIZE)
    device: torch.device  # where this rank's model and data go: cuda:N or cpu
    backend: str  # the default group's backend: "cpu:gloo,cuda:nccl", "gloo", ...
    note: str = ""  # why the placement is not one GPU per rank, when it is not

    def describe(self) -> str:
        """One line for a log: 'rank 1 of 2 on cuda:0 (backend gloo)'."""
        text = f"rank {self.rank} of {self.world_size} on {self.device} (backend {self.backend})"
        return f"{text}; {self.note}" if self.note else text


def launch() -> Launch:
    """This process's place in the job; initializes the default group if nobody has."""
    where = groups.placement()
    own_group = dist.is_available() and dist.is_initialized()
    if not groups.ensure_initialized():  # not under torchrun, no group of the program's own
        groups.init(where, store=dist.HashStore(), rank=0, world_size=1)
    shutdown.at_exit()  # the program's own group too: gloo's threads put down before exit
    device = torch.device(where.device)
    if own_group and where.cuda_ordinal is not None:
        if torch.cuda.is_initialized():  # the program chose its GPU: keep it
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            torch.cuda.set_device(where.cuda_ordinal)
    return Launch(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=environment.whole("LOCAL_RANK", 0, low=0),
        local_world_size=environment.whole("LOCAL_WORLD_SIZE", None, low=1)
        or dist.get_world_size(),
        device=device,
        backend=str(dist.get_backend()),
        note=where.note,
    )
