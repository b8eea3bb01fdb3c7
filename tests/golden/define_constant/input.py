"""A model size fixed at expansion time."""

import torch
import macrogen as mg

D_MODEL = mg.define(256)  # width of the residual stream
N_HEAD = mg.define(D_MODEL // 64)
NAMES = mg.define(("q", "k", "v"))


def make():
    return torch.nn.Linear(D_MODEL, D_MODEL)
