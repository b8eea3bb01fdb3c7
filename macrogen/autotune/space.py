"""The candidate space: every combination of the tunables' choices a macro allows.

A candidate is a dict ``tunable key -> value``. The space is the product of the
``choices`` of every ``tunable`` of the file, minus the combinations a macro
rules out for this machine. A macro declares its rules with an optional
function in its module::

    def tuning_constraint(arguments: Mapping[str, Any], env: TuningEnv) -> str | None:
        '''The reason a combination can't run here, or None.'''

called with the site's tunable arguments (argument name -> value). Macros that
declare none get the built-in rules below (a tensor-parallel size must divide
the world size; a Triton tile must fit in one Triton block). Module-level
``tunable`` constants have no macro, so no rule applies to them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from macrogen import macros
from macrogen.expand import Expansion

# Beyond this many combinations the space is sampled (seeded), not enumerated.
MAX_ENUMERATED = 100_000
# Triton's largest block (triton.language.TRITON_MAX_TENSOR_NUMEL).
TRITON_MAX_BLOCK_NUMEL = 1 << 20


@dataclass(frozen=True)
class TuningEnv:
    """What a constraint may depend on."""

    target: str  # "cpu" or "cuda": the device the candidates run on
    world_size: int  # ranks per measured run
    device_name: str


@dataclass(frozen=True)
class Parameter:
    """One tunable of the file."""

    key: str  # "BLOCK" (module constant) or "GPT.bucket_mb" (macro argument)
    default: Any
    choices: tuple[Any, ...]
    macro: str | None  # the macro whose argument it is; None for a module constant
    argument: str | None  # that argument's name ("bucket_mb"), or its position ("0")


Constraint = Callable[[Mapping[str, Any], TuningEnv], "str | None"]


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
    """The file's tunables, each with the macro whose argument it is (by source position)."""
    sites = sorted(expansion.sites, key=lambda s: s[1])
    out = []
    for t in expansion.tunables.values():
        macro = argument = None
        if "." in t.key:  # a macro argument: "<site qualname>.<argument>"
            enclosing = [m for m, line in sites if line <= t.line]
            macro = enclosing[-1] if enclosing else None
            argument = t.key.rsplit(".", 1)[1]
        out.append(Parameter(t.key, t.default, tuple(t.choices), macro, argument))
    return tuple(out)


def build(params: tuple[Parameter, ...], env: TuningEnv, *, seed: int = 0) -> Space:
    size = math.prod(len(p.choices) for p in params)
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


def violation(params: tuple[Parameter, ...], candidate: Mapping[str, Any], env: TuningEnv):
    """Why a macro rules this candidate out, or None."""
    by_site: dict[tuple[str, str], dict[str, Any]] = {}
    for p in params:
        if p.macro is not None and p.argument is not None:
            site = p.key.rsplit(".", 1)[0]
            by_site.setdefault((p.macro, site), {})[p.argument] = candidate[p.key]
    for (macro, site), arguments in sorted(by_site.items()):
        reason = constraint_for(macro)(arguments, env)
        if reason is not None:
            return f"{site}: {reason}"
    return None


def constraint_for(macro: str) -> Constraint:
    try:
        declared = getattr(macros.get(macro), "tuning_constraint", None)
    except (KeyError, ImportError):
        declared = None
    if declared is not None:
        return declared
    return BUILTIN.get(macro, _no_constraint)


def _no_constraint(arguments: Mapping[str, Any], env: TuningEnv) -> str | None:
    return None


# -- built-in rules for macros that declare none ----------------------------------
_PARALLEL_SIZE_ARGUMENTS = ("size", "tp", "tp_size", "degree", "tensor_parallel_size")
_NOT_TILE_ARGUMENTS = ("num_warps", "num_stages")


def tensor_parallel_divides_world(arguments: Mapping[str, Any], env: TuningEnv) -> str | None:
    for name in _PARALLEL_SIZE_ARGUMENTS:
        size = arguments.get(name)
        if isinstance(size, int) and (size < 1 or env.world_size % size):
            return f"{name}={size} does not divide the world size {env.world_size}"
    return None


def tile_fits_a_triton_block(arguments: Mapping[str, Any], env: TuningEnv) -> str | None:
    tiles = {
        k: v
        for k, v in arguments.items()
        if k not in _NOT_TILE_ARGUMENTS and isinstance(v, int) and not isinstance(v, bool)
    }
    if env.target != "cuda" or not tiles:
        return None  # the CPU path is vectorized torch: any tile runs
    numel = math.prod(tiles.values())
    if numel > TRITON_MAX_BLOCK_NUMEL:
        return f"a {'x'.join(map(str, tiles.values()))} tile has {numel} elements, more than Triton's {TRITON_MAX_BLOCK_NUMEL}"
    return None


BUILTIN: dict[str, Constraint] = {
    "tensor_parallel": tensor_parallel_divides_world,
    "tile": tile_fits_a_triton_block,
}
