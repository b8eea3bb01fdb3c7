"""The user's program as verify runs it: FILE loaded serial or expanded, its factory, one step.

The factory contract (docs/verify.md): ``factory()`` in FILE (``--entry :build``), or
``factory(module)`` in another module (``--entry mymodels:build``, given FILE's module),
returns ``(model, batch)`` or ``(model, batch, loss_fn)``: the model after its
``mg.parallelize(...)`` call, one batch (a dict is passed as keywords, a tuple or list as
positional arguments, anything else as the one argument), and optionally
``loss_fn(output) -> scalar``. Without one, the loss is the output's ``.loss`` where it has
one, else a fixed random projection of every floating output, summed, so that every
output element reaches the gradients.

The same code runs serially (FILE unexpanded: every marker a no-op) and on every rank
(FILE expanded); the random seed is set before the module runs and before the factory,
so both build the same weights.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn


class EntryError(Exception):
    """The entry does not name a factory of the contract: bad usage (exit 2)."""


class ProgramError(Exception):
    """The user's program failed (its import, its factory, its step): exit 1."""


@dataclass(frozen=True)
class Snapshot:
    """One step's numbers, whole and by the serial parameter names (on the CPU)."""

    loss: torch.Tensor  # () the step's loss
    weights: dict[str, torch.Tensor]  # before the step
    grads: dict[str, torch.Tensor | None]  # after backward; None: no gradient
    placements: dict[str, str]  # a DTensor parameter's placements ("(Shard(dim=0),)")


def load(source: Path, *, expanded: bool, seed: int) -> types.ModuleType:
    """FILE as a fresh module under its own name (a second entry module's ``import`` finds it)."""
    from macrogen import hook

    name = source.stem
    if expanded:  # through the hook's cache; the hook also expands FILE's macro imports
        code = hook.load(source, name, hook.options())
        hook.install()
    else:
        try:  # (a file without macros reaches here unparsed: the pass skips it)
            code = compile(source.read_bytes(), str(source), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes
            raise ProgramError(f"{source.name} is not valid Python: {_one_line(e)}") from None
    module = types.ModuleType(name)
    module.__file__ = str(source)
    sys.modules[name] = module
    if str(source.parent) not in sys.path:
        sys.path.insert(0, str(source.parent))
    torch.manual_seed(seed)
    try:
        exec(code, module.__dict__)
    except Exception as e:
        raise ProgramError(f"importing {source.name} raised {_one_line(e)}") from e
    return module


@contextlib.contextmanager
def parallelize_calls(source: Path) -> Iterator[list[int]]:
    """The lines of ``source`` whose ``mg.parallelize`` ran meanwhile (serially: the marker,
    a no-op, wrapped to note its caller), so that a file with several sites is reported at
    the one the entry used."""
    import macrogen

    marker = macrogen.parallelize
    lines: list[int] = []

    def noting(model: Any, **options: Any) -> Any:
        caller = sys._getframe(1)
        if caller.f_code.co_filename == str(source):
            lines.append(caller.f_lineno)
        return marker(model, **options)

    macrogen.parallelize = noting
    try:
        yield lines
    finally:
        macrogen.parallelize = marker


def build(module: types.ModuleType, entry: str, *, seed: int) -> tuple[nn.Module, Any, Any]:
    """The factory's ``(model, batch, loss_fn or None)``, built from ``seed``."""
    module_name, _, factory_name = entry.partition(":")
    owner = module
    if module_name:
        try:
            owner = importlib.import_module(module_name)
        except ImportError as e:
            raise EntryError(f"--entry {entry}: cannot import {module_name}: {e}") from e
    factory = getattr(owner, factory_name, None)
    if factory is None:
        raise EntryError(f"--entry {entry}: {owner.__name__} has no {factory_name}")
    if not callable(factory) or isinstance(factory, type):
        raise EntryError(f"--entry {entry}: {factory_name} is not a factory (a function)")
    torch.manual_seed(seed)
    try:
        made = factory(module) if module_name else factory()
    except Exception as e:
        raise ProgramError(f"the entry {entry} raised {_one_line(e)}") from e
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise EntryError(
            f"--entry {entry} must return (model, batch) or (model, batch, loss_fn),"
            f" not {type(made).__name__}"
        )
    model, batch, *rest = made
    loss_fn = rest[0] if rest else None
    if not isinstance(model, nn.Module):
        raise EntryError(f"--entry {entry}: its model is a {type(model).__name__}, no nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise EntryError(f"--entry {entry}: its loss_fn is not callable")
    return model, batch, loss_fn


def step(model: nn.Module, batch: Any, loss_fn: Any, *, seed: int) -> Snapshot:
    """One forward and backward from the weights as built; every tensor gathered whole.

    On ranks every rank calls this (gathering a DTensor is a collective)."""
    from torch.distributed.tensor import DTensor

    weights = {name: _whole(p.detach()) for name, p in model.named_parameters()}
    placements = {
        name: str(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)
    }
    torch.manual_seed(seed)
    try:
        if isinstance(batch, dict):
            output = model(**batch)
        elif isinstance(batch, (tuple, list)):
            output = model(*batch)
        else:
            output = model(batch)
        loss = loss_fn(output) if loss_fn is not None else default_loss(output, seed=seed)
        loss = _whole(loss)
        loss.backward()
    except Exception as e:
        raise ProgramError(f"the step raised {_one_line(e)}") from e
    grads = {
        name: None if p.grad is None else _whole(p.grad) for name, p in model.named_parameters()
    }
    return Snapshot(loss.detach().cpu(), weights, grads, placements)


def default_loss(output: Any, *, seed: int) -> torch.Tensor:
    """``output.loss`` where there is one, else a seeded random projection of every output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    total: torch.Tensor | None = None
    for i, t in enumerate(_floating(output)):
        t = _whole(t)
        weights = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + i))
        term = (t.float() * weights.to(t.device)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ProgramError("the model's output has no floating tensor to take a loss of")
    return total


def _floating(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield output
    elif isinstance(output, dict):  # (transformers' ModelOutput is one)
        for value in output.values():
            yield from _floating(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _floating(value)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective on its mesh), on the CPU; a tensor as it is."""
    if _is_dtensor(t):
        t = t.full_tensor()  # type: ignore[attr-defined]
    return t if t.requires_grad else t.detach().cpu()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
