"""Issue 27, checkpoints: generated cases per category, each a clean answer that loses nothing.

Categories (the counts are printed by ``test_category_counts``):

- **checkpoint folder**: a folder damaged or odd in one way (truncated, zeroed or missing
  shard, garbage, empty or torch.save ``.metadata``, FIFOs, links, directories). ``list``
  says what it is, ``convert`` exits 1 with one line, ``resumable()`` stops with one line
  and deletes nothing (``fresh=True`` starts over and keeps it, set aside).
- **marker**: ``macrogen_complete.json`` with each field wrong in type or range, nested
  200,000 deep, too large: never trusted, never a traceback.
- **loop.***: ``loop.step`` (and the RNG states) saved with a wrong type or value: never
  resumed from (``-3`` resumed ``range(8)[-3:]``).

Then one test per remaining item: the step past the loop's end, convert's staged
write, pruning through links, a disk full during a save, odd folder names, ``list``
on a step folder.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from macrogen.cli import main
from macrogen.runtime import checkpoint_dir
from macrogen.runtime.checkpoint import CheckpointError, resumable
from macrogen.runtime.checkpoint_dir import MARKER, step_dir, write_marker

pytestmark = pytest.mark.timeout(120)  # a FIFO must not hang anything


# ---- helpers -------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _train(ckpt: Path, steps: int = 4, every: int = 2, **options) -> list[int]:
    """The steps the loop ran (a resumed loop starts after its checkpoint)."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []
    for step in resumable(
        range(steps), model=model, optimizer=opt, dir=ckpt, every=every, **options
    ):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ran.append(step)
    return ran


def _whole(folder: Path) -> dict:
    """The checkpoint's state as saved (the tests trust what they wrote)."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=dcp.FileSystemReader(folder),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state


def _resave(folder: Path, state: dict, step: int) -> None:
    for p in folder.iterdir():
        p.unlink()
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    write_marker(folder, step, 1)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("macrogen checkpoint: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _resume_refused(ckpt: Path, folder: Path) -> str:
    """resumable() on ``ckpt`` stops with one line, warns in one line each, deletes nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as e:
            _train(ckpt, steps=8)
    for w in caught:
        assert "\n" not in str(w.message), w.message
    assert "\n" not in str(e.value)
    assert os.path.lexists(folder)
    return str(e.value)


# ---- category: checkpoint folder -----------------------------------------------------------


def _truncate(f: Path) -> None:
    shard = f / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])


def _zero(f: Path) -> None:
    shard = f / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)


def _metadata(data: bytes) -> Callable[[Path], None]:
    return lambda f: (f / ".metadata").write_bytes(data)


def _torch_save_metadata(f: Path) -> None:
    buffer = io.BytesIO()  # torch.save refuses the name ".metadata" itself
    torch.save({"a": torch.ones(2)}, buffer)
    (f / ".metadata").write_bytes(buffer.getvalue())


