"""A transformers model cut into pipeline stages at the plan it ships (``mg.parallelize(pp=N)``).

    model = LlamaForCausalLM(config)
    model = mg.parallelize(model, pp=2, microbatches=4)
    loss = mg.pipeline_step(model, input_ids, labels)    # serially: model(input_ids, labels=labels).loss

A transformers model lists its parts in the order forward runs them (``model.pp_plan``:
``config.base_model_pp_plan`` under the base model's prefix, and the head's entry)::

    model.embed_tokens   (["input_ids"], ["inputs_embeds"])
    model.layers         (["hidden_states", "attention_mask"], ["hidden_states"])   an nn.ModuleList
    model.norm           (["hidden_states"], ["hidden_states"])
    lm_head              (["hidden_states"], ["logits"])

The layers are shared out between the stages, balanced by parameter count (what comes
before them counting on the first stage, what comes after on the last). Every stage runs
the model's own ``forward`` on the micro-batch's own inputs (so the masks, positions and
rotary embeddings are the serial ones), with what it does not hold standing in:

- a layer of an earlier stage passes its input on, and the one just before this stage's
  first layer gives the hidden state the previous stage sent;
- the layer just after this stage's last one ends the stage: its input, the hidden state,
  is what the stage sends on (the rest of forward does not run);
- an embedding of an earlier stage gives zeros of its output's shape: what forward
  computes from it is dropped at this stage's first layer;
- the norm and the head live on the last stage, which computes forward's own loss.

Modules the plan does not name that hold parameters (a per-layer input projection) are
held by every stage, their gradients summed over the pipeline ranks, as are the weights
two stages share (the embedding and the head under ``tie_word_embeddings``).

Before the cut the model runs once whole and then once per stage, as that stage will run
(8 tokens, no gradient, in eval mode), on every rank: each stage must give the whole
model's values (the hidden state it sends on; the last stage the logits and the loss). A
stage whose layers read the embedding other than through the hidden state (Gemma 3n's
per-layer inputs) holds the embedding too; one that still differs is refused, named (its
layers read state other layers wrote, or the loss reads more than the last stage's layers:
an auxiliary loss over every layer's router logits).

The loss: ``pipeline_step(model, x, y)`` without a ``loss_fn`` gives ``y`` to forward as
``labels`` (``x``: the input ids, or a dict of forward's inputs). A model whose forward
takes HF's loss keyword arguments and computes the causal-LM loss is given the batch's
count of labelled tokens (``num_items_in_batch``, as HF's Trainer does for gradient
accumulation): each micro-batch's loss is its tokens' sum over the batch's count, and
they add up to the batch's mean, ignored (-100) labels included. Any other model's loss is
a mean per micro-batch, so its labels must not ignore any position (the mean of unequal
micro-batch means is not the batch's).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from macrogen.pipelining.units import SplitError, balanced, runs
from macrogen.runtime.pipeline_check import check_stages
from macrogen.runtime.pipeline_parts import Elsewhere, numel, part_at, tied, unplaced
from macrogen.runtime.pipeline_plan import StepInputs
from macrogen.runtime.pipeline_standins import (
    EmbeddingElsewhere,
    Handoff,
    PassedLayer,
    Relay,
    Running,
)

IGNORED = -100  # HF's ignore_index: a label no loss counts


def shipped_plan(model: nn.Module) -> list[str]:
    """The paths of ``model``'s pipeline plan in forward's order: the base model's, then the head's."""
    plan = dict(getattr(model, "pp_plan", None) or getattr(model, "_pp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    lead = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
    inside = [k for k in plan if k.startswith(lead)]  # (without a base model: every entry)
    if not inside:  # a model built without transformers' plan bookkeeping: its config's
        config = getattr(model, "config", None)
        inside = [f"{lead}{k}" for k in getattr(config, "base_model_pp_plan", None) or {}]
    return [*inside, *(k for k in plan if k not in inside)]


@dataclass
class TransformersCut:
    """A transformers model's plan shared out between the stages; see the module docstring."""

    name: str  # the model's class
    before: list[str]  # the plan's parts before the layers (the embedding, its dropout)
    layers: str  # the plan's nn.ModuleList
    count: int  # its layers
    after: list[str]  # the plan's parts after them (the norm, the head)
    starts: list[int]  # the layer each stage after the first starts at
    owners: dict[str, set[int]] = field(default_factory=dict)
    tied: list[tuple[str, frozenset[int]]] = field(default_factory=list)
    everywhere: list[str] = field(default_factory=list)  # unplanned parts every stage holds
    counts_items: bool = False  # forward takes num_items_in_batch for its causal-LM loss
    call: dict[str, Any] = field(default_factory=dict)  # forward's keywords every stage passes
    relay: Relay = field(default_factory=Relay)  # the stage running now (the stand-ins read it)
    num_items: torch.Tensor | None = None  # this step's labelled tokens (counts_items)
    embedding_dims: dict[str, int] = field(default_factory=dict)  # embeddings before the layers

    targets = "labels"  # forward's parameter for y, when it computes the loss

    @property
    def stages(self) -> int:
        return len(self.starts) + 1

    def layer_bounds(self, stage: int) -> tuple[int, int]:
        edges = [0, *self.starts, self.count]
        return edges[stage], edges[stage + 1]

    def blocks(self, stage: int) -> list[str]:
        a, b = self.layer_bounds(stage)
        return [f"{self.layers}.{k}" for k in range(a, b)]

    def held(self, stage: int) -> list[str]:
        """The plan's parts ``stage`` holds, in forward's order."""
        order = [*self.before, *(f"{self.layers}.{k}" for k in range(self.count)), *self.after]
        return [p for p in order if stage in self.owners.get(p, ())]

    def describe(self) -> str:
        """``stage 0: model.embed_tokens, model.layers.0-1 | stage 1: model.layers.2-3, ...``."""
        text = " | ".join(f"stage {s}: {runs(self.held(s))}" for s in range(self.stages))
        return text + (f" | every stage: {', '.join(self.everywhere)}" if self.everywhere else "")

    def placeholder(self, part: str, stage: int) -> nn.Module:
        head, _, index = part.rpartition(".")
        if head == self.layers and index.isdigit():
            return PassedLayer(part, int(index), stage, self.relay)
        if part in self.embedding_dims:
            return EmbeddingElsewhere(part, self.embedding_dims[part], stage, self.relay)
        return Elsewhere(part, stage)

    def code(self, model: nn.Module, stage: int) -> Callable[..., Any]:
        """Stage ``stage``: the model's forward, its other stages' parts standing in."""
        start, end = self.layer_bounds(stage)
        last = stage == self.stages - 1

        def run(model: nn.Module, *args: Any, **inputs: Any) -> Any:
            if not last:  # (a rank that holds the last stage too gets its labels)
                inputs.pop(self.targets, None)
            elif self.targets in inputs and self.num_items is not None:
                inputs["num_items_in_batch"] = self.num_items
            received = args[0] if stage > 0 else None
            self.relay.running = Running(start, None if last else end, received)
            try:  # model.forward, not model(...): the model's own hooks run once per step
                out = model.forward(**inputs, **self.call)
            except Handoff as handoff:
                return handoff.hidden
            finally:
                self.relay.running = None
            if not last:
                raise RuntimeError(
                    f"pipeline stage {stage} of {self.name} ends at {self.layers}.{end}, and"
                    f" {self.name}.forward never called it"
                )
            return out

        return run

    def inputs(
        self, x: Any, y: torch.Tensor, loss_fn: Any, microbatches: int, *, where: str
    ) -> StepInputs:
        given = dict(x) if isinstance(x, Mapping) else {"input_ids": x}
        ids = given.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            raise TypeError(
                f"{where}pipeline_step takes x as the input ids, or a dict of forward's inputs"
                f" with input_ids (a tokenizer's batch), not {type(x).__name__}"
            )
        if loss_fn is not None:
            self.num_items = None
            return StepInputs((ids,), given, {}, microbatches)
        if self.counts_items:  # each micro-batch's sum over the batch's count: the batch's mean
            self.num_items = (y[..., 1:] != IGNORED).sum()
            return StepInputs((ids,), given, {self.targets: y}, 1)
        if bool((y == IGNORED).any()):
            raise ValueError(
                f"{where}labels ignore some positions (-100), and {self.name}.forward takes no"
                " num_items_in_batch for its loss: each micro-batch's loss is its own mean, and"
                " the mean of unequal micro-batch means is not the batch's. Give a loss_fn"
                " (on the logits), or labels without -100"
            )
        self.num_items = None
        return StepInputs((ids,), given, {self.targets: y}, microbatches)


