"""Pipelined models under ``resumable``, for ``tests/test_meta_checkpoint_dist.py``.

Two models, in float64, ``STEPS`` AdamW steps with a checkpoint every ``EVERY``:

- ``llama``: a transformers Llama (``tests/meta_models.py``'s shrunk config) built on the meta
  device and given its values by ``init=mg.load(folder)`` (a ``save_pretrained`` folder),
  through ``mg.parallelize(pp=2, ...)`` and the other layouts of ``meta_models.LAYOUTS``
  (``replicate``: pp=1; ``pp2_zero1``: with ``shard_optimizer``, as the expanded
  ``mg.shard_optimizer`` call makes it), trained through ``mg.pipeline_step`` with a float64 loss;
  ``"serial"``: the unexpanded marker in one process. A resumed run's values come from the
  checkpoint (``init=`` fills the model first).
- ``gpt``: the tests' own GPT with ``@mg.pipeline`` (``tests/golden/pipeline_tied_cut``: the
  embedding on stage 0 tied to the head on stage 1; forward computes its loss). Expanded it is
  cut into 2 stages (on 4 ranks: 2 data replicas of them); ``"serial"``: the file unexpanded.
  ``gpt_interleaved``: the same cut into 4 stages, 2 a rank (``schedule="interleaved"``: the
  tied weight on stages 0 and 3).

Each step's global batch is drawn from the step alone (a rank the saving job did not have
has no saved RNG state to draw it with); a rank trains its data rank's rows. A run gives its
losses and its whole state: every parameter under each of its names and its AdamW state,
gathered from every stage.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import macrogen as mg
from tests import meta_models

STEPS, EVERY, STOP = 6, 2, 2  # checkpoints at 2, 4, 6; a run stopped in step 2 resumes at 2
ROWS, SEQ = 8, 8  # each step's global batch: 4 micro-batches of 2 data replicas get a row each
VOCAB = 64
GOLDEN = Path(__file__).parent / "golden" / "pipeline_tied_cut" / "input.py"
CUT = '@mg.pipeline(stages=2, microbatches=4, schedule="1f1b", split=["transformer.h.2"])'
INTERLEAVED = '@mg.pipeline(stages=4, microbatches=4, schedule="interleaved")'
Run = tuple[dict[int, float], dict[str, torch.Tensor]]  # (each step's loss, the whole state)


def sources(directory: Path) -> dict[str, str]:
    """What the ranks build from: the expanded layouts, the Llama's folder, the GPT expanded."""
    torch.manual_seed(0)
    llama = meta_models.model_class("llama")(meta_models.config("llama")).double()
    llama.save_pretrained(directory / "llama")
    source = GOLDEN.read_text()
    assert CUT in source
    return {
        "layouts": meta_models.expanded(directory),
        "folder": str(directory / "llama"),
        "gpt": mg.expand_source(source, path=str(GOLDEN)).code,
        "gpt_interleaved": mg.expand_source(
            source.replace(CUT, INTERLEAVED), path=str(GOLDEN)
        ).code,
        "dir": str(directory),
    }


@functools.cache
def _gpt(kind: str, code: str, directory: str) -> Any:
    """The GPT module (``code``: expanded, or the file as it is), loaded once per process."""
    from tests.helpers import load_module

    return load_module(code, f"{kind}_checkpoints_{os.getpid()}", Path(directory))


def build(kind: str, layout: str, src: dict[str, str]) -> torch.nn.Module:
    from macrogen.runtime import mesh

    mesh.reset()  # (one mesh per program: each run is a program of its own)
    torch.manual_seed(7)
    if kind.startswith("gpt"):
        if layout == "serial":
            module = _gpt("gpt_serial", GOLDEN.read_text(), src["dir"])
        else:
            module = _gpt(kind, src[kind], src["dir"])
        return module.GPT(module.GPTConfig())
    model = meta_models.meta_model("llama")
    if layout == "serial":
        return mg.parallelize(model, init=mg.load(src["folder"]))  # the unexpanded marker
    return getattr(meta_models._module(src["layouts"]), layout)(model, mg.load(src["folder"]))


