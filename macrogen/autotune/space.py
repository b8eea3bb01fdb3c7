"""The candidate space: every combination of the tunables' choices a macro allows.

A candidate is a dict ``tunable key -> value``. The space is the product of the
``choices`` of every ``tunable`` of the file, minus the combinations a macro
rules out for this machine. A macro declares its rules with an optional
function in its module (the protocol's ``tuning_constraint`` hook)::

    def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
        '''The reason a combination can't run here, or None.'''

called for each site with a tunable argument, with every argument of the site
(keyword name, or position "0", "1"... -> value: the candidate's value for a
tunable one, the written value for the others). This module knows no macro.
Module-level ``tunable`` constants have no site, so no rule applies to them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from macrogen import macros
from macrogen.expand import Expansion
from macrogen.expand.context import SiteArguments
from macrogen.expand.protocol import Constraint, TuningEnv, tuning_constraint

__all__ = ["Constraint", "Parameter", "Space", "TuningEnv", "build", "parameters", "violation"]

# Beyond this many combinations the space is sampled (seeded), not enumerated.
MAX_ENUMERATED = 100_000


@dataclass(frozen=True)
class Parameter:
    """One tunable of the file."""

    key: str  # "BLOCK" (module constant) or "GPT.bucket_mb" (macro argument)
    default: Any
    choices: tuple[Any, ...]
    macro: str | None  # the macro whose argument it is; None for a module constant
    argument: str | None  # that argument's name ("bucket_mb"), or its position ("0")
    # every argument of its site, as written (None for a module constant)
    site: SiteArguments | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Space:
    parameters: tuple[Parameter, ...]
    candidates: tuple[dict[str, Any], ...]  # allowed ones; the all-defaults candidate first
    excluded: tuple[tuple[dict[str, Any], str], ...]  # (candidate, why) ruled out by a macro
    sampled: bool  # True when the product was too large to enumerate

    @property
    def default(self) -> dict[str, Any]:
        return {p.key: p.default for p in self.parameters}


def parameters(expansion: Expansion) -> tuple[Parameter, ...]:
    """The file's tunables, each with the site whose argument it is."""
    owner = {key: (site, arg) for site in expansion.arguments for arg, key in site.tunables.items()}
    out = []
    for t in expansion.tunables.values():
        site, argument = owner.get(t.key, (None, None))
        macro = site.macro if site is not None else None
        out.append(Parameter(t.key, t.default, tuple(t.choices), macro, argument, site))
    return tuple(out)


def build(params: tuple[Parameter, ...], env: TuningEnv, *, seed: int = 0) -> Space:
    size = math.prod(len(p.choices) for p in params)
    combos: Iterable[tuple[Any, ...]]
    if size <= MAX_ENUMERATED:
        combos = itertools.product(*(p.choices for p in params))
    else:
        rng = random.Random(seed)
        combos = (tuple(rng.choice(p.choices) for p in params) for _ in range(MAX_ENUMERATED))
    default = {p.key: p.default for p in params}
    seen = set()
    allowed, excluded = [], []
    for combo in itertools.chain([tuple(default.values())], combos):
        candidate = dict(zip((p.key for p in params), combo))
        ident = repr(sorted(candidate.items()))
        if ident in seen:
            continue
        seen.add(ident)
        reason = violation(params, candidate, env)
        if reason is None:
            allowed.append(candidate)
        else:
            excluded.append((candidate, reason))
    return Space(params, tuple(allowed), tuple(excluded), size > MAX_ENUMERATED)


def violation(
    params: tuple[Parameter, ...], candidate: Mapping[str, Any], env: TuningEnv
) -> str | None:
    """Why a macro rules this candidate out, or None."""
    sites: dict[str, SiteArguments] = {}
    for p in params:
        if p.site is not None:
            sites.setdefault(p.site.qualname, p.site)
    for qualname, site in sorted(sites.items()):
        constraint = constraint_for(site.macro)
        if constraint is None:
            continue
        arguments = dict(site.values)
        for argument, key in site.tunables.items():
            if key in candidate:
                arguments[argument] = candidate[key]
        reason = constraint(arguments, env)
        if reason is not None:
            return f"{qualname}: {reason}"
    return None


def constraint_for(macro: str) -> Constraint | None:
    try:
        return tuning_constraint(macros.get(macro))
    except KeyError:
        return None
