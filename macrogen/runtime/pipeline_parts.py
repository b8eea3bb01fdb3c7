"""The parts of a pipelined model: dotted paths to the modules and tensors stages hold.

A part is a path through containers (``transformer.h.3``, ``model.embed_tokens``,
``lm_head``): the module, parameter or buffer a stage keeps, or the placeholder that
stands where another stage's part was. Both cuts (``pipeline_plan``: a forward's
statements; ``pipeline_transformers``: a transformers model's ``pp_plan``) say which
stages hold each part (``owners``); from that, this module finds the parameters that
parts on several stages share (a tied embedding and head), whose gradients the
pipeline sums over the stages holding them.

A model built on the meta device (``mg.parallelize(..., init=...)``) is cut before it has
storage; the parts other stages hold are kept aside, meta (``MetaParts``), for ``init=``
to walk the serial model's modules and names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
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


def aliases(model: nn.Module) -> dict[str, str]:
    """Each further name of a parameter the model knows by several (a tied head's weight) ->
    its first name, ``named_parameters``' own; read on the whole model, before the cut."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            out[name] = first[id(param)]
    return out


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


class MetaParts:
    """A meta model's parts other stages hold (no storage: kept costs nothing), and their
    parameters this rank holds too (a weight tied to one of this stage's parts)."""

    def __init__(self) -> None:
        self.parts: list[tuple[nn.Module, str, str, Any]] = []  # (parent, table, name, part)
        # (module of a part kept aside, its key, this stage's module holding it, its key)
        self.shared: list[tuple[nn.Module, str, nn.Module, str]] = []

    def keep(self, parent: nn.Module, name: str) -> None:
        """``parent``'s ``name`` is about to leave this rank: kept aside if it is meta."""
        for table in ("_modules", "_parameters", "_buffers"):
            held = getattr(parent, table)
            if name in held and _is_meta(held[name]):
                self.parts.append((parent, table, name, held[name]))

    def find_shared(self, model: nn.Module) -> None:
        """After the cut: where this stage holds each parameter of the parts kept aside."""
        places = {id(p): (module, key) for module in model.modules()
                  for key, p in module._parameters.items() if p is not None}  # fmt: skip
        for _, _, _, part in self.parts:
            for module in part.modules() if isinstance(part, nn.Module) else ():
                for key, p in module._parameters.items():
                    if p is not None and id(p) in places:
                        self.shared.append((module, key, *places[id(p)]))

    @contextlib.contextmanager
    def back(self) -> Iterator[None]:
        """The parts back in their places, each shared weight as this stage holds it now (FSDP
        made it anew); then the stand-ins again, and the parts dropped (``init=`` runs once)."""
        standing = [(parent, table, name, getattr(parent, table).get(name))
                    for parent, table, name, _ in self.parts]  # fmt: skip
        for parent, table, name, part in self.parts:
            getattr(parent, table)[name] = part
        for module, key, holder, held in self.shared:
            module._parameters[key] = holder._parameters[held]
        try:
            yield
        finally:
            for parent, table, name, stand_in in standing:
                if stand_in is None:
                    getattr(parent, table).pop(name, None)
                else:
                    getattr(parent, table)[name] = stand_in
            self.parts.clear()
            self.shared.clear()


def _is_meta(part: Any) -> bool:
    if isinstance(part, nn.Module):
        return any(t.is_meta for t in [*part.parameters(), *part.buffers()])
    return isinstance(part, torch.Tensor) and part.is_meta
