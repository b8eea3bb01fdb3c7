"""``macrogen.runtime.checkpoint.resumable`` in one process: exact resume, pruning, bad input."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from macrogen.runtime.checkpoint import CheckpointError, resumable
from macrogen.runtime.checkpoint_dir import MARKER

STEPS = 12


def _model(hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.Dropout(0.25), torch.nn.Linear(hidden, 2)
    )


def train(ckpt: Path, *, stop: int | None = None, every: int = 3, keep: int = 2, hidden: int = 16):
    """A run that uses the global RNG (data and dropout), so RNG restore matters."""
    torch.manual_seed(0)
    model = _model(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=every, keep=keep)
    for step in loop:
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == stop:
            break
    del loop  # waits for the save in flight
    return model


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def steps(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return train(tmp_path_factory.mktemp("ref") / "ckpt")


def test_stop_and_resume_is_bit_identical(tmp_path: Path, reference: torch.nn.Module) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=7)  # saves at 3 and 6; step 7 is redone after the restart
    assert steps(ckpt) == ["step_00000003", "step_00000006"]
    assert same(train(ckpt), reference)
    assert steps(ckpt) == ["step_00000009", "step_00000012"]  # keep=2 pruned the rest


def test_marker_lists_files_and_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=3, keep=5)
    marker = json.loads((ckpt / "step_00000003" / MARKER).read_text())
    assert marker["step"] == 3 and marker["world_size"] == 1
    assert ".metadata" in marker["files"] and MARKER not in marker["files"]


def test_partial_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, reference: torch.nn.Module
) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=7)
    (ckpt / "step_00000006" / MARKER).unlink()  # as if a rank died mid-save
    with pytest.warns(UserWarning, match=r"step_00000006: no completion marker"):
        resumed = train(ckpt)
    assert same(resumed, reference)


def test_truncated_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, reference: torch.nn.Module
) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=7)
    data = ckpt / "step_00000006" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.warns(UserWarning, match=r"step_00000006: __0_0.distcp has 100 bytes"):
        resumed = train(ckpt)
    assert same(resumed, reference)


def test_unreadable_metadata_is_skipped_with_a_warning(
    tmp_path: Path, reference: torch.nn.Module
) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=7)
    meta = ckpt / "step_00000006" / ".metadata"
    size = meta.stat().st_size
    meta.write_bytes(b"\0" * size)  # same size, garbage: only loading finds out
    with pytest.warns(UserWarning, match=r"step_00000006: its .metadata can't be read"):
        resumed = train(ckpt)
    assert same(resumed, reference)


def test_different_model_names_the_first_mismatching_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=3)
    with pytest.raises(CheckpointError, match=r"different model: 'model.0.weight' has shape"):
        train(ckpt, hidden=8)


def test_renamed_layer_names_the_missing_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    train(ckpt, stop=3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))  # no dropout slot
    with pytest.raises(CheckpointError, match=r"it has no 'model.1.weight'"):
        resumable(range(3), model=model, dir=ckpt, every=3)


def test_unwritable_dir_fails_at_start_up(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    model = _model()
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*file/ckpt' is not writable"):
        resumable(range(3), model=model, dir=blocker / "ckpt", every=1)  # before any step


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_dir_fails_at_start_up(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="is not writable"):
            resumable(range(3), model=_model(), dir=ckpt, every=1)
    finally:
        ckpt.chmod(0o755)


@pytest.mark.parametrize("bad", [{"every": 0}, {"every": 2.5}, {"keep": 0}, {"keep": True}])
def test_bad_arguments(tmp_path: Path, bad: dict) -> None:
    args = {"model": _model(), "dir": tmp_path, "every": 1, **bad}
    with pytest.raises(ValueError, match="must be a whole number >= 1"):
        resumable(range(3), **args)


def test_other_iterables_skip_the_consumed_items(tmp_path: Path) -> None:
    model = _model()
    seen = list(resumable(iter("abcdefg"), model=model, dir=tmp_path, every=2))
    assert seen == list("abcdefg")
    shutil.rmtree(tmp_path / "step_00000006")  # resume from step 4
    assert list(resumable(iter("abcdefg"), model=model, dir=tmp_path, every=2)) == list("efg")


def test_cli_converts_the_newest_complete_checkpoint(tmp_path: Path, capsys) -> None:
    from macrogen.cli import main

    ckpt = tmp_path / "ckpt"
    model = train(ckpt, stop=7)  # checkpoints at 3 and 6
    (ckpt / "step_00000006" / MARKER).unlink()
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "convert", str(ckpt), str(out), "--model-only"]) == 0
    assert "from " + str(ckpt / "step_00000003") in capsys.readouterr().out
    assert main(["checkpoint", "list", str(ckpt)]) == 0
    assert "step_00000006  INCOMPLETE: no completion marker" in capsys.readouterr().out
    at3 = torch.load(out)
    assert at3.keys() == model.state_dict().keys()
    whole = tmp_path / "whole.pt"
    assert main(["checkpoint", "convert", str(ckpt / "step_00000003"), str(whole)]) == 0
    saved = torch.load(whole, weights_only=False)
    assert saved["loop"]["step"] == 3 and "rng" in saved and "optim" in saved
    assert all(torch.equal(at3[k], saved["model"][k]) for k in at3)
    assert main(["checkpoint", "convert", str(ckpt / "step_00000006"), str(whole)]) == 1
    assert "is not complete" in capsys.readouterr().err


def test_the_optimizer_state_is_flattened_per_parameter(tmp_path: Path) -> None:
    """Under the serial names, torch's flattened layout: what loads across pipeline stages."""
    from macrogen.runtime.checkpoint_files import read_metadata

    train(tmp_path / "ckpt", stop=3)
    keys = read_metadata(tmp_path / "ckpt" / "step_00000003").state_dict_metadata
    assert {"optim.state.0.weight.exp_avg", "optim.param_groups.2.bias.lr"} <= keys.keys()
    assert not any(k.startswith("optim.param_groups.0.") and k.count(".") == 3 for k in keys)


def test_parameter_groups_split_otherwise_than_saved_are_an_error(tmp_path: Path) -> None:
    """Each parameter's settings go back to its group: a group whose parameters were saved
    with different settings is named, not averaged or guessed."""
    from macrogen.runtime.checkpoint_state import UnsupportedModel

    def run(groups: Callable[[torch.nn.Module], Any]) -> None:
        model = _model()
        opt = torch.optim.AdamW(groups(model), lr=1e-2)
        for _ in resumable(range(2), model=model, optimizer=opt, dir=tmp_path / "ckpt", every=1):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()

    run(lambda m: [{"params": m[0].parameters(), "lr": 0.1}, {"params": m[2].parameters()}])
    with pytest.raises(UnsupportedModel, match=r"lr=0\.1 for 0\.weight and lr=0\.01 for 2\.weight"):
        run(lambda m: m.parameters())


def test_a_checkpoint_in_the_older_optimizer_layout_resumes(
    tmp_path: Path, reference: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written before the optimizer state was flattened (its param_groups a
    list) resumes as it did."""
    from macrogen.runtime import checkpoint_state
    from macrogen.runtime.checkpoint_files import read_metadata

    ckpt = tmp_path / "ckpt"
    get_state = checkpoint_state.get_state
    with monkeypatch.context() as m:
        m.setattr(
            checkpoint_state, "get_state", lambda *a, **k: get_state(*a, **{**k, "flat": False})
        )
        train(ckpt, stop=7)
    keys = read_metadata(ckpt / "step_00000006").state_dict_metadata
    assert checkpoint_state.NESTED_KEY in keys
    assert same(train(ckpt), reference)
