"""The tuning database: one JSON file of measured candidates and their winners.

The file is meant to be read, diffed and committed next to the source it tunes
(by default ``macrogen_tuning.json`` in the source's directory)::

    {
      "format": "macrogen-tuning",
      "version": 2,
      "records": [
        {
          "key": {"device": {"kind": "cpu", "name": "..."}, "entry": "bench:make_step",
                  "entry_hash": "...", "file": "gpt.py", "macrogen": "0.1.0",
                  "params": ["GPT.bucket_mb"], "signature": {}, "site_hash": "...",
                  "target": "cpu", "world_size": 2},
          "source_hash": "...",           # the exact source the winner was chosen for
          "generation": 3,                # larger = tuned more recently
          "candidates": [{"values": {"GPT.bucket_mb": 4}, "time_s": 0.0121, "samples": 10},
                         {"values": {"GPT.bucket_mb": 64}, "error": "RuntimeError: ..."}],
          "winner": {"GPT.bucket_mb": 4},
          "environment": {"python": "3.11.9", "torch": "2.13.0", ...}
        }
      ]
    }

One record is one tuning problem: a file's tunables, measured through one entry
on one kind of device and world size. Its ``site_hash`` hashes the source with
every ``tunable(...)`` call's arguments blanked out, so editing a ``choices``
list keeps the measurements already taken (only new choices are measured),
while ``source_hash`` is the file's exact hash: ``expand`` uses a winner only
when it matches, and reports the entry as stale otherwise.

Values that JSON can't hold exactly (tuples, sets, complex numbers) are stored
as ``{"python": "<repr>"}`` and read back with ``ast.literal_eval``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import libcst as cst

from macrogen.files import write_atomic

FORMAT = "macrogen-tuning"
FORMAT_VERSION = 2
DEFAULT_NAME = "macrogen_tuning.json"
KEY_FIELDS = (
    "device",
    "entry",
    "entry_hash",
    "file",
    "macrogen",
    "params",
    "signature",
    "site_hash",
    "target",
    "world_size",
)


def default_path(source: Path) -> Path:
    """Where ``autotune`` writes and ``expand`` looks when no ``--tuning`` is given."""
    return source.parent / DEFAULT_NAME


# -- hashes -----------------------------------------------------------------------
def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def site_hash(text: str) -> str:
    """The source's hash with the arguments of every ``tunable(...)`` blanked out.

    What a measurement depends on is the program, not the list of values it may
    take: adding a choice must not throw away the choices already measured.
    """
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return source_hash(text)
    blanked = module.visit(_BlankTunables(_tunable_names(module)))
    return source_hash(blanked.code)


def _tunable_names(module: cst.Module) -> set[str]:
    names = {"tunable"}
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    if alias.asname is None or getattr(alias.name, "value", "") != "tunable":
                        continue
                    asname = alias.asname.name  # a Name: `import ... as (a, b)` is no syntax
                    if isinstance(asname, cst.Name):
                        names.add(asname.value)
    return names


class _BlankTunables(cst.CSTTransformer):
    def __init__(self, names: set[str]):
        self.names = names

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        name = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", None)
        if name in self.names:
            return updated.with_changes(args=[])
        return updated


# -- values -----------------------------------------------------------------------
def encode_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return value
    return {"python": repr(value)}


def decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"python"}:
        text = value["python"]
        if not isinstance(text, str):
            raise ValueError(f"{{'python': ...}} must hold a string, not {text!r}")
        try:
            return ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise ValueError(f"{text[:80]!r} is not a Python literal") from None
    if isinstance(value, dict):
        raise ValueError(f"a value is a JSON value or {{'python': '<literal>'}}, not {value!r}")
    return value


def encode_values(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: encode_value(v) for k, v in sorted(values.items())}


def decode_values(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: decode_value(v) for k, v in values.items()}


def canonical(values: Mapping[str, Any]) -> str:
    """One string per candidate: how candidates are compared and sorted."""
    return json.dumps(encode_values(values), sort_keys=True)


def _natural(values: Mapping[str, Any]) -> list[tuple[str, int, Any]]:
    """Sort numbers as numbers (1, 4, 16), everything else by its repr."""
    return [
        (k, 0, v) if isinstance(v, (int, float)) and not isinstance(v, bool) else (k, 1, repr(v))
        for k, v in sorted(values.items())
    ]


# -- the file -----------------------------------------------------------------------
def load(path: Path) -> dict[str, Any]:
    """The database at ``path`` (empty if there is none); ValueError naming the file and the record if malformed."""
    raw = read_regular(path)
    if raw is None:
        return {"format": FORMAT, "version": FORMAT_VERSION, "records": []}
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a macrogen tuning database (nested too deeply)") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not isinstance(data.get("records"), list)
    ):
        raise ValueError(f"{path}: not a macrogen tuning database")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: tuning database version {data.get('version')!r}; this macrogen reads version"
            f" {FORMAT_VERSION} (re-run macrogen autotune)"
        )
    for i, record in enumerate(data["records"]):
        problem = _record_problem(record)
        if problem is not None:
            raise ValueError(
                f"{path}: record {i + 1} of {len(data['records'])}: {problem}"
                " (fix or remove the record, or delete the file and run macrogen autotune again)"
            )
        # What a record may leave out (a hand-written winner): nothing measured yet.
        record.setdefault("candidates", [])
        record["key"].setdefault("signature", {})
    return data


def kind(path: Path) -> str | None:
    """None if ``path`` is a regular file (or a link to one); else what it is, for a message."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return f"can't be examined ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return f"{what}, not a regular file"
    return "not a regular file"


