"""``resumable`` with a model built on the meta device and given its values by ``init="model"``
(``tests/test_checkpoint_fsdp_dist.py``'s model, batches and checks), and with an expert-parallel
model (``tests.expert_models.PlainMoE`` in float64), in the same spawns.

Under FSDP on 2 gloo ranks: a run stopped at step 5 (checkpoint at 4) and resumed in fresh
objects (built on meta again) ends bit-identical to the uninterrupted run, and its step-4
checkpoint resumes on 4 ranks (DCP reshards), within fp32 rounding.

Under ep=2 on 2 ranks: the same stop and resume ends bit-identical (parameters and AdamW state),
the uninterrupted run equals the serial model on the global batch within 1e-10, and its step-4
checkpoint resumes on 4 ranks as ep=2 x data parallel 2, ep=4 and ep=2 x FSDP, each equal to the
serial model within 1e-10 after the resumed steps.

Pipelined (``tests/pipeline_checkpoints.py``, float64, AdamW, checkpoints every 2 of 6 steps):
a Llama built on meta and filled by ``init=mg.load(folder)`` through ``mg.parallelize(pp=2)``,
and the tests' own GPT with ``@mg.pipeline`` (its embedding and head tied across the stages).
On 2 ranks a run stopped in its third step (after the step-2 checkpoint) and resumed in fresh
objects equals the uninterrupted run exactly (losses, parameters, AdamW state). The step-2
checkpoint of the uninterrupted run resumes as the serial model in this process (pp=1), and
the GPT's also as pp=2 x 2 data replicas on 4 ranks, each within 1e-12 of the uninterrupted
run; the GPT's runs there save again, and their step-4 checkpoints resume exactly. The GPT's
checkpoints hold the serial model's keys (each stage its own parameters; the tied weight's
optimizer state once), and the GPT started on the Llama's checkpoints stops on every rank
with the same error. The extended tier resumes the Llama's as pp=2 x 2 data replicas, pp=2 x
tp=2, pp=2 x FSDP 2 and pp=2 x ZeRO-1 on 4 ranks, as pp=1 on 2 and serially, each layout's
own checkpoint again, and a serial run's checkpoint as pp=2 on 2 ranks; and it stops and
resumes the GPT cut into 4 interleaved stages on 2 ranks, exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from macrogen.runtime.checkpoint import resumable
from macrogen.runtime.checkpoint_files import read_metadata
from tests import pipeline_checkpoints as pipelines
from tests.distributed import run_ranks
from tests.test_checkpoint_fsdp_dist import EVERY, FP32, STEPS, STOP, Net, full


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    from macrogen.runtime.fully_sharded import FullyShardedConfig, apply_fully_sharded
    from macrogen.runtime.materialize import apply_init, check_init
    from macrogen.runtime.parallelize import device_mesh, parallelize_once

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    check_init(model, "model", where="t.py:1")
    parallelize_once(model, where="t.py:1")
    mesh = device_mesh(where="t.py:1")
    apply_fully_sharded(model, mesh, FullyShardedConfig(), where="t.py:1")
    apply_init(model, "model", where="t.py:1")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> torch.Tensor:
    """The step's global batch, drawn from the step alone: a rank the saving job did not have
    has no saved RNG state to draw it with (resumable restores each saved rank's own)."""
    from macrogen.runtime.mesh import mesh

    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(step))
    m = mesh()
    return ids.chunk(m.data_size)[m.data_rank]


