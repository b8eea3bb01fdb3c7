"""Tokens to their experts' ranks and back: the two all-to-alls of expert parallelism.

Each rank holds a contiguous range of the experts (rank r of the expert group: experts
``r * L .. r * L + L - 1``, L local experts) and its own tokens. An experts module's call
``experts(hidden, top_k_index, top_k_weights)`` (transformers 5's convention: global expert
ids, one row per token) becomes, on every rank of the group:

1. each (token, slot) pair sorted by its expert id, so pairs for one rank are contiguous and,
   within them, grouped by expert (a stable sort: token order kept inside each expert);
2. the per-expert counts exchanged (one small all-to-all), which gives every split size;
3. the pairs' hidden states sent to their experts' ranks (``all_to_all_single``, uneven
   splits), run there by the experts module's own forward, top-1 with unit weights on local
   expert ids;
4. the outputs sent back by a second all-to-all, put back in (token, slot) order, weighted by
   the router's weights and summed per token in increasing expert order, as transformers'
   serial loop adds them (``index_add_`` of expert 0, then 1, ...).

Both all-to-alls are ``AllToAll`` nodes whose backward is the reverse all-to-all: gradients
reach the rank that holds each token exactly. Nothing is dropped: every pair is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Bytes this rank handed to the routing all-to-alls since the last ``reset``."""

    dispatched: int = 0  # forward, tokens to their experts (every routed pair, own rank's too)
    combined: int = 0  # forward, expert outputs back to their tokens' ranks
    backward: int = 0  # both all-to-alls' backward (their gradients)
    remote: int = 0  # of dispatched + combined, the bytes that leave this rank
    counts: int = 0  # the per-expert count exchanges
    pairs: int = 0  # (token, slot) pairs this rank routed

    def __str__(self) -> str:
        return (
            f"all-to-all bytes: {self.dispatched} dispatched, {self.combined} combined,"
            f" {self.backward} in backward ({self.remote} of the forward's to other ranks),"
            f" {self.counts} of counts; {self.pairs} routed pairs"
        )

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_sizes: list[int],
        in_sizes: list[int],
        group: dist.ProcessGroup,
        traffic: Traffic,
    ) -> torch.Tensor:
        ctx.sizes, ctx.group, ctx.traffic = (out_sizes, in_sizes), group, traffic
        return _exchange(x.contiguous(), out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_sizes, in_sizes = ctx.sizes
        ctx.traffic.backward += grad.numel() * grad.element_size()
        return _exchange(grad.contiguous(), in_sizes, out_sizes, ctx.group), None, None, None, None


def _exchange(
    x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_sizes, in_sizes, group=group)
    return out


@dataclass
class Routes:
    """One call's routing: what the way back needs."""

    order: torch.Tensor  # (pairs,) the pairs sorted by expert id
    send_sizes: list[int]  # rows to each rank of the group
    recv_sizes: list[int]  # rows from each rank
    recv_experts: torch.Tensor  # (received rows, 1) the local expert of each received row


class ExpertRouter:
    """Routes one experts module's calls over its expert group (see the module docstring)."""

    def __init__(
        self, group: dist.ProcessGroup, rank: int, size: int, local_experts: int, traffic: Traffic
    ):
        self.group, self.rank, self.size = group, rank, size
        self.local_experts = local_experts
        self.traffic = traffic

    def dispatch(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor
    ) -> tuple[torch.Tensor, Routes]:
        """This rank's (token, slot) pairs' hidden states to their experts' ranks."""
        k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        send = hidden[order // k]
        experts = self.local_experts * self.size
        counts = torch.bincount(ids, minlength=experts).view(self.size, self.local_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        self.traffic.counts += counts.numel() * counts.element_size()
        send_sizes = counts.sum(dim=1).tolist()
        recv_sizes = received.sum(dim=1).tolist()
        row = send.element_size() * (send.numel() // max(send.shape[0], 1))
        self.traffic.pairs += int(ids.numel())
        self.traffic.dispatched += int(send.shape[0]) * row
        self.traffic.remote += (int(send.shape[0]) - send_sizes[self.rank]) * row
        recv = AllToAll.apply(send, recv_sizes, send_sizes, self.group, self.traffic)  # type: ignore[no-untyped-call]
        local = torch.arange(self.local_experts, device=hidden.device).repeat(self.size)
        recv_experts = local.repeat_interleave(received.reshape(-1), output_size=sum(recv_sizes))
        return recv, Routes(order, send_sizes, recv_sizes, recv_experts.unsqueeze(-1))

    def combine(
        self,
        out: torch.Tensor,
        routes: Routes,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        like: torch.Tensor,
    ) -> torch.Tensor:
        """The experts' outputs back to their tokens' ranks, weighted and summed per token as the
        serial experts loop sums them (in increasing expert order, from zeros)."""
        row = out.element_size() * (out.numel() // max(out.shape[0], 1))
        self.traffic.combined += int(out.shape[0]) * row
        self.traffic.remote += (int(out.shape[0]) - routes.recv_sizes[self.rank]) * row
        back = AllToAll.apply(  # type: ignore[no-untyped-call]
            out, routes.send_sizes, routes.recv_sizes, self.group, self.traffic
        )
        tokens, k = top_k_index.shape
        inverse = torch.empty_like(routes.order)
        inverse[routes.order] = torch.arange(routes.order.numel(), device=inverse.device)
        per_slot = back[inverse].view(tokens, k, -1)
        weighted = (per_slot * top_k_weights.unsqueeze(-1)).to(like.dtype)
        by_expert = torch.argsort(top_k_index, dim=1, stable=True)
        weighted = weighted.gather(1, by_expert.unsqueeze(-1).expand(-1, -1, weighted.shape[-1]))
        total = torch.zeros_like(like)
        for j in range(k):
            total = total + weighted[:, j]
        return total
