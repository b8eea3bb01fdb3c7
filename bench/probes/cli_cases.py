"""The commands' values as a user mistypes them and an attacker chooses them: sizes,
memories, links, counts, world sizes, tolerances, entries; paths that do not exist,
directories, FIFOs, empty files, files with syntax errors or non-UTF-8 bytes. Each case
changes one thing of a command line that is otherwise right; every one must be a one-line
error (exit 2 for a bad option value, 1 for a bad input) that writes nothing."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from bench.probes import verdicts
from bench.probes.runner import Case, CaseBody, Run, Verdict

CONFIG = (
    '{"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,'
    ' "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,'
    ' "max_position_embeddings": 256}'
)
PROGRAM = """\
import torch
import torch.nn as nn
import macrogen as mg


def _model():
    return mg.parallelize(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))


def build(module=None):  # plan's and autotune's entry: (model, step)
    model, x = _model(), torch.randn(4, 8)

    def step():
        model(x).pow(2).mean().backward()

    return model, step


def pair(module=None):  # verify's entry: (model, batch)
    return _model(), torch.randn(4, 8)
"""


def setup(folder: Path) -> None:
    """The files every command case may name, good and bad."""
    (folder / "cfg.json").write_text(CONFIG)
    (folder / "train.py").write_text(PROGRAM)
    (folder / "empty.py").write_text("")
    (folder / "syntax.py").write_text("import macrogen as mg\ndef f(:\n    pass\n")
    (folder / "latin1.py").write_bytes(b"import macrogen as mg\nname = '\xe9t\xe9'\n")
    (folder / "nul.py").write_bytes(b"import macrogen as mg\x00\n")
    (folder / "folder").mkdir()
    (folder / "garbage.json").write_text("{not json")
    (folder / "list.json").write_text("[1, 2, 3]")
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    os.mkfifo(folder / "fifo")
    (folder / "unreadable.py").write_text(PROGRAM)
    (folder / "unreadable.py").chmod(0)


NUMBERS = {"zero": "0", "negative": "-3", "letters": "abc", "superscript": "²", "float": "1.5",
           "exponent": "1e9", "nan": "nan", "huge": "9" * 40, "empty": ""}  # fmt: skip
MEMORIES = {"nan": "nan", "inf": "inf", "negative": "-80GB", "zero": "0GB", "bits_typo": "80Gb",
            "letters": "lots", "unit_only": "GB", "overflow": "1e400GB", "empty": ""}  # fmt: skip
LINKS = {"no_number": "nvlink:.GB/s", "no_bandwidth": "nvlink", "empty_name": ":50GB/s",
         "negative": "nvlink:-5GB/s", "nan": "nvlink:nanGB/s", "three": "a:1GB/s,b:2GB/s,c:3GB/s",
         "no_unit": "nvlink:900", "empty": ""}  # fmt: skip
FRACTIONS = {"nan": "nan", "negative": "-1", "letters": "abc", "inf": "inf", "empty": ""}
ENTRIES = {"empty": "", "colon": ":", "no_colon": "build", "no_module": "no_such_module:build",
           "missing": ":missing", "not_callable": ":torch", "dotted": ":a.b"}  # fmt: skip
FILES = {"missing": "no_such.py", "directory": "folder", "fifo": "fifo", "syntax": "syntax.py",
         "latin1": "latin1.py", "nul": "nul.py", "json": "garbage.json"}  # fmt: skip

PLAN_MODEL = ("plan", "--model", "cfg.json", "--devices", "8xH100", "--global-batch", "16",
              "--seq-len", "128")  # fmt: skip
PLAN_FILE = ("plan", "train.py", "--entry", ":build", "--world-size", "8")
AUTOTUNE = ("autotune", "train.py", "--entry", ":build", "--world-size", "1", "--budget", "1")
VERIFY = ("verify", "train.py", "--entry", ":pair", "--world-size", "2")


def _swap(base: tuple[str, ...], option: str, value: str) -> tuple[str, ...]:
    """``base`` with ``option``'s value replaced (or the option added)."""
    argv = list(base)
    if option in argv:
        argv[argv.index(option) + 1] = value
    else:
        argv += [option, value]
    return tuple(argv)


def _refusal(argv: tuple[str, ...], status: int | None) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        setup(folder)
        before = verdicts.snapshot(folder)
        result = yield Run(cli=argv, timeout=120)
        verdict = verdicts.command_refusal(result, before, folder)
        if verdict.outcome == "ok" and status is not None and result.code != status:
            return Verdict("failed", f"exit {result.code}, not {status}: {verdict.line}")
        return verdict

    return body


def _runs(argv: tuple[str, ...], seconds: float) -> Callable[[Path], CaseBody]:
    """A value that is odd but valid: the command finishes (any clean outcome) in time."""

    def body(folder: Path) -> CaseBody:
        setup(folder)
        result = yield Run(cli=argv, timeout=seconds)
        if (bad := verdicts.crash(result)) is not None:
            return bad
        text = result.err + result.out
        if verdicts.TRACEBACK in text or result.code == 3:
            return Verdict("traceback", verdicts.error_line(text))
        return Verdict("ok", f"exit {result.code} in {result.seconds:.0f} s: "
                       + verdicts.error_line(text or "(nothing)"))  # fmt: skip

    return body


