"""``init=mg.load(path)``: a checkpoint folder read into a model's shards, each rank reading only
what it holds.

    model = mg.parallelize(model, tp=2, dp="fsdp", init=mg.load("llama-folder"))

Two kinds of folder:

- a transformers ``save_pretrained`` folder: ``model.safetensors``, or the shards a
  ``model.safetensors.index.json`` maps. Each parameter is read as this rank's slice
  (``safe_open(...).get_slice(key)[rows, cols]``) where its shard is one block of the serial
  tensor (``Shard`` placements); a packed layer's strided shard, and a weight transformers
  stores in another form (a mixture's experts, one key per expert: its conversion mapping), is
  read whole, one parameter at a time, and cut. Keys follow the model's ``state_dict``; a
  tied weight may be under any of its names.
- a DCP checkpoint folder (``.metadata``, as ``torch.distributed.checkpoint.save`` writes it of
  the model's ``state_dict()``): DCP's ``load`` reshards it into the DTensor state dict.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class Load:
    """``mg.load(path)``: fill a model's parameters from the checkpoint folder ``path``."""

    path: str


def load(path: str | Path) -> Load:
    """``init=mg.load(path)`` of ``mg.parallelize``: the checkpoint folder each rank reads its
    shards from (a ``save_pretrained`` folder or a DCP checkpoint)."""
    return Load(str(path))


def kind(path: str) -> str:
    """ "safetensors" or "dcp"; an error naming what the folder lacks."""
    folder = Path(path)
    if (folder / INDEX).is_file() or (folder / SINGLE).is_file():
        return "safetensors"
    if (folder / ".metadata").is_file():
        return "dcp"
    raise FileNotFoundError(
        f"mg.load({path!r}): no {SINGLE}, {INDEX} or DCP .metadata in that folder (a"
        " save_pretrained folder or a torch.distributed.checkpoint folder is expected)"
    )


def load_into(model: nn.Module, init: Load, where: str) -> dict[str, int]:
    """Every parameter and saved buffer of ``model`` from ``init.path`` (see the module doc);
    the bytes this rank read of each key of a safetensors folder ({} for DCP)."""
    if kind(init.path) == "dcp":
        _load_dcp(model, init.path)
        return {}
    folder = _Safetensors(Path(init.path))
    converters = _converters(model)
    missing = []
    direct, converted = [], []
    for names, tensor in _tensors(model):
        key = next((n for n in names if n in folder.keys), None)
        if key is not None:
            direct.append((key, tensor))
        else:
            converted.append((names, tensor))
    # file by file: a file's pages this rank touched leave its memory when the file is closed
    direct.sort(key=lambda item: str(folder.files[item[0]]))
    with torch.no_grad():
        for key, tensor in direct:
            _read(folder, key, tensor)
        for names, tensor in converted:
            found = next(((c, n) for c in converters for n in names if c.matches(n)), None)
            if found is None or not found[0].read_into(folder, found[1], tensor):
                missing.append(names[0])
    folder.close()
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise KeyError(
            f"mg.parallelize at {where}: mg.load({init.path!r}) has no {missing[0]}{more}:"
            " the folder must be a save_pretrained folder of this model's class and config"
        )
    return folder.read


