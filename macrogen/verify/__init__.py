"""``macrogen verify``: one step of the parallel program against the serial one, per parameter.

    report = verify("train.py", entry=":build", world_size=2)
    print(report.table())
    print(report.verdict())

The serial step runs here, from FILE unexpanded (the reference: every marker a no-op);
the parallel step on ``world_size`` ranks from FILE expanded (``macrogen.verify.rank``,
under torchrun by default; ``launch`` replaces it, as tests do). Both build the model
and the batch with the same seed, take one forward and backward, and the loss and every
gradient are compared by the serial parameter names, each row naming the plan entry of
``mg.parallelize`` whose layer holds it. A plan can pass every shape check and still
compute another function (an attention whose head count was not divided): this is the
check that catches it. See docs/verify.md.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from macrogen.verify import compare
from macrogen.verify.compare import Row
from macrogen.verify.launch import Launch, RanksFailed

if TYPE_CHECKING:
    from macrogen.verify.program import Snapshot


class UsageError(Exception):
    """A request verify cannot run (no such entry, not a factory, N < 1): exit 2."""


class VerifyError(Exception):
    """The program or its ranks failed before there was anything to compare: exit 1."""


@dataclass(frozen=True)
class Report:
    where: str  # "train.py:12:9", the mg.parallelize site (else the file)
    world_size: int
    rows: list[Row]  # the loss, then every parameter's gradient
    weights_differ: list[Row]  # weights that differed before the step (the factory's doing)
    undivided: list[tuple[str, int]]  # head counts beside sharded layers the plan leaves whole

    @property
    def ok(self) -> bool:
        return not self.weights_differ and all(r.ok for r in self.rows)

    def table(self) -> str:
        return compare.table(self.rows)

    def verdict(self) -> str:
        """One line: what passed, or the worst difference and the plan entry it belongs to."""
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if self.weights_differ:
            first = self.weights_differ[0]
            return (
                f"{self.where}: error: the weights differ before the step ({first.name}, max abs"
                f" {first.abs_diff:.2e}): the entry must build the same model each time it is"
                " called (from torch's seed, which verify sets)"
            )
        bad = [r for r in self.rows if not r.ok]
        worst = compare.worst(self.rows)
        if not bad:
            return (
                f"{self.where}: ok: the step on {ranks} matches the serial step"
                f" ({len(self.rows) - 1} gradients and the loss; nearest its tolerance:"
                f" {worst.name}, max abs {worst.abs_diff:.1e}, rel {worst.rel_diff:.1e})"
            )
        of = worst.planned.split()
        layer = f" (planned {of[0]} at {of[-1]})" if of else ""
        numbers = worst.note or f"max abs {worst.abs_diff:.2e}, rel {worst.rel_diff:.2e}"
        hint = "".join(
            f"; the plan does not divide {path} ({value}): add {path!r}: 'divide'?"
            for path, value in self.undivided
        )
        return (
            f"{self.where}: error: the step on {ranks} differs from the serial step in"
            f" {len(bad)} of {len(self.rows)} rows; worst {worst.name}{layer}: {numbers}{hint}"
        )


RANKS_PER_CPU = 4  # verify's ranks share this machine's CPUs


def check_request(entry: str, world_size: int) -> None:
    """UsageError unless ``entry`` reads ``module:factory`` (or ``:factory``) and N >= 1."""
    module, sep, factory = entry.partition(":")
    if not sep or not factory.isidentifier() or (module and not _dotted(module)):
        raise UsageError(
            f"--entry must be module:factory (:build for a factory in FILE), not {entry!r}"
        )
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, not {world_size}")
    most = max(8, RANKS_PER_CPU * (os.cpu_count() or 1))
    if world_size > most:  # each rank is a process of this machine: 1e9 of them never end
        raise UsageError(
            f"--world-size {world_size}: verify starts that many processes on this machine;"
            f" at most {most} here ({RANKS_PER_CPU} per CPU)"
        )


def verify(
    path: str | os.PathLike[str],
    *,
    entry: str,
    world_size: int,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    timeout: float = 300.0,
    launch: Launch | None = None,
) -> Report:
    """Compare one step of FILE's parallel program on ``world_size`` ranks with its serial step.

    Raises UsageError (a bad request), VerifyError (the program failed) or the pass's
    ExpansionError (FILE's macros are wrong)."""
    from macrogen.autotune import database
    from macrogen.expand import expand_source
    from macrogen.files import read_source
    from macrogen.verify.launch import torchrun

    check_request(entry, world_size)
    source_path = Path(path).resolve()
    try:  # a FIFO is refused, never waited on (None: no such file, for read_bytes to say)
        data = database.read_regular(source_path)
        source = read_source(data if data is not None else source_path.read_bytes())[0]
    except (OSError, SyntaxError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from e
    expansion = expand_source(source, path=str(path))
    with tempfile.TemporaryDirectory(prefix="macrogen-verify-") as folder:
        work = Path(folder)
        job = work / "job.json"
        out = work / "parallel.pt"
        job.write_text(
            json.dumps(
                {
                    "source": str(source_path),
                    "entry": entry,
                    "seed": seed,
                    "out": str(out),
                    "sys_path": [str(source_path.parent), os.getcwd()],
                }
            ),
            encoding="utf-8",
        )
        # the ranks start (import torch, expand FILE) while the serial step runs here
        ranks = (launch or torchrun)(job, world_size, timeout)
        try:
            serial, where, plan, undivided = _serial(
                str(path), source_path, source, expansion, entry, seed
            )
        except BaseException:
            ranks.stop()
            raise
        failure = None
        try:
            ranks.wait()
        except RanksFailed as e:
            failure = e
        errors = sorted(work.glob("error-rank*.txt"))
        if errors:
            rank = errors[0].stem.removeprefix("error-rank")
            raise VerifyError(f"{path}: on rank {rank} of {world_size}, {errors[0].read_text()}")
        if failure is not None or not out.exists():
            raise VerifyError(f"{path}: {failure or 'rank 0 wrote no result'}")
        parallel = _read_snapshot(out)
    rows, weights_differ = compare.compare(serial, parallel, plan, rtol=rtol, atol=atol)
    return Report(where, world_size, rows, weights_differ, undivided)


def _serial(
    path: str, source_path: Path, source: str, expansion: Any, entry: str, seed: int
) -> tuple[Snapshot, str, Sequence[tuple[str, str]], list[tuple[str, int]]]:
    """The serial step (FILE unexpanded, here), where its mg.parallelize is, its plan, and
    the head counts it leaves undivided."""
    from macrogen.verify import program
    from macrogen.verify.hints import undivided_head_counts

    saved = sys.modules.get(source_path.stem)
    try:
        with program.parallelize_calls(source_path) as called:
            module = program.load(source_path, expanded=False, seed=seed)
            model, batch, loss_fn = program.build(module, entry, seed=seed)
        where, arguments = _site(path, source, expansion, called)
        for name in ("pp", "servers"):
            value = arguments.get(name)
            if isinstance(value, int) and value > (1 if name == "pp" else 0):
                raise UsageError(
                    f"{where}: verify runs one step of a model that is not cut into pipeline"
                    f" stages or served by parameter servers ({name}={value}); verify the plan"
                    f" with {name}={1 if name == 'pp' else 0}"
                )
        serial = program.step(model, batch, loss_fn, seed=seed)
        plan = _plan(arguments.get("tp_plan"), model)
        tp = arguments.get("tp")
        undivided = undivided_head_counts(model, plan, tp) if isinstance(tp, int) else []
        return serial, where, plan, undivided
    except program.EntryError as e:
        raise UsageError(str(e)) from e
    except program.ProgramError as e:
        raise VerifyError(f"{path}: serially, {e}") from e
    finally:
        if saved is None:
            sys.modules.pop(source_path.stem, None)
        else:
            sys.modules[source_path.stem] = saved


def _read_snapshot(out: Path) -> Snapshot:
    import torch

    from macrogen.verify.program import Snapshot

    found = torch.load(out, weights_only=True)  # tensors, dicts and strings: nothing unpickled
    return Snapshot(found["loss"], found["weights"], found["grads"], found["placements"])


def _site(path: str, source: str, expansion: Any, called: list[int]) -> tuple[str, dict[str, Any]]:
    """``path:line:col`` of the mg.parallelize the entry ran (else FILE's first; else ``path``)
    and its arguments as written."""
    sites = [
        (line, arguments)
        for (macro, line), arguments in zip(expansion.sites, expansion.arguments, strict=False)
        if macro == "parallelize" and arguments.macro == "parallelize"
    ]
    if not sites:
        return path, {}
    line, arguments = sites[0]
    if called:  # the call runs on its first line or below: the last site starting at or above
        line, arguments = max(
            (s for s in sites if s[0] <= called[0]), key=lambda s: s[0], default=sites[0]
        )
    text = source.splitlines()[line - 1]
    return f"{path}:{line}:{_call_column(text)}", dict(arguments.values)


def _call_column(text: str) -> int:
    """The 1-based column where the ``mg.parallelize(`` call's name starts on its line."""
    at = text.find("parallelize(")
    if at < 0:
        return 1
    start = at
    while start > 0 and (text[start - 1].isidentifier() or text[start - 1] in "._0123456789"):
        start -= 1
    return start + 1


def _plan(tp_plan: Any, model: Any) -> Sequence[tuple[str, str]]:
    """The plan's entries as written, or the one a transformers model ships for ``"hf"``."""
    if tp_plan == "hf":
        from macrogen.runtime import hf_plan

        try:
            return compare.plan_entries(hf_plan(model))
        except ValueError:  # no plan: the ranks say so
            return []
    return compare.plan_entries(tp_plan if isinstance(tp_plan, dict) else None)


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))
