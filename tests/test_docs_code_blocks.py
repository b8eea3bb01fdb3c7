"""Every code block in README.md and docs/*.md is checked, or says it is a fragment.

The convention: the line right before a block's opening fence is an HTML comment (a
reader of the rendered page does not see it) saying what the block is:

    <!-- doc: run -->        Python: a whole program. Run as it is, serially (the unexpanded
                             file is the serial program): it exits 0; and it expands, and
                             the expansion compiles (it may need several ranks to run).
    <!-- doc: expand -->     Python: expands without an error and the expansion compiles; not
                             run (it needs ranks, a GPU, a dataset, or names the page defines
                             elsewhere).
    <!-- doc: expansion -->  Python: part of the expansion of the page's previous run/expand
                             block (as train.py): its lines appear there, in this order
                             (quotes aside: ``ruff format`` turns the page's ' into ").
    <!-- doc: compile -->    Python: compiles; shell: ``bash -n`` accepts it.
    <!-- doc: fragment -->   not checked: output, a command line, a template, an excerpt.

A block without the comment fails this test, naming its file and line, so a new example
is run or consciously marked. Run blocks are kept small: each runs in a process forked
from one that imported torch once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from macrogen.expand import expand_source

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = ("run", "expand", "expansion", "compile", "fragment")
MARKER = re.compile(r"^\s*<!-- doc: (\w+) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's line, 1-based
    info: str  # the fence's language: python, sh, ...
    kind: str | None  # the marker's kind; None: unmarked
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, info = opening.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        found.append(Block(page, i + 1, info, marker.group(1) if marker else None, code))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def _ids(kind: str) -> list[Block]:
    return [b for b in ALL if b.kind == kind]


def test_every_block_says_what_it_is():
    unmarked = [str(b) for b in ALL if b.kind is None]
    unknown = [f"{b}: {b.kind}" for b in ALL if b.kind is not None and b.kind not in KINDS]
    assert not unmarked, (
        "code blocks without a '<!-- doc: run|expand|expansion|compile|fragment -->' line"
        " before the fence (tests/test_docs_code_blocks.py says what each means):\n  "
        + "\n  ".join(unmarked)
    )
    assert not unknown, unknown
    python_only = [
        str(b) for b in ALL if b.kind in ("run", "expand", "expansion") and b.info != "python"
    ]
    assert not python_only, f"run/expand/expansion are for python blocks: {python_only}"


# Pages that still point outside the repository, each to be fixed by the stream that owns
# it (issue 43, item 11). A page listed here that no longer needs it fails the test below:
# take it off the list.
AWAITING: dict[str, str] = {}  # a page that must still refer outside, and to what
OUTSIDE = re.compile(r"\.\./shared|/work/(?:shared|wt|main)\b|/root/|\bflock\b")


def test_the_pages_refer_to_nothing_outside_the_repository():
    """No ../shared, no path of a developer's machine: the repository stands alone."""
    hits: dict[str, list[str]] = {}
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.setdefault(name, []).append(f"{name}:{n}: {line.strip()}")
    new = [hit for name, found in hits.items() if name not in AWAITING for hit in found]
    assert not new, "\n".join(new)
    fixed = sorted(set(AWAITING) - set(hits))
    assert not fixed, f"{fixed} no longer refer outside the repository: take them off AWAITING"


@pytest.mark.parametrize("block", _ids("compile"), ids=str)
def test_compile_blocks_compile(block: Block):
    if block.info in ("sh", "bash", "console"):
        done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert done.returncode == 0, f"{block}: {done.stderr}"
    else:
        compile(block.code, str(block), "exec")


@pytest.mark.parametrize("block", _ids("expand") + _ids("run"), ids=str)
def test_expand_and_run_blocks_expand(block: Block):
    expanded = expand_source(block.code, path="train.py").code
    compile(expanded, f"{block} expanded", "exec")


def _expansion_of(block: Block) -> str:
    before = [b for b in ALL if b.page == block.page and b.line < block.line]
    source = next(b for b in reversed(before) if b.kind in ("run", "expand"))
    return expand_source(source.code, path="train.py").code


def _same(line: str, want: str) -> bool:
    # ruff format rewrites the page's blocks to double quotes; the expansion writes repr()'s.
    return line.rstrip().replace("'", '"') == want.rstrip().replace("'", '"')


@pytest.mark.parametrize("block", _ids("expansion"), ids=str)
def test_expansion_blocks_are_what_expand_writes(block: Block):
    lines = iter(_expansion_of(block).splitlines())
    for want in block.code.strip("\n").splitlines():
        if not want.strip():
            continue
        assert any(_same(line, want) for line in lines), (
            f"{block}: {want.strip()!r} is not in the expansion (in this order)"
        )


RUNNER = """
import os, runpy, signal, sys, traceback
import torch, macrogen  # imported once: each block runs in a process forked from here

for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        os.chdir(os.path.dirname(path))
        with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        signal.alarm(240)
        sys.argv = [path]
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(path + ".rc", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def serial_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Every run block as a program of its own (serially: no torchrun variables), in processes
    forked from one that imported torch once; by block: (exit status, stdout, stderr)."""
    root = tmp_path_factory.mktemp("docs_run")
    paths = {}
    for i, block in enumerate(_ids("run")):
        folder = root / f"block{i}"
        folder.mkdir()
        (folder / "train.py").write_text(block.code)
        paths[str(block)] = folder / "train.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", RUNNER, *map(str, paths.values())]
    subprocess.run(argv, env=env, timeout=240 * len(paths) + 60, check=True)

    def read(path: Path, suffix: str) -> str:
        return Path(str(path) + suffix).read_text() if Path(str(path) + suffix).exists() else ""

    return {
        name: (int(read(path, ".rc") or -1), read(path, ".out"), read(path, ".err"))
        for name, path in paths.items()
    }


@pytest.mark.slow  # (its fixture starts the processes)
@pytest.mark.parametrize("block", _ids("run"), ids=str)
def test_run_blocks_run_serially(block: Block, serial_runs: dict[str, tuple[int, str, str]]):
    code, out, err = serial_runs[str(block)]
    assert code == 0, f"{block} exited {code}:\n{err[-3000:]}"