def _tensors(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Each parameter (with every name it has: tied weights) and each saved buffer, once."""
    seen: dict[int, list[str]] = {}
    values: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(_plain(name))
        values[id(p)] = p
    state = model.state_dict(keep_vars=True)
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in state:
            seen.setdefault(id(b), []).append(_plain(name))
            values[id(b)] = b
    for key, names in seen.items():
        if not values[key].is_meta:  # (another pipeline stage's, there for its names)
            yield names, values[key]


def _plain(name: str) -> str:
    """The serial model's name of a parameter (FSDP and checkpointing wrappers add parts)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class _Safetensors:
    """A ``save_pretrained`` folder's tensors by key, each file opened once, when first read."""

    def __init__(self, folder: Path):
        index = folder / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: folder / file for key, file in weight_map.items()}
        else:
            from safetensors import safe_open

            with safe_open(str(folder / SINGLE), framework="pt") as f:
                self.files = {key: folder / SINGLE for key in f.keys()}  # noqa: SIM118
        self.keys = set(self.files)
        self.handles: dict[Path, Any] = {}
        self.read: dict[str, int] = {}  # bytes read of each key (what this rank materialized)

    def slice(self, key: str) -> Any:
        from safetensors import safe_open

        file = self.files[key]
        if file not in self.handles:
            self.close()  # one file mapped at a time
            self.handles[file] = safe_open(str(file), framework="pt")
        return self.handles[file].get_slice(key)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def take(self, key: str, rows: tuple[Any, ...] | None = None) -> torch.Tensor:
        """The key's tensor, or its block ``rows``, read from the file (and counted)."""
        part = self.slice(key)
        got: torch.Tensor = part[:] if rows is None else part[rows]
        self.read[key] = self.read.get(key, 0) + got.numel() * got.element_size()
        return got

    def whole(self, key: str) -> torch.Tensor:
        return self.take(key)


def _read(folder: _Safetensors, key: str, tensor: torch.Tensor) -> None:
    """``tensor`` (this rank's shard, or a whole tensor) from the folder's ``key``: its block
    alone where the shard is one block, else the whole tensor, cut."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(folder.whole(key).reshape(tensor.shape))
        return
    block = _block(tensor)
    if block is not None:
        offset, shape = block
        local = tensor.to_local()
        if local.numel():
            rows = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            local.copy_(folder.take(key, rows))
        return
    _copy_whole(folder.whole(key), tensor)


def _copy_whole(whole: torch.Tensor, tensor: torch.Tensor) -> None:
    """``tensor`` (a shard or a whole tensor) cut from the serial tensor ``whole``."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(whole)
        return
    from macrogen.runtime.dtensor_whole import restride

    whole = whole.to(device=tensor.device, dtype=tensor.dtype)
    tensor.to_local().copy_(restride(whole, tensor).to_local())


