"""The engine's styles on layers that run their own forward, against the serial model (float64).

One spawn of 2 gloo ranks runs every case (``CASES``): each builds a small model, trains it
2 SGD steps serially and through ``apply_tensor_parallel`` with tp=2 from the same weights,
and compares losses, gradients (gathered whole) and parameters within 1e-10. Cases that
must be refused check the one-line message instead.

- a scaled embedding (an ``nn.Embedding`` subclass multiplying by sqrt(hidden), Gemma's):
  the old engine replaced its forward and dropped the scale;
- a rowwise ``nn.Linear`` subclass with its own forward and a bias (the bias counted once);
- a LoRA-style ``nn.Linear`` subclass (its adapters planned by parameter entries);
- a LoRA linear planned colwise alone: refused by the probe, naming the layer;
- per-head q/k norms (Qwen3's): serial-equal with ``replicate_grad_allreduce``, and without it
  the first backward's check names the parameters and the style;
- ``replicate_grad_allreduce`` on a parameter whose gradient is whole: named too;
- ``sequence_parallel`` (a layer norm on sequence slices), ``all_reduce`` (an MLP of bare
  parameters planned by parameter entries), ``embedding_colwise``;
- an unused parameter keeps no gradient (as serially: AdamW's decay must not step it);
- dropout in training: refused (each rank would draw its own shard's mask);
- a parameter cut by its own entry while its module is not planned: refused;
- a module whose code reads a whole width: its first forward's failure names it.
"""

from __future__ import annotations

import copy
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_ranks

DIM, VOCAB, HEADS = 16, 32, 4


class ScaledEmbedding(nn.Embedding):
    """Gemma's ``GemmaTextScaledWordEmbedding``."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__(rows, dim, padding_idx=1)
        self.register_buffer("scale", torch.tensor(math.sqrt(dim)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class ScaledLinear(nn.Linear):
    """A subclass whose forward does more than F.linear (but stays linear in its weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x)


class LoRALinear(nn.Linear):
    """A LoRA adapter in the layer: W x + b + s B A x."""

    def __init__(self, inp: int, out: int, rank: int = 4) -> None:
        super().__init__(inp, out)
        self.lora_A = nn.Parameter(torch.randn(rank, inp) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(out, rank) * 0.1)  # nonzero: gradients flow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + 2.0 * (x @ self.lora_A.t()) @ self.lora_B.t()


