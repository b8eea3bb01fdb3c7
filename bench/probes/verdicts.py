"""How a run is judged: a clean refusal, a traceback, a hang, or a silent wrong.

- A **command** (``macrogen ...``) refuses cleanly with exit status 1 or 2, an ``error:``
  line, no Python traceback and no internal-error (exit 3) line.
- A **program** (the user's script, macrogen's runtime inside it) refuses cleanly when it
  stops (non-zero) on an exception macrogen raised on purpose: the innermost frame is
  macrogen's (or the class is macrogen's), the type is not one of Python's "a bug happened"
  types (KeyError, IndexError, AttributeError, AssertionError, ...), and its message is one
  line. A raw torch or Python error is a traceback.
- Exit 0 where a refusal was due, or a result unequal to serial, or a user file changed:
  silent wrong. No exit within the time bound: hang.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from bench.probes.runner import Result, Verdict

TRACEBACK = "Traceback (most recent call last)"
BUG_TYPES = ("AssertionError", "KeyError", "IndexError", "AttributeError", "NameError",
             "UnboundLocalError", "ZeroDivisionError", "RecursionError", "OverflowError",
             "UnicodeDecodeError", "UnicodeEncodeError", "StopIteration")  # fmt: skip
_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+')
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.MULTILINE)
_LAST = re.compile(r"^([\w.]+): (.*)$")


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def error_line(text: str) -> str:
    """The line a user reads first: the one with ``error`` in it, else the first."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file under ``folder`` (bytes; None for what is not a regular file), but the
    runner's own capture files and __pycache__."""
    found: dict[str, bytes | None] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if "__pycache__" in rel or re.fullmatch(r"run\d+\.(out|err)\d+|run\d+\.in", rel):
            continue
        try:
            found[rel] = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        except OSError:
            found[rel] = None
    return found


def changes(before: dict[str, bytes | None], folder: Path, allowed: tuple[str, ...] = ()) -> str:
    """What the run wrote or changed among the user's files ("" for nothing)."""
    after = snapshot(folder)
    changed = [k for k in after if before.get(k, b"\0new") != after[k]]
    changed += [k for k in before if k not in after]
    changed = [k for k in changed if not any(k == a or k.startswith(a + "/") for a in allowed)]
    return ", ".join(sorted(changed)[:4])


def crash(result: Result) -> Verdict | None:
    """hang, or a signal (an abort, a segfault): None when it exited normally."""
    if result.hung:
        return Verdict("hang", f"no exit within the bound ({result.seconds:.0f} s)")
    bad = [c for c in result.codes if c is not None and c < 0]
    if bad:
        return Verdict("traceback", f"killed by signal {-bad[0]}: " + error_line(result.err))
    return None


def command_refusal(result: Result, before: dict | None = None, folder: Path | None = None,
                    allowed: tuple[str, ...] = ()) -> Verdict:  # fmt: skip
    """A macrogen command that should refuse its input."""
    if (bad := crash(result)) is not None:
        return bad
    text = result.err + result.out
    if result.code == 0:
        return Verdict("silent wrong", "exit 0 where a refusal was due: " + first_line(text))
    if TRACEBACK in text or result.code == 3 or "internal error" in text:
        return Verdict("traceback", f"exit {result.code}: " + error_line(text))
    if result.code not in (1, 2) or "error" not in text.lower():
        return Verdict("failed", f"exit {result.code} without an error line: " + first_line(text))
    if before is not None and folder is not None and (changed := changes(before, folder, allowed)):
        return Verdict("silent wrong", f"refused but wrote {changed}: " + error_line(text))
    return Verdict("ok", error_line(result.err or result.out))


def _raised(err: str) -> tuple[str, str, str] | None:
    """(exception type, message, innermost frame's file) of the last traceback in ``err``."""
    err = _RANK_PREFIX.sub("", err)  # torch's "[rank0]:" before each line of a rank's error
    if TRACEBACK not in err:
        return None
    tail = err[err.rindex(TRACEBACK) :].splitlines()
    frames = [m.group(1) for line in tail if (m := _FRAME.match(line))]
    last = next((line for line in reversed(tail) if _LAST.match(line)), None)
    if last is None:
        return None
    m = _LAST.match(last)
    assert m is not None
    kind, message = m.groups()
    # a multi-line message: the lines after the type's line
    after = tail[tail.index(last) + 1 :]
    if any(line.strip() for line in after):
        message += " [+more lines]"
    return kind, message, frames[-1] if frames else ""


def program_refusal(result: Result) -> Verdict:
    """A program that should stop on a clear, named error from macrogen."""
    if (bad := crash(result)) is not None:
        return bad
    if result.code == 0:
        return Verdict("silent wrong", "exit 0 where a refusal was due: " + first_line(result.err))
    return refused(result)


def refused(result: Result) -> Verdict:
    """Judge a non-zero exit: macrogen's named refusal (ok), or a raw error (traceback)."""
    for err in result.errs:
        raised = _raised(err)
        if raised is None:
            continue
        kind, message, frame = raised
        short = kind.rsplit(".", 1)[-1]
        ours = kind.startswith("macrogen.") or "/macrogen/" in frame
        if not ours or short in BUG_TYPES or message.endswith("[+more lines]"):
            return Verdict("traceback", f"{kind}: {message}"[:300])
        return Verdict("ok", f"{short}: {message}"[:300])
    # no traceback: a one-line message of its own (rank N: ..., macrogen ...: error: ...)
    text = result.err
    if "error" in text.lower() or "rank " in text:
        return Verdict("ok", error_line(text))
    return Verdict("failed", f"exit {result.code}, no message: " + first_line(result.out + text))


def succeeded(result: Result) -> Verdict | None:
    """None when the run exited 0; else its verdict (a refusal where success was due)."""
    if (bad := crash(result)) is not None:
        return bad
    if result.code == 0:
        return None
    judged = refused(result)
    if judged.outcome == "ok":
        return Verdict("failed", "refused where it should run: " + judged.line)
    return judged


def close(a: Any, b: Any, tol: float) -> float:
    """The worst difference between two nested lists/dicts of numbers (inf: unequal shapes)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        return max((close(a[k], b[k], tol) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((close(x, y, tol) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
        return abs(a - b) / max(1.0, abs(b))
    return 0.0 if a == b else math.inf
