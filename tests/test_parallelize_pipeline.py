"""``mg.parallelize(pp=N)`` without ranks: forward read at run time, its errors, the serial run.

The cut itself on gloo ranks: tests/test_parallelize_pipeline_dist.py.
"""

from __future__ import annotations

import textwrap
import traceback

import pytest
import torch
import torch.nn as nn

from macrogen.runtime import mesh as meshes
from macrogen.runtime import pipeline as rp
from macrogen.runtime.parallelize_pipeline import apply_pipeline, forward_of
from macrogen.runtime.pipeline_plan import forward_cut
from tests.helpers import expand, load_module

SCALE = 2.0


class Net(nn.Module):
    def __init__(self, layers=4, dim=8):
        super().__init__()
        self.emb = nn.Embedding(16, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, 16)

    def forward(self, ids):
        x = self.emb(ids) * SCALE  # a global of forward's module
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _whole(model, *args):
    """forward run through the generated unit functions, as one stage."""
    forward = forward_of(type(model), where="test.py:1")
    return forward_cut(model, 1, None, forward).code(model, 0)(model, *args)


def test_units_run_forward_with_its_globals():
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 16, (2, 5))
    assert torch.equal(_whole(model, ids), model(ids))


def test_a_class_defined_in_a_function_keeps_its_closure():
    scale = 3.0

    class Local(Net):
        def forward(self, ids):
            x = self.emb(ids) * scale
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = Local()
    ids = torch.randint(0, 16, (2, 5))
    assert torch.equal(_whole(model, ids), model(ids))


def test_a_stage_error_shows_the_users_line():
    class Failing(Net):
        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x[..., :3])  # the wrong width: raises here
            return self.head(x)

    model = Failing()
    with pytest.raises(RuntimeError) as e:
        _whole(model, torch.zeros(1, 2, dtype=torch.long))
    frames = [f for f in traceback.extract_tb(e.tb) if f.filename == __file__]
    assert frames[-1].line == "x = block(x[..., :3])  # the wrong width: raises here"


class Early(Net):
    def forward(self, ids):
        x = self.emb(ids)
        if x.sum() > 0:
            return x
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class NoLoop(Net):
    def forward(self, ids):
        return self.head(self.emb(ids))


class Super(Net):
    def forward(self, ids):
        return super().forward(ids)


@pytest.mark.parametrize(
    ("cls", "why"),
    [
        (Early, "a return before the end of forward"),
        (NoLoop, "has no `for block in self.<ModuleList>:` loop"),
        (Super, "it calls super()"),
    ],
)
def test_a_forward_that_cant_be_cut_is_one_line_naming_the_class(cls, why):
    with pytest.raises(ValueError) as e:
        apply_pipeline(
            cls(), meshes.SERIAL, pp=2, microbatches=4, schedule="1f1b", where="train.py:9"
        )
    message = str(e.value)
    assert message.startswith(
        f"mg.parallelize at train.py:9: pp > 1 cuts {cls.__name__}.forward into pipeline stages"
    )
    assert why in message and "docs/pipeline.md" in message and "\n" not in message


def test_a_forward_without_source_is_a_clear_error():
    namespace: dict = {"nn": nn}
    exec(
        textwrap.dedent(
            """
            class Hidden(nn.Module):
                def forward(self, x):
                    return x
            """
        ),
        namespace,
    )
    with pytest.raises(ValueError, match="Hidden.forward .* its source can't be read"):
        forward_of(namespace["Hidden"], where="train.py:9")


def test_more_stages_than_blocks_is_an_error():
    with pytest.raises(ValueError, match="4 stages but forward's loop over self.blocks has 2"):
        apply_pipeline(
            Net(layers=2), meshes.SERIAL, pp=4, microbatches=4, schedule="1f1b", where="t.py:1"
        )


PROGRAM = """
import torch
import torch.nn as nn
import torch.nn.functional as F
import macrogen as mg


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train():
    torch.manual_seed(0)
    model = mg.parallelize(Net(), pp=2, microbatches=4, dp="{dp}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 16, (4, 6))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(mg.pipeline_step(model, ids, ids, loss_fn).item())
        opt.step()
    return model, losses
"""


@pytest.mark.parametrize("dp", ["replicate", "fsdp", "none"])
def test_without_ranks_the_expanded_program_is_the_serial_one(tmp_path, dp):
    source = PROGRAM.replace("{dp}", dp)
    serial = load_module(source, f"pp_serial_{dp}", tmp_path).train()
    model, losses = load_module(expand(source), f"pp_expanded_{dp}", tmp_path).train()
    assert losses == serial[1]
    pipe = rp.pipeline_of(model)
    assert pipe is not None and pipe.layout is None  # planned, kept whole
    assert pipe.describe() == "stage 0: emb, blocks.0-1 | stage 1: blocks.2-3, head"
    state = model.full_state_dict()
    assert list(state) == list(serial[0].state_dict())
    for k, v in serial[0].state_dict().items():
        assert torch.equal(state[k], v), k
    model.load_full_state_dict(state)


def test_the_tuner_prunes_what_the_expansion_refuses():
    from macrogen.autotune.layouts import pipeline_problem
    from macrogen.macros.parallelize_arguments import DEFAULTS

    def problem(**values):
        return pipeline_problem({**DEFAULTS, **values})

    assert problem(pp=2, microbatches=4) == (None, ("microbatches", "schedule"))
    assert problem(pp=2, tp=2, microbatches=4)[0] is None  # tensor parallel inside the stages
    assert "needs at least as many micro-batches" in problem(pp=4, microbatches=2)[0]
    assert problem(pp=4, microbatches=2, schedule="gpipe")[0] is None
    assert "accumulate=1" in problem(pp=2, microbatches=4, accumulate=2)[0]


def test_a_transformers_model_is_refused_naming_why():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.forward .* submodule's forward"):
        apply_pipeline(model, meshes.SERIAL, pp=2, microbatches=4, schedule="1f1b", where="t:1")
