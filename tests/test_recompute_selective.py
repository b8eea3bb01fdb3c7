"""``mg.parallelize(recompute=N)``: every N-th repeated block recomputed (torchtitan's ``ac_freq``).

On one process, float64, against the serial model: a nanoGPT-style model with
dropout whose every 2nd block is recomputed trains bit for bit as the serial one,
only blocks 0, N, 2N, ... are checkpointed, and the state-dict keys stay the
serial model's. Then the expansion, its errors, and the layout autotuner's view:
names, and memory and cost predictions between none and all.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from macrogen.autotune import cost, layouts, memory
from macrogen.autotune.layouts import Layout
from macrogen.runtime import recompute
from macrogen.runtime.recompute import apply_recompute
from tests.helpers import expand, expansion_errors

VOCAB, DIM, SEQ = 32, 16, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).split(DIM, dim=-1)  # one head: (B, T, C)
        att = (q @ k.transpose(-2, -1)) / DIM**0.5
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        return self.proj(att @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.proj = nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.2)  # random: a recompute must replay the same mask

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, blocks: int = 5) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList(Block() for _ in range(blocks))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as nanoGPT's

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def _step(model, ids, seed):
    torch.manual_seed(seed)  # dropout's masks
    loss = F.cross_entropy(model(ids).view(-1, VOCAB), ids.view(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def _gpt(blocks: int = 5) -> GPT:
    torch.manual_seed(0)
    return GPT(blocks).double()


def _recomputed(model: GPT) -> list[int]:
    return [i for i, b in enumerate(model.h) if getattr(b.forward, "_mg_recomputed", False)]


# -- the runtime ---------------------------------------------------------------------------------


def test_every_second_block_trains_bit_identical_to_serial():
    serial = _gpt()
    model = apply_recompute(copy.deepcopy(serial), 2, where="t.py:1")
    assert list(model.state_dict()) == list(serial.state_dict())  # no wrapper in the keys
    assert type(model.h[0]) is Block and _recomputed(model) == [0, 2, 4]
    assert all("forward" not in model.h[i].__dict__ for i in (1, 3))  # the others untouched
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    for seed in range(3):
        want, want_grads = _step(serial, ids, seed)
        got, grads = _step(model, ids, seed)
        assert torch.equal(got, want)
        for name, grad in want_grads.items():
            assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize(
    ("which", "chosen"),
    [(1, [0, 1, 2, 3, 4]), ("blocks", [0, 1, 2, 3, 4]), (2, [0, 2, 4]), (3, [0, 3]), (9, [0])],
)
def test_only_every_nth_block_is_checkpointed_and_run_again(monkeypatch, which, chosen):
    calls = []

    def counted(fn, *args, **kwargs):
        calls.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counted)
    model = apply_recompute(_gpt(), which, where="t.py:1")
    assert _recomputed(model) == chosen
    runs = [0] * len(model.h)
    for i, block in enumerate(model.h):  # fc is called through the module: hooks see each run
        block.fc.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    _step(model, torch.zeros(2, SEQ, dtype=torch.long), 0)
    assert len(calls) == len(chosen)  # one checkpoint per recomputed block and forward
    assert runs == [2 if i in chosen else 1 for i in range(len(model.h))]


def test_saved_activations_fall_between_none_and_all():
    def saved_bytes(model):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.zeros(8, SEQ, dtype=torch.long)).sum()
        return total[0]

    serial = _gpt(blocks=8)
    none, half, every = (
        saved_bytes(apply_recompute(copy.deepcopy(serial), which, where="t.py:1"))
        for which in (None, 2, "blocks")
    )
    assert none > half > every


@pytest.mark.parametrize("bad", [0, -1, True, "half", 2.5, "all"])
def test_a_bad_value_is_a_one_line_error_naming_the_site(bad):
    with pytest.raises(ValueError) as e:
        apply_recompute(_gpt(), bad, where="t.py:3")
    message = str(e.value)
    assert message.startswith(f"mg.parallelize at t.py:3: recompute={bad!r}: expected")
    assert "an int N >= 1" in message and "\n" not in message


def test_every_nth_without_blocks_is_an_error():
    with pytest.raises(ValueError, match="t.py:3: recompute=2 found no repeated blocks"):
        apply_recompute(nn.Linear(2, 2), 2, where="t.py:3")


# -- the expansion -------------------------------------------------------------------------------


def test_the_expansion_recomputes_every_nth_block():
    code = expand("import macrogen as mg\nmodel = mg.parallelize(model, dp='fsdp', recompute=2)\n")
    assert "apply_recompute(model, 2, where=" in code
    assert "every 2nd repeated block recomputed in backward, then fully sharded" in code
    assert "# every 2nd repeated block, from the first, keeps only its input" in code
    code = expand("import macrogen as mg\nmodel = mg.parallelize(model, recompute=3)\n")
    assert "apply_recompute(model, 3, where=" in code and "every 3rd repeated block" in code
    tuned = expand(
        "import macrogen as mg\n"
        "model = mg.parallelize(model, recompute=mg.tunable(2, choices=[None, 2, 'blocks']))\n"
    )
    assert "apply_recompute(model, 2, where=" in tuned


@pytest.mark.parametrize("bad", ["0", "-1", "'half'", "True", "2.0"])
def test_a_bad_literal_is_an_error_at_its_line_and_column(bad):
    (error,) = expansion_errors(
        f"import macrogen as mg\n\nm = mg.parallelize(m, recompute={bad})\n"
    )
    assert error.startswith("test.py:3:33: error:"), error
    assert 'None, "none", "blocks" or an int N >= 1 (every N-th block)' in error


def test_a_bad_choice_of_a_tunable_is_an_error():
    (error,) = expansion_errors(
        "import macrogen as mg\nm = mg.parallelize(m, recompute=mg.tunable(2, choices=[2, 0]))\n"
    )
    assert error.startswith("test.py:2:") and "every N-th block" in error


def test_layout_auto_expands_a_recompute_every_2nd_layout():
    code = expand(
        "import macrogen as mg\ndef build(model):\n    return mg.parallelize(model, layout='auto')\n",
        tuning={"build.parallelize.layout": "tp1 pp1 fsdp mb1 recompute/2"},
    )
    assert "apply_recompute(model, 2, where=" in code and "apply_fully_sharded(model" in code


# -- the layout autotuner ------------------------------------------------------------------------


def test_layout_names_parse_back_and_stay_stable():
    every2 = Layout(tp=2, dp="fsdp", recompute=2)
    assert every2.name() == "tp2 pp1 fsdp mb1 recompute/2"
    assert Layout(tp=2, dp="fsdp", recompute=1).name() == "tp2 pp1 fsdp mb1 recompute"
    assert Layout(tp=2, dp="fsdp").name() == "tp2 pp1 fsdp mb1"
    assert every2.describe(4) == "tp2 x dp2 (fsdp) + recompute 1/2"
    assert Layout(pp=2, microbatches=4, recompute=1).describe(4) == (
        "pp2 (mb4) x dp2 (replicate) + recompute"
    )
    for name in layouts.auto_choices():
        assert layouts.parse(name).name() == name
    assert {layouts.parse(n).recompute for n in layouts.auto_choices()} == {0, 1, 2}
    assert layouts.parse("tp1 pp1 replicate mb1 recompute/3") == Layout(recompute=3)
    for bad in ("recompute/1", "recompute/0", "recompute/", "recompute/x"):
        with pytest.raises(ValueError, match="not a layout"):
            layouts.parse(f"tp1 pp1 replicate mb1 {bad}")


def test_recompute_arguments_map_to_layouts_and_back():
    given = {None: 0, "none": 0, "blocks": 1, 1: 1, 2: 2, 4: 4}
    for value, every in given.items():
        assert layouts.from_arguments({"recompute": value}) == Layout(recompute=every)
        assert layouts.recompute_every(layouts.recompute_argument(every)) == every
    for bad in (0, -1, True, "half", 2.0):
        assert layouts.from_arguments({"recompute": bad}) is None
    assert layouts.from_arguments({"layout": "tp1 pp2 fsdp mb4 recompute/2"}) == Layout(
        1, 2, "fsdp", 4, 2
    )
    assert layouts.recompute_argument(2) == 2 and layouts.recompute_argument(0) is None


def test_every_2nd_is_enumerated_beside_none_and_all():
    four = [layout for layout in layouts.enumerate_layouts(4) if layout.tp == 1 and layout.pp == 1]
    assert [(layout.dp, layout.recompute) for layout in four] == [
        (dp, r) for dp in layouts.LAYOUT_DP_MODES for r in (0, 1, 2)
    ]


def test_the_recomputed_share_counts_blocks_from_the_first():
    assert Layout().recomputed(8) == 0.0
    assert Layout(recompute=1).recomputed(8) == 1.0
    assert Layout(recompute=2).recomputed(8) == 0.5
    assert Layout(recompute=2).recomputed(5) == 3 / 5  # blocks 0, 2, 4
    assert Layout(recompute=3).recomputed(4) == 2 / 4  # blocks 0, 3
    assert Layout(recompute=2).recomputed(0) == 0.0


PROFILE = memory.Profile(
    param_bytes=100,
    sharded_bytes=80,
    block_bytes=80,
    blocks=8,
    state_bytes=200,
    transient_bytes=500,  # 100 of gradients, 400 of activations, all in the blocks
    step_s=1.0,
    block_s=0.8,
    message_bytes=10,
    block_activations=1.0,
)


def test_memory_falls_from_none_to_every_2nd_to_all():
    none, half, every = (
        memory.predict(PROFILE, Layout(recompute=r), 1).activations for r in (0, 2, 1)
    )
    assert none > half > every
    # 4 of 8 blocks keep their activations (200) and 4 their inputs of 10; block 6 lives again
    # in backward after block 7, kept, was freed: no higher peak
    assert half == pytest.approx(400 / 2 + 4 * 10)
    # all: only the inputs, and the last block's activations again in backward (50)
    assert every == pytest.approx(400 / 8 + 8 * 10)
    # 9 blocks, every 2nd: 0, 2, ..., 8; block 8, recomputed first, lives again on top
    nine = dataclasses.replace(PROFILE, blocks=9)
    assert memory.predict(nine, Layout(recompute=2), 1).activations == pytest.approx(
        400 * 4 / 9 + 400 / 9 + 5 * 10
    )
    for world, layout in ((4, Layout(tp=2, dp="fsdp")), (2, Layout(pp=2, microbatches=4))):
        values = [
            memory.predict(PROFILE, dataclasses.replace(layout, recompute=r), world).total
            for r in (0, 2, 1)
        ]
        assert values[0] > values[1] > values[2], layout


def test_cost_rises_from_none_to_every_2nd_to_all():
    machine = cost.Machine(2, cost.GLOO_LOCAL, cost.GLOO_LOCAL)
    none, half, every = (
        cost.predict(PROFILE, Layout(tp=2, recompute=r), 2, machine) for r in (0, 2, 1)
    )
    assert none.compute < half.compute < every.compute
    assert none.tensor < half.tensor < every.tensor  # a recomputed forward all-reduces again
    assert none.calls < half.calls < every.calls
    # the blocks' 0.8 s of forward and backward: half of them gain one forward (a third)
    serial = cost.predict(PROFILE, Layout(recompute=2), 1, machine).compute
    assert serial == pytest.approx(cost.predict(PROFILE, Layout(), 1, machine).compute + 0.4 / 3)
    assert half.tensor == pytest.approx(none.tensor * 5 / 4)  # 4 + 2 x 1/2 all-reduces per block


def test_plan_widens_its_layout_column_for_every_2nd(capsys):
    import argparse

    from macrogen.autotune import planner
    from macrogen.commands.plan import _print_probed

    machine = cost.Machine(8, cost.GLOO_LOCAL, cost.GLOO_LOCAL)
    rows = [
        planner.Row(
            layout,
            cost.predict(PROFILE, layout, 64, machine),
            memory.Breakdown(1, 1, 1, 1),
            None,
            None,
        )
        for layout in (Layout(pp=2, microbatches=4, recompute=2), Layout())
    ]
    _print_probed(
        rows, argparse.Namespace(world_size=64, gpus_per_node=8, link="gloo:1GB/s", top=10)
    )
    header, *lines = capsys.readouterr().out.splitlines()[1:]
    assert "pp2 (mb4) x dp32 (replicate) + recompute 1/2 " in lines[0]
    # every row's step column ends where the header's does
    end = header.index("step") + len("step")
    assert all(line[end - 1] != " " and line[end] == " " for line in lines)
