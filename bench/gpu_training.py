"""bench/gpu.py's ``training`` section: one step of a GPT per parallel wrapper, at world size 1.

At world size 1 no collective moves data, so each row measures what the
wrapper itself adds to a training step (hooks, bucket copies, the optimizer's
bookkeeping), against the torch wrapper a user would otherwise use, from the
same weights on the same batch:

    @data_parallel           vs torch DDP (same bucket size)
    shard_optimizer (ZeRO-1) vs DDP + ZeroRedundancyOptimizer(AdamW)
    mg.parallelize(tp=1)     vs parallelize_module on a 1-device mesh
    mg.parallelize(fsdp)     vs fully_shard by hand (each block, then the root)
    each of the first two under torch.compile, against its peer compiled

Checked: the losses of 3 steps equal the peer's (1e-5 relative; 1e-4 compiled).
Ratio: the peer's step time / ours (goal >= 0.95: at most 1.05x the peer's time).
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from macrogen.expand import expand_source

SOURCE = """
import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, block):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@mg.data_parallel(bucket_mb=25)
class DataParallelGPT(GPT):
    pass


def zero(model, lr):
    return mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=lr))


def tensor_parallel(model):
    return mg.parallelize(model, tp=1, dp="none", tp_plan={
        "h.*.qkv": ("colwise", 3), "h.*.proj": "rowwise", "h.*.fc": "colwise", "h.*.out": "rowwise",
    })


def fully_sharded(model):
    return mg.parallelize(model, dp="fsdp")
"""

LR = 1e-3
STEPS = 3
BUCKET_MB = 25


def _size(dry: bool) -> dict[str, int]:
    if dry:
        return dict(vocab=64, d=32, heads=4, layers=2, block=16, batch=2)
    return dict(vocab=32768, d=1024, heads=16, layers=8, block=1024, batch=8)


class _Case:
    """One wrapper and its peer: each builds (model, optimizer) from the same serial weights."""

    def __init__(
        self, name: str, ours: Callable, peer: Callable, peer_name: str, compiled=False, note=""
    ):
        self.name, self.ours, self.peer, self.peer_name = name, ours, peer, peer_name
        self.compiled, self.note = compiled, note


def _cases(module: Any) -> list[_Case]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    def adamw(model, foreach=None):
        return torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)

    def as_data_parallel(serial):  # the wrapper's class, the serial weights
        model = module.DataParallelGPT(*serial.sizes).to(serial.head.weight.device)
        model.load_state_dict(serial.state_dict())
        return model

    def ddp(serial):
        return DDP(copy.deepcopy(serial), bucket_cap_mb=BUCKET_MB)

    def torch_tp(serial):
        model = copy.deepcopy(serial)
        mesh = init_device_mesh(serial.head.weight.device.type, (1,))
        for block in model.h:
            parallelize_module(
                block,
                mesh,
                {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                 "fc": ColwiseParallel(), "out": RowwiseParallel()},
            )  # fmt: skip
        return model

    def hand_fsdp(serial):
        model = copy.deepcopy(serial)
        for block in model.h:
            fully_shard(block)
        return fully_shard(model)

    return [
        _Case(
            "@data_parallel",
            lambda s: (m := as_data_parallel(s), adamw(m)),
            lambda s: (m := ddp(s), adamw(m)),
            "DDP",
        ),
        _Case(
            "shard_optimizer",
            lambda s: (m := as_data_parallel(s), module.zero(m, LR)),
            lambda s: (
                m := ddp(s),
                ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=LR),
            ),
            "ZeroRedundancyOpt",
        ),
        # torch's TP leaves the embeddings, norms and head plain tensors beside the blocks'
        # DTensors, and AdamW's foreach step (CUDA's default) refuses the mix: the peer needs
        # foreach=False, and ours (plain tensors throughout) runs it too, for the same step
        _Case(
            "parallelize tp=1",
            lambda s: (m := module.tensor_parallel(copy.deepcopy(s)), adamw(m, foreach=False)),
            lambda s: (m := torch_tp(s), adamw(m, foreach=False)),
            "parallelize_module",
            note="AdamW foreach=False (the peer's mixed DTensor/Tensor params)",
        ),
        _Case(
            "parallelize fsdp",
            lambda s: (m := module.fully_sharded(copy.deepcopy(s)), adamw(m)),
            lambda s: (m := hand_fsdp(s), adamw(m)),
            "fully_shard",
        ),
        _Case(
            "@data_parallel compiled",
            lambda s: (m := as_data_parallel(s), adamw(m)),
            lambda s: (m := ddp(s), adamw(m)),
            "DDP compiled",
            compiled=True,
        ),
        _Case(
            "shard_optimizer compiled",
            lambda s: (m := as_data_parallel(s), module.zero(m, LR)),
            lambda s: (
                m := ddp(s),
                ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=LR),
            ),
            "ZeRO compiled",
            compiled=True,
        ),
    ]


def training_rows(
    directory: Path, device: str, dry: bool, bench: Callable, row: Callable, load: Callable
) -> list:
    """One row per case (``row`` makes bench/gpu.py's Row; ``bench`` times a call; ``load``
    imports generated code from a file, bench/gpu.py's ``_module``)."""
    size = _size(dry)
    module = load(
        expand_source(SOURCE, path="gpu_training.py").code,
        directory / "gpu_training_model.py",
        "gpu_training_model",
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    rows = []
    try:
        torch.manual_seed(0)
        serial = module.GPT(size["vocab"], size["d"], size["heads"], size["layers"], size["block"])
        serial = serial.to(device)
        serial.sizes = (size["vocab"], size["d"], size["heads"], size["layers"], size["block"])
        gen = torch.Generator().manual_seed(1)
        data = torch.randint(0, size["vocab"], (size["batch"], size["block"] + 1), generator=gen)
        x, y = data[:, :-1].to(device), data[:, 1:].to(device)
        backend = "aot_eager" if dry else "inductor"
        for case in _cases(module):
            try:
                rows.append(_row(case, serial, x, y, device, backend, bench, row))
            except Exception as e:  # a crash is a wrong result: in the table, then go on
                rows.append(row("training", f"CRASH {case.name}: {e}"[:60], float("nan"), 0.0,
                                0.0, "", 0.0, ""))  # fmt: skip
    finally:
        dist.destroy_process_group()
    return rows


def _row(case: _Case, serial, x, y, device: str, backend: str, bench: Callable, row: Callable):
    results = []
    for build in (case.ours, case.peer):
        model, optimizer = build(serial)
        forward = torch.compile(model, backend=backend) if case.compiled else model

        def step(forward=forward, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            loss = forward(x, y)
            loss.backward()
            optimizer.step()
            return loss

        losses = torch.stack([step().detach() for _ in range(STEPS)])
        results.append((losses, step))
    (ours, step_ours), (theirs, step_theirs) = results
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    tolerance = 1e-4 if case.compiled else 1e-5
    t_ours, t_theirs = bench(step_ours, device), bench(step_theirs, device)
    return row(
        "training",
        case.name,
        error,
        tolerance,
        t_ours,
        case.peer_name,
        t_theirs / t_ours,
        ">=0.95",
        case.note,
    )
