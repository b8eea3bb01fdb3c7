"""Two tunables chosen by the tuning database, one left at its default."""

import torch

import macrogen as mg

BLOCK = mg.tunable(64, choices=[32, 64, 128])  # tuned to 128
MODE = mg.tunable("rows", choices=["rows", "cols"])  # tuned to "cols"
WIDTH = mg.tunable(8, choices=[4, 8])  # no entry: the default


def blocks(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(BLOCK * WIDTH, dim=0 if MODE == "rows" else 1))
