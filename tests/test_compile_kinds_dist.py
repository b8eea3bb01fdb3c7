"""The kinds ``test_compile_dist`` leaves out, under ``torch.compile``: sequence parallel
through the ``@tensor_parallel`` class decorator, and pipeline stages.

- **Sequence parallel** (the decorator path): tests/golden/tensor_parallel_sequence's
  block, its input sliced over the sequence, compiled whole and block by block's
  sublayers, trains 5 AdamW steps equal to the uncompiled block (1e-6, fp32),
  with nothing recompiled after step 2 and no graph break (the collectives of the
  tensor-parallel layers run synchronously while dynamo traces, so it need not break at
  an async all-reduce).
- **Pipeline stages:** nanoGPT as written (tests/golden/pipeline_tied_cut), 1F1B
  on 2 ranks, each block compiled on its own (torchtitan compiles a pipelined
  model's blocks, not the schedule): ``mg.pipeline_step``'s losses and the
  parameters after 5 steps equal the uncompiled pipeline's.

Both compile with ``aot_eager`` (dynamo and AOTAutograd, where hooks, graph breaks and
recompilations happen; Inductor's C++ build would cost this 2-core machine minutes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import macrogen as mg
from tests.distributed import run_ranks
from tests.helpers import expand, load_module
from tests.test_compile_dist import GraphBreaks

GOLDEN = Path(__file__).parent / "golden"
STEPS = 5


def _counters(breaks: GraphBreaks) -> tuple[int, int]:
    """Graphs compiled so far, and graph breaks as dynamo's graph-break log shows them."""
    import torch._dynamo.utils as dynamo_utils

    return dynamo_utils.counters["stats"]["unique_graphs"], len(breaks.reasons)


def _sequence_parallel(rank, world, tmp, whole):
    import torch._dynamo

    os.environ["MACROGEN_TP_SIZE"] = str(world)
    source = (GOLDEN / "tensor_parallel_sequence" / "input.py").read_text()
    module = load_module(expand(source), f"sp_compile_{whole}_{rank}", Path(tmp))
    shape = (2, 16, 32)
    mine = slice(rank * shape[1] // world, (rank + 1) * shape[1] // world)
    finals, counts = [], None
    for compiled in (False, True):
        torch.manual_seed(0)
        block = module.Block(module.Config())
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
        step = block
        if compiled and whole:
            step = torch.compile(block, backend="aot_eager")
        elif compiled:  # each sublayer on its own
            for child in (block.attn, block.mlp):
                child.compile(backend="aot_eager")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        data = torch.Generator().manual_seed(1)
        with GraphBreaks() as breaks:
            for i in range(STEPS):
                x = torch.randn(shape, generator=data)[:, mine]
                w = torch.randn(shape, generator=data)[:, mine]
                optimizer.zero_grad()
                (step(x) * w).sum().backward()
                optimizer.step()
                if i == 1:
                    after_two = _counters(breaks)[0]
        if compiled:
            counts = (after_two, *_counters(breaks))
        finals.append({k: v.detach().clone() for k, v in block.state_dict().items()})
    for key, value in finals[0].items():
        torch.testing.assert_close(finals[1][key], value, rtol=0, atol=1e-6, msg=key)
    return counts


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "per_sublayer"])
def test_sequence_parallel_compiled_equals_eager(tmp_path, whole):
    results = run_ranks(_sequence_parallel, 2, args=(str(tmp_path), whole), timeout=300)
    after_two, after_all, breaks = results[0]
    print(
        f"sequence parallel, compiled {'whole' if whole else 'per sublayer'}:"
        f" {after_all} graphs, {breaks} graph breaks"
    )
    assert after_two > 0  # it did compile
    assert after_all == after_two  # nothing recompiled after step 2
    assert breaks == 0  # the collectives trace: no async all-reduce in a compiled region


def _pipeline(rank, world, tmp, expanded):
    import torch._dynamo

    from macrogen.runtime import mesh as meshes

    sys.path.insert(0, tmp)
    results, counts = [], None
    for compiled in (False, True):
        meshes.reset()
        module = load_module(expanded, f"pipe_compile_{compiled}_{rank}", Path(tmp))
        torch.manual_seed(0)
        model = module.GPT(module.GPTConfig())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if compiled:  # every block; the ones on other stages never run here
            for block in model.transformer.h:
                block.compile(backend="aot_eager")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
        X, Y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        losses = []
        with GraphBreaks() as breaks:
            for i in range(STEPS):
                optimizer.zero_grad()
                losses.append(mg.pipeline_step(model, X, Y).item())
                optimizer.step()
                if i == 1:
                    after_two = _counters(breaks)[0]
        if compiled:
            counts = (after_two, *_counters(breaks))
        state = {k: v.detach().clone() for k, v in model.full_state_dict().items()}
        results.append((losses, state))
    (eager_losses, eager), (compiled_losses, ours) = results
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=0, atol=1e-6)
    for key, value in eager.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-6, msg=key)
    return counts


def test_pipeline_stages_with_compiled_blocks_equal_eager(tmp_path):
    expanded = mg.expand_source(
        (GOLDEN / "pipeline_tied_cut" / "input.py").read_text(),
        path=str(GOLDEN / "pipeline_tied_cut" / "input.py"),
    ).code
    results = run_ranks(_pipeline, 2, args=(str(tmp_path), expanded), timeout=300)
    for rank, (after_two, after_all, breaks) in enumerate(results):
        print(f"pipeline stage {rank}, blocks compiled: {after_all} graphs, {breaks} breaks")
        assert after_two > 0  # each stage compiled its blocks
        assert after_all == after_two  # nothing recompiled after step 2
