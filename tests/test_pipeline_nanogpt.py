"""@pipeline on nanoGPT's GPT as written (no processes): paths through containers, the tie, the loss.

The model here has nanoGPT's shape: a ``transformer`` ModuleDict holding the
blocks' ModuleList, ``wte`` tied to ``lm_head``, and a forward that computes
its loss when given targets. The distributed parity runs are in
test_pipeline_nanogpt_dist.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg
from macrogen.pipelining import analysis
from macrogen.pipelining import units as pf
from macrogen.runtime import pipeline as rp
from macrogen.runtime.pipeline_plan import forward_cut
from tests.helpers import expand, expansion_errors
from tests.pipeline_units import forward_of


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, block_size=16, n_layer=4):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(block_size, d),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block(d) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(d),
                unused=nn.Linear(d, d),  # forward never names it: stage 0 keeps it
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        t = idx.size(1)
        assert t <= self.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)
        x = self.transformer.drop(tok_emb + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


def _data():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (4, 9), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _plan(model, stages, split):
    return forward_cut(model, stages, split, forward_of(type(model)))


def _parse(source):
    return analysis.parse(source).forward


# -- the plan -----------------------------------------------------------------------------


def test_the_blocks_loop_inside_a_module_dict_is_found_and_balanced():
    model = GPT()
    p = _plan(model, 2, None)
    assert p.forward.loops == ("transformer.h",)
    assert p.describe() == (
        "stage 0: transformer.wte, transformer.drop, transformer.wpe, transformer.h.0-1"
        " | stage 1: transformer.h.2-3, transformer.ln_f, lm_head"
    )
    assert p.carried == ["x"]
    assert p.owners["transformer.wte"] == {0} and p.owners["lm_head"] == {1}
    assert p.owners["transformer.h.3"] == {1}
    assert p.owners["transformer.unused"] == {0}
    assert "transformer" not in p.owners and "transformer.h" not in p.owners


def test_split_names_reach_through_the_containers():
    model = GPT()
    p = _plan(model, 3, ("transformer.h.1", "transformer.ln_f"))
    assert p.describe() == (
        "stage 0: transformer.wte, transformer.drop, transformer.wpe, transformer.h.0"
        " | stage 1: transformer.h.1-3 | stage 2: transformer.ln_f, lm_head"
    )


def test_the_tie_across_the_cut_is_kept_not_refused():
    """It used to be `stages 1 and 0 both use a parameter ... untie the weights`."""
    model = GPT()
    assert _plan(model, 2, None).tied == [("lm_head.weight", frozenset({0, 1}))]
    # on one side of the cut there is nothing to share
    assert _plan(model, 2, ("transformer.ln_f",)).tied == [("lm_head.weight", frozenset({0, 1}))]


def test_a_parameter_used_on_one_stage_only_is_not_tied():
    model = GPT()
    model.transformer.wte.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    assert _plan(model, 2, None).tied == []


@pytest.mark.parametrize(
    "split, message",
    [
        # (the expansion says it is "called inside `if targets is not None:`": the
        # pipeline_container_errors golden; the runtime reads no source)
        (("lm_head",), "'lm_head' is no submodule forward calls at top level"),
        (
            ("transformer.h",),
            "the list forward loops over: name the block that starts the stage (transformer.h.0-3)",
        ),
        (
            ("transformer.h.7",),
            "self.transformer.h has 4 blocks (transformer.h.0 to transformer.h.3)",
        ),
        (("transformer.ln_g",), "did you mean 'transformer.ln_f'?"),
    ],
)
def test_refused_splits_list_real_choices(split, message):
    with pytest.raises(ValueError, match=None) as e:
        _plan(GPT(), 2, split)
    assert message in str(e.value)
    assert "()" not in str(e.value)


# -- forward's analysis -----------------------------------------------------------------


def test_targets_reach_the_last_stage_only():
    source = """
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        if targets is not None:
            return self.lm_head(x), targets
        return self.lm_head(x), None
    """
    with pytest.raises(pf.SplitError, match="return before the end"):
        _parse(source)
    forward = _parse(
        """
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        loss = None if targets is None else F.cross_entropy(self.lm_head(x), targets)
        return x, loss
    """
    )
    assert forward.targets == "targets"
    units = forward.units({"transformer.h": 2})
    assert pf.check_cuts(forward, units, [2]) == ["x"]  # targets is no carried value
    assert "targets" in forward.statements[-2].reads  # the last stage's statement reads it
    assert all("targets" not in s.reads for s in forward.statements[:2])  # stage 0 never does


def test_a_second_parameter_without_a_default_is_no_targets():
    forward = _parse("def forward(self, x, mask):\n    return self.a(x, mask)\n")
    assert forward.targets is None


def test_targets_read_before_the_last_stage_are_refused():
    forward = _parse(
        """
    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x) * (targets is None)
        return x
    """
    )
    units = forward.units({"blocks": 3})
    with pytest.raises(pf.SplitError, match="'targets' .* reaches the last stage only"):
        pf.check_cuts(forward, units, [3])


# -- the serial step -------------------------------------------------------------------


def test_pipeline_step_without_a_loss_fn_is_nanogpts_step():
    torch.manual_seed(0)
    a = GPT()
    b = GPT()
    b.load_state_dict(a.state_dict())
    x, y = _data()
    loss = mg.pipeline_step(a, x, y)
    _, ref = b(x, y)
    ref.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(a.lm_head.weight.grad, b.lm_head.weight.grad)


def test_a_tuple_gives_its_first_element_to_the_loss_fn():
    torch.manual_seed(0)
    model = GPT()
    x, y = _data()
    loss = mg.pipeline_step(model, x, y, lambda logits, y: F.cross_entropy(logits[:, -1], y[:, -1]))
    assert loss.ndim == 0 and model.lm_head.weight.grad is not None


def test_a_forward_returning_no_loss_says_so():
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError):  # Linear takes no targets: the serial call fails as written
        mg.pipeline_step(model, torch.randn(2, 3), torch.randn(2, 2))
    model = GPT()
    with pytest.raises(ValueError, match="got NoneType: return the loss"):
        rp.serial_step(model, _data()[0], None)  # targets=None: nanoGPT returns (logits, None)


# -- expansion ----------------------------------------------------------------------------

NANO = """
import torch
import torch.nn as nn
import torch.nn.functional as F
import macrogen as mg