def read_regular(path: Path) -> bytes | None:
    """The bytes of the file at ``path``; None if there is none; ValueError if it is no regular file.

    Opened without blocking and checked on the descriptor: a FIFO (or a device)
    named like a database would otherwise hang the reader until someone writes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ValueError(f"{path}: a directory, not a regular file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: {kind(path) or 'not a regular file'}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """The JSON value of the regular file at ``path`` (a config, a spec, a device table);
    ValueError naming the file for anything else: no such file, a FIFO or a directory (never
    a wait for a writer), an unreadable file, bytes that are not UTF-8 JSON, nesting deeper
    than the parser's recursion."""
    try:
        data = read_regular(path)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    if data is None:
        raise ValueError(f"{path}: no such file")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def _record_problem(record: Any) -> str | None:
    """What is wrong with one record's structure, or None."""
    if not isinstance(record, dict):
        return f"a record is a JSON object, not {type(record).__name__}"
    if not isinstance(record.get("key"), dict):
        return 'no "key" object'
    if not isinstance(record["key"].get("signature", {}), dict):
        return '"key"."signature" must be an object'
    generation = record.get("generation", 0)
    if not isinstance(generation, int) or isinstance(generation, bool):
        return f'"generation" must be a whole number, not {generation!r}'
    if not isinstance(record.get("source_hash"), (str, type(None))):
        return '"source_hash" must be a string'
    candidates = record.get("candidates", [])
    if not isinstance(candidates, list) or not all(
        isinstance(c, dict) and isinstance(c.get("values"), dict) for c in candidates
    ):
        return '"candidates" must be a list of objects with "values"'
    for c in candidates:
        if "error" in c and not isinstance(c["error"], str):
            return f'"error" must be a string, not {c["error"]!r}'
        if "time_s" in c and (
            not isinstance(c["time_s"], (int, float)) or isinstance(c["time_s"], bool)
        ):
            return f'"time_s" must be a number, not {c["time_s"]!r}'
    winner = record.get("winner")
    if winner is not None and not isinstance(winner, dict):
        return f'"winner" must be an object of tunable values or null, not {winner!r}'
    for values in [winner or {}] + [c["values"] for c in candidates]:
        try:
            decode_values(values)
        except ValueError as e:
            return str(e)
    return _layout_problem(record)


# the mg.parallelize arguments a layout is made of (a tuning key ``<site>.<argument>``)
_LAYOUT_ARGUMENTS = ("layout", "tp", "pp", "dp", "microbatches", "recompute")


