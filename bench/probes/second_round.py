"""The second round's categories (issue 27), rerun: import forms and comprehension scopes
that must not skip macros, a macro applied twice, a form feed in a block, checkpoint
folders that are truncated, zeroed, planted with a pickle, oddly named or with a marker
that is a directory, a FIFO or 100,000 levels deep, and ``cache clear`` on a user's tree."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

from bench.probes import verdicts
from bench.probes.programs import ENV_PROGRAM
from bench.probes.runner import Case, CaseBody, Run, Verdict

FUSED = """\
import torch.distributed as dist
{imports}


def sync(a, b):
    with {alias}.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
    return a, b
"""
IMPORT_FORMS = {
    "import macrogen.markers as mm": ("import macrogen.markers as mm", "mm"),
    "import macrogen.markers": ("import macrogen.markers", "macrogen.markers"),
    "import macrogen (dotted use)": ("import macrogen", "macrogen"),
    "list comprehension named mg": ("import macrogen as mg\nG = [mg for mg in ()]", "mg"),
    "generator named mg": ("import macrogen as mg\nG = list(mg for mg in ())", "mg"),
    "dict comprehension named mg": ("import macrogen as mg\nG = {mg: 1 for mg in ()}", "mg"),
    "lambda parameter named mg": ("import macrogen as mg\nG = lambda mg: mg", "mg"),
}
TWICE = {
    "@mg.tile twice": "@mg.tile(i=4)\n@mg.tile(i=4)\ndef f(out, x):\n    for i in range(4):\n        out[i] = x[i]\n",
    "@data_parallel twice": "@mg.data_parallel()\n@mg.data_parallel()\nclass M(nn.Module):\n    pass\n",
    "@tensor_parallel twice": (
        "@mg.tensor_parallel(plan={})\n@mg.tensor_parallel(plan={})\nclass M(nn.Module):\n    pass\n"
    ),
}


def _expands(source: str, must_contain: str) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(source)
        result = yield Run(cli=("expand", "train.py", "-o", "out.py"), timeout=60)
        if (bad := verdicts.crash(result)) is not None:
            return bad
        if result.code != 0:
            kind = "traceback" if verdicts.TRACEBACK in result.err or result.code == 3 else "failed"
            return Verdict(kind, verdicts.error_line(result.err))
        if must_contain not in (folder / "out.py").read_text():
            return Verdict("silent wrong", "exit 0, the macro was not expanded")
        return Verdict("ok", "expanded")

    return body


def _refused(source: str) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(source)
        before = verdicts.snapshot(folder)
        result = yield Run(cli=("expand", "train.py", "-o", "out.py"), timeout=60)
        return verdicts.command_refusal(result, before, folder)

    return body


class _Payload:
    """Unpickling it writes ``pwned`` in the working folder: it must never be unpickled."""

    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


def _tamper(kind: str, step: Path) -> None:
    shard = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    if kind == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
    elif kind == "zeroed shard":
        shard.write_bytes(b"\0" * shard.stat().st_size)
    elif kind == "garbage .metadata":
        (step / ".metadata").write_bytes(os.urandom(200))
    elif kind == "empty .metadata":
        (step / ".metadata").write_bytes(b"")
    elif kind == "planted pickle in .metadata":
        (step / ".metadata").write_bytes(pickle.dumps(_Payload()))
    elif kind == "marker is a directory":
        (step / "macrogen_complete.json").unlink()
        (step / "macrogen_complete.json").mkdir()
    elif kind == "marker is a FIFO":
        (step / "macrogen_complete.json").unlink()
        os.mkfifo(step / "macrogen_complete.json")
    elif kind == "marker 100,000 deep":
        (step / "macrogen_complete.json").write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "marker with string sizes":
        (step / "macrogen_complete.json").write_text(
            '{"format": 1, "step": "2", "sizes": {"a": "1"}}'
        )
    elif kind == "step_² folder":
        step.rename(step.parent / "step_²")
    elif kind == "group-writable folder":
        step.chmod(0o777)


TAMPER = ("truncated shard", "zeroed shard", "garbage .metadata", "empty .metadata",
          "planted pickle in .metadata", "marker is a directory", "marker is a FIFO",
          "marker 100,000 deep", "marker with string sizes", "step_² folder",
          "group-writable folder")  # fmt: skip
# what convert may still convert: the untampered step beside a renamed one; a marker whose
# sizes are strings (a marker is advice: the files themselves are checked)
CONVERTIBLE = ("step_² folder", "marker with string sizes")
COMMANDS = {"list": ("checkpoint", "list", "ckpt"),
            "convert": ("checkpoint", "convert", "ckpt", "model.pt", "--model-only"),
            "resume": None}  # fmt: skip


def _checkpoint(kind: str, command: str) -> Callable[[Path], CaseBody]:
    """A real checkpoint (ENV_PROGRAM's resumable loop), tampered, then read."""

    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(ENV_PROGRAM)
        made = yield Run(cli=("run", "train.py"), timeout=120)
        if (bad := verdicts.succeeded(made)) is not None:
            return Verdict("failed", "making the checkpoint: " + bad.line)
        steps = sorted((folder / "ckpt").glob("step_*"))
        for step in steps[-1:] if kind == "step_² folder" else steps:  # (one name: one folder)
            _tamper(kind, step)
        argv = COMMANDS[command]
        if argv is None:  # resumable() at start-up over the tampered folders
            result = yield Run(cli=("run", "train.py"), timeout=120)
        else:
            result = yield Run(cli=argv, timeout=60)
        if (folder / "pwned").exists():
            return Verdict("silent wrong", "the planted pickle ran")
        if (bad := verdicts.crash(result)) is not None:
            return bad
        text = result.err + result.out
        if verdicts.TRACEBACK in text and result.code != 0:
            return verdicts.refused(result)  # resumable(): its named error, or a raw one
        if verdicts.TRACEBACK in text or result.code == 3:
            return Verdict("traceback", verdicts.error_line(text))
        # every step tampered (but where one was renamed): nothing to convert
        if result.code == 0 and command == "convert" and kind not in CONVERTIBLE:
            return Verdict(
                "silent wrong", "converted a tampered checkpoint: " + verdicts.first_line(text)
            )
        return Verdict("ok", f"exit {result.code}: " + verdicts.error_line(text or "(nothing)"))

    return body


def _cache_clear(folder: Path) -> CaseBody:
    own = folder / "tree" / "sub" / "train.macrogen-cpu.py"
    own.parent.mkdir(parents=True)
    own.write_text("print('mine')\n")
    result = yield Run(cli=("cache", "clear", "--cache-dir", "tree"), timeout=60)
    if (bad := verdicts.crash(result)) is not None:
        return bad
    if not own.exists():
        return Verdict("silent wrong", "cache clear deleted the user's own file")
    return Verdict("ok", f"exit {result.code}, the user's file kept")


def cases() -> list[Case]:
    found = []
    for name, (imports, alias) in IMPORT_FORMS.items():
        source = FUSED.format(imports=imports, alias=alias)
        found.append(Case("imports", name, _expands(source, "fused_allreduce at train.py")))
    formfeed = FUSED.format(imports="import macrogen as mg", alias="mg").replace(
        "        dist.all_reduce(b)", "\f        dist.all_reduce(b)"
    )
    found.append(Case("imports", "form feed in a block", _expands(formfeed, "fused_allreduce at")))
    header = "import torch.nn as nn\nimport macrogen as mg\n\n"
    found += [Case("twice", name, _refused(header + src)) for name, src in TWICE.items()]
    for kind in TAMPER:
        for command in COMMANDS:
            found.append(Case("checkpoint", f"{command}: {kind}", _checkpoint(kind, command)))
    found.append(Case("cache", "clear keeps a user's file", _cache_clear))
    return found
