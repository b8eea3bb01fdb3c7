"""The ``resumable`` macro: unexpanded it is the plain loop; expanded it checkpoints and resumes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

import macrogen as mg
from macrogen import expand_source

SOURCE = textwrap.dedent(
    """
    import torch

    import macrogen as mg


    def train(ckpt, stop=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in mg.resumable(range(10), model=model, optimizer=opt, dir=ckpt, every=3):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == stop:
                break
        return model
    """
)


def load(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "train.py", "exec"), namespace)
    return namespace


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_marker_is_the_plain_loop() -> None:
    items = [1, 2, 3]
    assert mg.resumable(items, model=None, dir="unused", every=1) is items


def test_expanded_loop_resumes_to_the_unexpanded_result(tmp_path: Path) -> None:
    serial = load(SOURCE)["train"](str(tmp_path / "unused"))  # the marker writes nothing
    assert not (tmp_path / "unused").exists()
    expanded = expand_source(SOURCE, path="train.py").code
    assert "from macrogen.runtime import resumable as _mg_resumable" in expanded
    train = load(expanded)["train"]
    ckpt = str(tmp_path / "ckpt")
    assert same(train(ckpt, stop=7), load(SOURCE)["train"](ckpt, stop=7))  # saving changes nothing
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step_00000003",
        "step_00000006",
    ]
    assert same(train(ckpt), serial)  # resumed at step 6: the uninterrupted result, bit for bit
