"""The import hook across processes: `macrogen run`, and eight processes on one cold cache."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from macrogen import cache, hook
from macrogen.commands.expand import expand_files

SCRIPT = """\
import sys
import macrogen as mg
import consts

GREETING = mg.define("hello")
print(GREETING, consts.product(), sys.argv[1:], __name__)
"""

CONSTANTS = """\
import macrogen as mg

A = mg.define(6)
B = mg.define(7)


def product():
    return A * B
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (hook.DISABLE_ENV, hook.CACHE_DIR_ENV, hook.TUNING_ENV, hook.SHOW_ENV)
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _macrogen(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "macrogen", *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def test_run_expands_the_script_and_shows_what_it_expanded_warm_or_cold(tmp_path):
    _write(tmp_path, "consts.py", CONSTANTS)
    _write(tmp_path, "main.py", SCRIPT)
    for how in ("expanded now: cache missing", "cached"):
        done = _macrogen("run", "--show-expanded", "main.py", "a", "-b", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "hello 42 ['a', '-b'] __main__\n"
        pycache = tmp_path / "__pycache__"
        assert f"macrogen: __main__ ({tmp_path / 'main.py'}): define:5 -> " in done.stderr
        assert f"{pycache / 'main.macrogen-any.py'} [{how}]" in done.stderr
        assert f"macrogen: consts ({tmp_path / 'consts.py'}): define:3, define:4 -> " in done.stderr
        assert f"{pycache / 'consts.macrogen-any.py'} [{how}]" in done.stderr


def test_run_reports_macro_errors_like_the_cli_without_a_traceback(tmp_path):
    bad = _write(tmp_path, "consts.py", CONSTANTS.replace("mg.define(7)", "mg.define(seven)"))
    _write(tmp_path, "main.py", SCRIPT)
    done = _macrogen("run", "main.py", cwd=tmp_path)
    stderr = io.StringIO()
    assert expand_files([str(bad)], stdout=io.BytesIO(), stderr=stderr) == 1
    assert (done.returncode, done.stdout, done.stderr) == (1, "", stderr.getvalue())
    assert "Traceback" not in done.stderr


def test_run_shows_the_scripts_traceback_without_macrogens_frames(tmp_path):
    _write(tmp_path, "consts.py", CONSTANTS)
    _write(tmp_path, "main.py", SCRIPT + "raise SystemError(consts.B)\n")
    done = _macrogen("run", "main.py", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):\n")
    assert f'File "{tmp_path / "main.py"}", line 7, in <module>' in done.stderr
    assert "macrogen" + os.sep + "commands" not in done.stderr
    assert done.stderr.endswith("SystemError: 7\n")
    # the script's own exit status passes through; a missing script is a usage error
    _write(tmp_path, "main.py", "import sys\nsys.exit(3)\n")
    assert _macrogen("run", "main.py", cwd=tmp_path).returncode == 3
    assert _macrogen("run", "missing.py", cwd=tmp_path).returncode == 2


def test_disabled_run_runs_plain_python(tmp_path):
    _write(tmp_path, "consts.py", CONSTANTS)
    _write(tmp_path, "main.py", SCRIPT)
    done = _macrogen("run", "--show-expanded", "main.py", cwd=tmp_path, MACROGEN_DISABLE="1")
    assert (done.returncode, done.stdout, done.stderr) == (0, "hello 42 [] __main__\n", "")
    assert not (tmp_path / "__pycache__").exists() or not any(
        cache.MARKER in p.name for p in (tmp_path / "__pycache__").iterdir()
    )


IMPORTER = """\
import sys, time
from pathlib import Path
import macrogen.expand  # the expander's own import cost, paid before the start line
import macrogen.hook

ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.005)
macrogen.hook.install()
import consts
print(consts.product(), macrogen.hook.records()[-1].cache)
"""


def test_eight_processes_import_one_module_from_a_cold_cache(tmp_path):
    """All succeed and one whole entry remains (the module needs no torch: start-up stays cheap)."""
    _write(tmp_path, "consts.py", CONSTANTS)
    importer = _write(tmp_path, "importer.py", IMPORTER)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(importer), str(tmp_path / f"ready{i}"), str(go)],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{i}").exists() for i in range(8)):
            assert time.monotonic() < deadline, "importers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.01)
        go.touch()  # all eight import at once
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * 8, outputs
    statuses = [out.split() for out, _ in outputs]
    assert all(s[0] == "42" for s in statuses), outputs
    assert any(s[1] == "missing" for s in statuses)
    print("expanded by", sum(s[1] == "missing" for s in statuses), "of 8")
    files = sorted(p.name for p in (tmp_path / "__pycache__").iterdir())
    tag = sys.implementation.cache_tag
    assert files == [f"consts.macrogen-any.{tag}.mgc", "consts.macrogen-any.py"]  # no temp files
    src = tmp_path / "consts.py"
    key = cache.key(src.read_bytes(), path=src, target=None, tuning={})
    assert cache.read(tmp_path / "__pycache__" / files[0], key)[1] == "hit"
