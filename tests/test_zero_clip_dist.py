"""``mg.parallelize(dp="zero1")`` and torch's ``clip_grad_norm_`` where DDP users put it.

After ``backward()`` each rank's ``.grad`` is its local gradient (the sharded
optimizer reduce-scatters it), so a clip of it would clip by a local norm. On 2
gloo ranks in float64, a transformers Llama trained as a DDP user writes it
(``clip_grad_norm_(model.parameters(), c)`` between ``backward()`` and
``step()``) returns the serial norm and ends 3 AdamW steps at the serial
parameters, within 1e-10, at the cost of one small all-reduce per clip and no
gradient sent twice; also under a user's torch-function mode (``with
torch.device(...)``). A parameter only some ranks use makes the clip an error on
every rank, naming it, where ``mg.clip_grad_norm_`` still clips.
"""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module
from tests.test_data_parallel_dist import CountAllReduce

pytest.importorskip("transformers")

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import macrogen as mg
    from transformers import LlamaConfig, LlamaForCausalLM

    VOCAB = 64


    def llama():
        return mg.parallelize(LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)),
            dp="zero1")


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x, extra):
            h = self.a(x)
            return (self.b(h) if extra else h).pow(2).mean()


    def branchy():
        return mg.parallelize(Branchy(), dp="zero1")


    def optimizer(model):
        return mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    """
)
STEPS, BATCH, SEQ, MAX_NORM = 3, 4, 8, 0.5


def _train(module, model, opt, rows, *, mode=None):
    """3 steps, clipped as DDP users clip; the norms clip_grad_norm_ returned."""
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(STEPS):
        ids = torch.randint(0, module.VOCAB, (BATCH, SEQ), generator=gen)[rows]
        with mode if mode is not None else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            opt.zero_grad()
    return norms


def _clipped(rank, world, tmp):
    torch.set_default_dtype(torch.float64)
    serial_module = load_module(SOURCE, f"zero_clip_serial_{rank}", Path(tmp))
    module = load_module(expand(SOURCE), f"zero_clip_{rank}", Path(tmp))
    torch.manual_seed(0)
    serial = serial_module.llama()
    want = _train(serial_module, serial, serial_module.optimizer(serial), slice(None))
    assert min(want) > MAX_NORM  # the clip changes every step
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    report = {}
    for case in ("plain", "under a mode"):
        torch.manual_seed(0)
        model = module.llama()
        opt = module.optimizer(model)
        with CountAllReduce() as count:
            # a DeviceContext is a torch-function mode on the stack: the guard goes beneath it
            got = _train(
                module, model, opt, rows, mode=torch.device("cpu") if case != "plain" else None
            )
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0, msg=case)
        for (name, p), q in zip(model.named_parameters(), serial.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10, msg=f"{case}: {name}")
        assert opt.resends == 0, "the gradients sent during backward were used, clipped"
        report[case] = sorted(set(count.sizes)), count.calls
    report["params"] = len(list(serial.parameters()))
    return report


def test_torch_clip_grad_norm_after_backward_clips_by_the_serial_norm(tmp_path):
    results = run_ranks(_clipped, 2, args=(str(tmp_path),), timeout=300)
    for r in results:
        for case in ("plain", "under a mode"):
            sizes, calls = r[case]
            # per step: one flag (are the gradients sent still current?) and one number per
            # parameter (their norms' parts): no gradient is all-reduced
            assert sizes == [1, r["params"]] and calls == 2 * STEPS, (case, sizes, calls)


def _partly_used(rank, world, tmp):
    import macrogen as mg
    from macrogen.runtime.zero_grads import ShardedGradientError

    module = load_module(expand(SOURCE), f"zero_partly_{rank}", Path(tmp))
    torch.manual_seed(0)
    model = module.branchy()
    opt = module.optimizer(model)
    model(torch.ones(2, 8), extra=rank == 0).backward()  # b is used on rank 0 only
    with pytest.raises(ShardedGradientError, match=r"b\.weight got a gradient on some ranks"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    norm = mg.clip_grad_norm_(opt, 1.0)  # from the shares: every parameter's
    opt.step()
    return float(norm)


def test_a_parameter_some_ranks_use_makes_torch_clip_an_error_on_every_rank(tmp_path):
    norms = run_ranks(_partly_used, 2, args=(str(tmp_path),), timeout=120)
    assert norms[0] == norms[1] > 0