def _layout_problem(record: Mapping[str, Any]) -> str | None:
    """A winner that is a parallel layout the layout rules refuse (``layouts.problem``) on the
    record's world size, for its model as probed (``layout_probe``): a record edited by hand
    to name one is an error here, at expansion, not a failure at run time on every rank."""
    from macrogen.autotune import layouts

    winner = decode_values(record.get("winner") or {})
    sites: dict[str, dict[str, Any]] = {}
    for key, value in winner.items():
        site, _, argument = key.rpartition(".")
        if site and argument in _LAYOUT_ARGUMENTS:
            sites.setdefault(site, {})[argument] = value
    probe = record.get("layout_probe")
    if not sites or (probe is None and not any("layout" in v for v in sites.values())):
        return None  # no layout: a layout record is one autotune probed, or a layout="auto"
    world = record["key"].get("world_size", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return f'"key"."world_size" must be a whole number of ranks, not {world!r}'
    shape, written = None, None
    if probe is not None:
        try:
            shape = layouts.ModelShape(**probe["shape"])
            written = decode_values(probe.get("arguments", {}))
        except (TypeError, KeyError, ValueError):
            return '"layout_probe" is not a probe macrogen autotune wrote'
        if not isinstance(shape.divisible, dict) or not all(
            isinstance(v, int) and v > 0 for v in shape.divisible.values()
        ):
            return '"layout_probe"."shape" is not a probe macrogen autotune wrote'
    for site, chosen in sorted(sites.items()):
        arguments = {**(written or {}), **chosen}
        layout = layouts.from_arguments(arguments)
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(chosen.items()))
        if layout is None:
            if "layout" in chosen:
                return f"the winner {shown} for {site} is not a layout"
            continue  # dp="none" and the like: no layout the rules model
        if layout.pp == 1:
            layout = dataclasses.replace(layout, microbatches=1)
        reason = layouts.problem(layout, world, shape, arguments if written else None)
        if reason is not None:
            return f"the winner {shown} for {site} cannot run on {world} ranks: {reason}"
        if probe is None:  # autotune writes it with every layout="auto" winner; the rules
            # of the model's shape and the site's arguments (zero1, the heads) need it
            return f'the winner {shown} for {site} comes without its "layout_probe"'
    return None