def transformers_cut(
    model: nn.Module,
    stages: int,
    *,
    where: str,
    speeds: list[float] | None = None,
    limits: list[float] | None = None,
) -> TransformersCut:
    """Cut ``model`` at its shipped pipeline plan into ``stages`` stages (checked; see above);
    ``speeds``: each stage's device's relative speed, its share of the parameters;
    ``limits``: the most parameters each stage's memory holds."""
    name = type(model).__name__
    at = f"{where}: pp={stages} cuts {name} at its pipeline plan"
    plan = shipped_plan(model)
    lists = [p for p in plan if isinstance(part_at(model, p), nn.ModuleList)]
    missing = [p for p in plan if not isinstance(part_at(model, p), nn.Module)]
    if missing:
        raise ValueError(f"{at}, and {', '.join(missing)} is no module of it")
    if len(lists) != 1:
        what = ", ".join(lists) if lists else "none"
        raise ValueError(
            f"{at} ({', '.join(plan)}), which needs one nn.ModuleList of layers to share out"
            f" between the stages, not {what}"
        )
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(
            f"{at}, and its config has output_router_logits=True: the router's auxiliary loss"
            " reads every layer's router logits, and the last stage holds its own layers only"
        )
    layers = lists[0]
    count = len(part_at(model, layers))
    if stages > count:
        raise ValueError(f"{at}: {stages} stages, and {layers} has {count} layers")
    k = plan.index(layers)
    cut = TransformersCut(name, plan[:k], layers, count, plan[k + 1 :], [])
    try:
        cut.starts = _balance(model, cut, stages, speeds, limits)
    except SplitError as e:
        raise ValueError(f"{at}: {e.message}") from None
    _place(model, cut)
    cut.call = _call_keywords(model)
    cut.counts_items = _counts_items(model)
    check_stages(model, cut, at)
    cut.tied = tied(model, cut.owners)
    return cut


