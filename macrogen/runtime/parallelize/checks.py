"""What the engine checks so that a plan never trains silently different from serial.

- ``probe``: a planned layer whose forward is not ``nn.Linear``'s, HF ``Conv1D``'s or
  ``nn.Embedding``'s (a scaled embedding, a LoRA linear, a quantized one) runs once on a
  small random input when the plan is applied, serially on the whole layer and in parallel
  on the shards; a different output or input gradient refuses the plan, naming the layer.
- ``GradientCheck``: after the first backward, the gradients of every parameter the plan keeps
  whole are compared across the tensor group (one all-gather of two checksums each); a
  parameter whose copies differ saw only its rank's shard (per-head q/k norms) and needs
  ``replicate_grad_allreduce``; one that style summed although it was whole already is named
  too. A parameter whose gradient is zero (a LoRA adapter's first step) is checked at the
  first backward that gives it one (up to ``GradientCheck.LIMIT`` backwards).
- ``no_sharded_outputs``: a colwise layer's output, which holds this rank's slice of the
  features, must not be what the model returns (an LM head's logits).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from macrogen.runtime.parallelize.layout import EMBEDDING_STYLES, LINEAR_STYLES, Wrap
from macrogen.runtime.parallelize.local import stands_for, weakly_bound
from macrogen.runtime.parallelize.plan import PlanError
from macrogen.runtime.parallelize.styles import LAST_OUTPUT, is_fast

# -- the probe ---------------------------------------------------------------------------------

# outputs and input gradients within this much of serial, relative to their largest element
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
LOW_PRECISION_TOLERANCE = 3e-2  # bf16, fp16


@dataclass
class Probe:
    """A planned layer's serial answer on a small random input, taken before it is cut."""

    wrap: Wrap
    x: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor | None
    grad_x: torch.Tensor | None
    extra: tuple[torch.Tensor, ...] = ()  # the experts' routes


def needs_probe(wrap: Wrap) -> bool:
    """A layer whose forward is not known to be F.linear / F.embedding of its parameters, and a
    mixture of experts (its experts' weights cut as the plan says: a packed gate_up cut plainly
    gives one rank the gates and the other the ups) whose sizes it can read."""
    if wrap.style.kind == "moe_experts":
        return _experts_sizes(wrap.module) is not None
    return wrap.style.kind in LINEAR_STYLES + EMBEDDING_STYLES and not is_fast(
        wrap.module, wrap.kind
    )


def _experts_sizes(module: nn.Module) -> tuple[int, int] | None:
    """(experts, hidden size) of transformers' experts module (its forward takes
    ``hidden_states (tokens, hidden), top_k_index, top_k_weights (tokens, k)``)."""
    experts = getattr(module, "num_experts", None)
    hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None)
    if not (isinstance(experts, int) and isinstance(hidden, int) and experts > 0 and hidden > 0):
        return None
    try:  # (hidden_states, top_k_index, top_k_weights): not Llama 4's routed-in experts
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (experts, hidden) if len(positional) >= 3 else None


@contextlib.contextmanager
def quietly(modules: list[nn.Module]) -> Iterator[None]:
    """Evaluation mode (no dropout) and the random state untouched: the probes draw nothing
    from the program's generators, so the run stays the serial program's."""
    modes = [(m, m.training) for top in modules for m in top.modules()]
    devices = sorted({p.device.index or 0 for top in modules for p in top.parameters()
                      if p.device.type == "cuda"})  # fmt: skip
    with torch.random.fork_rng(devices=devices):
        for m, _ in modes:
            m.training = False
        try:
            yield
        finally:
            for m, mode in modes:
                m.training = mode


def serial_probe(wrap: Wrap, generator: torch.Generator) -> Probe:
    module = wrap.module
    if wrap.style.kind == "moe_experts":
        return _experts_probe(wrap, generator)
    weight: Any = module.weight
    if wrap.kind == "embedding":
        assert isinstance(module, nn.Embedding)
        ids = torch.randint(0, module.num_embeddings, (2, 3), generator=generator)
        ids = ids.to(weight.device)
        with torch.no_grad():
            return Probe(wrap, ids, module(ids).detach(), None, None)
    width = weight.shape[1] if wrap.kind == "linear" else weight.shape[0]
    x = torch.randn(2, width, generator=generator).to(weight.device, weight.dtype)
    x.requires_grad_(True)
    with torch.enable_grad():
        out = module(x)
        grad_out = torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
        (grad_x,) = torch.autograd.grad(out, x, grad_out)
    return Probe(wrap, x.detach(), out.detach(), grad_out, grad_x)