def dumps(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _identity(record: Mapping[str, Any]) -> str:
    """Which tuning problem a record is (its key; the signature is filled in later)."""
    key = {k: v for k, v in record["key"].items() if k != "signature"}
    return json.dumps(key, sort_keys=True, default=repr)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the database's folder (fcntl), held for one read-merge-write.

    The folder, not the file, because the file is replaced by a rename at every save.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class Database:
    """The records of one file, saved atomically after every change.

    Several processes may tune into one file at once (``macrogen autotune a.py``
    and ``b.py``): every save locks the file's folder, reads the file again,
    replaces only the records this process changed, and writes the result, so
    each run keeps the others' records.
    """

    def __init__(self, path: Path):
        self.path = path
        self.data = load(path)
        self._mine: dict[int, dict[str, Any]] = {}  # records this process created or changed

    @property
    def records(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self.data["records"]
        return records

    def find(self, key: Mapping[str, Any], *, ignore: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Records whose key equals ``key`` on every field but ``ignore``; newest first."""
        fields = [f for f in KEY_FIELDS if f not in ignore]
        found = [r for r in self.records if all(r["key"].get(f) == key.get(f) for f in fields)]
        return sorted(found, key=lambda r: -r.get("generation", 0))

    def new_record(self, key: Mapping[str, Any], environment: Mapping[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {
            "key": dict(key),
            "source_hash": None,
            "generation": self.next_generation(),
            "candidates": [],
            "winner": None,
            "environment": dict(environment),
        }
        self.records.append(record)
        self._mine[id(record)] = record
        return record

    def next_generation(self) -> int:
        return 1 + max((r.get("generation", 0) for r in self.records), default=0)

    def save(self, *changed: dict[str, Any]) -> None:
        """Write the records this process created, and ``changed``, merged into the file as it is now."""
        for record in changed:
            self._mine[id(record)] = record
        with _locked(self.path):
            mine = list(self._mine.values())
            ours = {_identity(r) for r in mine}
            on_disk = load(self.path)
            others = [r for r in on_disk["records"] if _identity(r) not in ours]
            self.data = {**on_disk, "records": others + mine}
            self.records.sort(key=lambda r: json.dumps(r["key"], sort_keys=True))
            for record in self.records:
                record["candidates"].sort(key=lambda c: _natural(decode_values(c["values"])))
            write_atomic(self.path, dumps(self.data).encode("utf-8"))


# -- what expand reads --------------------------------------------------------------------
def winners(
    path: Path,
    source: str,
    *,
    file: str,
    target: str | None = None,
    device: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The winning value per tunable key of ``file`` (its name as recorded); and the stale keys skipped.

    Several records may tune the same file (other devices, world sizes): the one
    tuned most recently wins. A record for another source text is stale. Given
    ``device`` (a rank's device kind, as ``environment.device_kinds`` names it), a
    rank of a mixed job resolves its own kind's records first: those keyed by that kind
    (name, capability, memory, link), then those of a device of its name, then of its
    kind of device (CUDA, CPU), then any.
    """
    return resolve(file_records(path, file=file, target=target), source, device)


def file_records(path: Path, *, file: str, target: str | None = None) -> list[dict[str, Any]]:
    """The records of ``file`` (of ``target``, when given) that have a winner."""
    return [
        r
        for r in load(path)["records"]
        if r["key"].get("file") == file
        and r.get("winner") is not None
        and (target is None or r["key"].get("target") in (None, target))
    ]


def resolve(
    records: list[dict[str, Any]], source: str, device: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``winners`` over ``file_records``: each key's value from the record nearest to
    ``device`` (newest first among equals); and the stale keys."""
    digest = source_hash(source)
    values: dict[str, Any] = {}
    stale: set[str] = set()
    ordered = sorted(
        records, key=lambda r: (_distance(r["key"].get("device"), device), -r.get("generation", 0))
    )
    for record in ordered:
        if record.get("source_hash") != digest:
            stale.update(record["winner"])
            continue
        for key, value in decode_values(record["winner"]).items():
            values.setdefault(key, value)
    return values, sorted(stale - set(values))


def kinds(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The device kinds ``records`` are keyed by, newest first."""
    found: dict[str, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: -r.get("generation", 0)):
        recorded = record["key"].get("device")
        if isinstance(recorded, dict):
            found.setdefault(json.dumps(recorded, sort_keys=True, default=repr), recorded)
    return list(found.values())


def kind_named(records: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The newest recorded kind whose device name is ``name`` (any case), else None."""
    return next((k for k in kinds(records) if str(k.get("name", "")).lower() == name.lower()), None)


def kind_names(records: list[dict[str, Any]]) -> str:
    """The device names ``records`` are keyed by, for a message: "'A100', 'H100'"."""
    return ", ".join(sorted({repr(str(k.get("name"))) for k in kinds(records)}))


def per_kind_text(per_kind: list[tuple[dict[str, Any], Any]]) -> str:
    """One entry of ``differing``, for a message: "A100: 16, H100: 32"."""
    return ", ".join(f"{kind.get('name', '?')}: {value!r}" for kind, value in per_kind)


def differing(
    records: list[dict[str, Any]], source: str
) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """The tunable keys whose winner depends on the device kind: for each, every recorded
    kind (newest first) with the value a rank of that kind resolves (``resolve(...,
    device=kind)``). Empty when the records name one kind, or their kinds agree."""
    resolved = [(kind, resolve(records, source, kind)[0]) for kind in kinds(records)]
    out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for key in sorted({key for _, values in resolved for key in values}):
        per_kind = [(kind, values[key]) for kind, values in resolved if key in values]
        if len({canonical({key: value}) for _, value in per_kind}) > 1:
            out[key] = per_kind
    return out


def _distance(recorded: Any, device: Mapping[str, Any] | None) -> int:
    """How far a record's device is from the rank's: 0 its kind, 1 its name, 2 its kind of
    device (a CUDA record for a GPU the database has no record of), 3 another."""
    if device is None or not isinstance(recorded, dict):
        return 0 if device is None else 3
    if all(recorded.get(k) == v for k, v in device.items()) and set(recorded) == set(device):
        return 0
    if all(recorded.get(k) == device.get(k) for k in ("kind", "name")):
        return 1
    return 2 if recorded.get("kind") == device.get("kind") else 3
