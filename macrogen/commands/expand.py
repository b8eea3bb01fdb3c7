"""Expand the macros of Python files: write the expanded program (stdout by default).

Nothing is written unless every file expanded: outputs are staged beside their
targets and renamed into place together. See docs/expand.md.

exit status: 0 success (--check: up to date), 1 errors in the input or an
unwritable output (--check: something is stale), 2 usage, 3 a macrogen bug.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from macrogen import files
from macrogen.commands import HelpFormatter, describe
from macrogen.expand import ExpansionError, InternalError, expand_source
from macrogen.files import encode_source, read_source

STDIO = "-"
# autotune.database.DEFAULT_NAME, written out: the database imports libcst, which a run
# over files without macros never needs (start-up is part of every expand).
TUNING_FILE = "macrogen_tuning.json"


class UsageError(Exception):
    """Bad arguments: exit 2."""


class InputError(Exception):
    """An input that can't be read (an unreadable folder): exit 1."""


@dataclass(frozen=True)
class Job:
    src: str  # a path, or "-" for stdin
    dst: str | None  # a path, or None for stdout


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "expand",
        help="expand the macros of Python files",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "sources", nargs="+", metavar="SRC", help="files or directories (of *.py); - reads stdin"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "-o", "--output", metavar="OUT", help="output file (one SRC only); default: stdout"
    )
    where.add_argument(
        "--out-dir",
        metavar="DIR",
        help="write each output under DIR, mirroring directories (DIR itself is not read as input)",
    )
    where.add_argument(
        "--in-place",
        action="store_true",
        help="overwrite each SRC with its expansion (read-only files are refused)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if an output is missing or differs from the expansion"
        " (with no -o/--out-dir, or with --in-place: compares against the source file itself)",
    )
    p.add_argument(
        "--diff",
        action="store_true",
        help="write nothing; print a unified diff from what is there now to the expansion",
    )
    p.add_argument(
        "--target", choices=("cpu", "cuda"), help="fix target() branches for this device"
    )
    p.add_argument(
        "--device",
        metavar="NAME",
        help="with records for several device kinds (an H100's and an A100's), write this"
        " kind's winners (its name as recorded: 'NVIDIA H100 80GB HBM3'); default: the newest"
        " record's. The import hook resolves them on each rank for its own device",
    )
    p.add_argument(
        "--tuning",
        metavar="FILE",
        help="tuning database to read winners from; it must exist"
        " (default: macrogen_tuning.json next to SRC, if any)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    return expand_files(
        args.sources,
        output=args.output,
        out_dir=args.out_dir,
        in_place=args.in_place,
        check=args.check,
        diff=args.diff,
        target=args.target,
        tuning=args.tuning,
        device=args.device,
    )


