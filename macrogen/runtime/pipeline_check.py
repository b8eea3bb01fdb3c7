"""Before a transformers model is cut: each stage, run alone, gives the whole model's values.

The model runs whole on a few tokens (no gradient, eval mode: no dropout draws), then each
stage runs as its rank will run it, the other stages' parts standing in
(``pipeline_transformers``): a stage but the last must send on the hidden state the whole
model's next layer got, the last must compute the whole model's logits and loss. This
tests the cut itself rather than a list of what models do: whatever a family computes
outside its layers, a stage that does not reproduce it is found here, before any rank
drops a part.

A stage that differs may read the embedding other than through the hidden state (Gemma 3n's
per-layer inputs): it holds the embedding too and runs again. One that still differs is
refused, named, with why (its layers read state earlier layers wrote; the loss reads more
than its layers: an auxiliary loss over every layer's router logits).

Values are compared exactly. Where the whole model run twice differs from itself (a
nondeterministic kernel), a stage may differ from it by as much as the two runs differ.
Every rank runs the same check on the same whole model and merges its verdicts with the
others' (a tensor-parallel model's collectives run in the same order on every rank).

A model built on the meta device (``mg.parallelize(..., init=...)``) has no values yet: it
runs on fake tensors (torch's ``FakeTensorMode``, which transformers' masks take as tracing),
so the check finds the stages that fail alone, send on another shape, or read the embedding
(autograd's graph), but compares no values.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from macrogen.pipelining.units import runs
from macrogen.runtime import groups
from macrogen.runtime.pipeline_parts import part_at
from macrogen.runtime.pipeline_standins import EmbeddingElsewhere

if TYPE_CHECKING:
    from macrogen.runtime.pipeline_transformers import TransformersCut

TOKENS = 8  # the check's sequence: long enough for masks and positions to matter


@dataclass(frozen=True)
class Whole:
    """The whole model's run: its output (logits, loss) and each layer's hidden input."""

    out: Any
    hidden: list[torch.Tensor]


def check_stages(model: nn.Module, cut: TransformersCut, at: str) -> None:
    """Hold the embedding where a stage reads it; refuse a stage that differs from the whole."""
    everyone = range(cut.stages)
    values = _values(model)
    with _checking(model):
        with values:
            ids = _ids(model)
            whole = _whole(model, cut, ids, at)
            again = _whole(model, cut, ids, at)  # (a nondeterministic kernel differs from itself)
            if cut.embedding_dims:
                with torch.enable_grad():  # (the graph, not values: a zero weight hides no edge)
                    reads = [_reads_embedding(model, cut, s, ids, whole) for s in everyone]
        if cut.embedding_dims:
            reads = _agree(reads)
            for s in (s for s in everyone if reads[s]):
                for part in cut.embedding_dims:
                    cut.owners[part].add(s)
        with values:
            problems = [_differs(model, cut, s, ids, whole, again) for s in everyone]
        problems = _agree(problems)
    for s, problem in enumerate(problems):
        if problem:
            raise ValueError(f"{at}, and stage {s} ({runs(cut.held(s))}) {problem}")


def _values(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """A meta model runs on fake tensors (shapes, graphs, no values); any other as it is."""
    if not any(p.is_meta for p in model.parameters()):
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _ids(model: nn.Module) -> torch.Tensor:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) or TOKENS
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return (torch.arange(TOKENS, device=device) % vocab)[None]


@contextlib.contextmanager
def _checking(model: nn.Module) -> Iterator[None]:
    """No gradient, eval mode, and a tensor-parallel model on its local shards (its forward
    swaps them in through the model's own hook, which ``model.forward`` skips)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), _local_shards(model):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _local_shards(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    from macrogen.runtime import parallelize

    if parallelize.is_tensor_parallel(model):
        return parallelize.local_parameters(model)
    return contextlib.nullcontext()


def _labels(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    takes = "labels" in inspect.signature(type(model).forward).parameters
    return {"labels": ids} if takes else {}


def _whole(model: nn.Module, cut: TransformersCut, ids: torch.Tensor, at: str) -> Whole:
    """The whole model on ``ids`` (its labels too), each layer's hidden input recorded."""
    seen: list[list[Any]] = [[] for _ in range(cut.count)]

    def record(k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            seen[k].append(args[0] if args else kwargs.get("hidden_states"))

        return hook

    layers = part_at(model, cut.layers)
    hooks = [m.register_forward_pre_hook(record(k), with_kwargs=True) for k, m in enumerate(layers)]
    try:
        out = model.forward(input_ids=ids, **_labels(model, ids), **cut.call)
    except Exception as e:
        if ids.is_meta:  # a meta model's fake tensors: no values for control flow to read
            raise ValueError(
                f"{at}, built on the meta device, and its forward can't run on shapes alone"
                f" to check the cut ({type(e).__name__}: {e}: a forward that reads values, as a"
                " mixture of experts' routing does): build the model with its values for pp > 1"
            ) from None
        raise ValueError(f"{at}, and its forward on {TOKENS} tokens failed ({e})") from None
    finally:
        for h in hooks:
            h.remove()
    calls = [len(s) for s in seen]
    if any(n != 1 for n in calls):
        k = next(k for k, n in enumerate(calls) if n != 1)
        raise ValueError(
            f"{at}, and its forward calls {cut.layers}.{k} {calls[k]} times: a stage boundary"
            " needs each layer called once, in order"
        )
    if any(not isinstance(s[0], torch.Tensor) for s in seen):
        raise ValueError(f"{at}, and its layers take no hidden-state tensor first")
    return Whole(out, [s[0] for s in seen])


def _alone_run(
    model: nn.Module, cut: TransformersCut, stage: int, ids: torch.Tensor, whole: Whole
) -> Any:
    """Stage ``stage`` run as its rank will run it, on the whole model's inputs."""
    start = cut.layer_bounds(stage)[0]
    last = stage == cut.stages - 1
    args = (ids,) if stage == 0 else (whole.hidden[start].detach(),)
    inputs = {"input_ids": ids, **(_labels(model, ids) if last else {})}
    return cut.code(model, stage)(model, *args, **inputs)


def _reads_embedding(
    model: nn.Module, cut: TransformersCut, stage: int, ids: torch.Tensor, whole: Whole
) -> str:
    """Whether what ``stage`` sends on reaches, in autograd's graph, the zeros standing in
    for an embedding it does not hold ("" when not; its layers read it beside the hidden state)."""
    with _alone(model, cut, stage) as standing:
        made: list[torch.Tensor] = []
        for placeholder in standing:
            if isinstance(placeholder, EmbeddingElsewhere):
                placeholder.made = made
        if not any(isinstance(p, EmbeddingElsewhere) for p in standing):
            return ""
        try:
            out = _alone_run(model, cut, stage, ids, whole)
        except Exception:
            return ""  # (_differs says why)
    ends = [o for o in (out, _field(out, "logits"), _field(out, "loss")) if _is_tensor(o)]
    return "reads the embedding" if _reaches(ends, made) else ""


def _reaches(ends: list[torch.Tensor], leaves: list[torch.Tensor]) -> bool:
    """Whether autograd's graph from ``ends`` reaches any of ``leaves``."""
    targets = set()
    for leaf in leaves:  # a leaf's accumulator: the node its first op's graph points to
        targets.add(leaf.view_as(leaf).grad_fn.next_functions[0][0])  # type: ignore[union-attr]
    stack = [e.grad_fn for e in ends if e.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack += [n for n, _ in node.next_functions if n is not None]
    return False


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _differs(
    model: nn.Module,
    cut: TransformersCut,
    stage: int,
    ids: torch.Tensor,
    whole: Whole,
    again: Whole,
) -> str:
    """Why stage ``stage`` run alone differs from the whole model ("" when it does not)."""
    end = cut.layer_bounds(stage)[1]
    try:
        with _alone(model, cut, stage):
            out = _alone_run(model, cut, stage, ids, whole)
    except Exception as e:
        return f"fails run alone ({type(e).__name__}: {e})"
    if stage < cut.stages - 1:
        if _same(out, whole.hidden[end], again.hidden[end]):
            return ""
        return (
            f"sends on another hidden state than the whole model's {cut.layers}.{end} gets: its"
            " layers read state other than the hidden state from the layers before them"
        )
    if not _same(_field(out, "logits"), _field(whole.out, "logits"), _field(again.out, "logits")):
        return (
            "computes other logits than the whole model: its layers read state other than the"
            " hidden state from the layers before them"
        )
    if not _same(_field(out, "loss"), _field(whole.out, "loss"), _field(again.out, "loss")):
        return (
            "computes another loss than the whole model from the same logits: the loss reads"
            " more than the last stage's layers (an auxiliary loss over every layer?)"
        )
    return ""


@contextlib.contextmanager
def _alone(model: nn.Module, cut: TransformersCut, stage: int) -> Iterator[list[nn.Module]]:
    """The model as ``stage``'s rank will hold it: the other stages' parts stand in (given)."""
    swapped = []
    for part, users in cut.owners.items():
        if stage in users or not isinstance(part_at(model, part), nn.Module):
            continue
        head, _, name = part.rpartition(".")
        parent = part_at(model, head) if head else model
        swapped.append((parent, name, parent._modules[name]))
        parent._modules[name] = cut.placeholder(part, min(users))
    try:
        yield [parent._modules[name] for parent, name, _ in swapped]  # type: ignore[misc]
    finally:
        for parent, name, module in swapped:
            parent._modules[name] = module


def _field(out: Any, name: str) -> Any:
    return out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)


def _same(found: Any, want: Any, again: Any) -> bool:
    """``found`` equals ``want``, or differs by no more than ``want`` run again does."""
    if found is None or want is None:
        return found is None and want is None
    if not isinstance(found, torch.Tensor) or found.shape != want.shape:
        return False
    if found.is_meta:  # a meta model's fake tensors: the shape is all there is to compare
        return bool(found.dtype == want.dtype)
    if torch.equal(found, want):
        return True
    if not found.is_floating_point() or torch.equal(want, again):
        return False  # a deterministic run: any difference is the stage's
    noise = (want - again).abs().max()
    return bool((found - want).abs().max() <= 4 * noise)


def _agree(problems: list[str]) -> list[str]:
    """Every rank's verdicts, merged (a stage that differs on one rank differs for all)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    device = groups.placement().device  # (the process group's device: a meta model has none)
    flags = torch.tensor([bool(p) for p in problems], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [p or ("differs on another rank" if f else "") for p, f in zip(problems, flags.tolist())]
