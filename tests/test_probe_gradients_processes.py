"""The layout probe's activations do not depend on how the step zeroes its gradients.

``zero_grad()`` frees the gradients (set_to_none) before the forward; the probe's window opens
with them live, so its peak above the start is the activations less them. The probe adds back
what was freed: the same model gives the same activations whether its step frees or keeps its
gradients, and ``grads_kept`` tells the two apart (the memory model counts the gradients at
the activations' peak only where a layout holds them).
"""

from __future__ import annotations

import sys

import pytest

from macrogen.autotune import probe

CODE = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)

    def step():
        opt.zero_grad(set_to_none=SET_TO_NONE)
        model(x).square().mean().backward()
        opt.step()

    return model, step
"""


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_activations_are_the_same_whether_the_step_frees_its_gradients(set_to_none, tmp_path):
    profile, _ = probe.run(
        CODE.replace("SET_TO_NONE", str(set_to_none)),
        "net.py",
        "net:build",
        True,
        [str(tmp_path), *sys.path],
        None,
    )
    # 4 blocks of 2 x 128 K weights: 4.2 MB of gradients, several times the activations
    assert profile.param_bytes == 4 * (256 * 512 * 2 + 512 + 256) * 4
    # what autograd saves: per block its input and relu's output (32 rows), 0.4 MB
    saved = 4 * 32 * (256 + 512) * 4
    # freed or kept, the activations and no gradients: the step's peak above the start alone
    # read ~0.07 MB when zero_grad freed the gradients, and with them added back, the 4.2 MB
    # backward makes again (kept, backward's one gradient at a time before it is added in place,
    # 0.5 MB at most here, is the step's too)
    assert saved <= profile.activation_bytes < profile.param_bytes / 2, profile.activation_bytes
    assert profile.grads_kept is not set_to_none
