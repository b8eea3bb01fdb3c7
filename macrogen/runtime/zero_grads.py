"""The gradients a ``ShardedOptimizer`` has sent: torch's clipping and AMP act on their average.

After a training backward each rank's ``.grad`` is its local gradient: the
reduce-scatter has sent it, and the averaged gradient, the serial program's,
exists only as shares, each rank holding 1/world of it. From the end of that
backward to ``step()`` the guard (``zero_guard``) routes the torch operations a
training loop applies to those ``.grad`` tensors here, so that they act on the
averaged gradient as the serial program's act on its gradient:

- a norm (``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``,
  ``p.grad.norm()``) is the averaged gradient's: each rank takes its shares'
  part of every parameter's norm, and one all-reduce of one number per
  parameter sums them. It is a collective, as the norm of FSDP's DTensor
  gradients is: every rank takes it (then the parts are kept, and more norms
  of the same order cost nothing);
- an in-place element-wise operation with scalar operands (the clip's
  multiplication, ``clip_grad_value_``'s clamps, a division) is applied to the
  shares;
- a ``GradScaler``'s ``unscale_`` checks and unscales the shares, and every
  rank takes the largest ``found_inf`` (any rank's non-finite share makes the
  average non-finite), so all skip the step or none.

None of this sends a gradient again: the shares the backward's reduce-scatter
left are used, waited for at the first such operation. ``.grad`` itself stays
the local gradient. What can't be taken from the shares is refused with
``ShardedGradientError`` on every rank, never computed from the local
gradients: a norm along a dim, an operation mixing sent gradients with others,
a parameter that got a gradient on some ranks only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from macrogen.runtime.zero_buckets import version_of

if TYPE_CHECKING:
    from macrogen.runtime.zero_buckets import ShardBucket
    from macrogen.runtime.zero_tensor import TensorShards


class ShardedGradientError(RuntimeError):
    """An operation on gradients the sharded optimizer has sent that their average can't give."""


# the norm functions torch.nn.utils.clip_grad_norm_ and get_total_norm call, and the usual
# spellings of one tensor's norm; the parameter names of each, in order
NORMS: dict[Any, tuple[str, ...]] = {
    torch._foreach_norm: ("self", "ord", "dtype"),
    torch.linalg.vector_norm: ("x", "ord", "dim", "keepdim"),
    torch.linalg.norm: ("A", "ord", "dim", "keepdim"),
    torch.norm: ("input", "p", "dim", "keepdim", "out", "dtype"),
    torch.Tensor.norm: ("self", "p", "dim", "keepdim", "dtype"),
}

# in place and element-wise: with scalar operands, the same operation on the shares is the
# serial program's on its gradient (clip_grad_norm_'s multiply, clip_grad_value_'s clamps)
SCALAR_WRITES = frozenset(
    {
        torch._foreach_mul_,
        torch._foreach_div_,
        torch._foreach_clamp_min_,
        torch._foreach_clamp_max_,
        torch.Tensor.mul_,
        torch.Tensor.div_,
        torch.Tensor.clamp_,
        torch.clamp_,
        torch.Tensor.clamp_min_,
        torch.Tensor.clamp_max_,
    }
)

# a GradScaler's unscale_: it writes the gradients without bumping their version counters
UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_

ROUTED = frozenset(NORMS) | SCALAR_WRITES | {UNSCALE}

ADVICE = "torch.nn.utils.clip_grad_norm_(params, c) or mg.clip_grad_norm_(opt, c)"