def train(
    kind: str,
    layout: str,
    src: dict[str, str],
    ckpt: Path,
    stop: int | None = None,
    seed: int = 1,
) -> Run:
    """``STEPS`` steps under ``resumable``: the losses of the steps this run took (a resumed
    run: those after its checkpoint) and its whole state."""
    from macrogen.runtime.checkpoint import resumable

    torch.set_default_dtype(torch.float64)
    try:
        model = build(kind, layout, src)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        if layout.endswith("zero1"):  # (what the expanded mg.shard_optimizer(...) calls)
            from macrogen.runtime.zero import shard_optimizer

            opt = shard_optimizer(opt)
        torch.manual_seed(seed)  # (the batches do not draw from it)
        loop = resumable(
            range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY, keep=STEPS
        )
        losses = {}
        for step in loop:
            ids = _batch(step)
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # (as nanoGPT's get_batch)
            loss_fn = None if kind.startswith("gpt") else _loss  # (the GPT's forward: its own)
            loss = mg.pipeline_step(model, x, y, loss_fn)
            opt.step()
            opt.zero_grad()
            losses[step] = _mean_over_data(loss.detach())
            if step == stop:
                break
        del loop  # waits for the save in flight
        return losses, whole_state(model, opt)
    finally:
        from macrogen.runtime import mesh

        torch.set_default_dtype(torch.float32)
        mesh.reset()  # (the next program makes its own)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 cross entropy (HF's own loss is float32)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch(step: int) -> torch.Tensor:
    """The step's global batch (from the step alone), this data rank's rows of it."""
    from macrogen.runtime.mesh import SERIAL, mesh

    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    m = mesh() if dist.is_initialized() else SERIAL
    return ids.chunk(m.data_size)[m.data_rank]


def _mean_over_data(loss: torch.Tensor) -> float:
    """The global batch's loss: the data replicas' mean (equal rows)."""
    from macrogen.runtime.mesh import mesh

    if not dist.is_initialized() or mesh().data_size == 1:
        return loss.item()
    dist.all_reduce(loss, group=mesh().data_group)
    return (loss / mesh().data_size).item()


def whole_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter under each of its names, and ``name:key`` for its AdamW state, whole
    (DTensors gathered), from every rank (each stage gives its own)."""
    from macrogen.runtime.dtensor_whole import full_tensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (full_tensor(t) if hasattr(t, "device_mesh") else t).detach().clone()

    from macrogen.runtime.zero import ShardedOptimizer

    names: dict[int, list[str]] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.replace("_checkpoint_wrapped_module.", "")
        names.setdefault(id(p), []).append(name)
        out[name] = whole(p)
    states: Any = opt.state
    if isinstance(opt, ShardedOptimizer):  # its state_dict: the serial optimizer's (gathered)
        params = [p for group in opt.param_groups for p in group["params"]]
        states = {params[i]: state for i, state in opt.state_dict()["state"].items()}
    for p, state in states.items():
        for name in names[id(p)]:
            out.update({f"{name}:{k}": whole(v) for k, v in state.items()})
    if not dist.is_initialized():
        return out
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged


# ---- what the spawns run ---------------------------------------------------------------------


def stop_and_resume(root: Path, src: dict[str, str]) -> tuple[dict[str, tuple[Run, Run]], str]:
    """On 2 ranks (pp=2), each model's uninterrupted run and a run stopped in step ``STOP``
    and resumed in fresh objects with another seed (the saved state must win); and the error
    the GPT started on the Llama's checkpoints raises (on every rank: no stage waits)."""
    from macrogen.runtime.checkpoint import CheckpointError

    out = {kind: stopped_and_resumed(root, kind, src) for kind in ("llama", "gpt")}
    try:
        train("gpt", "pp2", src, root / "llama" / "whole")
    except CheckpointError as e:
        return out, str(e)
    raise AssertionError("the GPT resumed from the Llama's checkpoints")


def stopped_and_resumed(root: Path, kind: str, src: dict[str, str]) -> tuple[Run, Run]:
    """The uninterrupted run of ``kind`` as cut for the spawn's ranks, and a run stopped in step
    ``STOP`` and resumed in fresh objects with another seed (the saved state must win)."""
    whole = train(kind, "pp2", src, root / kind / "whole")
    train(kind, "pp2", src, root / kind / "stopped", stop=STOP)
    return whole, train(kind, "pp2", src, root / kind / "stopped", seed=2)


def resumed_as(
    root: Path, kind: str, layout: str, src: dict[str, str], again: bool = True
) -> tuple[Run, Run | None]:
    """The uninterrupted pp=2 run's first checkpoint resumed under ``layout`` to the end; then,
    ``again``, the checkpoint that run saved next, resumed in fresh objects (this layout's own
    save)."""
    here = root / kind / layout
    first, second = here / "first", here / "second"
    copy(root / kind / "whole" / _step(EVERY), first / _step(EVERY))
    resumed = train(kind, layout, src, first, seed=3)
    if not again:
        return resumed, None
    copy(first / _step(2 * EVERY), second / _step(2 * EVERY))
    return resumed, train(kind, layout, src, second, seed=4)


def _step(step: int) -> str:
    return f"step_{step:08d}"


def copy(source: Path, target: Path) -> None:
    """A checkpoint copied by rank 0 (the others wait)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(source, target)
    if dist.is_initialized():
        dist.barrier()


def gap(ours: dict, theirs: dict) -> float:
    """The largest difference between two runs' states or losses (their keys must agree)."""
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    return max(float(torch.as_tensor(ours[k] - v).abs().max()) for k, v in theirs.items())