def _outside_metadata(f: Path) -> None:
    md = pickle.loads((f / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (f / ".metadata").write_bytes(pickle.dumps(md))


def _fifo(name: str) -> Callable[[Path], None]:
    def make(f: Path) -> None:
        (f / name).unlink()
        os.mkfifo(f / name)

    return make


def _shard_dir(f: Path) -> None:
    (f / "__0_0.distcp").unlink()
    (f / "__0_0.distcp").mkdir()


def _shard_link(f: Path) -> None:
    target = f.parent.parent / "elsewhere.distcp"
    (f / "__0_0.distcp").rename(target)
    (f / "__0_0.distcp").symlink_to(target)


def _missing_shard(f: Path) -> None:
    (f / "__0_0.distcp").unlink()


def _marker_dir(f: Path) -> None:
    (f / MARKER).unlink()
    (f / MARKER).mkdir()


# (name, damage, whether the marker is rewritten to the new sizes, as a careful forger would)
FOLDER_CASES = [
    ("truncated shard, sizes as listed", _truncate, False),
    ("truncated shard, marker rewritten", _truncate, True),
    ("zeroed shard", _zero, True),
    ("garbage .metadata", _metadata(b"\x80\x04garbage" * 50), True),
    ("zeroed .metadata", lambda f: _metadata(b"\0" * 600)(f), True),
    ("empty .metadata", _metadata(b""), True),
    ("a torch.save file as .metadata", _torch_save_metadata, True),
    ("a .metadata naming files outside", _outside_metadata, True),
    ("missing shard", _missing_shard, False),
    ("a FIFO as shard", _fifo("__0_0.distcp"), False),
    ("a FIFO as .metadata", _fifo(".metadata"), False),
    ("a FIFO as marker", _fifo(MARKER), False),
    ("a directory as shard", _shard_dir, False),
    ("a directory as marker", _marker_dir, False),
    ("a link as shard", _shard_link, False),
]


@pytest.fixture(params=FOLDER_CASES, ids=[c[0] for c in FOLDER_CASES])
def damaged(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    """A dir whose only checkpoint (step 2) is damaged as the case says."""
    _, damage, rewrite = request.param
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    folder = step_dir(ckpt, 2)
    damage(folder)
    if rewrite:
        write_marker(folder, 2, 1)
    return ckpt, folder


def test_folder_list_says_what_is_wrong(damaged, capsys) -> None:
    ckpt, folder = damaged
    for where in (ckpt, folder):  # the dir, and the step folder itself
        assert main(["checkpoint", "list", str(where)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{folder}  ") and out.count("\n") == 1, out


def test_folder_convert_is_one_line_exit_1(damaged, tmp_path, capsys) -> None:
    _, folder = damaged
    out = tmp_path / "model.pt"
    for extra in ([], ["--model-only"]):
        assert main(["checkpoint", "convert", str(folder), str(out), *extra]) == 1
        _one_line_error(capsys)
        assert not out.exists()


def test_folder_resumable_stops_and_keeps_it(damaged) -> None:
    ckpt, folder = damaged
    message = _resume_refused(ckpt, folder)
    assert "no checkpoint under" in message and "fresh=True" in message


def test_folder_fresh_starts_over_and_keeps_it(damaged, monkeypatch) -> None:
    ckpt, folder = damaged
    state, _ = checkpoint_dir.examine(folder)
    monkeypatch.setenv("MACROGEN_FRESH", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _train(ckpt) == [0, 1, 2, 3]
    if state == checkpoint_dir.UNUSABLE:  # known unusable: kept, out of the saves' way
        assert (ckpt / "step_00000002.unreadable").exists()
        assert any("kept the unusable checkpoint" in str(w.message) for w in caught)
    else:  # looks complete (only a load would tell): fresh deletes it, as the user asked
        assert not (ckpt / "step_00000002.unreadable").exists()
    assert checkpoint_dir.check_complete(step_dir(ckpt, 4)) is None


# ---- category: marker ----------------------------------------------------------------------


def _marker(**changes) -> Callable[[dict], object]:
    def edit(marker: dict) -> object:
        marker.update(changes)
        return marker

    return edit


def _sizes_as(kind: Callable) -> Callable[[dict], object]:
    def edit(marker: dict) -> object:
        marker["files"] = {k: kind(v) for k, v in marker["files"].items()}
        return marker

    return edit


def _without(key: str) -> Callable[[dict], object]:
    return lambda marker: {k: v for k, v in marker.items() if k != key}


def _file(name: str) -> Callable[[dict], object]:
    def edit(marker: dict) -> object:
        marker["files"][name] = 0
        return marker

    return edit


MARKER_CASES: list[tuple[str, Callable[[dict], object] | bytes]] = [
    ("sizes as strings", _sizes_as(str)),
    ("sizes as floats", _sizes_as(float)),
    ("sizes as booleans", _sizes_as(bool)),
    ("negative sizes", _sizes_as(lambda v: -v)),
    ("files a list", _marker(files=[".metadata"])),
    ("files empty", _marker(files={})),
    ("no files", _without("files")),
    ("no step", _without("step")),
    ("step a string", _marker(step="2")),
    ("step negative", _marker(step=-3)),
    ("step another folder's", _marker(step=7)),
    ("step true", _marker(step=True)),
    ("world_size 0", _marker(world_size=0)),
    ("world_size a float", _marker(world_size=1.0)),
    ("format 2", _marker(format=2)),
    ("format true", _marker(format=True)),
    ("a file outside", _file("../x")),
    ("a file in a subfolder", _file("a/b")),
    ("the marker listed", _file(MARKER)),
    ("a list", lambda marker: [marker]),
    ("null", lambda marker: None),
    ("a string", lambda marker: "complete"),
    ("nested 200,000 deep", b"[" * 200_000 + b"]" * 200_000),
    ("invalid JSON", b"{'step': 2"),
    ("empty", b""),
    ("not UTF-8", b"\xff\xfe{}"),
    ("larger than 1 MiB", b" " * (1 << 20) + b"{}"),
]


@pytest.mark.parametrize("edit", [c[1] for c in MARKER_CASES], ids=[c[0] for c in MARKER_CASES])
def test_marker(tmp_path: Path, edit, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    folder = step_dir(ckpt, 2)
    if isinstance(edit, bytes):
        data = edit
    else:
        data = json.dumps(edit(json.loads((folder / MARKER).read_text()))).encode()
    (folder / MARKER).write_bytes(data)
    state, why = checkpoint_dir.examine(folder)
    assert state == checkpoint_dir.UNUSABLE and "\n" not in why
    assert main(["checkpoint", "list", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder}  UNUSABLE: ") and out.count("\n") == 1, out
    assert "the save wrote" not in out  # "has 2331 bytes, the save wrote 2331"
    assert main(["checkpoint", "convert", str(ckpt), str(tmp_path / "m.pt")]) == 1
    _one_line_error(capsys)
    _resume_refused(ckpt, folder)
    assert (folder / MARKER).read_bytes() == data  # kept as it was


# ---- category: loop.* ----------------------------------------------------------------------


def _step_value(value: object) -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        state["loop"]["step"] = value

    return edit


def _rng(value: torch.Tensor) -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        state["rng"]["rank0"]["cpu"] = value

    return edit


def _no_step(state: dict) -> None:
    del state["loop"]["step"]


LOOP_CASES = [
    ("step -3", _step_value(-3)),
    ("step another folder's", _step_value(1)),
    ("step 10**12", _step_value(10**12)),
    ("step True", _step_value(True)),
    ("step '2'", _step_value("2")),
    ("step 2.0", _step_value(2.0)),
    ("step None", _step_value(None)),
    ("step [2]", _step_value([2])),
    ("step a tensor", _step_value(torch.tensor(2))),
    ("no step", _no_step),
    ("rng float", _rng(torch.zeros(5056))),
    ("rng 2-d", _rng(torch.zeros(2, 8, dtype=torch.uint8))),
    ("rng huge", _rng(torch.zeros(1 << 21, dtype=torch.uint8))),
]


@pytest.mark.parametrize("edit", [c[1] for c in LOOP_CASES], ids=[c[0] for c in LOOP_CASES])
def test_loop(tmp_path: Path, edit) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    folder = step_dir(ckpt, 2)
    state = _whole(folder)
    edit(state)
    _resave(folder, state, 2)
    message = _resume_refused(ckpt, folder)
    assert "step_00000002: " in message
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == [folder.name]


def test_category_counts(capsys) -> None:
    with capsys.disabled():
        print(
            f"\ncheckpoint categories: checkpoint folder {len(FOLDER_CASES)} cases x 4 checks,"
            f" marker {len(MARKER_CASES)}, loop.* {len(LOOP_CASES)}"
        )


# ---- item 6: unusable checkpoints are kept ---------------------------------------------------


def test_an_unusable_newest_checkpoint_is_kept_and_the_older_one_resumed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=4)  # step 2 and step 4
    _zero(step_dir(ckpt, 4))
    write_marker(step_dir(ckpt, 4), 4, 1)
    with pytest.warns(UserWarning, match=r"step_00000004: DCP can't read it: "):
        assert _train(ckpt, steps=6) == [2, 3, 4, 5]
    assert (ckpt / "step_00000004.unreadable").is_dir()
    assert checkpoint_dir.check_complete(step_dir(ckpt, 4)) is None  # saved again


def test_fresh_argument_and_a_bad_environment_value(tmp_path: Path, monkeypatch) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    assert _train(ckpt, steps=4, fresh=True) == [0, 1, 2, 3]  # complete ones: started over
    monkeypatch.setenv("MACROGEN_FRESH", "yes")
    with pytest.raises(ValueError, match="MACROGEN_FRESH must be 1 or 0, not 'yes'"):
        _train(ckpt)
    with pytest.raises(ValueError, match="fresh must be True or False"):
        _train(ckpt, fresh="yes")


# ---- item 7: a step past the loop's end ------------------------------------------------------


def test_a_checkpoint_past_the_end_of_the_loop_is_an_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=10, every=10)
    with pytest.raises(CheckpointError, match=r"at step 10, past the end of this loop \(8 items\)"):
        _train(ckpt, steps=8)
    assert step_dir(ckpt, 10).is_dir()


# ---- item 8: convert replaces OUT whole or not at all ------------------------------------------


def test_convert_on_a_full_disk_keeps_the_previous_file(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes every write past 4 kB fail, in C++ as in Python (a full disk)."""
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    out = tmp_path / "model.pt"
    out.write_bytes(b"previous")
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        from macrogen.cli import main
        sys.exit(main(["checkpoint", "convert", {str(ckpt)!r}, {str(out)!r}]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("macrogen checkpoint: error: can't write ") and (
        "File too large" in done.stderr
    )
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.pt"]  # no temporary


# ---- item 9: pruning never follows links ---------------------------------------------------------


def test_pruning_never_follows_a_linked_step_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / MARKER).write_text("{}")
    (outside / "precious").write_text("keep me")
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    (ckpt / "step_00000001").symlink_to(outside)  # older than every save: pruned before
    (ckpt / "step_00000004").symlink_to(outside)  # in the way of the step-4 save
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _train(ckpt, steps=8, keep=1) == [2, 3, 4, 5, 6, 7]
    assert sorted(p.name for p in outside.iterdir()) == [MARKER, "precious"]
    assert (ckpt / "step_00000001").is_symlink()
    assert (ckpt / "step_00000004.unreadable").is_symlink()
    assert sorted(p.name for p in ckpt.iterdir() if not p.is_symlink()) == ["step_00000008"]


def test_pruning_a_folder_whose_marker_is_a_directory(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    (ckpt / "step_00000001" / MARKER).mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _train(ckpt, steps=6, keep=1) == [2, 3, 4, 5]
    assert (ckpt / "step_00000001" / MARKER).is_dir()  # unusable: kept


# ---- item 10: a disk full during a save ---------------------------------------------------------


def _disk_full_at(monkeypatch, step: int, error: BaseException) -> None:
    """The writer fails for the save of ``step`` after writing part of the shard."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem._write_item

    def write_item(*args, **kwargs):
        stream = args[1] if len(args) > 1 else kwargs["stream"]
        if f"step_{step:08d}" in getattr(stream, "name", ""):
            stream.write(b"\0" * 100)  # a partial file
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)


ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
SHORT = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@pytest.mark.parametrize("error", [ENOSPC, SHORT], ids=["ENOSPC", "short write"])
def test_disk_full_during_a_save_is_named_and_cleaned(tmp_path, monkeypatch, error) -> None:
    ckpt = tmp_path / "ckpt"
    _disk_full_at(monkeypatch, 4, error)
    monkeypatch.setattr("macrogen.runtime.checkpoint.free_bytes", lambda path: 0)
    with pytest.raises(CheckpointError) as e:
        _train(ckpt, steps=6)
    assert str(e.value) == (
        f"can't save checkpoint {step_dir(ckpt, 4)}: no space left on device (0 bytes free)"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002"]  # no partial save


def test_disk_full_with_on_save_error_warn_trains_on(tmp_path, monkeypatch) -> None:
    ckpt = tmp_path / "ckpt"
    _disk_full_at(monkeypatch, 4, ENOSPC)
    with pytest.warns(UserWarning, match=r"step_00000004: no space left on device"):
        assert _train(ckpt, steps=8, on_save_error="warn") == list(range(8))
    assert [p.name for p in checkpoint_dir.step_dirs(ckpt)] == ["step_00000006", "step_00000008"]


def test_a_save_that_fails_for_another_reason_is_raised_as_it_is(tmp_path, monkeypatch) -> None:
    ckpt = tmp_path / "ckpt"
    _disk_full_at(monkeypatch, 2, ZeroDivisionError("a bug"))
    with pytest.raises(BaseException, match="a bug"):
        _train(ckpt, steps=4, on_save_error="warn")
    assert not step_dir(ckpt, 2).exists()


# ---- item 12: odd folder names ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["step_²", "step_٣", "step_", "step_+3", "step_ 3", "step_1e3"])
def test_odd_step_names_are_not_checkpoints(tmp_path: Path, name: str, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / name).mkdir(parents=True)
    assert main(["checkpoint", "list", str(ckpt)]) == 0
    assert "no checkpoint folders" in capsys.readouterr().out
    assert main(["checkpoint", "convert", str(ckpt), str(tmp_path / "m.pt")]) == 1
    assert "no complete checkpoint under" in _one_line_error(capsys)
    assert _train(ckpt, steps=2) == [0, 1]
    assert (ckpt / name).is_dir()


# ---- item 20: list on a step folder ---------------------------------------------------------------


def test_list_on_a_step_folder_lists_it(tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    assert main(["checkpoint", "list", str(step_dir(ckpt, 2))]) == 0
    assert capsys.readouterr().out == f"{step_dir(ckpt, 2)}  complete\n"


# ---- the macro passes fresh and on_save_error on -----------------------------------------------


def test_the_macro_passes_fresh_and_on_save_error() -> None:
    from macrogen import expand_source
    from macrogen.expand import ExpansionError

    source = (
        "import macrogen as mg\n"
        'for s in mg.resumable(range(8), model=m, dir="c", every=2, fresh=args.fresh,'
        ' on_save_error="warn"):\n'
        "    pass\n"
    )
    code = expand_source(source, path="t.py").code
    assert "every=2, keep=2, fresh=args.fresh, on_save_error='warn')" in code
    with pytest.raises(ExpansionError, match="on_save_error must be 'error' or 'warn', not 'no'"):
        expand_source(source.replace('"warn"', '"no"'), path="t.py")


# ---- umask 002: the checkpoints resumable writes are its own to read -----------------------------


def test_checkpoints_written_under_umask_002_are_usable(tmp_path: Path) -> None:
    old = os.umask(0o002)  # user-private groups (Debian, Ubuntu): group-writable by default
    try:
        ckpt = tmp_path / "ckpt"
        _train(ckpt, steps=2)
        assert _train(ckpt, steps=4) == [2, 3]
    finally:
        os.umask(old)
    assert not os.stat(ckpt).st_mode & 0o022
    assert all(
        not os.stat(p).st_mode & 0o022 for p in [step_dir(ckpt, 4), *step_dir(ckpt, 4).iterdir()]
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_shard_is_one_line(tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    shard = step_dir(ckpt, 2) / "__0_0.distcp"
    shard.chmod(0)
    try:
        assert main(["checkpoint", "convert", str(ckpt), str(tmp_path / "m.pt")]) == 1
        assert "Permission denied" in _one_line_error(capsys)
        _resume_refused(ckpt, step_dir(ckpt, 2))
    finally:
        shard.chmod(0o644)


@pytest.mark.parametrize("kind", ["directory", "read-only file"])
def test_convert_to_an_unwritable_out_is_one_line(tmp_path: Path, kind: str, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    out = tmp_path / "out"
    if kind == "directory":
        out.mkdir()
    else:
        out.write_bytes(b"previous")
        out.chmod(0o444)
    assert main(["checkpoint", "convert", str(ckpt), str(out)]) == 1
    err = _one_line_error(capsys)
    assert err.count(str(out)) == 1, err