def expand_files(
    sources: list[str],
    *,
    output: str | None = None,
    out_dir: str | None = None,
    in_place: bool = False,
    check: bool = False,
    diff: bool = False,
    target: str | None = None,
    tuning: str | None = None,
    device: str | None = None,
    stdin: IO[bytes] | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Expand files as the CLI does; returns the exit status."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr
    try:
        jobs = plan_jobs(sources, output=output, out_dir=out_dir, in_place=in_place)
        if tuning is not None:
            from macrogen.autotune import database

            what = database.kind(Path(tuning))
            if what is not None:  # "no such file", "a FIFO (named pipe), not a regular file", ...
                raise UsageError(f"--tuning {tuning}: {what}")
    except UsageError as e:
        print(f"macrogen expand: error: {e}", file=stderr)
        return 2
    except InputError as e:
        print(f"macrogen expand: error: {e}", file=stderr)
        return 1
    status = 0
    outputs: list[tuple[Job, bytes]] = []
    for job in jobs:
        try:
            code, new = _expand_one(job, check, diff, target, tuning, device, stdin, stdout, stderr)
        except InternalError as e:
            print(f"{job.src}: internal error (a macrogen bug, please report it): {e}", file=stderr)
            code, new = 3, None
        status = max(status, code)
        if new is not None:
            outputs.append((job, new))
    if status != 0:  # nothing is written unless every file expanded
        return status
    return _write_all(outputs, stdout, stderr)


def _write_all(outputs: list[tuple[Job, bytes]], stdout: IO[bytes], stderr: IO[str]) -> int:
    """Stage every file output, then put them all in place; on any failure, none of them."""
    staged: list[files.Staged] = []
    # Temporary files of killed runs go, once per folder, even where every output is up to date.
    dsts = [Path(job.dst) for job, _ in outputs if job.dst is not None]
    for folder in {files.target_of(dst).parent for dst in dsts}:
        files.clean_stale(folder)
    try:
        for job, new in outputs:
            if job.dst is None:
                continue
            dst = Path(job.dst)
            if dst.is_file() and dst.read_bytes() == new:
                continue  # up to date: leave the file (and its mtime) alone
            try:
                staged.append(files.stage(dst, new))
            except files.WriteError as e:
                raise files.WriteError(str(e)) from None
            except OSError as e:
                raise files.WriteError(f"can't write {job.dst}: {e.strerror or e}") from None
        for s in staged:
            files.commit(s)
    except OSError as e:
        files.discard(staged)
        message = str(e) if isinstance(e, files.WriteError) else f"can't write: {e.strerror or e}"
        print(f"macrogen expand: error: {message}", file=stderr)
        return 1
    for job, new in outputs:
        if job.dst is None:
            stdout.write(new)
            stdout.flush()
    return 0


def plan_jobs(
    sources: list[str], *, output: str | None, out_dir: str | None, in_place: bool
) -> list[Job]:
    if output is not None and len(sources) != 1:
        raise UsageError("-o takes exactly one SRC; use --out-dir for several")
    jobs: list[Job] = []
    for src in sources:
        if src == STDIO:
            if in_place or out_dir is not None:
                raise UsageError("- (stdin) can't be used with --in-place or --out-dir")
            jobs.append(Job(STDIO, None if output in (None, STDIO) else output))
            continue
        path = Path(src)
        if path.is_dir():
            if out_dir is None and not in_place:
                raise UsageError(f"{src} is a directory: give --out-dir DIR or --in-place")
            for file, rel in _python_files(path, skip=out_dir):
                dst: str | None = file if in_place else str(Path(out_dir or "") / rel)
                jobs.append(Job(file, dst))
        elif path.is_file():
            if in_place:
                dst = src
            elif out_dir is not None:
                dst = str(Path(out_dir) / path.name)
            else:
                dst = None if output in (None, STDIO) else output
            jobs.append(Job(src, dst))
        elif path.exists():
            raise UsageError(f"{src}: not a regular file or a directory")
        else:
            raise UsageError(f"{src}: no such file or directory")
    seen: dict[str, str] = {}
    folders: dict[str, str] = {}
    for job in jobs:
        if job.dst is None:
            continue
        key = _resolved(job.dst, folders)
        if key in seen and seen[key] != job.src:
            raise UsageError(f"{seen[key]} and {job.src} would both be written to {job.dst}")
        seen[key] = job.src
    if not in_place:
        for job in jobs:
            if job.src != STDIO and job.dst is not None and _same_file(job.src, job.dst):
                raise UsageError(
                    f"refusing to overwrite the input {job.src}; pass --in-place to do that"
                )
    return jobs


def _resolved(path: str, folders: dict[str, str]) -> str:
    """``str(Path(path).resolve())``, resolving each folder once (a walk of torch/ has 2,000 files)."""
    folder, name = os.path.split(os.path.abspath(path))
    if folder not in folders:
        folders[folder] = os.path.realpath(folder)
    full = os.path.join(folders[folder], name)
    return os.path.realpath(full) if os.path.islink(full) else full


def _python_files(root: Path, *, skip: str | None) -> list[tuple[str, str]]:
    """Every ``*.py`` file below ``root`` as (path, path relative to root), in the order of
    sorted Paths; symlinks are not followed.

    ``skip`` (the --out-dir) is left out, so earlier outputs inside the source
    tree are never read as inputs. A folder that can't be read is an error.
    Strings and ``os.scandir`` rather than Path objects: the entries' types come
    with the listing, so a large tree costs one ``scandir`` per folder.
    """
    skip_real = os.path.realpath(skip) if skip is not None else None
    unreadable: list[str] = []
    found: list[tuple[str, ...]] = []  # path components below root
    top = str(root)
    stack: list[tuple[str, tuple[str, ...]]] = [(top, ())]
    while stack:
        folder, parts = stack.pop()
        try:
            with os.scandir(folder) as entries:
                listing = list(entries)
        except OSError as e:
            unreadable.append(f"{e.filename}: {e.strerror or e}")
            continue
        for entry in listing:
            try:
                if entry.is_symlink():
                    continue
                if entry.is_dir():
                    if skip_real is None or os.path.realpath(entry.path) != skip_real:
                        stack.append((entry.path, (*parts, entry.name)))
                elif entry.name.endswith(".py") and entry.is_file():
                    found.append((*parts, entry.name))
            except OSError:
                continue
    if unreadable:
        raise InputError("can't read " + "; ".join(sorted(unreadable)))
    found.sort()  # as sorted Paths: component by component
    out = []
    for parts in found:
        rel = os.path.join(*parts)
        out.append((rel if top == "." else os.path.join(top, rel), rel))  # str(root / rel)
    return out


def _same_file(a: str, b: str) -> bool:
    pa, pb = Path(a), Path(b)
    if pb.exists():
        return pa.resolve() == pb.resolve() or pa.samefile(pb)
    return pa.resolve() == pb.resolve()


def _expand_one(
    job: Job,
    check: bool,
    diff: bool,
    target: str | None,
    tuning: str | None,
    device: str | None,
    stdin: IO[bytes],
    stdout: IO[bytes],
    stderr: IO[str],
) -> tuple[int, bytes | None]:
    """(exit status, the bytes to write to ``job.dst``; None when there is nothing to write)."""
    try:
        data = stdin.read() if job.src == STDIO else Path(job.src).read_bytes()
    except OSError as e:
        print(f"macrogen expand: error: can't read {job.src}: {e.strerror or e}", file=stderr)
        return 1, None
    display = "<stdin>" if job.src == STDIO else job.src
    try:
        source, encoding = read_source(data)
    except (SyntaxError, UnicodeDecodeError) as e:
        print(f"{display}:1:1: error: can't decode the file: {e}", file=stderr)
        return 1, None
    values: dict[str, Any] = {}
    if tuning is None and job.src != STDIO:
        default = Path(job.src).parent / TUNING_FILE  # the file autotune writes by default
        tuning = str(default) if default.is_file() else None
    if tuning is not None:
        try:
            values, stale = _winners(Path(tuning), source, display, target, device, stderr)
        except UsageError as e:
            print(f"macrogen expand: error: {e}", file=stderr)
            return 2, None
        except (OSError, ValueError) as e:
            print(f"macrogen expand: error: {e}", file=stderr)
            return 1, None
        for key in stale:
            print(
                f"{display}: warning: tuning entry {key!r} is stale (the source changed); using its default",
                file=stderr,
            )
    try:
        result = expand_source(source, path=display, target=target, tuning=values)
    except ExpansionError as e:
        print(e.report(), file=stderr)
        return 1, None
    if not result.changed:
        new = data  # nothing to expand: the file as it is, byte for byte
    else:
        try:
            new = encode_source(result.code, encoding)
        except UnicodeError as e:
            print(f"{display}:1:1: error: {e}", file=stderr)
            return 1, None
    if check or diff:
        old_bytes = data if job.dst in (None, job.src) and job.src != STDIO else _existing(job)
        stale_out = old_bytes != new
        if diff and stale_out:
            old_text = read_source(old_bytes)[0] if old_bytes is not None else ""
            name = job.dst or display
            lines = difflib.unified_diff(
                old_text.splitlines(keepends=True),
                result.code.splitlines(keepends=True),
                f"a/{name}",
                f"b/{name}",
            )
            stdout.write("".join(lines).encode("utf-8"))
        if check and stale_out:
            print(f"{job.dst or display}: {_stale_message(job, old_bytes)}", file=stderr)
            return 1, None
        return 0, None
    return 0, new


def _winners(
    db: Path, source: str, display: str, target: str | None, device: str | None, stderr: IO[str]
) -> tuple[dict[str, Any], list[str]]:
    """The winners ``expand`` writes: of the kind named ``--device`` (UsageError if no record
    of ``file`` names it), else each key's newest record's, saying so when they differ by
    device kind: one expanded file carries one value to every rank (a tunable shapes the
    code: a Triton constexpr, a bucket size, a layout), so the line names the keys, the value
    used and where each rank gets its own."""
    from macrogen.autotune import database

    file = Path(display).name
    records = database.file_records(db, file=file, target=target)
    kind = None if device is None else database.kind_named(records, device)
    if device is not None and kind is None and records:
        raise UsageError(
            f"--device {device!r}: no record of {file} names it"
            f" (recorded: {database.kind_names(records)})"
        )
    values, stale = database.resolve(records, source, kind)
    differ = {} if device is not None else database.differing(records, source)
    if differ:
        keys = "; ".join(
            f"{key} = {values[key]!r} ({database.per_kind_text(per_kind)})"
            for key, per_kind in sorted(differ.items())
        )
        print(
            f"{display}: warning: tuning differs by device kind, and this file gives every rank one"
            f" value: {keys}; --device NAME chooses the kind; the import hook (macrogen run)"
            " resolves them on each rank for its own device",
            file=stderr,
        )
    return values, stale


def _stale_message(job: Job, old: bytes | None) -> str:
    """What --check compared, in words."""
    if job.dst is None:
        if job.src == STDIO:
            return "would be changed by expansion (stdin is compared against nothing)"
        return (
            "has macros to expand (--check without -o/--out-dir compares against the source itself)"
        )
    if old is None:
        return "missing (the expansion was never written)"
    if job.dst == job.src:
        return "has macros to expand (would be rewritten in place)"
    return f"stale: differs from the expansion of {job.src} (would be rewritten)"


def _existing(job: Job) -> bytes | None:
    """What an output is now: the destination file, or for stdout the source itself."""
    if job.dst is None:
        return None if job.src == STDIO else Path(job.src).read_bytes()
    path = Path(job.dst)
    # only a regular file (through symlinks) has contents to compare: never read a FIFO
    return path.read_bytes() if path.is_file() else None
