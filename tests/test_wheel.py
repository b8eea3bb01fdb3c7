"""The wheel: templates and kernels ship inside the package, and the installed command works.

Builds the wheel from a copy of the project (the checkout stays clean), installs
it into a fresh venv whose only view of torch, libcst and jinja2 is the test
interpreter's site-packages (added by a .pth file; the editable macrogen there
is not picked up because .pth files inside it are not processed), and runs
``macrogen expand`` from a directory outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from macrogen.expand import expand_source

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "tests" / "golden" / "fused_allreduce_k3" / "input.py"


def _run(*cmd: str | Path, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"{cmd}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("macrogen", "kernels", "templates"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", out, src, cwd=src)  # fmt: skip
    (built,) = out.glob("macrogen-*.whl")
    return built


def test_wheel_holds_templates_and_kernels_inside_the_package(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"macrogen", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    templates = sorted(p.name for p in (REPO / "templates").glob("*.j2"))
    assert templates and all(f"macrogen/templates/{t}" in names for t in templates)
    assert "macrogen/kernels/__init__.py" in names
    kernels = sorted(p.name for p in (REPO / "kernels").glob("*.py"))
    assert all(f"macrogen/kernels/{k}" in names for k in kernels)
    subpackages = {p.parent for p in (REPO / "macrogen").rglob("__init__.py")}
    for package in subpackages:
        relative = package.relative_to(REPO).as_posix()
        assert f"{relative}/__init__.py" in names, (
            f"{relative} is not in the wheel (pyproject packages)"
        )


def test_installed_wheel_expands_from_outside_the_repository(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run(base_python, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q",
         "--disable-pip-version-check", wheel, cwd=tmp_path)  # fmt: skip
    site = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).stdout.strip()
    )
    # torch, libcst, jinja2 from this interpreter; its editable macrogen stays invisible
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert not (site / "kernels").exists() and not (site / "templates").exists()

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE, work / "train.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run(venv / "bin" / "macrogen", "expand", "train.py", "-o", "out/train.py", cwd=work, env=env)
    want = expand_source(EXAMPLE.read_text(), path="train.py").code
    assert (work / "out" / "train.py").read_text() == want

    probe = (
        "import macrogen, macrogen.kernels, macrogen.expand.codegen as c, importlib.util as u\n"
        "print(macrogen.__file__); print(c.templates_dir()); print(u.find_spec('kernels'))\n"
        "import sys; sys.path.insert(0, 'out'); import train\n"
        "import torch; t = torch.ones(3); train.sync_metrics(t, t * 2, t * 4); print(t.tolist())\n"
    )
    lines = _run(python, "-c", probe, cwd=work, env=env).stdout.splitlines()
    assert lines[0].startswith(str(site / "macrogen")), lines
    assert lines[1] == str(site / "macrogen" / "templates")
    assert lines[2] == "None"  # no top-level kernels module
    assert lines[3] == "[1.0, 1.0, 1.0]"  # world size 1: the block leaves values as they are
