"""macrogen verify's usage errors: one line, exit 2, no rank started (issue 43).

Each request here fails before the parallel step: the ranks a launch would start are
stopped, so these tests start none (a launch that records what it was asked).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import macrogen.verify
from macrogen.cli import main
from tests import verify_programs


class _NotStarted:
    def wait(self) -> None:
        raise AssertionError("a usage error must not wait for ranks")

    def stop(self) -> None:
        pass


@pytest.fixture
def no_ranks(monkeypatch):
    """The command's launch replaced: nothing is started."""
    monkeypatch.setattr(macrogen.verify.launch, "torchrun", lambda job, n, t: _NotStarted())


PIPELINED = """\
import torch
import torch.nn as nn
import macrogen as mg


def build():
    model = mg.parallelize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), pp=2, microbatches=2)
    return model, torch.randn(2, 4)


class NotAFactory:
    pass


NUMBER = 3


def wrong():
    return nn.Linear(4, 4)
"""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--entry", "build"], "--entry must be module:factory"),
        (["--entry", ":bu-ild"], "--entry must be module:factory"),
        (["--entry", ":missing"], "has no missing"),
        (["--entry", ":NotAFactory"], "NotAFactory is not a factory"),
        (["--entry", ":NUMBER"], "NUMBER is not a factory"),
        (
            ["--entry", ":wrong"],
            "must return (model, batch) or (model, batch, loss_fn), not Linear",
        ),
        (["--entry", "no_such_module:build"], "cannot import no_such_module"),
        (["--entry", ":build", "--world-size", "0"], "--world-size must be at least 1"),
        (["--entry", ":build", "--world-size", "two"], "--world-size 'two'"),
        (["--entry", ":build", "--rtol", "-1"], "--rtol '-1'"),
        (["--entry", ":build"], "pp=2); verify the plan with pp=1"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(tmp_path, capsys, no_ranks, argv, message):
    path = verify_programs.write(tmp_path, "pipelined_plan", PIPELINED)
    assert main(["verify", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("macrogen verify: error: ") and err.count("\n") == 1, err
    assert message in err


def test_a_missing_file_is_bad_usage(tmp_path, capsys, no_ranks):
    assert main(["verify", str(tmp_path / "nowhere.py"), "--entry", ":build"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_failing_factory_is_the_program_s_error_exit_1(tmp_path, capsys, no_ranks):
    source = "import macrogen as mg\n\n\ndef build():\n    raise ValueError('no data here')\n"
    path = verify_programs.write(tmp_path, "failing_plan", source)
    assert main(["verify", str(path), "--entry", ":build"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"macrogen verify: error: {path}: serially, the entry :build raised ValueError:"
        " no data here\n"
    )


def test_the_command_is_listed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "macrogen verify train.py --entry :build" in capsys.readouterr().out


def test_an_entry_module_elsewhere_gets_the_file_s_module(tmp_path, monkeypatch, capsys, no_ranks):
    (tmp_path / "factories.py").write_text(
        "def build(module):\n    raise RuntimeError(f'got {module.__name__}')\n"
    )
    path = verify_programs.write(tmp_path, "plain_plan", "import macrogen as mg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["verify", str(path), "--entry", "factories:build"]) == 1
    assert "RuntimeError: got plain_plan" in capsys.readouterr().err
    assert not Path(tmp_path / "__pycache__" / "nothing").exists()


def test_verify_true_refuses_a_pipeline():
    from macrogen.expand import ExpansionError, expand_source

    source = (
        "import macrogen as mg\nmodel = mg.parallelize(model, pp=2, microbatches=2, verify=True)\n"
    )
    with pytest.raises(ExpansionError, match="verify=True checks a model that is not cut"):
        expand_source(source, path="p.py")