def _experts_probe(wrap: Wrap, generator: torch.Generator) -> Probe:
    sizes = _experts_sizes(wrap.module)
    assert sizes is not None  # (needs_probe)
    experts, hidden = sizes
    param = next(wrap.module.parameters())
    tokens, k = 6, min(2, experts)
    x = torch.randn(tokens, hidden, generator=generator).to(param.device, param.dtype)
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator).to(param.device, param.dtype)
    routes = (index.to(param.device), weights)
    x.requires_grad_(True)
    with torch.enable_grad():
        out = wrap.module(x, *routes)
        grad_out = torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
        (grad_x,) = torch.autograd.grad(out, x, grad_out)
    return Probe(wrap, x.detach(), out.detach(), grad_out, grad_x, routes)


def parallel_problem(probe: Probe, group: dist.ProcessGroup) -> str | None:
    """How the wrapped layer, on this rank's shards, differs from its serial answer."""
    wrap = probe.wrap
    what = f"{wrap.name}: {wrap.style.kind} on {type(wrap.module).__name__}"
    x = probe.x.clone().requires_grad_(probe.grad_x is not None)
    want, grad_out = probe.out, probe.grad_out
    if wrap.style.kind == "colwise":  # this rank's slice of each block of the output
        want = _slice(want, group, wrap.style.blocks)
        grad_out = None if grad_out is None else _slice(grad_out, group, wrap.style.blocks)
    try:
        with torch.enable_grad():
            out = wrap.module(x, *probe.extra)
            grad_x = None
            if grad_out is not None:
                (grad_x,) = torch.autograd.grad(out, x, grad_out)
    except Exception as e:
        return f"{what}: its forward fails on this rank's shards ({type(e).__name__}: {e})"
    if not isinstance(out, torch.Tensor) or out.shape != want.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"{what}: its forward gives {shape} on the shards where {tuple(want.shape)} is due"
    gap = _gap(out.detach(), want)
    if gap is None and grad_x is not None and probe.grad_x is not None:
        gap = _gap(grad_x, probe.grad_x, "its input gradient")
    if gap is not None and wrap.style.kind == "moe_experts":
        return (
            f"{what}: the experts do not compute the serial experts on their shards ({gap}):"
            " a weight is cut across what its forward splits (a packed gate_up plan 'colwise'"
            " gives one rank the gates and the other the ups: plan it ('colwise', 2))"
        )
    if gap is not None:
        return (
            f"{what}: its forward does not compute the serial layer on the shards ({gap}): it"
            f" does more than {'F.embedding' if wrap.kind == 'embedding' else 'F.linear'} of"
            " its parameters; plan its parts (e.g. a LoRA adapter's parameters) with entries of"
            " their own, or leave the layer whole"
        )
    return None


