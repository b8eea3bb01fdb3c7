"""Every code block of README.md and docs/ as a user meets it: a ``run`` block run as a
program of its own (serially: the unexpanded file is the serial program), a ``run`` or
``expand`` block through ``macrogen expand``, and each page read for paths outside the
repository. (tests/test_docs_code_blocks.py says what each block's marker means.)"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from bench.probes import verdicts
from bench.probes.runner import Case, CaseBody, Run, Verdict

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!-- doc: (\w+) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
OUTSIDE = re.compile(r"\.\./shared|/work/(?:shared|wt|main)\b|/root/|\bflock\b")


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, marker kind, code) of each fenced block; the kind is "" when unmarked."""
    import textwrap

    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        found.append((i + 1, marker.group(1) if marker else "", code))
        i = end + 1
    return found


def _run(code: str) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(code)
        result = yield Run(script="train.py", timeout=240)
        bad = verdicts.succeeded(result)
        return bad or Verdict("ok", "ran: " + (verdicts.first_line(result.out) or "(no output)"))

    return body


def _expand(code: str) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(code)
        result = yield Run(cli=("expand", "train.py", "-o", "out.py"), timeout=120)
        if (bad := verdicts.crash(result)) is not None:
            return bad
        if result.code != 0:
            kind = "traceback" if verdicts.TRACEBACK in result.err or result.code == 3 else "failed"
            return Verdict(kind, verdicts.error_line(result.err))
        try:
            compile((folder / "out.py").read_text(), "out.py", "exec")
        except SyntaxError as e:
            return Verdict("failed", f"the expansion does not compile: {e}")
        return Verdict("ok", "expands, compiles")

    return body


def _outside(page: Path) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        hits = [f"{n}: {line.strip()}" for n, line in
                enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]  # fmt: skip
        if hits:
            return Verdict("failed", "refers outside the repository: " + hits[0])
        unmarked = [str(line) for line, kind, _ in blocks(page) if not kind]
        if unmarked:
            return Verdict("failed", "blocks without a doc marker at lines " + ", ".join(unmarked))
        return Verdict("ok", "nothing outside the repository; every block marked")
        yield  # a generator that never runs anything

    return body


def cases() -> list[Case]:
    found = []
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        found.append(Case("docs", f"{name} links", _outside(page)))
        for line, kind, code in blocks(page):
            if kind == "run":
                found.append(Case("docs", f"{name}:{line} runs", _run(code)))
            if kind in ("run", "expand"):
                found.append(Case("docs", f"{name}:{line} expands", _expand(code)))
    return found
