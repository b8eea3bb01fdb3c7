"""The parts of a pipelined model: dotted paths to the modules and tensors stages hold.

A part is a path through containers (``transformer.h.3``, ``model.embed_tokens``,
``lm_head``): the module, parameter or buffer a stage keeps, or the placeholder that
stands where another stage's part was. Both cuts (``pipeline_plan``: a forward's
statements; ``pipeline_transformers``: a transformers model's ``pp_plan``) say which
stages hold each part (``owners``); from that, this module finds the parameters that
parts on several stages share (a tied embedding and head), whose gradients the
pipeline sums over the stages holding them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def child(obj: Any, name: str) -> Any:
    """A module's submodule, parameter or buffer ``name``; None if it has none."""
    if not isinstance(obj, nn.Module):
        return None
    for table in (obj._modules, obj._parameters, obj._buffers):
        if name in table:
            return table[name]
    return None


def part_at(model: nn.Module, part: str) -> Any:
    """The module, parameter or buffer at a dotted path (``transformer.h.3``); None if none."""
    obj: Any = model
    for name in part.split("."):
        obj = child(obj, name)
        if obj is None:
            return None
    return obj


def placeable(model: nn.Module, path: str) -> str | None:
    """``transformer.wte`` for ``transformer.wte.weight``: the path down to a non-container."""
    obj: Any = model
    kept: list[str] = []
    for name in path.split("."):
        obj = child(obj, name)
        if obj is None:
            break
        kept.append(name)
        if not isinstance(obj, CONTAINERS):
            break
    return ".".join(kept) or None  # None: an int, a config, a method: nothing to place


def part_params(model: nn.Module, part: str) -> list[nn.Parameter]:
    obj = part_at(model, part)
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    if isinstance(obj, nn.Parameter):
        return [obj]
    return []


def numel(model: nn.Module, parts: list[str]) -> int:
    """The parameters of ``parts``, each tensor counted once (a tied one weighs once)."""
    seen: set[int] = set()
    n = 0
    for part in parts:
        for p in part_params(model, part):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


def tied(model: nn.Module, owners: dict[str, set[int]]) -> list[tuple[str, frozenset[int]]]:
    """Parameters that parts on more than one stage share: (a name of each, those stages).

    Each such stage keeps a copy; the pipeline sums their gradients over those stages.
    """
    names: dict[int, str] = {}
    users: dict[int, set[int]] = {}
    for part, stages in sorted(owners.items()):
        obj = part_at(model, part)
        found: Any = [(part, obj)] if isinstance(obj, nn.Parameter) else []
        if isinstance(obj, nn.Module):
            found = obj.named_parameters(prefix=part)
        for name, param in found:
            names.setdefault(id(param), name)
            users.setdefault(id(param), set()).update(stages)
    return [(names[i], frozenset(users[i])) for i in names if len(users[i]) > 1]


def unplaced(model: nn.Module, owners: dict[str, set[int]]) -> list[str]:
    """The parts no entry of ``owners`` covers: the largest subtrees next to placed ones."""
    found: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for table in (module._modules, module._parameters, module._buffers):
            for name, value in table.items():
                path = f"{prefix}{name}"
                if value is None or any(path == q or path.startswith(q + ".") for q in owners):
                    continue
                if isinstance(value, nn.Module) and any(q.startswith(path + ".") for q in owners):
                    walk(value, path + ".")  # a container some of whose entries are placed
                else:
                    found.append(path)

    walk(model, "")
    return found


def elsewhere(part: str, stage: int) -> RuntimeError:
    """The error of running a part this rank does not hold."""
    return RuntimeError(
        f"{part} lives on pipeline stage {stage}, not on this rank: a pipelined model trains"
        " through mg.pipeline_step(model, x, y, loss_fn), which runs the schedule"
    )


class Elsewhere(nn.Module):
    """A part of the model that lives on another pipeline stage (this rank holds no copy)."""

    def __init__(self, part: str, stage: int):
        super().__init__()
        self.part = part
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise elsewhere(self.part, self.stage)

    def extra_repr(self) -> str:
        return f"{self.part!r} on stage {self.stage}"