def cases() -> list[Case]:
    found: list[Case] = []

    def add(category: str, name: str, argv: tuple[str, ...], status: int | None = 2) -> None:
        # 1e9 is a whole number written as Python writes floats: taking it is no error,
        # but the command must finish (issue 43: plan --world-size 1e9 ran for minutes)
        # 80Gb is 80 gigabits (10 GB), as --link reads b: a valid size
        # an empty --link is the default links
        valid = name.endswith(("exponent", "bits_typo")) or name == "--link empty"
        body = _runs(argv, 120) if valid else _refusal(argv, status)
        found.append(Case(category, name, body, ranks=valid))

    # plan --model: every number, memory and link
    for option in ("--global-batch", "--seq-len", "--top"):
        for name, value in NUMBERS.items():
            if option == "--top" and name == "huge":
                continue  # a huge --top is valid: all rows
            add("plan", f"{option} {name}", _swap(PLAN_MODEL, option, value))
    for name, value in {"count_zero": "0xH100", "unknown_kind": "8xNOPE", "no_count": "xH100",
                        "bad_memory": "8xH100:lots", "nan_memory": "8xH100:nanGB",
                        "empty": "", "superscript": "²xH100"}.items():  # fmt: skip
        add("plan", f"--devices {name}", _swap(PLAN_MODEL, "--devices", value))
    for name, value in MEMORIES.items():
        add("plan", f"--gpu-memory {name}", _swap(PLAN_FILE, "--gpu-memory", value))
    for name, value in LINKS.items():
        add("plan", f"--link {name}", _swap(PLAN_FILE, "--link", value))
    for name, value in NUMBERS.items():
        add("plan", f"--world-size {name}", _swap(PLAN_FILE, "--world-size", value))
        if name in ("zero", "negative", "letters", "nan"):
            add("plan", f"--gpus-per-node {name}", _swap(PLAN_FILE, "--gpus-per-node", value))
    for name, value in FRACTIONS.items():
        add("plan", f"--speedup {name}", _swap(PLAN_FILE, "--speedup", value))
    for name, path in {"missing": "no_such.json", "directory": "folder", "garbage": "garbage.json",
                       "list": "list.json", "deep": "deep.json", "fifo": "fifo"}.items():  # fmt: skip
        add("plan", f"--model {name}", _swap(PLAN_MODEL, "--model", path), None)
        if name != "missing":
            add("plan", f"--device-table {name}", PLAN_MODEL + ("--device-table", path), None)
    huge = _swap(PLAN_MODEL, "--devices", "1099511627776xH100")
    found.append(Case("plan", "--devices 2^40 GPUs", _runs(huge, 120), ranks=True))

    # autotune: every count and size
    for option in ("--world-size", "--max-trials", "--steps", "--rounds", "--group", "--warmup"):
        for name in ("zero", "negative", "letters", "superscript", "huge"):
            if option == "--warmup" and name == "zero":
                continue  # no warm-up is valid
            add("autotune", f"{option} {name}", _swap(AUTOTUNE, option, NUMBERS[name]))
    for option in ("--budget", "--min-time", "--timeout", "--noise"):
        for name, value in FRACTIONS.items():
            add("autotune", f"{option} {name}", _swap(AUTOTUNE, option, value))
    for name, value in MEMORIES.items():
        add("autotune", f"--memory-per-rank {name}", _swap(AUTOTUNE, "--memory-per-rank", value))
    for name, value in ENTRIES.items():
        add("autotune", f"--entry {name}", _swap(AUTOTUNE, "--entry", value), None)
    for name, path in FILES.items():
        add(
            "autotune",
            f"FILE {name}",
            ("autotune", path, "--entry", ":build", "--budget", "1"),
            None,
        )
    for name, path in {"directory": "folder", "fifo": "fifo", "garbage": "garbage.json",
                       "list": "list.json"}.items():  # fmt: skip
        add("autotune", f"--tuning {name}", _swap(AUTOTUNE, "--tuning", path), None)

    # verify: sizes, tolerances, seeds, entries, files
    for name in ("zero", "negative", "letters", "superscript", "exponent", "huge", "empty"):
        add("verify", f"--world-size {name}", _swap(VERIFY, "--world-size", NUMBERS[name]))
    for option in ("--rtol", "--atol", "--timeout"):
        for name, value in FRACTIONS.items():
            add("verify", f"{option} {name}", _swap(VERIFY, option, value))
    for name in ("letters", "superscript", "huge", "float"):
        add("verify", f"--seed {name}", _swap(VERIFY, "--seed", NUMBERS[name]))
    for name, value in ENTRIES.items():
        add("verify", f"--entry {name}", _swap(VERIFY, "--entry", value), None)
    for name, path in FILES.items():
        add("verify", f"FILE {name}", ("verify", path, "--entry", ":pair"), None)

    # expand: inputs and outputs (a missing SRC is usage, 2; what it holds is input, 1)
    for name, path in FILES.items():
        if name in ("syntax", "latin1", "nul"):
            add("expand", f"SRC {name}", ("expand", path, "-o", "out.py"), None)
    # valid: a folder of sources, a file without macros (passed through as it is, whatever
    # it holds), a file root can read, -o into folders that do not exist yet (made)
    for name, argv in {"SRC directory": ("expand", "folder", "--out-dir", "out"),
                       "SRC without macros": ("expand", "garbage.json", "-o", "out.py"),
                       "SRC mode 000 (root reads it)": ("expand", "unreadable.py", "-o", "out.py"),
                       "-o into a missing folder": ("expand", "train.py", "-o", "no/such/out.py"),
                       }.items():  # fmt: skip
        found.append(Case("expand", name, _runs(argv, 60)))  # (cheap: no model)
    for name in ("missing", "fifo"):
        add("expand", f"SRC {name}", ("expand", FILES[name], "-o", "out.py"), None)
    add("expand", "-o a directory", ("expand", "train.py", "-o", "folder"), 1)
    add("expand", "--target gpu", ("expand", "train.py", "--target", "gpu"))
    add("expand", "-o with two SRC", ("expand", "train.py", "empty.py", "-o", "out.py"))
    add("expand", "--in-place and -o", ("expand", "train.py", "--in-place", "-o", "out.py"))
    return found
