"""How fast ``macrogen expand`` is: seconds per 1000 lines, median of several runs.

    python bench/expand_speed.py [--repeat 15]

Two files of 1000+ lines: a realistic training module with macro sites
(defines, tunables, target branches, fused_allreduce blocks; goal <= 0.25
s/kLOC), and the same code without macrogen (goal <= 2 ms/kLOC: the cheap
pre-check). libcst's parse alone costs about 0.1 s/kLOC for reference, and is
printed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import libcst as cst

from macrogen.expand import expand_source

HEADER = '''\
"""A GPT-style model and its training step, annotated for macrogen."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

D_MODEL = mg.define(768)
N_HEAD = mg.define(12)
HEAD_DIM = mg.define(D_MODEL // N_HEAD)
BLOCK = mg.tunable(64, choices=[32, 64, 128])
BUCKET_MB = mg.tunable(25, choices=[1, 4, 16, 25, 64])
'''

CHUNK = '''

class Attention{i}(nn.Module):
    """Causal self-attention, variant {i}."""

    def __init__(self, d_model: int = 768, n_head: int = 12, dropout: float = 0.0):
        super().__init__()
        assert d_model % n_head == 0
        self.qkv = nn.Linear(d_model, 3 * d_model)  # (B, T, 3C)
        self.proj = nn.Linear(d_model, d_model)
        self.n_head = n_head
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(T, T, device=x.device, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP{i}(nn.Module):
    def __init__(self, d_model: int = 768, hidden: int = 3072):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block{i}(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(768)
        self.attn = Attention{i}()
        self.ln2 = nn.LayerNorm(768)
        self.mlp = MLP{i}()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def device_kind_{i}() -> str:
    if mg.target("cuda"):
        return "cuda"
    return "cpu"


def sync_metrics_{i}(loss, correct, seen, tokens):
    # one collective for the four counters
    with mg.fused_allreduce(block=BLOCK):
        dist.all_reduce(loss)
        dist.all_reduce(correct)
        dist.all_reduce(seen)
        dist.all_reduce(tokens)
    return loss / seen, correct / seen


def train_step_{i}(model, batch, optimizer, scaler=None):
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    correct = (logits.argmax(-1) == targets).sum()
    seen = torch.tensor(float(targets.numel()))
    tokens = torch.tensor(float(inputs.numel()))
    return sync_metrics_{i}(loss.detach(), correct.float(), seen, tokens)
'''


def annotated_source(min_lines: int = 1000) -> str:
    parts, i = [HEADER], 0
    while sum(p.count("\n") for p in parts) < min_lines:
        parts.append(CHUNK.replace("{i}", str(i)))
        i += 1
    return "".join(parts)


def plain_source(min_lines: int = 1000) -> str:
    """The same code with every macro use removed: nothing for macrogen to do."""
    text = annotated_source(min_lines)
    text = text.replace("import macrogen as mg\n", "")
    text = text.replace('if mg.target("cuda"):', "if torch.cuda.is_available():")
    text = text.replace("with mg.fused_allreduce(block=BLOCK):", "if True:")
    for name in ("define", "tunable"):
        text = text.replace(f"mg.{name}(", "(")
    text = text.replace(", choices=[32, 64, 128]", "").replace(", choices=[1, 4, 16, 25, 64]", "")
    text = text.replace("annotated for macrogen", "plain")
    assert "macrogen" not in text and "mg." not in text
    return text


def seconds(fns, repeat: int) -> list[float]:
    """Median time of each function; run alternately, so load on the machine hits all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()

    annotated, plain = annotated_source(), plain_source()
    result = expand_source(annotated, path="gpt.py")  # warm-up: imports, templates
    assert result.changed and not expand_source(plain, path="plain.py").changed
    kloc_a = annotated.count("\n") / 1000
    kloc_p = plain.count("\n") / 1000

    expand_s, parse_s = seconds(
        [lambda: expand_source(annotated, path="gpt.py"), lambda: cst.parse_module(annotated)],
        args.repeat,
    )
    (plain_s,) = seconds([lambda: expand_source(plain, path="plain.py")], args.repeat * 20)

    print(f"file with macros:    {annotated.count(chr(10))} lines, {len(result.sites)} sites")
    print(f"  expand:            {expand_s / kloc_a:.3f} s/kLOC (goal <= 0.25)")
    print(
        f"  libcst parse only: {parse_s / kloc_a:.3f} s/kLOC (for reference; expand = {expand_s / parse_s:.2f} x parse)"
    )
    print(f"file without macros: {plain.count(chr(10))} lines")
    print(f"  expand:            {plain_s / kloc_p * 1000:.4f} ms/kLOC (goal <= 2)")
    print(f"median of {args.repeat} runs ({args.repeat * 20} for the file without macros)")


if __name__ == "__main__":
    main()
