"""A plan resolved against a built model: which parameter is cut along which dim, which
gradients are summed, which attributes divided, which modules' forwards wrapped.

A module's entry decides for the module's own parameters (transformers' rule): ``colwise``
cuts each along its out-features dim (a weight ``(out, in)``'s dim 0, HF Conv1D's dim 1, a
bias's dim 0, another parameter's second-to-last dim), ``rowwise`` its weight along the
in-features dim and keeps the bias whole (added once, after the reduction), ``vocab`` the rows,
``embedding_colwise`` the columns; ``replicate_grad_allreduce`` and ``sequence_parallel`` keep
them whole with their gradients summed. A parameter's own entry overrides its module's:

    parameter style           cut
    colwise, (colwise, k)     its second-to-last dim (a 3-D expert weight's out features; 1-D: dim 0)
    rowwise, (rowwise, k)     its last dim (the in features)
    vocab / embedding_colwise dim 0 / dim 1
    shard_experts             dim 0: whole experts per rank (the owner's num_experts divided)
    replicate                 none
    replicate_grad_allreduce  none, its gradient summed

Every problem is collected, so that a plan's errors are reported at once, each naming its path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from macrogen.runtime.parallelize.plan import (
    PlanError,
    Style,
    layer_kind,
    matches,
    near,
    plan_styles,
)
from macrogen.runtime.parallelize.sequence import LINEAR as SEQUENCE_LINEAR
from macrogen.runtime.parallelize.sequence import WRAPPED as SEQUENCE_WRAPPED
from macrogen.runtime.parallelize.sequence import linear_problem, slice_problem

LINEAR_STYLES = ("colwise", "colwise_gather_output", "rowwise")
EMBEDDING_STYLES = ("vocab", "embedding_colwise")
# module styles that wrap the module's forward with collectives around it
WRAPPED = (
    *LINEAR_STYLES,
    *EMBEDDING_STYLES,
    "all_reduce",
    "sequence_parallel",
    "mla_kv_a_proj",
    "moe_experts",
    "moe_identity_expert",
    *SEQUENCE_WRAPPED,
)
# styles a parameter entry may take
PARAMETER_STYLES = ("colwise", "rowwise", *EMBEDDING_STYLES, "shard_experts", "replicate",
                    "replicate_grad_allreduce")  # fmt: skip
SUMS = (
    "replicate_grad_allreduce",
    "sequence_parallel",
    "sequence_slice",
)  # the module's own gradients summed


@dataclass(frozen=True)
class Cut:
    """``module.key`` becomes this rank's shard along ``dim`` (``blocks`` packed blocks)."""

    module: nn.Module
    key: str
    dim: int
    blocks: int
    name: str


@dataclass(frozen=True)
class Wrap:
    """``module``'s forward runs between its style's input and output transforms."""

    module: nn.Module
    name: str
    style: Style
    kind: str | None  # layer_kind
    experts: int = 0  # moe_experts over whole experts per rank (shard_experts): how many in all


@dataclass
class Layout:
    cuts: list[Cut] = field(default_factory=list)
    summed: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (module, key, name)
    divides: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (owner, attr, name)
    wraps: list[Wrap] = field(default_factory=list)
    # id(module) -> (module, experts in all) whose experts' parameters are cut whole per rank
    expert_owners: dict[int, tuple[nn.Module, int]] = field(default_factory=dict)
    entries: list[str] = field(default_factory=list)  # what every rank must plan alike


