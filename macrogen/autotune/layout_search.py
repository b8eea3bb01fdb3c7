"""Autotuning an ``mg.parallelize`` layout: prune, predict, measure the best first, stop early.

    candidates --same layout?--> one each --probe--> shape and memory rules --> feasible
    feasible --cost model--> order (predicted best first) --measure--> fit --> re-rank the rest
    by the fit --> stop when no remaining layout's fitted prediction beats the measured best by
    more than the noise

A candidate is a dict of tunable values; ``layout_of`` reads the site's
arguments with them in place (``layout="auto"``'s name, or the degrees).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from macrogen.autotune import cost, database, layouts, memory
from macrogen.autotune.layouts import Layout, ModelShape
from macrogen.autotune.memory import Profile
from macrogen.autotune.space import Parameter, Space
from macrogen.expand.context import SiteArguments

ARGUMENTS = ("tp", "pp", "dp", "microbatches", "ep", "layout")
# the most the finals' measured spread widens the search by: a layout predicted up to this
# much slower than the winner is still measured
MAX_REACH = 0.2


def site_of(params: tuple[Parameter, ...]) -> SiteArguments | None:
    """The ``mg.parallelize`` site whose degrees are tuned, if any."""
    for p in params:
        if p.macro == "parallelize" and p.argument in ARGUMENTS and p.site is not None:
            return p.site
    return None


def arguments_of(site: SiteArguments, candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The site's arguments with the candidate's values in place of its tunables."""
    arguments = dict(site.values)
    for argument, key in site.tunables.items():
        if key in candidate:
            arguments[argument] = candidate[key]
    return arguments


def layout_of(site: SiteArguments, candidate: Mapping[str, Any]) -> Layout | None:
    layout = layouts.from_arguments(arguments_of(site, candidate))
    if layout is not None and layout.pp == 1:
        layout = replace(layout, microbatches=1)  # micro-batches change nothing without stages
    return layout


def machine_for(target: str, world: int) -> cost.Machine:
    """This machine: gloo over loopback on CPU (ranks share the cores), one node on CUDA."""
    if target == "cpu":
        # torchrun gives each of several ranks OMP_NUM_THREADS=1 unless it is set
        try:
            threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))) if world > 1 else 1
        except ValueError:
            threads = 1
        slowdown = max(1.0, world * threads / (os.cpu_count() or 1))
        one = world > 1 and threads == 1
        return cost.Machine(world, cost.GLOO_LOCAL, cost.GLOO_LOCAL, slowdown, one_thread=one)
    nvlink = cost.Link("nvlink", 300e9)
    return cost.Machine(world, nvlink, nvlink)


@dataclass
class Prediction:
    layout: Layout
    step: cost.Step
    memory: memory.Breakdown


def prepare(
    cspace: Space,
    site: SiteArguments,
    profile: Profile,
    shape: ModelShape,
    world: int,
    machine: cost.Machine,
    memory_limit: float | None = None,
) -> tuple[Space, dict[str, Prediction]]:
    """The feasible candidates, one per layout, ordered by predicted step time; the rest with why."""
    kept: list[tuple[float, dict[str, Any]]] = []
    excluded = list(cspace.excluded)
    seen: dict[Layout, str] = {}
    predictions: dict[str, Prediction] = {}
    for candidate in cspace.candidates:
        layout = layout_of(site, candidate)
        if layout is None:
            excluded.append((candidate, "not a layout the models know (dp='none'?)"))
            continue
        if layout in seen:
            excluded.append((candidate, f"the same layout as {seen[layout]}"))
            continue
        seen[layout] = layout.name()
        reason = layouts.problem(layout, world, shape, arguments_of(site, candidate))
        mem = memory.predict(profile, layout, world)
        if reason is None and memory_limit is not None and mem.total > memory_limit:
            reason = (
                f"predicted {memory.format_bytes(mem.total)} per rank, over"
                f" {memory.format_bytes(memory_limit)}"
            )
        if reason is not None:
            excluded.append((candidate, reason))
            continue
        step = cost.predict(profile, layout, world, machine)
        predictions[database.canonical(candidate)] = Prediction(layout, step, mem)
        kept.append((step.total, candidate))
    kept.sort(key=lambda item: item[0])
    ordered = tuple(c for _, c in kept)
    return Space(cspace.parameters, ordered, tuple(excluded), cspace.sampled), predictions


