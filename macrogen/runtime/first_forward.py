"""``mg.parallelize(..., verify=True)``: the first forward checked against a serial copy.

    reference = serial_copy(model)                       # before any step changes the model
    ...                                                  # tensor parallel, data parallel
    check_first_forward(model, reference, where="train.py:12")

At the model's first forward, the serial copy runs the same inputs (without gradients,
the random number state put back afterwards), and every floating tensor of the two
outputs is compared (a DTensor output whole); a difference beyond the dtype's tolerance
is an error naming the site, the output and the numbers, on every rank. Then the copy
is dropped. It checks the forward only: ``macrogen verify`` checks one step's gradients
as well, per parameter (docs/verify.md).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from macrogen.verify.compare import TOLERANCE


class FirstForwardMismatch(RuntimeError):
    """The parallel model's first output is not the serial copy's."""


def serial_copy(model: nn.Module) -> nn.Module:
    """The model as it is now, deep-copied: the serial reference of the first forward."""
    return copy.deepcopy(model)


def check_first_forward(model: nn.Module, reference: nn.Module, *, where: str) -> None:
    """Compare ``model``'s first output with ``reference``'s on the same inputs, once."""
    held: dict[str, Any] = {"reference": reference}

    def keep_inputs(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        held["inputs"] = (_cloned(args), _cloned(kwargs))

    def compare(_: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        for handle in held.pop("handles"):
            handle.remove()
        serial, (args, kwargs) = held.pop("reference"), held.pop("inputs")
        devices = [t.device for t in _tensors(output) if t.device.type == "cuda"][:1]
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            expected = serial(*args, **kwargs)
        got, want = list(_tensors(output)), list(_tensors(expected))
        if len(got) != len(want):
            raise FirstForwardMismatch(
                f"{where}: error: verify=True: the first forward returned {len(got)} floating"
                f" tensors, the serial model {len(want)}"
            )
        worst = 0.0
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            rtol, atol = TOLERANCE.get(str(w.dtype), TOLERANCE["torch.float32"])
            g = _whole(g).detach().double()
            w = w.detach().double()
            scale = float(w.abs().max()) if w.numel() else 0.0
            diff = float((g - w).abs().max()) if g.shape == w.shape and w.numel() else 0.0
            if g.shape != w.shape or not diff <= atol + rtol * scale:
                shape = f"shape {tuple(g.shape)} for {tuple(w.shape)}" if g.shape != w.shape else ""
                numbers = shape or f"max abs {diff:.2e}, rel {diff / max(scale, 1e-30):.2e}"
                raise FirstForwardMismatch(
                    f"{where}: error: verify=True: the first forward's output {i} differs from"
                    f" the serial model's ({numbers}): the plan does not compute the serial"
                    " function; `macrogen verify` names the parameters (docs/verify.md)"
                )
            worst = max(worst, diff / scale if scale else diff)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"macrogen: {where}: verify=True: the first forward matches the serial model"
                f" ({len(got)} outputs, worst rel {worst:.1e})",
                file=sys.stderr,
            )

    held["handles"] = [
        model.register_forward_pre_hook(keep_inputs, with_kwargs=True),
        model.register_forward_hook(compare, with_kwargs=True),
    ]


def _cloned(value: Any) -> Any:
    """Tensors cloned (a forward may change its inputs in place), the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    return value


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield output
    elif isinstance(output, dict):  # (transformers' ModelOutput is one)
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _tensors(value)


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