def resolve(model: nn.Module, plan: Mapping[str, Any], tp: int) -> Layout:
    """The plan's cuts, sums, divisions and wrapped forwards; ``PlanError`` with every problem."""
    styles, unparsed = plan_styles(plan)
    layout = Layout()
    problems: list[str] = []
    hits = {path: list(matches(model, path)) for path in styles}
    # a parameter's own entry overrides its module's: known before any module is cut
    parameters = {(id(owner), attr) for found in hits.values() for _, owner, attr in found
                  if owner._parameters.get(attr) is not None}  # fmt: skip
    seen: dict[int, str] = {}
    cut_parameters: list[tuple[str, nn.Module, Style]] = []
    for path in plan:  # in the plan's order: the problems too
        if path not in styles:
            problems += [p for p in unparsed if p.startswith(f"{path}: ")][:1]
            continue
        style = styles[path]
        if not hits[path]:
            problems.append(f"{path}: matches nothing in {type(model).__name__}{near(model, path)}")
        for name, owner, attr in hits[path]:
            target = getattr(owner, attr)
            value = f" = {target}" if style.kind == "divide" and isinstance(target, int) else ""
            layout.entries.append(f"{name}: {style}{value}")
            problem: str | None = None
            if isinstance(target, nn.Module):
                if id(target) in seen:
                    problems.append(f"{name}: already planned as {seen[id(target)]}")
                    continue
                seen[id(target)] = name
                own = {k for k in target._parameters if (id(target), k) in parameters}
                problem = _module(name, target, style, tp, own, layout)
            elif (id(owner), attr) in parameters:
                problem = _parameter(name, owner, attr, style, tp, layout)
                if problem is None and style.kind not in ("replicate", "replicate_grad_allreduce"):
                    cut_parameters.append((name, owner, style))
            else:
                problem = _attribute(name, owner, attr, target, style, tp, layout)
            if problem:
                problems.append(problem)
    for name, owner, style in cut_parameters:  # its module runs as it is: on the shard
        if id(owner) not in seen:
            path = name.rpartition(".")[0]
            problems.append(
                f"{name}: {style.kind} cuts a parameter of {path} ({type(owner).__name__}), which"
                " the plan does not name, so its forward would use this rank's shard as if it were"
                f" whole: plan {path} too ('moe_experts', 'all_reduce', or 'replicate' for a"
                " module that works on this rank's heads)"
            )
    layout.wraps = [  # experts cut whole per rank: how many in all (their parameters' entries)
        replace(w, experts=layout.expert_owners.get(id(w.module), (w.module, 0))[1])
        for w in layout.wraps
    ]
    wrapped = {id(w.module) for w in layout.wraps if w.style.kind == "moe_experts"}
    for module, _ in layout.expert_owners.values():
        if id(module) not in wrapped:
            name = next(n for n, m in model.named_modules() if m is module)
            problems.append(
                f"{name}: its experts are cut whole per rank (shard_experts): plan {name}"
                " 'moe_experts', so that the routes to other ranks' experts are masked"
            )
    problems += _ties(model, layout)
    if problems:
        raise PlanError("\n".join(problems))
    return layout


def _attribute(
    name: str, owner: nn.Module, attr: str, target: Any, style: Style, tp: int, layout: Layout
) -> str | None:
    if style.kind == "replicate":
        return None
    if style.kind != "divide":
        return f"{name}: {style.kind} takes a module or a parameter, not {type(target).__name__}"
    if not isinstance(target, int) or isinstance(target, bool):
        return f"{name}: divide needs an int attribute, not {type(target).__name__}"
    if target % tp:
        return f"{name} = {target} is not divisible by tp={tp}"
    layout.divides.append((owner, attr, name))
    return None


def _parameter(
    name: str, owner: nn.Module, key: str, style: Style, tp: int, layout: Layout
) -> str | None:
    p = owner._parameters[key]
    assert p is not None
    if style.kind not in PARAMETER_STYLES:
        return (
            f"{name} is a parameter: {style.kind} takes a module (a parameter takes"
            f" {', '.join(PARAMETER_STYLES)})"
        )
    if style.kind == "replicate":
        return None
    if style.kind == "replicate_grad_allreduce":
        layout.summed.append((owner, key, name))
        return None
    if style.kind == "rowwise" and p.dim() < 2:
        return (
            f"{name}: rowwise on a 1-D parameter (a bias) would add it on every rank: plan its"
            " module rowwise (the bias is then added once)"
        )
    if style.kind == "shard_experts":
        if p.dim() < 2:
            return (
                f"{name}: shard_experts takes a stacked experts parameter (experts, ...), not 1-D"
            )
        layout.expert_owners[id(owner)] = (owner, int(p.shape[0]))
    dim = {
        "colwise": p.dim() - 2 if p.dim() >= 2 else 0,
        "rowwise": p.dim() - 1,
        "vocab": 0,
        "embedding_colwise": 1 if p.dim() >= 2 else 0,
        "shard_experts": 0,
    }[style.kind]
    return _cut(layout, owner, key, dim, style.blocks, name, tp, f"dim {dim} ({p.shape[dim]})")


def _module(
    name: str, module: nn.Module, style: Style, tp: int, own: set[str], layout: Layout
) -> str | None:
    """The module's own parameters' cuts (those without an entry of their own), its wrap."""
    kind, what = layer_kind(module), type(module).__name__
    problem = _fits(name, module, kind, what, style, tp)
    if problem:
        return problem
    if style.kind == "sequence_slice":  # its submodules' parameters see my tokens only too
        layout.summed += [(sub, key, f"{name}.{prefix}.{key}")
                          for prefix, sub in module.named_modules() if sub is not module
                          for key, p in sub._parameters.items() if p is not None]  # fmt: skip
    for key, p in module._parameters.items():
        if p is None or key in own:
            continue
        if style.kind in SUMS:
            layout.summed.append((module, key, f"{name}.{key}"))
            continue
        dim = _own_dim(style, kind, key, p.dim())
        if dim is not None:
            problem = _cut(
                layout, module, key, dim, style.blocks, f"{name}.{key}", tp,
                _what(style, kind, key, p.shape[dim], dim, name),
            )  # fmt: skip
            if problem:  # (one problem a module: its weight's, then nothing else)
                return problem.replace(f"{name}.{key}: ", f"{name}: ", 1)
    if style.kind in WRAPPED:
        layout.wraps.append(Wrap(module, name, style, kind))
    return None


