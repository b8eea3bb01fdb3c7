"""A batch of hostile values for every option of ``macrogen plan`` and ``macrogen autotune``:
each is a usage error (exit 2) in one line that names the option, never a traceback, an
internal error (exit 3), a hang or a silently different meaning.

The values are what people and scripts pass by mistake: empty strings, signs, NaN and
infinities, exponents, non-ASCII digits, units in the wrong case, sizes past any machine,
lists with holes. ``plan`` reads a transformers config here (``--model``): no probe runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macrogen.cli import main

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
    "num_hidden_layers": 4, "vocab_size": 1024, "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}  # fmt: skip

NUMBERS = ["", " ", "0", "-1", "-0", "nan", "NaN", "inf", "-inf", "1e9999", "1.5", "abc",
           "²", "١٢", "１２", "0x10", "1_000_000_000_000_000_000_000", "9" * 400]  # fmt: skip
COUNTS = [v for v in NUMBERS if v != "1.5"] + ["2.0", "3e-2", "1e99999999"]
SIZES = ["", "0", "-80GB", "nan", "infGB", "80", "80XB", "GB", "80 GB GB", "1e999GB", "²GB",
         "80Gb/s", "-0GB", "80GB,40GB"]  # fmt: skip
LINKS = ["", ":", "nvlink", "nvlink:", ":900GB/s", "nvlink:.GB/s", "nvlink:-1GB/s",
         "nvlink:nanGB/s", "nvlink:900GB", "nvlink:900GB/s,", "nvlink:900GB/s,ib:50GB/s,x:1GB/s",
         "nvlink:0GB/s", "nvlink:infGB/s", "nvlink:900XB/s"]  # fmt: skip
DEVICES = ["", ",", "8x", "x H100", "0xH100", "-8xH100", "8xNOPE", "8xH100:", "8xH100:nanGB",
           "8xH100:0GB", "8xH100,,8xA100", "²xH100", "1e3xH100", "8xH100:80GB:1",
           "99999999999999999999xH100"]  # fmt: skip
SEQ = COUNTS + ["4096,", ",4096", "4096,,8192", "4096,-1", "1e10"]
DP = ["", ",", "replicate,", "ddp", "fsdp,nope", "REPLICATE"]


def _cases() -> list[tuple[str, str]]:
    huge = ("1e9999", "9" * 400, "1_000_000_000_000_000_000_000")  # --top: all rows, fine
    cases = [("--global-batch", v) for v in COUNTS] + [
        ("--top", v) for v in COUNTS if v not in huge
    ]
    cases += [("--gpu-memory", v) for v in SIZES] + [("--link", v) for v in LINKS]
    cases += [("--devices", v) for v in DEVICES] + [("--seq-len", v) for v in SEQ]
    cases += [("--dp", v) for v in DP]
    return cases


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _status(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        status = e.code if isinstance(e.code, int) else 1
    return status, capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), _cases())
def test_plan_refuses_a_hostile_value_naming_the_option(
    option: str, value: str, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--model": str(config), "--devices": "8xH100", "--global-batch": "16",
            "--seq-len": "256", "--top": "3"}  # fmt: skip
    base[option] = value
    argv = ["plan", *[f"{k}={v}" for k, v in base.items()]]
    status, err = _status(argv, capsys)
    assert status == 2, f"{argv}: exit {status}\n{err}"
    assert "Traceback" not in err and option in err, err
    assert err.strip().splitlines()[-1].startswith("macrogen plan: error:"), err


@pytest.mark.parametrize("value", [v for v in COUNTS if v != ""] + [""])
@pytest.mark.parametrize("option", ["--world-size", "--budget"])
def test_autotune_refuses_a_hostile_count_naming_the_option(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "train.py"
    source.write_text("import macrogen as mg\nB = mg.tunable(1, [1, 2])\n")
    status, err = _status(["autotune", str(source), f"{option}={value}"], capsys)
    assert status == 2, f"{option}={value!r}: exit {status}\n{err}"
    assert "Traceback" not in err and option in err, err
