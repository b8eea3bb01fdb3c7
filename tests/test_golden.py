"""Golden files: ``tests/golden/<case>/input.py`` expands to ``expected.py``.

An error case has ``expected.err`` instead: the rendered diagnostics, with the
path shown as ``input.py``. An optional ``options.json`` gives the options,
e.g. ``{"target": "cpu", "tuning": {"BLOCK": 128}}``.

    pytest tests/test_golden.py -k fused_allreduce        # one family of cases
    pytest tests/test_golden.py --update-goldens -k CASE  # rewrite, then review by eye
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from macrogen.expand import ExpansionError, expand_source
from macrogen.files import encode_source, read_source

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "input.py").is_file())
OPTIONS = ("target", "tuning")


def _options(case: Path) -> dict:
    file = case / "options.json"
    if not file.is_file():
        return {}
    options = json.loads(file.read_text())
    unknown = set(options) - set(OPTIONS)
    assert not unknown, f"{file}: unknown options {sorted(unknown)} (known: {list(OPTIONS)})"
    return options


def expand_case(case: Path) -> tuple[str, bytes]:
    """("expected.py", output bytes) or ("expected.err", the report) for one case."""
    source, encoding = read_source((case / "input.py").read_bytes())
    try:
        result = expand_source(source, path="input.py", **_options(case))
    except ExpansionError as e:
        return "expected.err", (e.report() + "\n").encode("utf-8")
    return "expected.py", encode_source(result.code, encoding)


def _diff(want: bytes, got: bytes, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            want.decode("utf-8", "replace").splitlines(True),
            got.decode("utf-8", "replace").splitlines(True),
            f"{name} (expected)",
            f"{name} (got)",
        )
    )


@pytest.mark.parametrize("name", CASES)
def test_golden(name: str, update_goldens: bool) -> None:
    case = GOLDEN / name
    kind, got = expand_case(case)
    other = case / ("expected.err" if kind == "expected.py" else "expected.py")
    expected = case / kind
    if update_goldens:
        other.unlink(missing_ok=True)
        if not expected.is_file() or expected.read_bytes() != got:
            expected.write_bytes(got)
    if other.exists():
        pytest.fail(
            f"{name}: the input now gives {kind}, but {other.name} exists:\n"
            + got.decode("utf-8", "replace")
        )
    if not expected.is_file():
        pytest.fail(f"{name}: no {kind}; run pytest {__file__} --update-goldens -k {name}")
    want = expected.read_bytes()
    if want != got:
        pytest.fail(f"{name}: expansion differs from {kind}:\n" + _diff(want, got, kind))
    if kind == "expected.py":
        compile(read_source(want)[0], str(expected), "exec")


def test_every_case_is_complete() -> None:
    """A case folder without input.py is a mistake, not a case."""
    for folder in GOLDEN.iterdir():
        if folder.is_dir() and folder.name not in ("__pycache__",):
            assert (folder / "input.py").is_file(), f"{folder} has no input.py"