def _slice(t: torch.Tensor, group: dist.ProcessGroup, blocks: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.cat([b.chunk(size, dim=-1)[rank] for b in t.chunk(blocks, dim=-1)], dim=-1)


def _gap(got: torch.Tensor, want: torch.Tensor, what: str = "its output") -> str | None:
    tolerance = TOLERANCE.get(want.dtype, LOW_PRECISION_TOLERANCE)
    scale = max(float(want.abs().max()), 1e-30) if want.numel() else 1.0
    diff = float((got.to(want.dtype) - want).abs().max()) / scale if want.numel() else 0.0
    return None if diff <= tolerance else f"{what} off by {diff:.2g} relative"


def check_probes(
    probes: list[Probe], group: dist.ProcessGroup, where: str, run: Callable[[], list[str]]
) -> None:
    """Every rank's problems (``run``), agreed: the same error on every rank."""
    if not probes:
        return
    mine = run()
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    # one line per planned path: the same problem in every layer is said once, as "layers.*"
    problems: dict[str, str] = {}
    for problem in (p for rank in every for p in rank):
        name, _, rest = problem.partition(": ")
        problems.setdefault(re.sub(r"[.]\d+(?=[.]|$)", ".*", name), rest)
    if problems:
        lines = [f"{name}: {rest}" for name, rest in problems.items()]
        raise PlanError(f"mg.parallelize at {where}: " + "\n".join(lines))


# -- the replicated-gradient check ---------------------------------------------------------------

SPREAD = 1e-3  # copies of a replicated gradient further apart than this (relative) differ
WHOLE = 1e-9  # copies of a gradient this close before they were summed were whole already


class GradientCheck:
    """The first backwards' gradients of the parameters the plan keeps whole, compared across
    the tensor group (``run``, called by the local forward's backward)."""

    LIMIT = 8  # backwards after which a gradient that stayed zero is not waited for

    def __init__(self, group: dist.ProcessGroup, names: Mapping[int, str], where: str) -> None:
        self.group, self.names, self.where = group, names, where
        self.pending = True
        self.done: set[tuple[int, str]] = set()
        self.calls = 0

    def fresh(self) -> GradientCheck:
        """The same check for another swap (an FSDP unit, a pipeline stage), from the start."""
        return GradientCheck(self.group, self.names, self.where)

    def run(
        self,
        slots: list[tuple[nn.Module, str]],
        specs: list[Any],
        summed: Mapping[int, Any],
        grads: list[torch.Tensor | None],
        sum_now: Callable[[], None],
    ) -> None:
        keys = [(id(m), k) for m, k in slots]
        whole = [
            i for i, spec in enumerate(specs) if keys[i] not in self.done and _replicated(spec)
        ]
        before = [i for i in whole if i in summed]
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        sums = [_checksum(grads[i], device) for i in before]
        sum_now()
        sums += [_checksum(grads[i], device) for i in whole]
        self.calls += 1
        if not sums:
            self.pending = False
            return
        mine = torch.stack(sums)  # (n, 2)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        table = torch.stack(every).cpu()  # (ranks, n, 2)
        spread = (table.amax(0) - table.amin(0)) / table.abs().amax(0).clamp_min(1e-300)
        nonzero = table.abs().amax(0).amax(-1) > 0
        over = [before[j] for j in range(len(before)) if nonzero[j] and spread[j].amax() <= WHOLE]
        partial = [i for j, i in enumerate(whole)
                   if spread[len(before) + j].amax() > SPREAD]  # fmt: skip
        if partial:
            raise PlanError(self._partial(slots, partial))
        if over:
            raise PlanError(self._over(slots, over))
        for j, i in enumerate(whole):
            if nonzero[len(before) + j]:
                self.done.add(keys[i])
        if self.calls >= self.LIMIT or all(keys[i] in self.done for i in whole):
            self.pending = False

    def _name(self, slot: tuple[nn.Module, str]) -> str:
        module, key = slot
        prefix = self.names.get(id(module), type(module).__name__)
        return f"{prefix}.{key}" if prefix else key

    def _listed(self, slots: list[tuple[nn.Module, str]], indices: list[int]) -> str:
        names = [self._name(slots[i]) for i in indices]
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return ", ".join(names[:4]) + more

    def _partial(self, slots: list[tuple[nn.Module, str]], indices: list[int]) -> str:
        owners = [self.names.get(id(slots[i][0]), "") for i in indices]
        paths = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", p) for p in owners if p))
        plan = ", ".join(f"{p!r}: 'replicate_grad_allreduce'" for p in paths[:3])
        return (
            f"mg.parallelize at {self.where}: after backward, the gradients of"
            f" {self._listed(slots, indices)}, which the plan keeps whole, differ between the"
            " tensor-parallel ranks: each rank's copy saw only its shard of the activations"
            " (its heads, its tokens) and holds part of the gradient. Sum them: plan"
            f" {{{plan}}} (transformers: 'replicated_with_grad_allreduce')"
        )

    def _over(self, slots: list[tuple[nn.Module, str]], indices: list[int]) -> str:
        tp = dist.get_world_size(self.group)
        return (
            f"mg.parallelize at {self.where}: the gradients of {self._listed(slots, indices)}"
            " were whole on every rank before replicate_grad_allreduce summed them, which"
            f" multiplies them by tp={tp}: plan them 'replicate'"
        )


def _replicated(spec: Any) -> bool:
    """The DTensor is whole on the tensor dim of its mesh."""
    names = spec.mesh.mesh_dim_names or ()
    if "tensor" in names:
        return bool(spec.placements[names.index("tensor")].is_replicate())
    return spec.mesh.ndim == 1 and bool(spec.placements[0].is_replicate())


def _checksum(grad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Two sums that differ when copies of a gradient do (no cancellation: both positive)."""
    if grad is None:
        return torch.zeros(2, dtype=torch.float64, device=device)
    g = grad.detach().to(torch.float64)
    return torch.stack([g.square().sum(), g.abs().sum()])


# -- the model's first forward -------------------------------------------------------------------

FAILURES = (RuntimeError, ValueError, IndexError, TypeError)  # shapes that do not fit the shards


def guard_first_forward(model: nn.Module, names: Mapping[int, str], where: str) -> None:
    """Until the model's first training forward succeeds, a failure in it is a ``PlanError``
    naming the module whose code failed on the shards (a width it reads whole, a shard mixed
    with a whole tensor), instead of a traceback deep inside the model. Eager forwards only."""
    own = model.__dict__.get("forward")
    first = weakly_bound(_first_forward, model, own, names, where)
    stands_for(first, model)  # (until the first training forward passes)
    model.__dict__["forward"] = first


def _first_forward(
    model: nn.Module, own: Any, names: Mapping[int, str], where: str, *args: Any, **kwargs: Any
) -> Any:
    bound = own if own is not None else functools.partial(type(model).forward, model)
    if torch.compiler.is_compiling():
        return bound(*args, **kwargs)
    try:
        out = bound(*args, **kwargs)
    except FAILURES as e:
        if isinstance(e, (PlanError, torch.OutOfMemoryError)):
            raise
        raise PlanError(_failure(e, names, where)) from e
    if not model.training:  # an evaluation: dropout is off, the training forward is to come
        return out
    if own is None:  # passed: the model's own forward again (and no cycle through this one)
        model.__dict__.pop("forward", None)
    else:
        model.__dict__["forward"] = own
    return out


DROPOUTS = {
    F.dropout: 0.5,
    F.dropout1d: 0.5,
    F.dropout2d: 0.5,
    F.dropout3d: 0.5,
    F.alpha_dropout: 0.5,
    F.feature_alpha_dropout: 0.5,
}


class NoDropout(TorchFunctionMode):
    """Dropout in training draws its mask from the generator: under tensor parallelism each rank
    draws the mask of its own shard (its heads, its features) where the serial program draws
    one mask for all, and everything drawn after differs too: a silent difference, refused."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        p = 0.0
        if func in DROPOUTS:
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            p = float(args[1] if len(args) > 1 else kwargs.get("p", DROPOUTS[func])) * bool(
                training
            )
        elif func is F.scaled_dot_product_attention:
            p = float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))
        if p > 0:
            raise PlanError(
                f"mg.parallelize at {self.where}: the model applies dropout in training"
                f" ({func.__name__}, p={p:g}): under tensor parallelism each rank draws the mask of"
                " its own shard, which is not the serial program's mask; set the model's dropout"
                " to 0 for tensor-parallel training (a transformers config: attention_dropout=0.0"
                " and its other *dropout fields)"
            )
        return func(*args, **kwargs)


