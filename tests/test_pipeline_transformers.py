"""A transformers model's cut at its pipeline plan, checked before any rank drops a part.

The models here are transformers-shaped (a ``pp_plan``, a base model under a prefix, a head,
forward's own loss from ``labels``) so that each way a family can read more than the hidden
state is one class: a side input computed from the embedding (Gemma 3n's per-layer inputs),
layers that share state (Gemma 3n's shared KV), a loss over every layer (MoE routers' aux
loss). The check runs each stage alone on one process, as its rank would; no ranks here.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from macrogen.runtime import pipeline as rp
from macrogen.runtime.pipeline_check import _alone
from macrogen.runtime.pipeline_transformers import shipped_plan, transformers_cut
from tests.helpers import expand, load_module

DIM, VOCAB, LAYERS = 8, 16, 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, hidden_states, side=None, state=None, aux=None):
        out = hidden_states + torch.tanh(self.fc(hidden_states))
        if side is not None:
            out = out + side
        if state is not None:  # the previous layer's output, beside the hidden state
            out = out + state.get("last", 0)
            state["last"] = out
        if aux is not None:
            aux.append(out.square().mean())
        return out


class Base(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.side = nn.Linear(DIM, DIM)
        nn.init.zeros_(self.side.weight)  # a zero weight hides no edge of the graph

    def forward(self, input_ids, aux=None, **kwargs):
        h = self.embed_tokens(input_ids)
        side = self.side(h) if self.kind == "side" else None
        state = {} if self.kind == "state" else None
        for layer in self.layers:
            h = layer(h, side=side, state=state, aux=aux)
        return self.norm(h)


class Config:
    vocab_size = VOCAB


class LM(nn.Module):
    """A causal LM as transformers writes one: its plan, a base model, a head, forward's loss."""

    base_model_prefix = "model"
    pp_plan = {
        "lm_head": (["hidden_states"], ["logits"]),
        "model.embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "model.layers": (["hidden_states"], ["hidden_states"]),
        "model.norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(self, kind="plain"):
        super().__init__()
        self.config = Config()
        self.model = Base(kind)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, labels=None, **kwargs):
        aux: list[torch.Tensor] | None = [] if self.model.kind == "aux" else None
        logits = self.lm_head(self.model(input_ids, aux=aux))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            if aux:
                loss = loss + 0.01 * torch.stack(aux).sum()
        return {"logits": logits, "loss": loss}


def test_the_plan_in_forwards_order_base_model_first():
    assert shipped_plan(LM()) == ["model.embed_tokens", "model.layers", "model.norm", "lm_head"]


def test_a_plain_model_is_cut_at_its_plan():
    cut = transformers_cut(LM(), 2, where="t.py:3")
    assert cut.describe() == (
        "stage 0: model.embed_tokens, model.layers.0-1 | stage 1: model.layers.2-3, model.norm,"
        " lm_head | every stage: model.side"
    )  # (model.side holds parameters the plan does not name: every stage holds it)


def test_each_stage_alone_computes_the_serial_forward():
    torch.manual_seed(0)
    model = LM()
    ids = torch.randint(0, VOCAB, (2, 6))
    want = model(ids, labels=ids)
    cut = transformers_cut(model, 3, where="t.py:3")
    with _alone(model, cut, 0):  # the model as stage 0's rank holds it
        hidden = cut.code(model, 0)(model, ids, input_ids=ids)
    with _alone(model, cut, 1):
        hidden = cut.code(model, 1)(model, hidden, input_ids=ids)
    with _alone(model, cut, 2):
        got = cut.code(model, 2)(model, hidden, input_ids=ids, labels=ids)
    assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["loss"], want["loss"])


def test_layers_reading_the_embedding_beside_the_hidden_state_get_it_on_their_stage():
    cut = transformers_cut(LM("side"), 2, where="t.py:3")
    assert cut.owners["model.embed_tokens"] == {0, 1}  # found through a weight of zeros
    assert cut.describe().startswith(
        "stage 0: model.embed_tokens, model.layers.0-1 | stage 1: model.embed_tokens,"
    )


def test_layers_sharing_state_are_refused_naming_the_stage():
    with pytest.raises(ValueError) as e:
        transformers_cut(LM("state"), 2, where="t.py:3")
    assert str(e.value) == (
        "t.py:3: pp=2 cuts LM at its pipeline plan, and stage 1 (model.layers.2-3, model.norm,"
        " lm_head) computes other logits than the whole model: its layers read state other than"
        " the hidden state from the layers before them"
    )


def test_a_loss_over_every_layer_is_refused():
    with pytest.raises(ValueError, match="the loss reads more than the last stage's layers"):
        transformers_cut(LM("aux"), 2, where="t.py:3")


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="5 stages, and model.layers has 4 layers"):
        transformers_cut(LM(), 5, where="t.py:3")


def test_labels_ignoring_positions_need_a_loss_that_counts_them():
    cut = transformers_cut(LM(), 2, where="t.py:3")
    assert not cut.counts_items  # (its forward takes no num_items_in_batch)
    ids = torch.randint(0, VOCAB, (4, 6))
    assert cut.inputs(ids, ids, None, 2, where="").divisor == 2  # a mean of equal means
    labels = ids.clone()
    labels[0, :3] = -100
    with pytest.raises(ValueError, match="the mean of unequal micro-batch means is not the batch"):
        cut.inputs(ids, labels, None, 2, where="")


transformers = pytest.importorskip("transformers")
SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def test_a_transformers_causal_lm_counts_its_labelled_tokens():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    cut = transformers_cut(model, 2, where="t.py:3")
    assert cut.counts_items  # HF's loss keywords: each micro-batch over the batch's count
    ids = torch.randint(0, 64, (4, 6))
    labels = ids.clone()
    labels[0, :3] = -100
    feed = cut.inputs({"input_ids": ids}, labels, None, 2, where="")
    assert feed.divisor == 1 and int(cut.num_items) == 4 * 5 - 2  # (the first is no target)


def test_router_logits_in_the_loss_are_refused():
    config = transformers.MixtralConfig(**SIZES, num_local_experts=4, output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=True: the router's auxiliary loss"):
        transformers_cut(transformers.MixtralForCausalLM(config), 2, where="t.py:3")


SERIAL = textwrap.dedent(
    """
    import torch
    import macrogen as mg
    from transformers import LlamaConfig, LlamaForCausalLM

    def train(sizes):
        torch.manual_seed(0)
        model = mg.parallelize(LlamaForCausalLM(LlamaConfig(**sizes)), pp=2, microbatches=2)
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
        return mg.pipeline_step(model, ids, ids), model
    """
)


def test_without_ranks_the_expanded_program_is_the_serial_one(tmp_path):
    """No process group: the model stays whole, and the step is forward's own loss."""
    module = load_module(expand(SERIAL), "hf_pp_serial_expanded", tmp_path)
    loss, model = module.train(SIZES)
    assert rp.pipeline_of(model) is not None and rp.pipeline_of(model).layout is None
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loss, plain(input_ids=ids, labels=ids).loss)


def test_a_compiled_model_takes_its_labels_by_name():
    """pipeline_step(torch.compile(model), x, y) gives y to forward's ``labels``, as for the
    model itself: the compiled wrapper's forward takes (*args, **kwargs), and y second would be
    a transformers model's attention_mask."""
    compiled = torch.compile(LM(), backend="eager")  # (not run: compiling takes seconds)
    assert rp.uncompiled(compiled).__class__ is LM
    assert rp._labels(compiled) == "labels"
