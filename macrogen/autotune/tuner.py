"""``autotune``: find a file's tunables, measure candidates, record them and the winner.

    source --expand--> tunables --space.build--> candidates --search.plan--> order
    order - already in the database --measure--> Measurement --> database (saved at once)

Everything measured is saved the moment it is known, so a run that is killed
or runs out of budget resumes where it stopped, and a run over an unchanged
file and entry measures nothing.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from macrogen import __version__
from macrogen.autotune import database, environment, finals, layout_search, memory, search, space
from macrogen.autotune.layouts import ModelShape
from macrogen.autotune.measure import Measurement, Program, Timing, measure
from macrogen.autotune.report import Reporter
from macrogen.autotune.space import Parameter
from macrogen.expand import expand_source
from macrogen.files import read_source


class AutotuneError(Exception):
    """A problem with the request itself (no tunables, a bad --entry): nothing is measured."""


@dataclass(frozen=True)
class Outcome:
    database: Path
    record: dict[str, Any] | None  # None when nothing could be recorded
    strategy: str  # "exhaustive" or "random"
    stopped: str  # "complete", "max trials", "early stop", "budget"
    planned: int  # candidates the search looks at
    new_measurements: int
    winner: dict[str, Any] | None  # tunable key -> value; None when every candidate failed
    space: space.Space
    measured_now: frozenset[str]  # database.canonical(values) of this run's measurements
    skipped: tuple[tuple[Parameter, str], ...] = ()  # not tuned here (no effect), and why
    # layouts: canonical values -> the cost and memory models' prediction; None otherwise
    predictions: dict[str, Any] | None = None
    world_size: int = 1
    # layouts: the leaders, timed again side by side (canonical values); see FINALISTS
    finalists: tuple[str, ...] = ()
    verdict: str = ""  # layouts: how far the winner leads the runner-up, against their spread
    others: tuple[Outcome, ...] = ()  # a machine with several kinds of device: the others'
    device: Mapping[str, Any] = field(default_factory=dict)  # the kind measured on (its key)


def autotune(
    path: str | os.PathLike[str],
    *,
    entry: str,
    world_size: int = 1,
    target: str | None = None,
    tuning: str | os.PathLike[str] | None = None,
    budget: float | None = None,
    max_trials: int = 32,
    timing: Timing | None = None,
    retry_failed: bool = False,
    reporter: Reporter | None = None,
    memory_per_rank: float | None = None,
    noise: float = 0.05,
) -> Outcome:
    """Tune every ``tunable`` of the file at ``path``; see docs/autotune.md.

    Once per kind of device this machine has (``environment.device_kinds``: name,
    capability, memory, link), each on its own devices, into a record keyed by that kind;
    the outcome is the first kind's, the others' in ``others``. A world size more than a
    kind has devices for is tuned once, on every device, keyed by the first kind."""
    _check_request(entry, world_size, max_trials)
    if target is None:
        import torch

        target = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kinds = environment.device_kinds(target)
    except RuntimeError as e:
        raise AutotuneError(str(e)) from None
    options: dict[str, Any] = dict(
        entry=entry,
        world_size=world_size,
        target=target,
        tuning=tuning,
        budget=budget,
        max_trials=max_trials,
        timing=timing,
        retry_failed=retry_failed,
        reporter=reporter,
        memory_per_rank=memory_per_rank,
        noise=noise,
    )
    if len(kinds) == 1 or any(len(indices) < world_size for _, indices in kinds):
        return _autotune_on(kinds[0][0], path, **options)
    outcomes = []
    for kind, indices in kinds:
        with _visible(indices):
            outcomes.append(_autotune_on(kind, path, **options))
    return replace(outcomes[0], others=tuple(outcomes[1:]))


@contextlib.contextmanager
def _visible(indices: list[int]) -> Iterator[None]:
    """The measurement processes see only these CUDA devices (indices as this process sees
    them: within its own CUDA_VISIBLE_DEVICES, if set)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = saved.split(",") if saved else [str(i) for i in range(max(indices) + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in indices)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _autotune_on(
    device: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    entry: str,
    world_size: int,
    target: str,
    tuning: str | os.PathLike[str] | None,
    budget: float | None,
    max_trials: int,
    timing: Timing | None,
    retry_failed: bool,
    reporter: Reporter | None,
    memory_per_rank: float | None,
    noise: float,
) -> Outcome:
    """``autotune`` on one kind of device (its tuning key's ``device``)."""
    started = time.monotonic()
    deadline = None if budget is None else started + budget
    source_path = Path(path)
    data = database.read_regular(source_path)  # a FIFO is refused, never waited on
    if data is None:
        raise AutotuneError(f"{source_path}: no such file")
    source = read_source(data)[0]
    expansion = expand_source(source, path=source_path.name, target=target)
    params = space.parameters(expansion)
    if not params:
        raise AutotuneError(f"{source_path}: no tunable(...) to tune")
    env = space.TuningEnv(target, world_size, device["name"])
    skipped = tuple((p, why) for p in params if (why := no_effect(p, env)) is not None)
    params = tuple(p for p in params if p.key not in {s.key for s, _ in skipped})
    if not params:
        notes = "; ".join(f"{p.key}: {why}" for p, why in skipped)
        raise AutotuneError(f"{source_path}: nothing to tune on {target} ({notes})")
    site_hash = database.site_hash(source)
    cspace = space.build(params, env, seed=int(site_hash[:8], 16))
    if not cspace.candidates:
        raise AutotuneError(
            f"{source_path}: every candidate is ruled out ({cspace.excluded[0][1]})"
        )
    searcher: Any = search.plan(cspace, max_trials=max_trials, seed=int(site_hash[:8], 16))

    db_path = Path(tuning) if tuning is not None else database.default_path(source_path)
    db = database.Database(db_path)
    search_path = [str(source_path.parent.resolve()), os.getcwd()]
    entry_module = entry.split(":", 1)[0]
    origin = environment.entry_origin(entry_module, search_path) if entry_module else None
    in_source = not entry_module or origin == source_path.resolve()
    timing = timing or Timing()
    layout_site = layout_search.site_of(params)
    predictions = None
    probed: dict[str, Any] | None = None
    if layout_site is not None:  # a layout: one candidate at a time, each its own mesh
        timing = replace(timing, group=1)
        plan = layout_site.values.get("tp_plan")
        reporter = reporter or Reporter()
        probed = _probe(
            db,
            source,
            expansion.code,
            source_path,
            entry,
            in_source,
            search_path,
            plan,
            target,
            reporter.note,
        )
        # the site's written arguments: what a record's layout is checked with when read
        probed = {**probed, "arguments": database.encode_values(layout_site.values)}
        profile = memory.Profile(**probed["profile"])
        shape = ModelShape(**probed["shape"])
        machine = layout_search.machine_for(target, world_size)
        cspace, predictions = layout_search.prepare(
            cspace, layout_site, profile, shape, world_size, machine, memory_per_rank
        )
        if not cspace.candidates:
            raise AutotuneError(
                f"{source_path}: every layout is ruled out ({cspace.excluded[0][1]})"
            )
        searcher = layout_search.LayoutSearch(list(cspace.candidates), predictions, noise)
    program = Program(
        source_path, source, entry, in_source, world_size, target, timing, layout_site is not None
    )
    key = _tuning_key(
        source_path,
        entry,
        "" if in_source else environment.file_hash(origin),
        device,
        params,
        site_hash,
        target,
        world_size,
    )
    book = _Book(db, key, source, cspace, retry_failed)
    book.probe = probed
    reporter = reporter or Reporter()

    with reporter.progress(len(searcher.order)) as progress:
        index = 0

        def observe_known() -> None:
            """Feed the search, in its order, every candidate the database now knows."""
            nonlocal index
            while index < len(searcher.order) and not searcher.done:
                known = book.known(searcher.order[index])
                if known is None:
                    return
                searcher.observe(
                    finals.first_time(known)
                )  # the finals' repeats don't move the search
                now = database.canonical(searcher.order[index]) in book.measured_now
                progress.advance(known, cached=not now, best=searcher.best)
                index += 1

        def on_result(m: Measurement) -> bool:
            book.record(m)  # even after the search stopped: it was measured with its group
            observe_known()
            return not searcher.done

        turn_of: list[tuple[str, int]] = []  # (candidate, turn) of the repeats in flight

        def on_repeat(m: Measurement) -> bool:
            ident = database.canonical(m.values)
            at = next(i for i, (c, _) in enumerate(turn_of) if c == ident)
            book.record(m, again=True, turn=turn_of.pop(at)[1])
            return True

        stopped = "complete"
        finalists: list[dict[str, Any]] = []
        for _ in range(
            finals.FINALISTS * finals.MAX_RUNS + 2
        ):  # every pass adds a run, or ends the loop
            observe_known()
            if not searcher.done:
                todo = [c for c in searcher.order[index:] if book.known(c) is None]
                # layouts: what is left is measured in the fitted model's order as it changes
                reorder = searcher.rank if layout_site is not None else None
                if measure(program, todo, on_result, deadline=deadline, reorder=reorder) == (
                    "budget"
                ):
                    stopped = "budget"
                    break
            if layout_site is None:
                break
            finalists = finals.leaders(searcher.order, book, searcher.favourite())
            again = finals.next_round(finalists, book)
            book.chosen = finals.winner(finalists, book)
            if again:
                assert predictions is not None  # a layout's search
                names = ", ".join(f"{predictions[database.canonical(c)].layout.name()}"
                                  for c in finalists)  # fmt: skip
                reporter.note(
                    f"timing the {len(finalists)} leading layouts again, in turns: {names}"
                )
                turn_of[:] = [(database.canonical(c), turn) for turn, c in again]
                todo = [c for _, c in again]
                if measure(program, todo, on_repeat, deadline=deadline) == "budget":
                    stopped = "budget"
                    break
                continue  # the leaders may change with their medians
            best, spread = finals.settled(finalists, book)
            if best is None:
                break
            searcher.settle(best, spread)  # a layout predicted within the spread is measured
            observe_known()
            if searcher.done:
                break
    if stopped != "budget":
        stopped = searcher.stop_reason
    book.finish()
    outcome = Outcome(
        db_path,
        book.record_,
        searcher.strategy,
        stopped,
        len(searcher.order),
        book.new,
        book.winner(),
        cspace,
        frozenset(book.measured_now),
        skipped,
        predictions,
        world_size,
        tuple(database.canonical(c) for c in finalists),
        finals.verdict(finalists, book),
        device=device,
    )
    reporter.summary(outcome, time.monotonic() - started)
    return outcome


def _probe(
    db: database.Database,
    source: str,
    code: str,
    source_path: Path,
    entry: str,
    in_source: bool,
    search_path: list[str],
    plan: Any,
    target: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The serial probe of the model: from the database when this source was probed on this
    target (None: any, ``macrogen plan``) by this probe's measures (``probe.MEASURES``), else
    run (on ``target``, else on CUDA when it is present)."""
    from macrogen.autotune import probe

    wanted = database.source_hash(source)
    found = stored_probe(db.records, wanted, entry, target)
    if found is not None:
        return found
    if target is None:
        import torch

        target = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        profile, shape = probe.run(
            code,
            source_path.name,
            entry,
            in_source,
            search_path,
            plan,
            target=target,
            progress=progress,
        )
    except probe.ProbeError as e:
        raise AutotuneError(
            f"{source_path}: probing the model for its layout failed: {e}"
        ) from None
    return {
        "profile": profile.__dict__,
        "shape": {**shape.__dict__, "divisible": dict(shape.divisible)},
        "source_hash": wanted,
        "measures": probe.MEASURES,
    }


def stored_probe(
    records: list[dict[str, Any]], source_hash: str, entry: str, target: str | None
) -> dict[str, Any] | None:
    """A probe stored for this source and entry, on ``target`` (None: any), of today's measures."""
    from macrogen.autotune.probe import MEASURES

    for record in records:
        found = record.get("layout_probe")
        key = record.get("key", {})
        if (
            isinstance(found, dict)
            and found.get("source_hash") == source_hash
            and found.get("measures") == MEASURES
            and key.get("entry") == entry
            and target in (None, key.get("target"))
        ):
            return found
    return None


def no_effect(param: space.Parameter, env: space.TuningEnv) -> str | None:
    """Why tuning ``param`` on ``env`` would measure nothing but noise; None if it matters
    (a macro's ``tuning_no_effect`` hook: measuring such an argument picks a "winner" from noise)."""
    if param.macro is None:
        return None  # a module constant: used by the user's own code
    from macrogen import macros
    from macrogen.expand.protocol import tuning_no_effect

    try:
        rule = tuning_no_effect(macros.get(param.macro))
    except (KeyError, ModuleNotFoundError):
        return None
    return None if rule is None or param.argument is None else rule(param.argument, env)


def _tuning_key(
    source_path: Path,
    entry: str,
    entry_hash: str,
    device: dict[str, str],
    params: tuple[space.Parameter, ...],
    site_hash: str,
    target: str,
    world_size: int,
) -> dict[str, Any]:
    """What makes two measurements comparable (database.KEY_FIELDS); the signature comes later."""
    return {
        "device": device,
        "entry": entry,
        "entry_hash": entry_hash,  # "" when the factory is in the tuned file (site_hash covers it)
        "file": source_path.name,
        "macrogen": __version__,
        "params": sorted(p.key for p in params),
        "signature": {},  # what the entry reports with its first measurement
        "site_hash": site_hash,
        "target": target,
        "world_size": world_size,
    }


def check_entry(entry: str) -> None:
    """AutotuneError unless ``entry`` reads ``module:factory`` (or ``:factory``)."""
    module, sep, factory = entry.partition(":")
    if not sep or not factory.isidentifier() or (module and not _dotted(module)):
        raise AutotuneError(
            f"--entry must be module:factory (e.g. bench_gpt:make_step, or :make_step for a factory in the tuned file), not {entry!r}"
        )


def _check_request(entry: str, world_size: int, max_trials: int) -> None:
    check_entry(entry)
    if world_size < 1:
        raise AutotuneError(f"--world-size must be at least 1, not {world_size}")
    if max_trials < 1:
        raise AutotuneError(f"--max-trials must be at least 1, not {max_trials}")


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


class _Book:
    """The database record of this tuning problem, kept current and saved after each change."""

    def __init__(
        self,
        db: database.Database,
        key: dict[str, Any],
        source: str,
        cspace: space.Space,
        retry_failed: bool,
    ):
        self.db, self.key, self.cspace = db, key, cspace
        self.source_hash = database.source_hash(source)
        found = db.find(key, ignore=("signature",))
        self.record_: dict[str, Any] | None = found[0] if found else None
        # failed candidates to measure again (--retry-failed), by canonical values
        self.retry = (
            {
                database.canonical(database.decode_values(c["values"]))
                for c in self.record_["candidates"]
                if "error" in c
            }
            if retry_failed and self.record_ is not None
            else set()
        )
        self.new = 0
        self.measured_now: set[str] = set()
        self.bumped = False  # the record's generation is raised once per run that changes it
        self.probe: dict[str, Any] | None = None  # layouts: the serial probe, kept in the record
        # layouts: the finals' winner (decided turn by turn, not by the lowest median)
        self.chosen: dict[str, Any] | None = None

    def known(self, values: Mapping[str, Any]) -> dict[str, Any] | None:
        if self.record_ is None:
            return None
        ident = database.canonical(values)
        if ident in self.retry:
            return None
        for c in self.record_["candidates"]:
            if database.canonical(database.decode_values(c["values"])) == ident:
                candidate: dict[str, Any] = c
                return candidate
        return None

    def record(self, m: Measurement, *, again: bool = False, turn: int | None = None) -> None:
        """Save ``m``; ``again``: a repeat of a measured candidate, kept beside its earlier
        times (``times``, and the finals' ``turn`` of each in ``turns``), the median of which is
        its ``time_s``."""
        if again and m.error is not None:
            return  # a failed repeat: the candidate keeps the times it has
        record = self._record_for(m.signature if m.error is None else None)
        entry: dict[str, Any] = {"values": database.encode_values(m.values)}
        before = self.known(m.values) if again else None
        if before is not None and "time_s" in before:
            times = [*before.get("times", [before["time_s"]]), float(f"{m.time_s:.6g}")]
            turns = [*before.get("turns", [None] * (len(times) - 1)), turn]
            m = replace(
                m,
                time_s=statistics.median(times),
                samples=m.samples + before.get("samples", 0),
                peak_bytes=tuple(map(max, m.peak_bytes, before.get("peak_bytes", m.peak_bytes))),
            )
            entry["times"] = times
            if any(t is not None for t in turns):
                entry["turns"] = turns
        if m.error is None:
            entry.update(time_s=float(f"{m.time_s:.6g}"), samples=m.samples)
            if m.signature != record["key"]["signature"]:
                entry["signature"] = m.signature
            if m.peak_bytes:
                entry["peak_bytes"] = list(m.peak_bytes)
            tokens = m.signature.get("tokens")
            if isinstance(tokens, (int, float)) and m.time_s:
                entry["tokens_s"] = float(f"{tokens / m.time_s:.6g}")
        else:
            entry["error"] = m.error
        ident = database.canonical(m.values)
        self.retry.discard(ident)
        self.measured_now.add(ident)
        record["candidates"] = [
            c
            for c in record["candidates"]
            if database.canonical(database.decode_values(c["values"])) != ident
        ] + [entry]
        self.new += 1
        self._update(record)

    def _record_for(self, signature: dict[str, Any] | None) -> dict[str, Any]:
        """This problem's record, made at its first measurement.

        Its key's signature is the first one the entry reported. A later
        candidate reporting another one (a shape that depends on the tuned
        value) stays in the same record with its own signature: what decides
        whether two runs are the same problem is the key's hashes of the file
        and the entry.
        """
        if self.record_ is None:
            self.record_ = self.db.new_record(
                {**self.key, "signature": signature or {}}, environment.versions()
            )
            self.bumped = True
        elif signature and not any("time_s" in c for c in self.record_["candidates"]):
            self.record_["key"]["signature"] = signature
        return self.record_

    def winner(self) -> dict[str, Any] | None:
        if self.record_ is None:
            return None
        allowed = {database.canonical(c) for c in self.cspace.candidates}
        timed = [
            c
            for c in self.record_["candidates"]
            if "time_s" in c and database.canonical(database.decode_values(c["values"])) in allowed
        ]
        if not timed:
            return None
        if self.chosen is not None and database.canonical(self.chosen) in allowed:
            return self.chosen
        best = min(timed, key=lambda c: (c["time_s"], database.canonical(c["values"])))
        return database.decode_values(best["values"])

    def _update(self, record: dict[str, Any]) -> None:
        winner = self.winner()
        encoded = None if winner is None else database.encode_values(winner)
        changed = record.get("winner") != encoded or record.get("source_hash") != self.source_hash
        record["winner"] = encoded
        record["source_hash"] = self.source_hash
        if self.probe is not None and record.get("layout_probe") != self.probe:
            record["layout_probe"] = self.probe
            changed = True
        if (changed or self.new) and not self.bumped:
            record["generation"] = self.db.next_generation()
            record["environment"] = environment.versions()
            self.bumped = True
        if changed or self.new:
            self.db.save(record)

    def finish(self) -> None:
        """Choices may have changed since the last run: re-pick the winner and claim this source."""
        if self.record_ is not None:
            self._update(self.record_)
