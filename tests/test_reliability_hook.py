"""The import hook's cache runs only what the current user wrote.

A cache entry's key and checksum are computable from public facts, so a cache
folder another user can write to could hand us their code. These tests plant
entries as a second, real user (made with ``useradd``; skipped where that is
impossible) in a shared sticky folder, like /tmp, and check that the importing
user expands afresh, warns once and never runs the planted code.
"""

from __future__ import annotations

import io
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from macrogen import cache, hook

SOURCE = "import macrogen as mg\n\nA = mg.define(6)\n"
PLANTED = "import builtins\nbuiltins._macrogen_planted_ran = True\nA = 'PWNED'\n"
OTHER = "mgreliab"


def _other_user() -> pwd.struct_passwd:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a second user")
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        pass
    made = subprocess.run(["useradd", "-M", "-N", "-s", "/bin/false", OTHER], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.decode().strip()}")
    return pwd.getpwnam(OTHER)


def _planted_entry(source_path: Path, cache_dir: Path | None) -> tuple[cache.Location, bytes]:
    """The bytes of a well-formed entry for ``source_path`` whose code is PLANTED."""
    where = cache.locate(source_path, target=None, cache_dir=cache_dir)
    key = cache.key(source_path.read_bytes(), path=source_path, target=None, tuning={})
    entry = cache.Entry(compile(PLANTED, str(source_path), "exec"), PLANTED, ())
    with tempfile.TemporaryDirectory() as tmp:  # cache.write's own format, then its bytes
        private = cache.Location(Path(tmp) / "e.mgc", Path(tmp) / "e.py")
        cache.write(private, key, entry)
        return where, private.entry.read_bytes()


def _as_user(user: pwd.struct_passwd, script: str, *args: str) -> None:
    """Run a stdlib-only script as ``user``, with a Python that user may execute."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run(
                [python, "-c", script, *args], user=user.pw_uid, group=user.pw_gid,
                capture_output=True, timeout=60, cwd="/",
            )  # fmt: skip
        except OSError:
            continue
        assert done.returncode == 0, done.stderr.decode()
        return
    pytest.skip(f"no Python that {user.pw_name} may run")


PLANT = """\
import os, sys
path, data = sys.argv[1], bytes.fromhex(sys.argv[2])
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "wb") as f:
    f.write(data)
"""


@pytest.fixture
def shared(tmp_path):
    """A sticky, world-writable folder (like /tmp) and a source tree the importing user owns."""
    shared = Path(tempfile.mkdtemp(prefix="mg-shared-"))
    shared.chmod(0o1777)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def _import(source: Path, cache_dir: Path | None) -> tuple[dict, str]:
    err = io.StringIO()
    hook._warned.clear()
    with redirect_stderr(err):
        code = hook.load(source, "victim", hook.options(cache_dir=cache_dir))
    namespace: dict = {}
    exec(code, namespace)
    return namespace, err.getvalue()


def test_an_entry_planted_by_another_user_is_never_run(shared, tmp_path):
    user = _other_user()
    source = tmp_path / "victim.py"
    source.write_text(SOURCE)
    where, data = _planted_entry(source, shared)
    _as_user(user, PLANT, str(where.entry), data.hex())
    assert os.stat(where.entry).st_uid == user.pw_uid
    namespace, err = _import(source, shared)
    assert namespace["A"] == 6 and not getattr(
        __import__("builtins"), "_macrogen_planted_ran", False
    )
    assert "not using the import cache" in err and "another user" in err
    assert where.entry.read_bytes() == data  # nothing written into their folder either


def test_our_cache_folders_are_private_and_used(shared, tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(SOURCE)
    namespace, err = _import(source, shared)
    assert namespace["A"] == 6 and err == ""
    where = cache.locate(source, target=None, cache_dir=shared)
    folder = where.entry.parent
    while folder != shared:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
        folder = folder.parent
    entry, status = cache.read(
        where.entry, cache.key(source.read_bytes(), path=source, target=None, tuning={})
    )
    assert status == "hit"


def test_an_entry_others_may_write_is_ignored_and_rebuilt(tmp_path):
    source = tmp_path / "loose.py"
    source.write_text(SOURCE)
    _import(source, None)  # a good entry in __pycache__
    where = cache.locate(source, target=None, cache_dir=None)
    where.entry.chmod(0o666)
    _, err = _import(source, None)
    assert "not using the import cache" in err
    where.entry.parent.chmod(0o777)
    namespace, err = _import(source, None)
    assert namespace["A"] == 6 and "belongs to you and mode drwxrwxrwx" in err


def test_warned_once_per_folder(tmp_path):
    source = tmp_path / "once.py"
    source.write_text(SOURCE)
    (tmp_path / "__pycache__").mkdir(mode=0o777)
    (tmp_path / "__pycache__").chmod(0o777)
    err = io.StringIO()
    hook._warned.clear()
    with redirect_stderr(err):
        for _ in range(3):
            hook.load(source, "once", hook.options())
    assert err.getvalue().count("not using the import cache") == 1
