"""A tensor-parallel plan as written: ``{path: style}``, parsed and matched against a built model.

A path is dotted, ``*`` standing for any one child (``model.layers.*.self_attn.q_proj``), and
names a module, a parameter (``model.layers.*.mlp.experts.gate_up_proj``: sharded only, its
module runs as it is) or an int attribute (``divide``). ``tp_plan="hf"`` reads the plan a
transformers model ships (``hf_plan``) in our style names (``macrogen.vocabulary``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from macrogen.vocabulary import HF_STYLES, PACKED, SIZED, STYLES, style_problem


class PlanError(ValueError):
    """A plan that does not fit the model, or that the engine cannot honour: one line each."""


@dataclass(frozen=True)
class Style:
    """One plan entry's style, parsed: ``kind`` of STYLES, ``blocks`` packed blocks (a fused
    qkv: ``("colwise", 3)``), ``size`` a width the style needs (MLA's rope part)."""

    kind: str
    blocks: int = 1
    size: int = 0

    @classmethod
    def parse(cls, value: Any, path: str) -> Style:
        problem = style_problem(value)
        if problem is not None:
            raise PlanError(
                f"{path}: {problem} (styles: {', '.join(STYLES)}; ({', '.join(PACKED)}, k) for k"
                f" packed blocks; ({', '.join(SIZED)}, n) with its rope width)"
            )
        if isinstance(value, (tuple, list)):
            kind, n = value
            return cls(kind, blocks=n) if kind in PACKED else cls(kind, size=n)
        return cls(value)

    def __str__(self) -> str:
        if self.blocks > 1:
            return f"({self.kind!r}, {self.blocks})"
        return f"({self.kind!r}, {self.size})" if self.size else repr(self.kind)


def hf_plan(model: nn.Module) -> dict[str, Any]:
    """The plan a transformers model ships, in our style names (``tp_plan="hf"``).

    ``model._tp_plan`` holds the full plan of a built model (the base model's
    ``config.base_model_tp_plan`` under its prefix, the head's entries, and the input
    embedding, which transformers adds). As transformers does, an entry that matches nothing
    in this model is left out (a plan lists layers that some configs of the family do not
    build); a style we cannot honour is an error naming it.
    """
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        config = getattr(model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        inner = getattr(model, prefix, None) if prefix else None
        lead = f"{prefix}." if isinstance(inner, nn.Module) and inner is not model else ""
        plan = {f"{lead}{k}": v for k, v in base.items()}
    if not plan:
        raise PlanError(
            f"tp_plan='hf': {type(model).__name__} ships no tensor-parallel plan (no _tp_plan,"
            " no config.base_model_tp_plan); write the plan: tp_plan={'path.to.layer': 'colwise', ...}"
        )
    out: dict[str, Any] = {}
    problems = []
    for path, style in plan.items():
        ours = HF_STYLES.get(style)
        if ours is None:
            problems.append(
                f"{path}: the model's plan uses transformers' style {style!r}, which mg.parallelize"
                f" does not know (it maps: {', '.join(sorted(HF_STYLES))}); write the plan yourself"
            )
        elif next(matches(model, path), None) is not None:
            out[path] = _sized(model, path, ours) if ours in SIZED else ours
    if problems:
        raise PlanError("\n".join(problems))
    if not out:
        raise PlanError(
            f"tp_plan='hf': no entry of {type(model).__name__}'s plan matches one of its modules"
        )
    return out


def _sized(model: nn.Module, path: str, style: str) -> Any:
    """``("mla_kv_a_proj", n)``: the rope width from the model's config, as transformers reads it."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "qk_rope_head_dim", None)
    if not isinstance(rope, int) or rope < 1:
        raise PlanError(
            f"{path}: {style} splits off the rope part of the projection, and the model's config"
            " has no qk_rope_head_dim"
        )
    return (style, rope)


def path_pattern(path: str) -> re.Pattern[str]:
    # "*" is one name segment (any child), as in torch's and HF's plans
    return re.compile(
        ".".join("[^.]+" if part == "*" else re.escape(part) for part in path.split("."))
    )


def matches(model: nn.Module, path: str) -> Iterator[tuple[str, nn.Module, str]]:
    """(full name, owner, attribute) for every submodule, parameter or attribute ``path`` names."""
    pattern = path_pattern(path)
    owner_path, _, attr = path.rpartition(".")
    owner_pattern = path_pattern(owner_path) if owner_path else None
    for name, module in model.named_modules():
        if owner_pattern is None:
            if name == "":
                for key in [attr] if attr != "*" else list(module._modules):
                    if getattr(module, key, None) is not None:
                        yield key, module, key
            continue
        if not owner_pattern.fullmatch(name):
            continue
        keys = list(module._modules) if attr == "*" else [attr]
        for key in keys:
            if getattr(module, key, None) is not None:  # (a layer this config does not build)
                full = f"{name}.{key}"
                if pattern.fullmatch(full):
                    yield full, module, key


def near(model: nn.Module, path: str) -> str:
    """`` (modules named 'x': a.x, b.x)``: what a path that matched nothing may have meant."""
    last = path.rsplit(".", 1)[-1]
    names = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == last][:3]
    return f" (modules named {last!r}: {', '.join(names)})" if names else ""


def layer_kind(layer: Any) -> str | None:
    """ "linear" (weight (out, in)), "conv1d" (HF's Conv1D: weight (in, out)), "embedding"."""
    if isinstance(layer, nn.Embedding):
        return "embedding"
    if isinstance(layer, nn.Linear):
        return "linear"
    weight = getattr(layer, "weight", None)
    nf = getattr(layer, "nf", None)
    if (
        isinstance(layer, nn.Module)
        and isinstance(nf, int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == nf
    ):
        return "conv1d"
    return None


def plan_styles(plan: Mapping[str, Any]) -> tuple[dict[str, Style], list[str]]:
    """Every entry's style, and the problems of those that do not parse."""
    styles, problems = {}, []
    for path, value in plan.items():
        try:
            styles[path] = Style.parse(value, path)
        except PlanError as e:
            problems.append(str(e))
    return styles, problems
