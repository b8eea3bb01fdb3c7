"""Autotuning of ``tunable`` parameters, and the tuning database ``expand`` reads.

    from macrogen.autotune import autotune
    outcome = autotune("gpt.py", entry="bench_gpt:make_step", world_size=2, budget=120)

``database`` is imported by ``expand`` and stays light; the tuner (torch,
rich, subprocesses) loads only when ``autotune`` is called.
"""

from __future__ import annotations

from typing import Any


def autotune(path: Any, **options: Any) -> Any:
    """Measure the candidates of every ``tunable`` in ``path``; see ``macrogen.autotune.tuner``."""
    from macrogen.autotune.tuner import autotune as run

    return run(path, **options)


__all__ = ["autotune"]
