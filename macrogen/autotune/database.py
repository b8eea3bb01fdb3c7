"""The tuning database: one JSON file of measured candidates and winners.

``expand`` needs one thing from it: the winning value of each tunable key of a
source file, for the current target. Entries whose source hash differs from the
file's are stale and ignored (with a warning from the caller).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"version": FORMAT_VERSION, "records": []}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a macrogen tuning database (version {FORMAT_VERSION})")
    return data


def winners(
    path: Path, source: str, *, file: str, target: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The winning value per tunable key of ``file`` (its name as recorded); and the stale keys skipped."""
    digest = source_hash(source)
    values: dict[str, Any] = {}
    stale: list[str] = []
    for record in load(path).get("records", []):
        if record.get("file") != file:
            continue
        if "winner" not in record or record.get("winner") is None:
            continue
        if target is not None and record.get("target") not in (None, target):
            continue
        if record.get("source_hash") != digest:
            stale.append(record.get("key", "?"))
            continue
        values[record["key"]] = record["winner"]
    return values, stale