def train(ckpt: Path, stop: int | None = None, seed: int = 1) -> nn.Module:
    model, opt = build()
    torch.manual_seed(seed)  # (the batches do not draw from it)
    for step in resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY):
        model(batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == stop:
            break
    return model


# ---- expert parallelism: the plain MoE in float64 --------------------------------------------

EP_LAYOUTS = {"ep2": (2, "replicate"), "ep4": (4, "replicate"), "ep2_fsdp": (2, "fsdp")}
ROWS = 4  # rows of each step's global batch


def build_ep(layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``PlainMoE`` in float64, serial or under ``EP_LAYOUTS[layout]`` (mg.parallelize's steps)."""
    from tests.expert_models import PlainMoE

    torch.manual_seed(0)
    model = PlainMoE().double()
    if layout != "serial":
        from macrogen.runtime import (
            FullyShardedConfig,
            apply_data_parallel,
            apply_expert_parallel,
            apply_fully_sharded,
            device_mesh,
            parallelize_once,
        )

        ep, dp = EP_LAYOUTS[layout]
        parallelize_once(model, where="t.py:1")
        mesh = device_mesh(where="t.py:1")
        apply_expert_parallel(model, mesh, ep=ep, where="t.py:1", dp=dp)
        if dp == "fsdp":
            apply_fully_sharded(model, mesh, FullyShardedConfig(), where="t.py:1")
        else:
            apply_data_parallel(model, mesh, dp, where="t.py:1")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def ep_batch(step: int, serial: bool = False) -> torch.Tensor:
    """The step's global batch (drawn from the step alone), or this data rank's rows of it."""
    from macrogen.runtime.mesh import mesh
    from tests.expert_models import batches

    ids = batches(step + 1, ROWS)[step]
    m = mesh()
    return ids if serial else ids.chunk(m.data_size)[m.data_rank]


def train_ep(
    layout: str, ckpt: Path | None, stop: int | None = None, seed: int = 1
) -> tuple[dict, int]:
    """``STEPS`` AdamW steps under ``resumable`` (serially without ``ckpt``): parameters and
    optimizer state, whole, and how many steps this run took (a resumed run: those after its
    checkpoint)."""
    model, opt = build_ep(layout)
    torch.manual_seed(seed)  # (the batches do not draw from it)
    steps = range(STEPS)
    if ckpt is not None:
        steps = resumable(steps, model=model, optimizer=opt, dir=ckpt, every=EVERY)
    taken = 0
    for step in steps:
        taken += 1
        ids = ep_batch(step, serial=ckpt is None)
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad()
        if step == stop:
            break
    return whole_state(model, opt), taken


def whole_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: whole(p) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        out.update({f"{names[id(p)]}:{k}": whole(v) for k, v in state.items()})
    return out


def gap(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    return max(float((ours[k] - v).abs().max()) for k, v in theirs.items())


# ---- the spawns ------------------------------------------------------------------------------


def stop_and_resume(rank: int, world: int, root: str, src: dict) -> tuple:
    whole = full(train(Path(root) / "whole"))
    train(Path(root) / "resumed", stop=STOP)
    resumed = full(train(Path(root) / "resumed", seed=2))
    ep_whole = train_ep("ep2", Path(root) / "ep")  # (its step-4 checkpoint: the 4-rank runs')
    train_ep("ep2", Path(root) / "ep_resumed", stop=STOP)
    ep_resumed = train_ep("ep2", Path(root) / "ep_resumed", seed=2)
    pipelined = pipelines.stop_and_resume(Path(src["dir"]) / "pp", src)
    return whole, resumed, ep_whole, ep_resumed, pipelined


def resume_elsewhere(
    rank: int, world: int, root: str, src: dict, cases: list[tuple[str, str, bool]]
) -> tuple[dict, dict[str, tuple], dict]:
    ep = {layout: train_ep(layout, Path(root) / layout, seed=3) for layout in EP_LAYOUTS}
    pipelined = resume_pipelines(rank, world, src, cases)
    return full(train(Path(root) / "fsdp", seed=3)), ep, pipelined


def resume_pipelines(
    rank: int, world: int, src: dict, cases: list[tuple[str, str, bool]]
) -> dict[tuple[str, str], tuple]:
    """The 2-rank pipelined runs' checkpoints resumed under other layouts (``(kind, layout,
    again)``: ``pipelines.resumed_as``)."""
    root = Path(src["dir"]) / "pp"
    return {
        (k, layout): pipelines.resumed_as(root, k, layout, src, again) for k, layout, again in cases
    }


def check_pipelines(wholes: dict, resumed: dict) -> dict[str, float]:
    """Each resumed layout: its first run within 1e-12 of the uninterrupted pp=2 run (losses
    and state), and the run resumed from its own checkpoint equal to it; the gaps."""
    gaps = {}
    for (kind, layout), (first, second) in resumed.items():
        (losses, state), (want_losses, want_state) = first, wholes[kind]
        assert sorted(losses) == list(range(pipelines.EVERY, pipelines.STEPS)), (kind, layout)
        gaps[f"{kind} {layout}"] = max(
            pipelines.gap(losses, {s: want_losses[s] for s in losses}),
            pipelines.gap(state, want_state),
        )
        if second is None:  # (not run again from its own checkpoint)
            continue
        assert sorted(second[0]) == list(range(2 * pipelines.EVERY, pipelines.STEPS))
        assert second[0] == {s: losses[s] for s in second[0]}, (kind, layout, "losses")
        assert pipelines.gap(second[1], state) == 0.0, (kind, layout, "own checkpoint")
    print("pipelines resumed elsewhere, gaps to the uninterrupted pp=2 run:", gaps)
    assert max(gaps.values()) <= 1e-12, gaps
    return gaps


@pytest.fixture(scope="module")
def pipeline_sources(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("transformers")
    return pipelines.sources(tmp_path_factory.mktemp("pipelines"))


def test_meta_built_expert_parallel_and_pipelined_models_resume_exactly_and_elsewhere(
    tmp_path: Path, pipeline_sources: dict
) -> None:
    src = pipeline_sources
    results = run_ranks(stop_and_resume, 2, args=(str(tmp_path), src), timeout=300)
    whole, resumed, (ep_whole, _), (ep_resumed, taken), (pipelined, refused) = results[0]
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), f"{key} differs after stop and resume"
    assert taken == STEPS - EVERY  # resumed from the step-4 checkpoint
    for key, value in ep_whole.items():
        assert torch.equal(ep_resumed[key], value), f"ep2: {key} differs after stop and resume"
        assert torch.equal(results[1][3][0][key], value), f"ep2: {key} differs between the ranks"
    for kind, ((whole_losses, whole_state), (losses, state)) in pipelined.items():
        assert sorted(losses) == list(range(pipelines.EVERY, pipelines.STEPS)), kind
        assert losses == {s: whole_losses[s] for s in losses}, f"{kind}: losses after resume"
        assert pipelines.gap(state, whole_state) == 0.0, f"{kind}: state after stop and resume"
    assert "is from a different model" in refused and refused == results[1][4][1], refused
    serial, _ = train_ep("serial", None)
    gaps = {"ep2 on 2": gap(ep_whole, serial)}
    four = tmp_path / "four"
    shutil.copytree(tmp_path / "whole" / "step_00000004", four / "fsdp" / "step_00000004")
    for layout in EP_LAYOUTS:
        shutil.copytree(tmp_path / "ep" / "step_00000004", four / layout / "step_00000004")
    # the GPT as pp=2 x 2 data replicas (the Llama: in the extended tier)
    cases = [("gpt", "pp2", True)]
    on_four, ep_on_four, pp_on_four = run_ranks(
        resume_elsewhere, 4, args=(str(four), src, cases), timeout=300
    )[0]
    for key, value in whole.items():
        torch.testing.assert_close(on_four[key], value, **FP32, msg=key)
    for layout, (state, taken) in ep_on_four.items():
        assert taken == STEPS - EVERY, layout  # resumed from the 2-rank step-4 checkpoint
        gaps[f"{layout} on 4"] = gap(state, serial)
    print("gaps to the serial model:", gaps)
    assert max(gaps.values()) < 1e-10, gaps
    serially = resume_pipelines(0, 1, src, [("llama", "serial", False), ("gpt", "serial", True)])
    check_pipelines({k: w for k, (w, _) in pipelined.items()}, {**pp_on_four, **serially})
    # the pipelined checkpoints hold the serial model's keys: every stage's, the tie's once
    saved = same_keys_as_serial(Path(src["dir"]) / "pp" / "gpt")
    assert "optim.state.lm_head.weight.exp_avg" not in saved  # the GPT's tied weight: wte's


def same_keys_as_serial(root: Path) -> set[str]:
    """The model and optimizer keys of the uninterrupted pp=2 run's last checkpoint, which must
    be those of the serial run's (``resumed_as(..., "serial")``)."""

    def keys(folder: Path) -> set[str]:
        saved = read_metadata(folder).state_dict_metadata
        return {k for k in saved if k.startswith(("model.", "optim."))}

    pipelined = keys(root / "whole" / "step_00000006")
    assert pipelined == keys(root / "serial" / "first" / "step_00000006"), root
    return pipelined


def test_pipelines_resume_under_tensor_parallel_fsdp_and_without_stages(
    tmp_path: Path, pipeline_sources: dict
) -> None:
    """The extended tier's layouts: the Llama's pp=2 checkpoint resumed as pp=2 x 2 data
    replicas, pp=2 x tp=2, pp=2 x FSDP 2 and pp=2 x ZeRO-1 on 4 ranks, as pp=1 on 2 and
    serially, and each of those layouts' own checkpoint resumed again; a checkpoint of the
    serial run resumed as pp=2 on 2 ranks; and the GPT cut into 4 interleaved stages (2 a
    rank) stopped and resumed exactly."""
    src = {**pipeline_sources, "dir": str(tmp_path)}
    results = run_ranks(uninterrupted_and_pp1, 2, args=(src,), timeout=300)
    wholes, pp1, ((whole_losses, whole_state), (losses, state)) = results[0]
    assert losses == {s: whole_losses[s] for s in losses} and sorted(losses) == [2, 3, 4, 5]
    assert pipelines.gap(state, whole_state) == 0.0, "interleaved: state after stop and resume"
    four = [("llama", layout, True) for layout in ("pp2", "pp2_tp2", "pp2_fsdp", "pp2_zero1")]
    on_four = run_ranks(resume_pipelines, 4, args=(src, four), timeout=300)[0]
    serially = resume_pipelines(0, 1, src, [("llama", "serial", True)])
    check_pipelines(wholes, {**pp1, **on_four, **serially})
    same_keys_as_serial(Path(src["dir"]) / "pp" / "llama")
    # and the other way: the serial run's step-4 checkpoint resumed as pp=2 on 2 ranks
    losses, state = run_ranks(from_serial, 2, args=(src,), timeout=300)[0]
    want_losses, want_state = wholes["llama"]
    assert sorted(losses) == [4, 5]
    assert pipelines.gap(losses, {s: want_losses[s] for s in losses}) <= 1e-12
    assert pipelines.gap(state, want_state) <= 1e-12


def from_serial(rank: int, world: int, src: dict) -> pipelines.Run:
    here = Path(src["dir"]) / "pp" / "llama"
    pipelines.copy(
        here / "serial" / "first" / "step_00000004", here / "from_serial" / "step_00000004"
    )
    return pipelines.train("llama", "pp2", src, here / "from_serial", seed=5)


def uninterrupted_and_pp1(rank: int, world: int, src: dict) -> tuple[dict, dict, tuple]:
    root = Path(src["dir"]) / "pp"
    wholes = {"llama": pipelines.train("llama", "pp2", src, root / "llama" / "whole")}
    interleaved = pipelines.stopped_and_resumed(root, "gpt_interleaved", src)
    return wholes, resume_pipelines(rank, world, src, [("llama", "replicate", True)]), interleaved
