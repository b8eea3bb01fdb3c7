"""A vocabulary-split LM head (``"transformer.wte": "vocab", "lm_head": "colwise"``) as nanoGPT uses it.

nanoGPT's ``forward`` feeds the head's logits to the loss when given targets and
returns them either way; its ``generate()`` calls ``forward`` without targets and
samples from the last position's logits. Under tensor parallelism the head's
output is this rank's slice of the vocabulary, so:

- the logits that leave ``forward`` without going into the loss (the
  ``targets is None`` branch) are gathered: ``generate()`` draws the serial
  tokens on every rank (written here as nanoGPT's, multinomial sampling with a
  fixed generator, top-k);
- the logits that go into the vocab-parallel loss and are returned too are a
  DTensor sharded on the vocabulary: their ``full_tensor()`` is the serial logits;
- the vocab-parallel cross-entropy computes in the logits' dtype: in fp64 its
  loss and gradients equal ``F.cross_entropy``'s within 1e-12, and a model
  trained in fp64 stays within 1e-12 of serial; fp16/bf16 logits are reduced in
  fp32 and the loss has their dtype, as ``F.cross_entropy``'s.

Checked on 2 gloo ranks (TP=2).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, expansion_errors, load_module

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import macrogen as mg

    VOCAB, BLOCK, N_EMBD = 64, 8, 16


    @mg.tensor_parallel(plan={"c_fc": "colwise", "c_proj": "rowwise"})
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
            self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))


    @mg.tensor_parallel(plan={"transformer.wte": "vocab", "lm_head": "colwise"})
    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(VOCAB, N_EMBD),
                    wpe=nn.Embedding(BLOCK, N_EMBD),
                    h=nn.ModuleList([MLP() for _ in range(2)]),
                    ln_f=nn.LayerNorm(N_EMBD),
                )
            )
            self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # weight tying

        def forward(self, idx, targets=None):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = x + block(x)
            x = self.transformer.ln_f(x)
            if targets is not None:
                logits = self.lm_head(x)
                loss = F.cross_entropy(
                    logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
                )
            else:
                # inference-time mini-optimization: only forward the lm_head on the last position
                logits = self.lm_head(x[:, [-1], :])
                loss = None
            return logits, loss

        @torch.no_grad()
        def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
            for _ in range(max_new_tokens):
                idx_cond = idx if idx.size(1) <= BLOCK else idx[:, -BLOCK:]
                logits, _ = self(idx_cond)
                logits = logits[:, -1, :] / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("Inf")
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat((idx, idx_next), dim=1)
            return idx
    """
)
FP64 = dict(rtol=0, atol=1e-12)


def _load(tmp: Path, rank: int):
    tmp = tmp / f"rank{rank}"
    tmp.mkdir(exist_ok=True)
    return load_module(SOURCE, f"vh_serial_{rank}", tmp), load_module(
        expand(SOURCE), f"vh_parallel_{rank}", tmp
    )


def _models(S, P, dtype=torch.float32):
    torch.manual_seed(0)
    serial = S.GPT().to(dtype)
    torch.manual_seed(0)
    return serial, P.GPT().to(dtype)


