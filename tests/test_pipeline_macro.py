"""@pipeline: what it expands to, its expansion-time errors, and the expanded program's parity.

Goldens (tests/golden/pipeline_*) pin the generated code; here the expanded
golden GPT trains on 2 gloo ranks and must match the unexpanded file run
serially, and mg.pipeline_step is checked to be the serial step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg
from macrogen.runtime import pipeline as rp
from tests.distributed import run_ranks
from tests.helpers import expand, expansion_errors, load_module

GOLDEN = Path(__file__).parent / "golden" / "pipeline_gpt_split" / "input.py"
STEPS = 5

NET = """\
import torch.nn as nn
import macrogen as mg

@mg.pipeline({args})
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
"""


def test_pipeline_step_is_the_serial_step():
    torch.manual_seed(0)
    a, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 2)
    b = nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    loss = mg.pipeline_step(a, x, y, F.mse_loss)
    ref = F.mse_loss(b(x), y)
    ref.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(a.weight.grad, b.weight.grad)


def test_the_cut_is_in_the_generated_class():
    code = expand(NET.format(args="stages=3, microbatches=4, split=['blocks.1', 'blocks.2']"))
    assert "# cut: stage 0: blocks.0 | stage 1: blocks.1 | stage 2: blocks.2, head" in code
    assert "split=('blocks.1', 'blocks.2')," in code


@pytest.mark.parametrize(
    "args, message",
    [
        ("", "pipeline() needs stages=N"),
        ("stages=1", "stages must be a whole number >= 2, not 1"),
        ("stages=2, micro=4", "unknown argument 'micro'"),
        ("stages=4, microbatches=4", "4 stages but forward's loop over self.blocks has 3 blocks"),
        ("stages=2, split='blocks.1'", "split must be a list of submodule names"),
        (
            "stages=2, split=mg.tunable(['blocks.1'], choices=[['blocks.1'], ['head'], ['hed']])",
            "split name 'hed' is no submodule forward calls",
        ),
        ("stages=2, microbatches=mg.tunable(4, choices=[1, 4])", "1f1b needs at least"),
        ("stages=2, schedule='interleaved'", "2 stages at 2 per rank is one pipeline rank"),
        ("stages=3, schedule='interleaved', stages_per_rank=2", "divides stages (3), not 2"),
        ("stages=2, stages_per_rank=2", "needs schedule='interleaved'"),
    ],
)
def test_errors_at_the_users_line(args, message):
    errors = expansion_errors(NET.format(args=args))
    assert len(errors) == 1 and message in errors[0], errors
    assert errors[0].startswith("test.py:4:")


def test_interleaved_expands_with_its_stages_per_rank():
    net = NET.replace("range(3)", "range(4)")
    code = expand(net.format(args="stages=4, schedule='interleaved'"))
    assert "schedule='interleaved',\n        split=None,\n        stages_per_rank=2," in code
    assert "stages_per_rank" not in expand(net.format(args="stages=2"))


def test_a_tunable_split_expands_with_its_default():
    code = expand(
        NET.format(
            args="stages=2, split=mg.tunable(['blocks.1'], choices=[['blocks.1'], ['head']])"
        )
    )
    assert "split=('blocks.1',)," in code
    tuned = expand(
        NET.format(
            args="stages=2, split=mg.tunable(['blocks.1'], choices=[['blocks.1'], ['head']])"
        ),
        tuning={"Net.split": ["head"]},
    )
    assert "split=('head',)," in tuned and "stage 1: head" in tuned


# -- the expanded golden program on 2 ranks --------------------------------------------


def _data():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (8, 17), generator=g)
    return data[:, :-1], data[:, 1:]


def _train(module, cls="GPT"):
    torch.manual_seed(0)
    model = getattr(module, cls)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    idx, targets = _data()
    pipe = rp.pipeline_of(model)
    if pipe is not None and pipe.layout.data_size > 1:  # each data replica trains on its rows
        share = len(idx) // pipe.layout.data_size
        rows = slice(pipe.layout.data_rank * share, (pipe.layout.data_rank + 1) * share)
        idx, targets = idx[rows], targets[rows]
    losses = []
    for _ in range(STEPS):
        module.train(model, [(idx, targets)], optimizer)
        losses.append(module.last_loss)
    if pipe is not None and pipe.layout.data_size > 1:  # the batch's loss: the replicas' mean
        t = torch.tensor(losses)
        torch.distributed.all_reduce(t, group=pipe.layout.data_group)
        losses = (t / pipe.layout.data_size).tolist()
    return losses, model.full_state_dict() if hasattr(
        model, "full_state_dict"
    ) else model.state_dict()


def _source(code: str) -> str:
    # record the loss the loop computes (the golden's loop returns nothing)
    return code.replace(
        "        optimizer.step()\n",
        "        optimizer.step()\n    global last_loss\n    last_loss = loss.item()\n",
    )


def _worker(rank, world, expanded, directory, cls="GPT"):
    sys.path.insert(0, directory)
    module = load_module(_source(expanded), f"pipelined_gpt_{world}_{rank}", Path(directory))
    return _train(module, cls)


def test_expanded_gpt_on_two_ranks_matches_the_unexpanded_file(tmp_path):
    source = GOLDEN.read_text()
    serial = _train(load_module(_source(source), "serial_gpt", tmp_path))
    expanded = mg.expand_source(source, path=str(GOLDEN)).code
    results = run_ranks(_worker, 2, args=(expanded, str(tmp_path)), timeout=300)
    ref_losses, ref_state = serial
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert list(state) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_interleaved_expanded_gpt_on_two_ranks_matches_the_unexpanded_file(tmp_path):
    """4 stages, 2 per rank: the mesh's pipeline dimension is 2."""
    source = GOLDEN.read_text().replace(
        'stages=2,\n    microbatches=mg.tunable(4, choices=[2, 4, 8]),\n    schedule="1f1b",\n'
        '    split=["blocks.3"],',
        'stages=4,\n    microbatches=4,\n    schedule="interleaved",\n'
        '    split=["blocks.1", "blocks.2", "blocks.3"],',
    )
    assert 'schedule="interleaved"' in source
    serial = _train(load_module(_source(source), "serial_gpt_interleaved", tmp_path))
    expanded = mg.expand_source(source, path=str(GOLDEN)).code
    assert "ranks=2," in expanded and "stages_per_rank=2," in expanded
    results = run_ranks(_worker, 2, args=(expanded, str(tmp_path)), timeout=300)
    ref_losses, ref_state = serial
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_pipeline_by_data_parallel_on_four_ranks_matches_the_unexpanded_file(tmp_path):
    """Stacked on the golden GPT: 2 stages x 2 data ranks, @data_parallel averaging each stage."""
    source = GOLDEN.read_text().replace(
        "@mg.pipeline(", "@mg.data_parallel(bucket_mb=1)\n@mg.pipeline("
    )
    serial = _train(load_module(_source(source), "serial_gpt_data", tmp_path))
    expanded = mg.expand_source(source, path=str(GOLDEN)).code
    assert "@data_parallel_class(" in expanded and "@pipeline_class(" in expanded
    results = run_ranks(_worker, 4, args=(expanded, str(tmp_path)), timeout=300)
    ref_losses, ref_state = serial
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