def _failure(e: BaseException, names: Mapping[int, str], where: str) -> str:
    """Which module of the model was running when ``e`` was raised (the innermost), and why."""
    name, cls = "", ""
    tb = e.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, nn.Module) and id(me) in names:
            name, cls = names[id(me)], type(me).__name__
        tb = tb.tb_next
    at = f" in {name or 'the model'} ({cls}.forward)" if cls else ""
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        f"mg.parallelize at {where}: under the tensor-parallel plan the model's first forward"
        f" fails{at}: {type(e).__name__}: {first_line}. Its code reads a width the plan shards"
        " (a head count, a size from the config) or mixes this rank's shard with a whole"
        " tensor: leave its layers whole, divide the attribute, or plan them alike"
    )


# -- the model's outputs ------------------------------------------------------------------------


def no_sharded_outputs(
    colwise: list[tuple[str, nn.Module]], where: str, model: nn.Module, args: Any, output: Any
) -> None:
    """A colwise layer's output returned by the model is this rank's slice of the features (an
    LM head's logits: a slice of the vocabulary, so a loss or a sampler would silently differ
    from serial): an error naming the layer. Plan such a layer colwise_gather_output."""
    from torch.utils._pytree import tree_leaves

    if torch.compiler.is_compiling():
        return
    returned = {id(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
    for name, layer in colwise:
        ref = layer.__dict__.get(LAST_OUTPUT)
        out = ref() if ref is not None else None
        if out is not None and id(out) in returned:
            raise PlanError(
                f"mg.parallelize at {where}: {name} is colwise, and the model returns its output,"
                " which holds this rank's slice of the features only: plan it"
                f" {{{name!r}: 'colwise_gather_output'}} (HF's colwise_gather_output) to return"
                " them whole"
            )
