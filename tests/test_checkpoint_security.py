"""A checkpoint folder is data: a planted pickle never runs, wherever it is and whoever owns it.

Issue 27, item 1. Each payload writes a file when unpickled; every way macrogen reads a
checkpoint (``resumable()``, ``checkpoint convert``, ``convert --model-only``, ``list``)
must leave it unwritten and answer with a one-line error, both for a folder that is the
user's own (the restricted unpickler and ``weights_only`` stop it) and for one another
user owns or others can write (refused before anything is read).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from macrogen.cli import main
from macrogen.runtime import checkpoint_dir
from macrogen.runtime.checkpoint import CheckpointError, resumable
from macrogen.runtime.checkpoint_dir import step_dir, write_marker

pytestmark = pytest.mark.filterwarnings("ignore")  # skip warnings are not the point here

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


class Payload:
    """Unpickled, it writes ``path``: the proof that code ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _resume(ckpt: Path, steps: int = 4) -> list[int]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return list(resumable(range(steps), model=model, optimizer=opt, dir=ckpt, every=2))


def _checkpoint(ckpt: Path) -> Path:
    """A real checkpoint at step 2 (what resumable writes)."""
    _resume(ckpt, 2)
    return step_dir(ckpt, 2)


def _plant(folder: Path, where: str, mark: Path) -> None:
    """Put the payload in ``where`` of the checkpoint at ``folder``, keeping it complete."""
    if where == "metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(mark)))
    else:  # a byte item, saved by DCP itself
        state: dict = {}
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        _load_state_dict(
            state,
            storage_reader=dcp.FileSystemReader(folder),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
        if where == "loop.step":
            state["loop"]["step"] = Payload(mark)
        else:  # a value resumable() loads into the optimizer (its state flattened per parameter)
            state["optim"]["param_groups.0.weight.lr"] = Payload(mark)
        for p in folder.iterdir():
            p.unlink()
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    assert not mark.exists()
    write_marker(folder, 2, 1)  # the sizes as planted: only the contents are hostile


def _make_foreign(ckpt: Path, folder: Path, how: str) -> None:
    if how == "chown folder":
        os.chown(folder, 12345, 12345)
    elif how == "chown file":
        os.chown(folder / ".metadata", 12345, 12345)
    elif how == "chmod o+w folder":
        folder.chmod(0o757)
    elif how == "chmod g+w file":
        (folder / "__0_0.distcp").chmod(0o664)
    elif how == "chmod o+w dir":
        ckpt.chmod(0o757)


WHERE = ["metadata", "loop.step", "optimizer item"]
OWNERS = [
    "own",
    pytest.param("chown folder", marks=ROOT_ONLY),
    pytest.param("chown file", marks=ROOT_ONLY),
    "chmod o+w folder",
    "chmod g+w file",
    "chmod o+w dir",
]


@pytest.fixture
def planted(tmp_path: Path, request: pytest.FixtureRequest):
    where, owner = request.param
    ckpt = tmp_path / "ckpt"
    folder = _checkpoint(ckpt)
    mark = tmp_path / "code-ran"
    _plant(folder, where, mark)
    if owner != "own":
        _make_foreign(ckpt, folder, owner)
    return ckpt, folder, mark


def _params():
    out = []
    for where in WHERE:
        for owner in OWNERS:
            if isinstance(owner, str):
                out.append(pytest.param((where, owner), id=f"{where}-{owner}"))
            else:
                out.append(
                    pytest.param((where, owner.values[0]), id=f"{where}-{owner.values[0]}",
                                 marks=owner.marks)
                )  # fmt: skip
    return out


@pytest.mark.parametrize("planted", _params(), indirect=True)
def test_resumable_never_runs_a_planted_pickle(planted) -> None:
    ckpt, folder, mark = planted
    with pytest.raises(CheckpointError) as e:
        _resume(ckpt)
    assert not mark.exists()
    assert "\n" not in str(e.value)
    assert folder.exists()  # and not deleted


@pytest.mark.parametrize("model_only", [False, True], ids=["whole", "model-only"])
@pytest.mark.parametrize("planted", _params(), indirect=True)
def test_convert_never_runs_a_planted_pickle(planted, model_only, tmp_path, capsys) -> None:
    ckpt, folder, mark = planted
    out = tmp_path / "out.pt"
    for src in (ckpt, folder):
        args = ["checkpoint", "convert", str(src), str(out)] + ["--model-only"] * model_only
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.startswith("macrogen checkpoint: error: ") and err.count("\n") == 1, err
        assert not mark.exists() and not out.exists()


@pytest.mark.parametrize("planted", _params(), indirect=True)
def test_list_never_runs_a_planted_pickle(planted, capsys) -> None:
    ckpt, folder, mark = planted
    assert main(["checkpoint", "list", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert not mark.exists()
    assert f"{folder}  UNUSABLE: " in out or f"{folder}  complete" in out  # byte items: not read


@pytest.mark.parametrize(
    "how", [pytest.param("chown folder", marks=ROOT_ONLY), "chmod o+w folder", "chmod o+w dir"]
)
def test_a_foreign_checkpoint_is_refused_with_a_message(tmp_path: Path, how: str) -> None:
    ckpt = tmp_path / "ckpt"
    folder = _checkpoint(ckpt)
    _make_foreign(ckpt, folder, how)
    reason = "belongs to another user" if "chown" in how else "writable by group or others"
    with pytest.raises(CheckpointError, match=reason):
        _resume(ckpt)
    if how != "chmod o+w dir":
        state, why = checkpoint_dir.examine(folder)
        assert state == "unusable" and reason in why


def test_a_sticky_shared_dir_is_fine(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt)
    ckpt.chmod(0o1777)  # like /tmp: others can't replace what is ours
    _resume(ckpt)