class SentGradients:
    """The ``.grad`` tensors a sharded optimizer sent at the end of the last training backward,
    and the operations on them that the guard routes here (see the module docstring).

    ``reduce`` makes the shares hold the averaged gradients (the optimizer's, once per step);
    it is called at the first routed operation, on every rank alike.
    """

    def __init__(
        self,
        buckets: list[ShardBucket],
        names: list[str],
        group: dist.ProcessGroup | None,
        reduce: Callable[[], None],
        where: str,
        shards: TensorShards | None = None,
    ):
        self.buckets = buckets
        self.shards = shards  # tensor-parallel parameters: their norms' parts summed over T
        self.names = names  # the optimizer's parameters (in its order: Piece.index), named
        self.group = group
        self.reduce = reduce
        self.where = where
        count = len(names)
        self.count = count
        self.device = buckets[0].full.device
        # each parameter's pieces in this rank's share: (bucket, first element, elements)
        self.pieces: list[list[tuple[ShardBucket, int, int]]] = [[] for _ in range(count)]
        for bucket in buckets:
            for pc in bucket.pieces:
                self.pieces[pc.index].append((bucket, pc.at, pc.tensor.numel()))
        self.grads: dict[int, tuple[torch.Tensor, int]] = {}  # id(.grad) -> (.grad, parameter)
        self.partial: list[str] = []  # parameters with a gradient on some ranks only
        self._parts: dict[float, torch.Tensor] = {}  # order -> every parameter's norm's part
        self._after_reduce: list[tuple[torch.Tensor | None, int]] = []  # (.grad, version)

    # -- what was sent -------------------------------------------------------------------
    def record(self, params: list[torch.Tensor]) -> None:
        """The .grads of ``params`` (the optimizer's order) as the backward left them."""
        self.grads = {id(p.grad): (p.grad, i) for i, p in enumerate(params) if p.grad is not None}
        self._parts = {}

    def clear(self) -> None:
        self.grads = {}
        self._parts = {}

    def written(self) -> None:
        """The shares were written (mg.clip_grad_norm_): norms taken before are out of date."""
        self._parts = {}

    def _index(self, x: Any) -> int | None:
        entry = self.grads.get(id(x)) if isinstance(x, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is x else None

    def touches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether an operation's arguments include a sent gradient."""
        for a in (*args, *kwargs.values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            if any(self._index(x) is not None for x in items):
                return True
        return False

    def reduced(self, params: list[torch.Tensor], used: list[int], worlds: list[int]) -> None:
        """The shares now hold the averaged gradients: note each .grad's version (a write to one
        after this is not in them) and the parameters some ranks (of the ``worlds[i]`` its
        bucket is cut over) had no gradient for."""
        self._after_reduce = [(p.grad, version_of(p.grad)) for p in params]
        self.partial = [self.names[i] for i, n in enumerate(used) if 0 < n < worlds[i]]
        self._parts = {}

    def written_after_reduce(self, params: list[torch.Tensor]) -> str | None:
        """A parameter whose .grad was replaced or written since the shares were averaged."""
        for i, (p, (g, version)) in enumerate(zip(params, self._after_reduce)):
            if p.grad is not g or (g is not None and version_of(g) != version):
                return self.names[i]
        return None

    # -- the guard's entry ---------------------------------------------------------------
    def route(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` (one of ROUTED) on the averaged gradients if it takes sent ones."""
        if not self.touches(args, kwargs):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if func in NORMS:
            return self._norm(func, name, args, kwargs)
        if func is UNSCALE:
            return self._unscale(func, args, kwargs)
        return self._write(func, name, args, kwargs)

    def refuse(self, name: str, why: str) -> ShardedGradientError:
        return ShardedGradientError(
            f"{self.where}: {name} of gradients the sharded optimizer has averaged: {why}."
            f" Each rank's .grad holds only its local gradient; {ADVICE} takes the averaged"
            " gradients' norm"
        )

    def _indices(self, name: str, tensors: list[Any]) -> list[int]:
        found = [self._index(t) for t in tensors]
        if any(i is None for i in found):
            raise self.refuse(name, "it mixes them with other tensors")
        return [i for i in found if i is not None]

    def _averaged(self, name: str) -> None:
        """Make the shares the averaged gradients (a collective, at the first routed operation).

        Then, alike on every rank: a parameter that got a gradient on some ranks only has a
        .grad on those ranks alone, so an operation over "every .grad" would take different
        parameters on different ranks: refused."""
        self.reduce()
        if self.partial:
            raise self.refuse(
                name,
                f"{self.partial[0]} got a gradient on some ranks only, so the ranks' .grads"
                " are not the same parameters; mg.clip_grad_norm_(opt, c) takes them all",
            )

    # -- norms ---------------------------------------------------------------------------
    def _norm(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = dict(zip(NORMS[func], args)) | kwargs
        first = next(iter(bound.values()))
        tensors = list(first) if func is torch._foreach_norm else [first]
        if bound.get("dim") is not None or bound.get("keepdim") or bound.get("out") is not None:
            raise self.refuse(name, "a norm along a dim (or into out=) is not taken from shares")
        order = bound.get("ord", bound.get("p", 2.0))
        if order in (None, "fro") or (func is torch.linalg.norm and first.dim() != 1):
            if order not in (None, "fro"):
                raise self.refuse(name, f"a matrix norm (ord={order!r}) is not taken from shares")
            order = 2.0
        if isinstance(order, str) or not (float(order) >= 0):
            raise self.refuse(name, f"ord={order!r}: orders 0 < p <= inf and 0 are supported")
        indices = self._indices(name, tensors)
        self._averaged(name)
        norms = self._averaged_norms(float(order))
        dtype = bound.get("dtype")
        out = [
            norms[i].to(device=t.device, dtype=dtype or t.dtype) for i, t in zip(indices, tensors)
        ]
        return out if func is torch._foreach_norm else out[0]

    def _averaged_norms(self, p: float) -> torch.Tensor:
        """Every parameter's averaged-gradient norm of order ``p`` (float64)."""
        parts = self.averaged_parts(p)
        return parts if p in (0.0, math.inf) else parts ** (1.0 / p)

    def averaged_parts(self, p: float) -> torch.Tensor:
        """Every parameter's part of a p-norm of the averaged gradients (float64): the sum of
        |g|^p (of the nonzeros' count for p = 0; the largest |g| for p = inf) over the
        serial parameter. One all-reduce over the data group; a tensor-parallel shard's then
        summed over its tensor group (``TensorShards``)."""
        if p in self._parts:
            return self._parts[p]
        parts = torch.zeros(self.count, dtype=torch.float64, device=self.device)
        views, owners = [], []
        for i, pieces in enumerate(self.pieces):
            for bucket, at, n in pieces:
                views.append(bucket.grad[at : at + n])
                owners.append(i)
        if views:
            index = torch.tensor(owners, device=self.device)
            wide = torch.promote_types(views[0].dtype, torch.float32)
            piece = torch.stack(torch._foreach_norm(views, p, dtype=wide)).to(parts)
            if p == math.inf:  # the largest over the pieces
                parts.scatter_reduce_(0, index, piece, "amax")
            else:  # sum over the pieces of |g|^p (of the nonzeros' count for p = 0)
                parts.index_add_(0, index, piece if p == 0 else piece**p)
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(parts, op=op, group=self.group)
        if self.shards:
            self.shards.sum_parts(parts, p)
        self._parts[p] = parts
        return parts

    # -- writes --------------------------------------------------------------------------
    def _shares(self, indices: list[int]) -> list[list[torch.Tensor]]:
        """Each listed parameter's views into the averaged gradients this rank holds."""
        return [[b.grad[at : at + n] for b, at, n in self.pieces[i]] for i in indices]

    def _write(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first, rest = (args[0], args[1:]) if args else (None, ())
        if first is None:  # (keyword spellings: torch.clamp_(input=...))
            key = next(iter(kwargs))
            first, kwargs = kwargs[key], {k: v for k, v in kwargs.items() if k != key}
        foreach = isinstance(first, (list, tuple))
        tensors = list(first) if foreach else [first]
        for value in (*rest, *kwargs.values()):
            if not _scalar(value) and not (
                foreach
                and isinstance(value, (list, tuple))
                and len(value) == len(tensors)
                and all(_scalar(v) for v in value)
            ):
                raise self.refuse(name, "its operands are not scalars, the same for every element")
        indices = self._indices(name, tensors)
        self._averaged(name)
        shares = self._shares(indices)
        if foreach:  # a list of scalars: each tensor's, for each of its pieces
            views = [v for share in shares for v in share]
            spread = [
                [s for share, s in zip(shares, value) for _ in share]
                if isinstance(value, (list, tuple))
                else value
                for value in rest
            ]
            if views:
                func(views, *spread, **kwargs)
        else:
            for view in shares[0]:
                func(view, *rest, **kwargs)
        self.written()
        return None if foreach else first

    # -- AMP -----------------------------------------------------------------------------
    def _unscale(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``GradScaler.unscale_``'s kernel, on every share of the gradients' dtype and device
        (the scaler passes them all, one call per dtype and device: on a rank without a
        .grad for some parameter, its share is unscaled too); ``found_inf`` is agreed."""
        names = ("self", "found_inf", "inv_scale")
        bound = dict(zip(names, args)) | kwargs
        grads, found_inf, inv_scale = (list(bound["self"]), bound["found_inf"], bound["inv_scale"])
        name = "a GradScaler's unscale_"
        indices = self._indices(name, grads)
        kind = (grads[0].dtype, grads[0].device)
        alike = {i for g, i in self.grads.values() if (g.dtype, g.device) == kind}
        if set(indices) != alike:
            raise self.refuse(name, "it unscales some of them only")
        self.reduce()
        shares = [b.grad[: b.chunk] for b in self.buckets if (b.grad.dtype, b.grad.device) == kind]
        if shares:
            func(shares, found_inf, inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        self.written()
        return None


def clip_shares(
    buckets: list[ShardBucket],
    group: dist.ProcessGroup | None,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the averaged gradients the buckets' shares hold:
    the total norm from every rank's shares (one all-reduce of one number; MAX for inf),
    the shares scaled in place by torch's coefficient; returns the total norm."""
    p = float(norm_type)
    shares = [bucket.grad[: bucket.chunk] for bucket in buckets]  # padding is 0
    norms = torch.stack(  # (half precision summed in float32)
        [
            torch.linalg.vector_norm(s, p, dtype=torch.promote_types(s.dtype, torch.float32))
            for s in shares
        ]
    )
    if p == math.inf:  # the largest over the ranks
        total, op = norms.max(), dist.ReduceOp.MAX
    else:  # sum of |g|^p (of nonzeros for p = 0) over the ranks
        total, op = (norms.sum() if p == 0 else (norms**p).sum()), dist.ReduceOp.SUM
    dist.all_reduce(total, op=op, group=group)
    return scale_shares(buckets, _root(total, p), max_norm, norm_type, error_if_nonfinite)


def clip_parts(
    buckets: list[ShardBucket],
    parts: torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``clip_shares`` from every parameter's part of the norm (``averaged_parts``: over a
    tensor-parallel model, where the tensor ranks' shares are parts of one parameter)."""
    p = float(norm_type)
    total = parts.max() if p == math.inf else parts.sum()
    return scale_shares(buckets, _root(total, p), max_norm, norm_type, error_if_nonfinite)


def _root(total: torch.Tensor, p: float) -> torch.Tensor:
    return total if p in (0.0, math.inf) else total ** (1.0 / p)


def scale_shares(
    buckets: list[ShardBucket],
    total: torch.Tensor,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """The shares scaled in place by torch's clip coefficient for the total norm ``total``."""
    shares = [bucket.grad[: bucket.chunk] for bucket in buckets]
    total = total.to(shares[0].dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is"
            " non-finite, so it cannot be clipped. To disable this error and scale the"
            " gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's, clamped
    torch._foreach_mul_(shares, coef)
    return total


def _scalar(value: Any) -> bool:
    """A Python number (or None: an absent clamp bound) or a 0-dim tensor."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, torch.Tensor) and value.dim() == 0