@mg.pipeline({args})
class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([nn.Linear(config.n_embd, config.n_embd) for _ in range(6)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss
"""


def test_nanogpt_as_written_expands_without_split():
    """It used to say the forward has no `for block in self.<ModuleList>:` loop."""
    code = expand(NANO.format(args="stages=2"))
    assert "# cut: at run time, between blocks of self.transformer.h" in code
    assert (
        "# tied: transformer.wte.weight = lm_head.weight: each stage that uses it holds it" in code
    )


def test_the_block_count_is_read_through_the_module_dict():
    errors = expansion_errors(NANO.format(args="stages=8, microbatches=8"))
    assert errors == [
        "test.py:8:21: error: 8 stages but forward's loop over self.transformer.h has 6 blocks:"
        " at most one stage per block"
    ]
    errors = expansion_errors(NANO.format(args="stages=2, split=['transformer.h.6']"))
    assert "self.transformer.h has 6 blocks (transformer.h.0 to transformer.h.5)" in errors[0]


def test_every_split_refusal_lists_real_choices():
    for split in ("'lm_head'", "'h.2'", "'transformer'", "'transformer.h'", "'wte'"):
        errors = expansion_errors(NANO.format(args=f"stages=2, split=[{split}]"))
        assert len(errors) == 1, errors
        assert "()" not in errors[0] and ": )" not in errors[0], errors[0]
        assert "transformer.h." in errors[0] or "order" in errors[0], errors[0]


def test_the_container_golden_plans_at_run_time_as_its_expansion_says(tmp_path):
    from pathlib import Path

    from tests.helpers import load_module

    golden = Path(__file__).parent / "golden" / "pipeline_container_paths"
    module = load_module((golden / "input.py").read_text(), "container_paths_input", tmp_path)
    expected = (golden / "expected.py").read_text()
    split = _plan(module.Split(), 3, ("stack.blocks.2", "stack.norm"))
    assert f"# cut: {split.describe()}\n" in expected
    balanced = _plan(module.Balanced(), 2, None)  # a Sequential inside a ModuleDict
    assert balanced.forward.loops == ("body.layers",)
    assert (
        balanced.describe() == "stage 0: body.inp, body.layers.0 | stage 1: body.layers.1-2, head"
    )


class NoLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleDict(dict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)))

    def forward(self, x):
        x = self.body.a(x)
        return self.body.b(x)


def test_no_loop_to_balance_names_where_a_stage_may_start():
    with pytest.raises(ValueError, match=r"give split=\[...\] .*stages may start at: body\.b\)"):
        _plan(NoLoop(), 2, None)
    assert _plan(NoLoop(), 2, ("body.b",)).describe() == "stage 0: body.a | stage 1: body.b"