class _Converter:
    """One of transformers' weight converters (its conversion mapping for the model's type):
    the model's tensor ``target`` made from the checkpoint's ``sources`` by its operations
    (``mlp.experts.gate_up_proj`` from every expert's ``gate_proj`` and ``up_proj``)."""

    def __init__(self, converter: Any):
        self.converter = converter
        self.sources: list[str] = list(converter.source_patterns)
        self.target: str = converter.target_patterns[0]
        self.pattern = re.compile(r"(?:^|(?<=\.))" + re.escape(self.target) + "$")

    def matches(self, name: str) -> bool:
        return len(self.converter.target_patterns) == 1 and bool(self.pattern.search(name))

    def read_into(self, folder: _Safetensors, name: str, tensor: torch.Tensor) -> bool:
        """``tensor`` (a shard or a whole tensor) from the checkpoint's sources; False when the
        folder lacks them. Experts dealt by blocks of dim 0 read their own keys only."""
        block = self._expert_block(tensor)
        if block is None:
            whole = self.assemble(folder, name)
            if whole is not None:
                _copy_whole(whole, tensor)
            return whole is not None
        offset, shape = block
        assert isinstance(tensor, DTensor)
        mine = self.assemble(folder, name, range(offset[0], offset[0] + shape[0]))
        if mine is None or mine.shape[0] != shape[0]:
            return False
        rest = (slice(None), *(slice(o, o + s) for o, s in zip(offset[1:], shape[1:])))
        tensor.to_local().copy_(mine[rest])
        return True

    def _expert_block(self, tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(offset, shape) of this rank's block when it is one block of a tensor stacked on dim 0
        from one key per index (``MergeModulelist(dim=0)``, nothing else touching dim 0)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = list(self.converter.operations)
        stacked = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        if not stacked or any(not isinstance(op, Concatenate) or op.dim == 0 for op in ops[1:]):
            return None
        if not isinstance(tensor, DTensor) or not tensor.to_local().numel():
            return None
        block = _block(tensor)
        if block is None or block[1][0] == tensor.shape[0]:
            return None  # whole on dim 0: nothing to skip
        return block

    def assemble(
        self, folder: _Safetensors, name: str, indices: range | None = None
    ) -> torch.Tensor | None:
        """The target tensor from its sources (only those of ``indices`` when given)."""
        prefix = name[: len(name) - len(self.target)]
        collected: dict[str, list[torch.Tensor]] = {}
        for source in self.sources:
            found = re.compile(re.escape(prefix + source).replace(r"\*", r"(\d+)") + "$")
            hits = sorted(
                ((int(m.group(1)) if m.groups() else 0, k) for k in folder.keys
                 if (m := found.match(k))),
            )  # fmt: skip
            if indices is not None:
                hits = [(i, k) for i, k in hits if i in indices]
            if not hits:
                return None
            collected[source] = [folder.whole(k) for _, k in hits]
        out: dict[str, Any] = collected
        for op in self.converter.operations:
            out = op.convert(out, source_patterns=self.sources, target_patterns=[self.target])
        return next(iter(out.values()))  # type: ignore[no-any-return]


def _block(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of this rank's shard when it is one block of the serial tensor: Shard
    and Replicate placements, or FSDP's chunk of a dim-0 shard (``(_StridedShard(0, n),
    Shard(0))`` on a 2-D mesh: experts under ``ep`` and FSDP, a colwise layer under FSDP x TP);
    None for any other."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements, local = tensor.device_mesh, tensor.placements, tensor.to_local()
    if all(type(p) in (Shard, Replicate) for p in placements):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        return tuple(offset), tuple(shape)
    strided = (
        mesh.ndim == 2
        and isinstance(placements[0], _StridedShard)
        and placements[0].dim == 0
        and placements[0].split_factor == mesh.size(1)
        and type(placements[1]) is Shard
        and placements[1].dim == 0
        and tensor.shape[0] % mesh.size(1) == 0
    )
    if not strided:
        return None
    per_ep = tensor.shape[0] // mesh.size(1)
    chunk = -(-per_ep // mesh.size(0))  # FSDP's torch.chunk of the ep rank's experts
    start = mesh.get_local_rank(0) * chunk
    rows = max(0, min(chunk, per_ep - start))
    shape = (rows, *tensor.shape[1:])
    if shape != tuple(local.shape):
        return None
    return (mesh.get_local_rank(1) * per_ep + start, *([0] * (tensor.dim() - 1))), shape


def _converters(model: nn.Module) -> list[_Converter]:
    """transformers' converters for ``model`` (none for a model not of transformers)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return [
        _Converter(c)
        for c in get_model_conversion_mapping(model, add_legacy=False)
        if isinstance(c, WeightConverter)
    ]


def _load_dcp(model: nn.Module, path: str) -> None:
    """DCP reshards the saved tensors into this layout's DTensors (its ``load`` reads in place).
    A strided shard (a packed layer's, FSDP over TP's) is read whole and cut, one at a time:
    DCP's own resharding into two nested strided shards permutes the rows (torch 2.13)."""
    import torch.distributed.checkpoint as dcp

    state = {_plain(k): v for k, v in model.state_dict().items() if not v.is_meta}
    strided = {k: v for k, v in state.items() if isinstance(v, DTensor) and _is_strided(v)}
    dcp.load({k: v for k, v in state.items() if k not in strided}, checkpoint_id=path)
    for key, value in strided.items():  # each rank its own (pipeline stages hold other keys)
        whole = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        dcp.load({key: whole}, checkpoint_id=path, no_dist=True)
        with torch.no_grad():
            _copy_whole(whole, value)


def _is_strided(value: DTensor) -> bool:
    return not all(type(p) in (Shard, Replicate) for p in value.placements)
