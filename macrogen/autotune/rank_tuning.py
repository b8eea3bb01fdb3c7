"""One rank's tuning values in a job on several device kinds (the import hook's lookup).

Records are keyed by device kind and ``macrogen autotune`` measures each kind, so a
database may hold an H100's winners beside an A100's. When they disagree, what a rank
takes depends on what the tunable feeds:

- **per device**: an argument whose macro says it shapes only the rank's own computation
  (``tuning_per_device``: ``@tile``'s tile sizes, warps and stages, a Triton kernel's
  constexprs). Each rank takes its own kind's winner (``database.winners(...,
  device=environment.rank_device(...))``).
- **job-wide**: everything else (a bucket size, a layout, a tensor-parallel size, a
  module constant whose uses are unknown). Ranks that disagree on one all-reduce buffers
  of different sizes or build different meshes, so every rank takes the same value: the
  newest record's (what ``macrogen expand`` writes), and a warning says so; or the winner
  of the kind ``MACROGEN_TUNING_DEVICE`` names (a job on one kind of several recorded).

When the kinds agree (or the database names one kind), nothing here looks at the device.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the hook imports this module on every import: libcst only when used
    from macrogen.autotune.space import Parameter


@dataclass(frozen=True)
class RankTuning:
    """What the database says for one file on this rank, before the file is expanded."""

    shared: dict[str, Any]  # the job's values: the same on every rank
    stale: list[str]  # keys whose records are for another source text
    # keys whose winner depends on the device kind: each recorded kind with its value
    differ: dict[str, list[tuple[dict[str, Any], Any]]] = field(default_factory=dict)
    own: dict[str, Any] = field(default_factory=dict)  # this rank's kind's values of those keys
    device: dict[str, Any] | None = None  # this rank's kind; None when the kinds agree
    chosen: bool = False  # the job's kind was named (MACROGEN_TUNING_DEVICE), not the newest
    notes: tuple[str, ...] = ()  # what the lookup could not do, for a warning

    def key(self) -> dict[str, Any]:
        """What the expansion and its warnings depend on (the import cache's key), known
        before expanding."""
        if self.device is None:
            return self.shared
        return {
            "shared": self.shared,
            "own": self.own,
            "differ": self.differ,
            "chosen": self.chosen,
        }

    def tag(self) -> str | None:
        """A short name for this rank's device kind (its own cache entry); None: no kind."""
        if self.device is None:
            return None
        text = json.dumps(self.device, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def lookup(
    path: Path, source: str, *, file: str, target: str | None, job_device: str | None = None
) -> RankTuning:
    """The database's values for ``file`` on this rank. The job's values are the newest
    record's, or those of the kind named ``job_device`` (a device name as recorded); this
    rank's device is asked for only when the recorded kinds disagree. ValueError or OSError
    for a bad database."""
    from macrogen.autotune import database, environment

    records = database.file_records(path, file=file, target=target)
    notes = []
    job_kind = None if job_device is None else database.kind_named(records, job_device)
    if job_device is not None and job_kind is None and records:
        notes.append(
            f"macrogen: warning: MACROGEN_TUNING_DEVICE={job_device!r}: no record of {file}"
            f" names it (recorded: {database.kind_names(records)}); using the newest record's"
            " values"
        )
    shared, stale = database.resolve(records, source, job_kind)
    differ = database.differing(records, source)
    chosen = job_kind is not None
    if not differ:
        return RankTuning(shared, stale, chosen=chosen, notes=tuple(notes))
    try:
        device = environment.rank_device(target)
    except (RuntimeError, ValueError) as e:  # no usable GPU, a bad LOCAL_RANK: the job's values
        notes.append(
            f"macrogen: warning: can't tell this rank's device ({e}); {file} takes the job's"
            " tuning values on this rank"
        )
        return RankTuning(shared, stale, chosen=chosen, notes=tuple(notes))
    mine, _ = database.resolve(records, source, device)
    own = {key: mine[key] for key in differ if key in mine}
    return RankTuning(shared, stale, differ, own, device, chosen, tuple(notes))


def choose(
    tuning: RankTuning, parameters: tuple[Parameter, ...]
) -> tuple[dict[str, Any], list[str]]:
    """The values to expand with, given which macro argument each tunable feeds; and one
    warning per job-wide key the kinds disagree on (unless the job's kind was named)."""
    from macrogen.autotune import database

    feeds = {p.key: p for p in parameters}
    values = dict(tuning.shared)
    warnings = []
    for key, per_kind in sorted(tuning.differ.items()):
        p = feeds.get(key)
        if p is not None and key in tuning.own and per_device(p):
            values[key] = tuning.own[key]
            continue
        if key not in values or tuning.chosen:
            continue
        warnings.append(
            f"macrogen: warning: tuning entry {key!r} differs by device kind"
            f" ({database.per_kind_text(per_kind)}); every rank"
            f" uses {values[key]!r}, the newest record's, as ranks that disagree on it would"
            " exchange mismatched data (MACROGEN_TUNING_DEVICE=NAME names the kind to use)"
        )
    return values, warnings


def per_device(parameter: Parameter) -> bool:
    """Whether a rank may take its own kind's winner for ``parameter`` (see the docstring)."""
    from macrogen import macros
    from macrogen.expand.protocol import tuning_per_device

    if parameter.macro is None or parameter.argument is None:
        return False  # a module constant: its uses are unknown
    try:
        rule = tuning_per_device(macros.get(parameter.macro))
    except KeyError:
        return False
    return rule is not None and rule(parameter.argument)