def _balance(
    model: nn.Module,
    cut: TransformersCut,
    stages: int,
    speeds: list[float] | None = None,
    limits: list[float] | None = None,
) -> list[int]:
    """Where stages 1.. start, most even by parameter count (the ends weigh on the end stages)."""
    layers = [f"{cut.layers}.{k}" for k in range(cut.count)]
    weights = [numel(model, cut.before), *(numel(model, [p]) for p in layers)]
    weights.append(numel(model, cut.after))
    starts = balanced(weights, list(range(2, cut.count + 1)), stages, speeds, limits)
    return [s - 1 for s in starts]  # units -> layers (the first unit is what comes before)


def _place(model: nn.Module, cut: TransformersCut) -> None:
    """Who holds what: the parts before the layers the first stage (parameterless ones every
    stage), each layer its stage, the parts after the last stage, the rest every stage."""
    last, everyone = cut.stages - 1, set(range(cut.stages))
    owners: dict[str, set[int]] = {}
    for part in cut.before:
        module = part_at(model, part)
        if not list(module.parameters()):
            continue  # a dropout: every stage runs it, on whatever it is given
        owners[part] = {0}
        if isinstance(module, nn.Embedding):
            cut.embedding_dims[part] = module.embedding_dim
        else:  # no zeros of a known shape stand in for it: every stage computes it
            owners[part] = set(everyone)
    for s in range(cut.stages):
        for block in cut.blocks(s):
            owners[block] = {s}
    for part in cut.after:
        owners[part] = {last}
    for part in unplaced(model, {**owners, **{p: set() for p in cut.before}}):
        if part_params_of(model, part):
            owners[part] = set(everyone)
            cut.everywhere.append(part)
    cut.owners = owners


def part_params_of(model: nn.Module, part: str) -> bool:
    obj = part_at(model, part)
    return isinstance(obj, nn.Parameter) or (
        isinstance(obj, nn.Module) and any(True for _ in obj.parameters())
    )


def _parameters(model: nn.Module) -> inspect.Signature:
    return inspect.signature(type(model).forward)


def _call_keywords(model: nn.Module) -> dict[str, Any]:
    """use_cache=False where forward takes it: no cache outlives a micro-batch's forward."""
    params = _parameters(model).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {"use_cache": False} if "use_cache" in params or takes_any else {}


def _counts_items(model: nn.Module) -> bool:
    """forward passes HF's loss keywords (num_items_in_batch) to the causal-LM loss (the rule
    HF's Trainer uses: ``accepts_loss_kwargs``, else a ``**kwargs`` parameter)."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        params = _parameters(model).parameters.values()
        accepts = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # (an HF-like model without transformers installed)
        return False
    return bool(accepts) and getattr(model, "loss_function", None) is ForCausalLMLoss