class Attention(nn.Module):
    """Per-head q/k norms between the colwise projections and the rowwise output (Qwen3)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.q_norm, self.k_norm = nn.RMSNorm(DIM // HEADS), nn.RMSNorm(DIM // HEADS)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, -1, DIM // HEADS)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(B, T, -1, DIM // HEADS)).transpose(1, 2)
        v = self.v(x).view(B, T, -1, DIM // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class WholeWidth(nn.Module):
    """Reads the head count whole where the plan shards the heads (a view that cannot fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).view(*x.shape[:2], HEADS, DIM // HEADS).sum()


class ParameterMLP(nn.Module):
    """An MLP of bare parameters (transformers' shared experts): planned by parameter entries,
    the module all_reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.w_up = nn.Parameter(torch.randn(32, DIM) * 0.2)
        self.w_down = nn.Parameter(torch.randn(DIM, 32) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.w_up)), self.w_down)


class NormedMixer(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 32), nn.Linear(32, DIM)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Model(nn.Module):
    def __init__(self, embedding: nn.Module, mixer: nn.Module) -> None:
        super().__init__()
        self.embed, self.mixer = embedding, mixer
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        logits = self.head(x + self.mixer(x))
        return F.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))


class Mixer(nn.Module):
    def __init__(self, up: nn.Linear, down: nn.Linear) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _scaled_embedding() -> tuple[nn.Module, dict]:
    return Model(ScaledEmbedding(VOCAB, DIM), Mixer(nn.Linear(DIM, 32), nn.Linear(32, DIM))), {
        "embed": "vocab",
        "mixer.up": "colwise",
        "mixer.down": "rowwise",
    }


def _own_rowwise() -> tuple[nn.Module, dict]:
    mixer = Mixer(ScaledLinear(DIM, 32), ScaledLinear(32, DIM))  # both with biases
    return Model(nn.Embedding(VOCAB, DIM), mixer), {"mixer.up": "colwise", "mixer.down": "rowwise"}


def _lora() -> tuple[nn.Module, dict]:
    mixer = Mixer(LoRALinear(DIM, 32), LoRALinear(32, DIM))
    return Model(nn.Embedding(VOCAB, DIM), mixer), {
        "mixer.up": "colwise",
        "mixer.up.lora_B": "colwise",  # (out, r): its out features
        "mixer.up.lora_A": "replicate_grad_allreduce",  # sees this rank's features' gradient
        "mixer.down": "rowwise",
        "mixer.down.lora_A": "rowwise",  # (r, in): its in features
        "mixer.down.lora_B": "replicate_grad_allreduce",
    }


def _lora_alone() -> tuple[nn.Module, dict]:
    mixer = Mixer(LoRALinear(DIM, 32), nn.Linear(32, DIM))
    return Model(nn.Embedding(VOCAB, DIM), mixer), {"mixer.up": "colwise", "mixer.down": "rowwise"}


def _attention(norms: str | None) -> tuple[nn.Module, dict]:
    plan = {"mixer.q": "colwise", "mixer.k": "colwise", "mixer.v": "colwise", "mixer.o": "rowwise"}
    if norms:
        plan.update({"mixer.q_norm": norms, "mixer.k_norm": norms})
    return Model(nn.Embedding(VOCAB, DIM), Attention()), plan


def _over_summed() -> tuple[nn.Module, dict]:
    model, plan = _scaled_embedding()
    return model, {**plan, "head": "replicate_grad_allreduce"}


def _sequence_parallel() -> tuple[nn.Module, dict]:
    return Model(nn.Embedding(VOCAB, DIM), NormedMixer()), {
        "mixer.norm": "sequence_parallel",
        "mixer.up": "colwise",
        "mixer.down": "rowwise",
    }


def _all_reduce() -> tuple[nn.Module, dict]:
    return Model(nn.Embedding(VOCAB, DIM), ParameterMLP()), {
        "mixer": "all_reduce",
        "mixer.w_up": "colwise",
        "mixer.w_down": "rowwise",
    }


def _module_unplanned() -> tuple[nn.Module, dict]:
    model, plan = _all_reduce()
    del plan["mixer"]
    return model, plan


def _embedding_colwise() -> tuple[nn.Module, dict]:
    return Model(ScaledEmbedding(VOCAB, DIM), ParameterMLP()), {"embed": "embedding_colwise"}


def _dropout() -> tuple[nn.Module, dict]:
    return Model(nn.Embedding(VOCAB, DIM), NormedMixer(0.1)), {
        "mixer.up": "colwise",
        "mixer.down": "rowwise",
    }


def _whole_width() -> tuple[nn.Module, dict]:
    return WholeWidth(), {"q": "colwise"}


CASES = {
    "scaled embedding": (_scaled_embedding, None),
    "own rowwise forward": (_own_rowwise, None),
    "lora": (_lora, None),
    "q/k norms summed": (lambda: _attention("replicate_grad_allreduce"), None),
    "sequence parallel": (_sequence_parallel, None),
    "all_reduce": (_all_reduce, None),
    "embedding colwise": (_embedding_colwise, None),
    "dropout": (_dropout, r"applies dropout in training \(dropout, p=0.1\)"),
    "module unplanned": (
        _module_unplanned,
        r"mixer.w_up: colwise cuts a parameter of mixer \(ParameterMLP\), which the plan does not",
    ),
    "lora alone": (_lora_alone, r"mixer.up: colwise on LoRALinear: its forward"),
    "q/k norms kept whole": (
        lambda: _attention(None),
        r"gradients of mixer.q_norm.weight, mixer.k_norm.weight, which the plan keeps whole,"
        r" differ .* \{'mixer.q_norm': 'replicate_grad_allreduce', 'mixer.k_norm'",
    ),
    "over-summed": (_over_summed, r"head.weight were whole on every rank .* plan them 'replicate'"),
    "whole width": (_whole_width, r"first forward fails in the model \(WholeWidth.forward\): Run"),
}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: nn.Module, steps: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
        loss = model(ids) if not isinstance(model, WholeWidth) else model(torch.randn(2, 8, DIM))
        loss.backward()
        grads.append({n: None if p.grad is None else _full(p.grad).clone()
                      for n, p in model.named_parameters()})  # fmt: skip
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _cases(rank, world):
    from macrogen.runtime.parallelize import PlanError, apply_tensor_parallel, device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = device_mesh(tp=2, planned=True, where="t.py:1")
    out = {}
    for name, (build, _) in CASES.items():
        torch.manual_seed(0)
        serial, plan = build()
        model = copy.deepcopy(serial)
        try:
            apply_tensor_parallel(model, mesh, plan, where="t.py:1")
            got = _train(model)
        except PlanError as e:
            out[name] = ("refused", str(e))
            continue
        want = _train(serial)
        gaps = [max(abs(a - b) for a, b in zip(got[0], want[0]))]
        for ours, theirs in zip(got[1], want[1]):
            for key, g in theirs.items():
                if g is None or ours[key] is None:
                    assert g is None and ours[key] is None, (name, key)  # no gradient: as serially
                else:
                    gaps.append(float((ours[key] - g).abs().max()))
        gaps += [float((got[2][k] - v).abs().max()) for k, v in want[2].items()]
        out[name] = ("trained", max(gaps))
    return out


def test_layers_run_their_own_forward_and_every_check_names_its_cause():
    results = run_ranks(_cases, 2, timeout=240)
    for name, (_, refusal) in CASES.items():
        kind, detail = results[0][name]
        if refusal is None:
            assert kind == "trained", (name, detail)
            assert detail < 1e-10, (name, detail)
        else:
            assert kind == "refused", (name, detail)
            assert re.search(refusal, detail), (name, detail)
    assert results[0] == results[1]