def _generate_and_train(rank, world, tmp):
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.tensor_parallel import full_gradients, full_state_dict

    os.environ["MACROGEN_TP_SIZE"] = str(world)
    S, P = _load(Path(tmp), rank)
    serial, model = _models(S, P)
    assert model.lm_head.weight.to_local().shape[0] == S.VOCAB // world  # the head is split
    prompt = torch.randint(0, S.VOCAB, (3, 2), generator=torch.Generator().manual_seed(1))

    # generate(): forward without targets, sampling from the last position (top-k and not)
    for top_k in (None, 10):
        want = serial.generate(
            prompt, 12, temperature=0.8, top_k=top_k, generator=torch.Generator().manual_seed(2)
        )
        got = model.generate(
            prompt, 12, temperature=0.8, top_k=top_k, generator=torch.Generator().manual_seed(2)
        )
        assert torch.equal(got, want), (top_k, got, want)
    logits, loss = model(prompt)
    assert loss is None and logits.shape == (3, 1, S.VOCAB)  # gathered: the whole vocabulary

    # with targets: the loss is vocab-parallel; the returned logits are the serial ones (a DTensor)
    data = torch.randint(0, S.VOCAB, (4, S.BLOCK + 1), generator=torch.Generator().manual_seed(3))
    idx, targets = data[:, :-1], data[:, 1:].clone()
    targets[0, :3] = -1  # ignore_index
    s_logits, s_loss = serial(idx, targets)
    logits, loss = model(idx, targets)
    assert isinstance(logits, DTensor) and not isinstance(loss, DTensor)
    torch.testing.assert_close(logits.full_tensor(), s_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, s_loss, rtol=1e-5, atol=1e-6)

    # fp64: one SGD step from the same weights, loss and parameters within 1e-12 of serial
    serial, model = _models(S, P, torch.float64)
    s_loss = serial(idx, targets)[1]
    s_loss.backward()
    loss = model(idx, targets)[1]
    assert loss.dtype == torch.float64
    loss.backward()
    torch.testing.assert_close(loss, s_loss, **FP64)
    grads = full_gradients(model)
    for name, p in serial.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **FP64, msg=f"grad {name}")
    for m in (serial, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    final = full_state_dict(model)
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(final[key], value, **FP64, msg=f"{key} after a step")
    return got


def _cross_entropy_dtypes(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    from macrogen.runtime.collectives import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(24, 64, generator=g, dtype=torch.float64) * 5
    target = torch.randint(0, 64, (24,), generator=g)
    target[::5] = -1
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, ignore_index=-1, reduction=reduction)
        weights = torch.rand(want.shape, generator=g, dtype=torch.float64)
        (want * weights).sum().backward()
        mine = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, -1, reduction)
        (got * weights).sum().backward()
        assert got.dtype == torch.float64 and mine.grad.dtype == torch.float64
        torch.testing.assert_close(got, want, **FP64, msg=f"fp64 loss, {reduction}")
        torch.testing.assert_close(
            mine.grad, full.grad.chunk(world, dim=-1)[rank], **FP64, msg=f"fp64 grad, {reduction}"
        )
    # half-precision logits: reduced in fp32, the loss in their dtype (as F.cross_entropy's)
    for dtype in (torch.bfloat16, torch.float16):
        half = logits.to(dtype)
        want = F.cross_entropy(half.float(), target, ignore_index=-1)
        mine = half.chunk(world, dim=-1)[rank].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, -1)
        got.backward()
        assert got.dtype == dtype == F.cross_entropy(half, target, ignore_index=-1).dtype
        assert mine.grad.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    return True


def test_generate_equals_serial_on_every_rank_under_a_vocab_split_head(tmp_path):
    tokens = run_ranks(_generate_and_train, 2, args=(str(tmp_path),), timeout=180)
    assert torch.equal(tokens[0], tokens[1])


def test_vocab_parallel_cross_entropy_keeps_the_logits_dtype():
    run_ranks(_cross_entropy_dtypes, 2, timeout=120)


def test_returned_logits_are_gathered_and_the_loss_logits_stay_sharded():
    code = expand(SOURCE)
    assert ("logits = gather_last_dim(self.lm_head(x[:, [-1], :]), self.tp_group)") in code
    assert "logits = as_sharded_dtensor(self.lm_head(x), self.tp_group)" in code
    assert "loss = vocab_parallel_cross_entropy(" in code
    assert "return self.c_proj(F.gelu(self.c_fc(x)))" in code  # into a rowwise layer: as it was


HEAD = """\
import torch.nn as nn
import torch.nn.functional as F
import macrogen as mg

@mg.tensor_parallel(plan={{"head": {style}}})
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 64)

    def forward(self, x, targets=None):
{body}
"""


def _head(body: str, style: str = '"colwise"') -> str:
    return HEAD.format(style=style, body=textwrap.indent(textwrap.dedent(body), " " * 8))


@pytest.mark.parametrize(
    "body, wrapped",
    [
        (
            "return self.head(x)",
            "return gather_last_dim(self.head(x), self.tp_group)",
        ),
        (
            """\
            logits = self.head(x)
            if targets is None:
                return logits
            return F.cross_entropy(logits, targets)
            """,
            "logits = as_sharded_dtensor(self.head(x), self.tp_group)",
        ),
        (
            """\
            logits = self.head(x)
            return F.cross_entropy(logits, targets)
            """,
            "logits = self.head(x)\n",
        ),
    ],
)
def test_where_a_colwise_output_goes_decides_its_layout(body, wrapped):
    assert wrapped in expand(_head(body))


@pytest.mark.parametrize(
    "body, style, message",
    [
        (
            "return self.head(x).softmax(-1)",
            '"colwise"',
            "test.py:12:16: error: self.head's output is split over the tensor-parallel ranks",
        ),
        (
            """\
            logits = self.head(x)
            probs = logits / 2
            return probs, None
            """,
            '"colwise"',
            "test.py:14:16: error: self.head's output is split over the tensor-parallel ranks",
        ),
        (
            "return self.head(x)",
            '("colwise", 2)',
            "test.py:12:16: error: self.head's output (packed blocks",
        ),
    ],
)
def test_a_colwise_output_returned_in_a_way_not_decided_is_an_error(body, style, message):
    errors = expansion_errors(_head(body, style))
    assert len(errors) == 1 and errors[0].startswith(message), errors