@dataclass
class LayoutSearch:
    """``search.Search``'s interface: the predicted best first, early stopping on the fit.

    ``order`` is measured from the front; from two measurements on, what is left of it
    is re-sorted by the fitted model after each one (``rank`` hands the worker that order).
    """

    order: list[dict[str, Any]]
    predictions: dict[str, Prediction]
    noise: float = 0.05  # a layout must be predicted this much faster than the best to be measured
    # ... or, once the finals measured the winner's spread, predicted within it (slower by up to
    # this share): the winner's own runs say how far one measurement may be from another
    reach: float = 0.0
    strategy: str = "cost model"
    patience: int | None = None
    best: float | None = None
    seen: list[float | None] = field(default_factory=list)
    fitted: cost.Fit = field(default_factory=cost.Fit)

    def observe(self, time_s: float | None) -> None:
        self.seen.append(time_s)
        if time_s is not None and (self.best is None or time_s < self.best):
            self.best = time_s
        points = [
            (self.predictions[database.canonical(c)].step, t)
            for c, t in zip(self.order, self.seen)
            if t is not None
        ]
        self.fitted = cost.fit(points)
        if len(points) >= 2:  # the fit ranks what is left (one point only scales the raw model)
            rest = sorted(self.order[len(self.seen) :], key=self.predicted)
            missing = self._unmeasured_kinds()
            # the best of a kind not measured yet goes first (see ``done``), by the raw model:
            # a fit to the other kind alone is what can't be trusted for it (fitted to two
            # pipelines, tensor parallel's collectives came out nearly free)
            first = [min((c for c in rest if self._kind(c) == k), key=self._raw) for k in missing]
            self.order[len(self.seen) :] = first + [c for c in rest if c not in first]

    def _raw(self, candidate: Mapping[str, Any]) -> float:
        return self.predictions[database.canonical(candidate)].step.total

    def _kind(self, candidate: Mapping[str, Any]) -> bool:
        """Whether the layout has pipeline stages: the two kinds the search measures both of."""
        return self.predictions[database.canonical(candidate)].layout.pp > 1

    def _unmeasured_kinds(self) -> list[bool]:
        """The kinds none of whose layouts is measured yet and some not tried (False first)."""
        measured = {self._kind(c) for c, t in zip(self.order, self.seen) if t is not None}
        offered = {self._kind(c) for c in self.order[len(self.seen) :]}
        return sorted(offered - measured)

    def settle(self, best: float, spread: float) -> None:
        """The finals' word: the winner's median, and its runs' spread relative to it; a layout
        predicted within that spread of the winner is measured before the search stops."""
        self.best = best
        # a layout predicted within the noise of the winner can't be ruled out by the model:
        # on a loaded machine (runs of one layout 20-30% apart) the search measures more
        self.reach = max(self.reach, min(spread, MAX_REACH))

    def rank(self, pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``pending`` in the search's order as it stands (the worker measures the first next)."""
        position = {database.canonical(c): i for i, c in enumerate(self.order)}
        return sorted(pending, key=lambda c: position.get(database.canonical(c), len(position)))

    def favourite(self) -> dict[str, Any] | None:
        """The measured layout the fitted model predicts fastest (None: none measured)."""
        measured = [c for c, t in zip(self.order, self.seen) if t is not None]
        return min(measured, key=self.predicted) if measured else None

    def predicted(self, candidate: Mapping[str, Any]) -> float:
        return self.fitted(self.predictions[database.canonical(candidate)].step)

    @property
    def done(self) -> bool:
        if len(self.seen) >= len(self.order):
            return True
        measured = [t for t in self.seen if t is not None]
        if len(measured) < 2 or self.best is None:
            return False  # one point fits one scale: the ranking is still the raw model's
        if self._unmeasured_kinds():
            # a layout with stages and one without, each measured once: what tells them apart
            # is the blocks' fixed cost per micro-batch, the probe's most fragile figure (under
            # load it came out 0, pipelines looked free of it, and a fit to pipelines alone
            # ruled out the fastest layout, replicate's, unmeasured)
            return False
        rest = min(self.predicted(c) for c in self.order[len(self.seen) :])
        return rest >= self.best * max(1 - self.noise, 1 + self.reach)

    @property
    def stop_reason(self) -> str:
        if len(self.seen) >= len(self.order):
            return "complete"
        return "early stop" if self.done else "incomplete"
