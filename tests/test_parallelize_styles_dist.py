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

The same spawn checks the per-forward swap of DTensor parameters for their local tensors
(``parallelize/local.py``, ``SWAPS``): a parameter replaced between steps (``load_state_dict``
with ``assign=True``, a reassigned weight, ``to_empty`` then a load, ``float()`` and back) is
the one the next step trains; what autograd gives the parameters (``autograd.grad``,
``backward(inputs=...)``, a tensor hook, a post-accumulate-grad hook) is serial's; and the
private DTensor fields the swap reads mean what it takes them to.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
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
        out[name] = ("trained", _gap(got, _train(serial), name))
    return out


def _gap(got, want, name: str) -> float:
    """The largest difference of two ``_train`` results (losses, gradients, parameters)."""
    gaps = [max(abs(a - b) for a, b in zip(got[0], want[0]))]
    for ours, theirs in zip(got[1], want[1]):
        for key, g in theirs.items():
            if g is None or ours[key] is None:
                assert g is None and ours[key] is None, (name, key)  # no gradient: as serially
            else:
                gaps.append(float((ours[key] - g).abs().max()))
    return max(gaps + [float((got[2][k] - v).abs().max()) for k, v in want[2].items()])


# -- the swap of DTensor parameters for their local tensors -------------------------------------


def _swap_model() -> tuple[nn.Module, dict]:
    return Model(nn.Embedding(VOCAB, DIM), NormedMixer()), {
        "mixer.up": "colwise",
        "mixer.down": "rowwise",
    }


def _assign(m: nn.Module) -> None:
    m.load_state_dict({k: v.detach() * 0.5 for k, v in m.state_dict().items()}, assign=True)


def _reassign(m: nn.Module) -> None:
    m.mixer.up.weight = nn.Parameter(m.mixer.up.weight.detach() * 0.5)


def _to_empty_and_load(m: nn.Module) -> None:
    state = {k: v.detach().clone() * 0.5 for k, v in m.state_dict().items()}
    m.to_empty(device="cpu")
    m.load_state_dict(state)


def _float_and_back(m: nn.Module) -> None:
    m.float().double()  # the parameters rounded to float32 (elementwise: the shards alike)


# each applied to the serial model and the parallel one after a step, before the next
REPLACEMENTS = {
    "load_state_dict(assign=True)": _assign,
    "a weight reassigned": _reassign,
    "to_empty, then loaded": _to_empty_and_load,
    "float() and back": _float_and_back,
}


def _autograd_views(m: nn.Module, ids: torch.Tensor) -> tuple[dict, list[str]]:
    """What autograd's entry points give the parameters: values gathered whole, and counts."""
    named = dict(m.named_parameters())
    out: dict = {}
    grads = torch.autograd.grad(m(ids), list(named.values()))
    out["autograd.grad"] = {k: _full(g) for k, g in zip(named, grads)}
    out["autograd.grad leaves .grad"] = all(p.grad is None for p in named.values())
    m(ids).backward(inputs=[named["mixer.up.weight"], named["head.weight"]])
    out["backward(inputs=...)"] = {k: None if p.grad is None else _full(p.grad).clone()
                                   for k, p in named.items()}  # fmt: skip
    m.zero_grad(set_to_none=True)
    calls: list[str] = []

    def doubled(g: torch.Tensor) -> torch.Tensor:
        calls.append(type(g).__name__)
        return g * 2

    handle = named["mixer.down.weight"].register_hook(doubled)
    accumulated: dict = {}
    handles = [p.register_post_accumulate_grad_hook(
        lambda p, k=k: accumulated.setdefault(k, []).append(_full(p.grad).clone()))
        for k, p in named.items()]  # fmt: skip
    m(ids).backward()
    out["hooked gradient"] = _full(named["mixer.down.weight"].grad)
    out["post-accumulate-grad hooks"] = accumulated
    out["tensor hook calls"] = len(calls)
    for h in [handle, *handles]:
        h.remove()
    m.zero_grad(set_to_none=True)
    return out, calls


def _private_fields(m: nn.Module) -> dict:
    """``_spec`` and ``_local_tensor`` of a DTensor parameter and ``DTensor.__new__`` without
    ``__init__``, as the swap uses them (a torch release that changes them fails here)."""
    from torch.distributed.tensor import DTensor

    p = m.mixer.up.weight
    with torch.no_grad():
        local = p.to_local()
    g = torch.randn(local.shape, dtype=local.dtype)
    built = DTensor.__new__(DTensor, g, p._spec, requires_grad=False)
    with torch.no_grad():
        its_local = built.to_local()
    return {
        "_local_tensor is to_local()'s storage": (p._local_tensor.data_ptr(),
                                                  p._local_tensor.shape, p._local_tensor.stride())
        == (local.data_ptr(), local.shape, local.stride()),  # fmt: skip
        "_spec is the placements' spec": p._spec.placements == p.placements
        and p._spec.mesh is p.device_mesh,
        "DTensor.__new__ builds the DTensor": type(built) is DTensor
        and its_local is g and built._spec is p._spec and built.placements == p.placements
        and built.shape == p.shape and not built.requires_grad,
    }  # fmt: skip


def _swaps(rank: int, world: int) -> dict:
    from macrogen.runtime.parallelize import apply_tensor_parallel, device_mesh

    mesh = device_mesh(tp=2, planned=True, where="t.py:1")
    out: dict = {}
    for name, replace in REPLACEMENTS.items():
        torch.manual_seed(0)
        serial, plan = _swap_model()
        model = apply_tensor_parallel(copy.deepcopy(serial), mesh, plan, where="t.py:1")
        for m in (serial, model):
            _train(m, steps=1)
            replace(m)
        out[name] = _gap(_train(model), _train(serial), name)
    torch.manual_seed(0)
    serial, plan = _swap_model()
    model = apply_tensor_parallel(copy.deepcopy(serial), mesh, plan, where="t.py:1")
    _train(model, steps=1)  # its first-backward checks passed
    _train(serial, steps=1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    (got, calls), (want, _) = _autograd_views(model, ids), _autograd_views(serial, ids)
    out["tensor hook sees DTensors"] = set(calls) == {"DTensor"}
    for key, value in want.items():
        out[key] = _same(got[key], value)
    out.update(_private_fields(model))
    return out


def _same(got, want) -> bool:
    """Equal structure, tensors within 1e-10."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            _same(got[k], v) for k, v in want.items())  # fmt: skip
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and float((got - want).abs().max()) < 1e-10
    return got == want


def _program(rank: int, world: int) -> dict:
    return {"cases": _cases(rank, world), "swaps": _swaps(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_program, 2, timeout=240)


def test_layers_run_their_own_forward_and_every_check_names_its_cause(results):
    cases = [r["cases"] for r in results]
    for name, (_, refusal) in CASES.items():
        kind, detail = cases[0][name]
        if refusal is None:
            assert kind == "trained", (name, detail)
            assert detail < 1e-10, (name, detail)
        else:
            assert kind == "refused", (name, detail)
            assert re.search(refusal, detail), (name, detail)
    assert cases[0] == cases[1]


def test_the_swap_trains_a_replaced_parameter_and_autograd_sees_the_serial_parameters(results):
    swaps = results[0]["swaps"]
    for name in REPLACEMENTS:  # a stale swap would train the old tensor (and leave .grad None)
        assert swaps[name] < 1e-10, (name, swaps[name])
    checks = {k: v for k, v in swaps.items() if k not in REPLACEMENTS}
    assert checks == dict.fromkeys(checks, True), checks
    assert len(checks) == 10
    assert results[1]["swaps"] == swaps
