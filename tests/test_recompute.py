"""``mg.parallelize(recompute="blocks")``: the repeated blocks recomputed in backward, on one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from macrogen.runtime.recompute import apply_recompute
from tests.helpers import expand, expansion_errors


class Block(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.2)  # random: the recompute must replay the same mask

    def forward(self, x, scale=1.0):
        return x + scale * self.proj(self.drop(torch.relu(self.fc(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, scale=0.5)  # a keyword argument reaches the checkpointed forward
        return self.head(x)


def _step(model, x, seed):
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recomputed_blocks_train_bit_identical_and_keep_the_model_as_it_is():
    torch.manual_seed(0)
    serial = Net()
    model = apply_recompute(copy.deepcopy(serial), "blocks", where="t.py:1")
    assert type(model) is Net and type(model.layers[0]) is Block
    assert list(model.state_dict()) == list(serial.state_dict())  # no wrapper in the keys
    x = torch.randn(8, 16)
    for seed in range(3):
        want, want_grads = _step(serial, x, seed)
        got, grads = _step(model, x, seed)
        assert torch.equal(got, want)
        for name, grad in want_grads.items():
            assert torch.equal(grads[name], grad), name


def test_recompute_saves_less_for_backward():
    def saved_bytes(model):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(64, 16)).sum()
        return total[0]

    torch.manual_seed(0)
    serial = Net(blocks=8)
    recomputed = apply_recompute(copy.deepcopy(serial), "blocks", where="t.py:1")
    assert saved_bytes(recomputed) < saved_bytes(serial) / 3


def test_evaluation_and_a_second_application_change_nothing():
    model = apply_recompute(Net(), "blocks", where="t.py:1")
    once = model.layers[0].forward
    apply_recompute(model, "blocks", where="t.py:1")
    assert model.layers[0].forward is once
    with torch.no_grad():
        model.eval()(torch.randn(2, 16))
    assert apply_recompute(Net(), None, where="t.py:1").layers[0].__dict__.get("forward") is None


def test_a_model_without_blocks_or_a_bad_choice_is_an_error():
    with pytest.raises(ValueError, match="recompute='blocks' found no repeated blocks"):
        apply_recompute(nn.Linear(2, 2), "blocks", where="t.py:3")
    with pytest.raises(ValueError, match="t.py:3: recompute='all'"):
        apply_recompute(Net(), "all", where="t.py:3")


def test_the_expansion_recomputes_between_tensor_and_data_parallel():
    code = expand(
        "import macrogen as mg\n"
        "model = mg.parallelize(model, tp=2, tp_plan='hf', dp='fsdp', recompute='blocks')\n"
    )
    tp = code.index("apply_tensor_parallel(model")
    again = code.index("apply_recompute(model, 'blocks'")
    fsdp = code.index("apply_fully_sharded(model")
    assert tp < again < fsdp
    plain = expand("import macrogen as mg\nmodel = mg.parallelize(model, recompute='none')\n")
    assert "apply_recompute" not in plain
    (error,) = expansion_errors("import macrogen as mg\nm = mg.parallelize(m, recompute='all')\n")
    assert "recompute" in error and '"blocks"' in error


def test_a_dropped_block_is_freed_at_once():
    import gc
    import weakref

    model = apply_recompute(Net(), "blocks", where="t.py:1")
    gone = weakref.ref(model.layers[3])
    gc.disable()  # no cycle collection: reference counts alone must free it
    try:
        model.layers[3] = nn.Identity()  # what a pipeline cut does to another stage's block
        assert gone() is None
    finally:
        gc.enable()