def _fits(name: str, module: nn.Module, kind: str | None, what: str, style: Style, tp: int) -> str | None:  # fmt: skip
    if style.kind == "divide":
        return f"{name}: divide needs an int attribute, not {what}"
    if style.kind == "shard_experts":
        return f"{name}: shard_experts takes a stacked experts parameter, not the module {what}"
    if style.kind in SEQUENCE_LINEAR:
        return linear_problem(name, module, kind, style.kind)
    if style.kind == "sequence_slice":
        return slice_problem(name, module, kind)
    if style.kind in LINEAR_STYLES and kind not in ("linear", "conv1d"):
        return (
            f"{name}: {style.kind} needs an nn.Linear (or a subclass) or an HF Conv1D, not {what}"
            " (vocab: nn.Embedding; divide: an int attribute)"
        )
    if style.kind == "rowwise" and style.blocks > 1:
        return (
            f"{name}: ('rowwise', k) takes a packed parameter (fused expert weights), not a module"
        )
    if style.kind == "colwise_gather_output" and style.blocks > 1:
        return f"{name}: colwise_gather_output takes no packed blocks"
    if style.kind in EMBEDDING_STYLES:
        if kind != "embedding":
            return f"{name}: {style.kind} needs an nn.Embedding (or a subclass), not {what}"
        assert isinstance(module, nn.Embedding)
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return (
                f"{name}: {style.kind} supports nn.Embedding without max_norm,"
                " scale_grad_by_freq, sparse"
            )
    if style.kind == "mla_kv_a_proj" and style.size < 1:
        return f"{name}: mla_kv_a_proj takes ('mla_kv_a_proj', n), n the rope part's width"
    return None


def _own_dim(style: Style, kind: str | None, key: str, ndim: int) -> int | None:
    """The dim a module entry cuts one of the module's own parameters along (None: whole)."""
    style = replace(style, kind=SEQUENCE_LINEAR.get(style.kind, style.kind))
    if style.kind in ("colwise", "colwise_gather_output"):
        if key == "weight" and kind == "conv1d":
            return 1
        return 0 if key in ("weight", "bias") or ndim < 2 else ndim - 2
    if style.kind == "rowwise":
        if key == "bias" or ndim < 2:
            return None  # whole, added once after the reduction
        return 0 if key == "weight" and kind == "conv1d" else ndim - 1
    if style.kind == "vocab":
        return 0
    if style.kind == "embedding_colwise":
        return 1 if ndim >= 2 else 0
    return None


def _what(style: Style, kind: str | None, key: str, size: int, dim: int, name: str) -> str:
    if key == "weight" and kind in ("linear", "conv1d"):
        what = "in features" if style.kind.startswith("rowwise") else "out features"
        return f"{size} {what}" + (f" in {style.blocks} blocks" if style.blocks > 1 else "")
    if key == "weight" and style.kind == "vocab":
        return f"{size} rows"
    return f"{key} dim {dim} ({size})"


def _cut(
    layout: Layout, module: nn.Module, key: str, dim: int, blocks: int, name: str, tp: int,
    what: str,
) -> str | None:  # fmt: skip
    p = module._parameters[key]
    assert p is not None
    if p.shape[dim] % (tp * blocks):
        return f"{name}: {what} are not divisible by tp={tp}"
    layout.cuts.append(Cut(module, key, dim, blocks, name))
    return None


def _ties(model: nn.Module, layout: Layout) -> list[str]:
    """A parameter two modules hold (an embedding tied to the head) must be cut the same way
    in both: a holder the plan leaves whole would compute on another rank's rows."""
    holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for prefix, module in model.named_modules():
        for key, p in module._parameters.items():
            if p is not None:
                name = f"{prefix}.{key}" if prefix else key
                holders.setdefault(id(p), []).append((module, key, name))
    cuts = {(id(c.module), c.key): c for c in layout.cuts}
    problems = []
    for cut in layout.cuts:
        p = cut.module._parameters[cut.key]
        for module, key, name in holders.get(id(p), []):
            other = cuts.get((id(module), key))
            if other is None:
                problems.append(
                    f"{cut.name} is tied to {name}, which the plan leaves whole: plan both with the"
                    " same split (a vocab embedding and a colwise head share rows) or untie them"
                )
            elif (other.dim, other.blocks) != (cut.dim, cut.blocks):
                problems.append(
                    f"{name} is tied to {cut.name}, and the plan cuts them differently (dim"
                    f" {other.dim} and dim {cut.dim}): plan both with the same split or untie them"
                )
    return sorted(set(problems), key=problems.index)
