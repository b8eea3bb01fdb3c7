"""@tensor_parallel classes captured at definition time (issue 24: no renamed classes).

torchtitan builds its layers through ``config.X.build()``, whose class was
recorded when the class was defined; registries and decorators capture classes
the same way. When ``@tensor_parallel`` renamed the user's class and put a
generated subclass under its name, those captures built the serial class:
no shards, no error. Now the class object itself carries the plan, so whatever
captured it builds the tensor-parallel class.

Checked on 2 gloo ranks in float64: a model built through a torchtitan-style
``Config.build()`` and a registry, re-initialized by its (decorated) parent,
starts from exactly the serial weights, and its losses, gradients and
parameters after 3 AdamW steps equal serial within 1e-10. A planned module the
plan never reached, and an undecorated parent re-initializing cut shards, are
errors at the first forward.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

SOURCE = textwrap.dedent(
    '''
    from dataclasses import dataclass

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import macrogen as mg

    REGISTRY = {}


    def register(name):
        def add(cls):
            REGISTRY[name] = cls  # the class object, captured at definition time
            return cls

        return add


    class Module(nn.Module):
        """torchtitan's pattern: a class's nested Config builds the class it was defined in."""

        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            if "Config" in cls.__dict__:
                cls.Config.owner = cls  # captured at definition time


    @mg.tensor_parallel(plan={"w1": "colwise", "w2": "rowwise"})
    class FeedForward(Module):
        @dataclass
        class Config:
            dim: int
            hidden: int

            def build(self):
                return self.owner(self.dim, self.hidden)

        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden)
            self.w2 = nn.Linear(hidden, dim)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)))


    @register("attention")
    @mg.tensor_parallel(plan={"qkv": ("colwise", 3), "proj": "rowwise", "n_head": "divide"})
    class Attention(nn.Module):
        def __init__(self, dim, n_head):
            super().__init__()
            self.n_head = n_head
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1))


    class Block(nn.Module):  # not decorated: built inside the decorated model
        def __init__(self, dim, n_head):
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.attn = REGISTRY["attention"](dim, n_head)
            self.ffn = FeedForward.Config(dim, 4 * dim).build()

        def forward(self, x):
            x = x + self.attn(self.ln(x))
            return x + self.ffn(x)


    @mg.tensor_parallel(plan={"emb": "vocab"})
    class Model(nn.Module):
        def __init__(self, vocab=32, dim=16, n_head=4, layers=2):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(layers))
            self.head = nn.Linear(dim, vocab)
            self.apply(self._init)  # after the children: it must see the serial layers

        def _init(self, module):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.1)
                nn.init.uniform_(module.bias, -0.1, 0.1)

        def forward(self, idx, targets):
            x = self.emb(idx)
            for block in self.blocks:
                x = block(x)
            logits = self.head(x)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


    class Stray(nn.Module):
        """A factory's module built during the model's construction but kept outside its tree."""

        def __init__(self):
            super().__init__()
            self.made = [FeedForward.Config(8, 16).build()]


    @mg.tensor_parallel(plan={})
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.stray = Stray()


    class PreTrained(nn.Module):
        """Hugging Face's post_init(), on a parent that is not decorated (but builds a decorated
        class and re-initializes it: the expansion decorates it)."""

        def __init__(self):
            super().__init__()
            self.ffn = FeedForward(8, 16)
            self.apply(self._init)

        def _init(self, module):
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(std=0.5)

        def forward(self, x):
            return self.ffn(x)
    '''
)

STEPS, TOL = 3, dict(rtol=1e-10, atol=1e-10)


def _load(tmp: Path, rank: int):
    tmp = tmp / f"rank{rank}"
    tmp.mkdir(exist_ok=True)
    serial = load_module(SOURCE, f"registry_serial_{rank}", tmp)
    parallel = load_module(expand(SOURCE), f"registry_parallel_{rank}", tmp)
    return serial, parallel


def _train(model, idx, targets):
    """Losses, first gradients and the norms ``clip_grad_norm_`` returned (it clips: max 0.5)."""
    from macrogen.runtime.tensor_parallel import full_gradients

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        if step == 0:
            grads = full_gradients(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms), grads


def _parity(rank, world, tmp):
    from torch.distributed.tensor import DTensor, Shard

    from macrogen.runtime.tensor_parallel import full_state_dict

    os.environ["MACROGEN_TP_SIZE"] = str(world)
    torch.set_default_dtype(torch.float64)
    S, P = _load(Path(tmp), rank)
    # what captured the classes at definition time holds the tensor-parallel classes themselves
    assert P.REGISTRY["attention"] is P.Attention and P.FeedForward.Config.owner is P.FeedForward

    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 32, (4, 9), generator=g)
    idx, targets = data[:, :-1], data[:, 1:]
    torch.manual_seed(0)
    serial = S.Model()
    initial = {k: v.clone() for k, v in serial.state_dict().items()}
    serial_numel = sum(p.numel() for p in serial.parameters())
    serial_losses, serial_norms, serial_grads = _train(serial, idx, targets)

    torch.manual_seed(0)
    model = P.Model()
    block = model.blocks[0]
    # the engine's DTensor parameters: whole-model tools see the serial model
    w1 = block.ffn.w1.weight
    assert isinstance(w1, DTensor) and w1.placements == (Shard(0),) and w1.shape == (64, 16)
    assert w1.to_local().shape == (64 // world, 16) and block.attn.n_head == 4 // world
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == serial_numel
    for key, value in full_state_dict(model).items():  # the parent's re-init saw serial layers
        torch.testing.assert_close(value, initial[key], rtol=0, atol=0, msg=f"initial {key}")
    losses, norms, grads = _train(model, idx, targets)
    torch.testing.assert_close(losses, serial_losses, **TOL)
    torch.testing.assert_close(norms, serial_norms, **TOL, msg="clip_grad_norm_'s norms")
    for key, grad in grads.items():
        torch.testing.assert_close(
            grad, serial_grads[key], **TOL, msg=lambda m, key=key: f"gradient {key}: {m}"
        )
    final = full_state_dict(model)
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(final[key], value, **TOL, msg=f"{key} after {STEPS} steps")

    # an undecorated parent of the same file that re-initializes what it builds: the expansion
    # makes its construction the one that applies the plans, so it starts from the serial draws
    x = torch.randn(2, 8)
    torch.manual_seed(3)
    want = S.PreTrained()
    torch.manual_seed(3)
    got = P.PreTrained()
    assert isinstance(got.ffn.w1.weight, DTensor)
    for key, value in full_state_dict(got).items():
        torch.testing.assert_close(value, want.state_dict()[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(got(x), want(x), **TOL)

    # one in another file (here: this test's), which the expansion does not see: an error at the
    # first forward, never a silently different start; a checkpoint loaded after it replaces the
    # values: no error
    class Elsewhere(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = P.FeedForward(8, 16)
            self.apply(lambda m: P.PreTrained._init(self, m))

        def forward(self, x):
            return self.ffn(x)

    with pytest.raises(
        RuntimeError, match=r"FeedForward's shards \(w1.weight, w2.weight\) changed"
    ):
        Elsewhere()(x)
    reloaded = Elsewhere()
    reloaded.ffn.load_full_state_dict(S.FeedForward(8, 16).state_dict())
    reloaded(x)

    # mg.parallelize's apply step on a model whose decorated classes were cut: one plan, one place
    from macrogen.runtime.parallelize import apply_tensor_parallel, device_mesh

    mesh = device_mesh(tp=world, where="test")
    with pytest.raises(RuntimeError, match=r"tensor-parallel already"):
        apply_tensor_parallel(model, mesh, {"head": "colwise"}, where="test")
    return True


def test_classes_captured_at_definition_build_the_parallel_model_on_two_ranks(tmp_path):
    assert run_ranks(_parity, 2, args=(str(tmp_path),), timeout=180) == [True, True]


def test_a_planned_module_the_plan_never_reached_is_an_error_at_its_forward(tmp_path):
    P = load_module(expand(SOURCE), "registry_stray", tmp_path)
    holder = P.Holder()
    with pytest.raises(
        RuntimeError, match=r"this FeedForward was built while Holder was being built"
    ):
        holder.stray.made[0](torch.zeros(1, 8))
