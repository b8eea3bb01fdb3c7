"""How a sharded optimizer finds its model's averaging: each parameter's link, no global table.

A ``GradientSync`` registers a ``SyncLink`` on each parameter it averages; a
sharded optimizer given those parameters follows the links to the model's
averaging and takes the gradients over. A copy or a pickle of a parameter has
no link; a parameter the model replaced no longer counts. An optimizer over
parameters of no data-parallel model, or of two, is refused by name: with no
model's forward to time it, a clip of its local gradients would go unseen.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from macrogen.runtime import data_parallel
from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync, syncs_of
from macrogen.runtime.mesh import SERIAL
from macrogen.runtime.zero import shard_optimizer


def averaged(model: nn.Module, where: str = "train.py:3") -> GradientSync:
    sync = GradientSync(model, DataParallelConfig(), where=where, mesh=SERIAL)
    model.__dict__["_mg_gradient_sync"] = sync
    return sync


def test_the_parameters_lead_to_their_models_averaging():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    sync = averaged(model)
    assert syncs_of(model.parameters()) == [sync]
    assert syncs_of([torch.nn.Parameter(torch.ones(2))]) == []
    assert not hasattr(data_parallel, "_OWNER")  # (the table this replaced)


def test_a_copied_or_pickled_parameter_has_no_link():
    model = nn.Linear(2, 2)
    averaged(model)
    assert syncs_of(copy.deepcopy(model).parameters()) == []
    again = pickle.loads(pickle.dumps(model.weight))
    assert syncs_of([again]) == []


def test_a_replaced_parameter_no_longer_counts():
    model = nn.Linear(2, 2)
    sync = averaged(model)
    old = model.weight
    model.weight = nn.Parameter(old.detach().clone())
    sync._collect()  # what the next training forward does when it sees the change
    assert syncs_of([old]) == []
    assert syncs_of([model.weight]) == [sync]


def test_shard_optimizer_needs_exactly_one_data_parallel_model(monkeypatch):
    import macrogen.runtime.groups as groups

    monkeypatch.setattr(groups, "world_size", lambda group=None: 2)
    plain = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"belong to no data-parallel model.*dp='zero1'"):
        shard_optimizer(torch.optim.AdamW(plain.parameters()), where="train.py:9")
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    averaged(a, "train.py:4")
    averaged(b, "train.py:5")
    both = torch.optim.AdamW([*a.parameters(), *b.parameters()])
    with pytest.raises(ValueError, match=r"2 data-parallel models \(train.py:4, train.py:5\)"):
        shard_optimizer(both, where="train.py:9")
