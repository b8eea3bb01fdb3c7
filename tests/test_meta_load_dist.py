"""Models built on the meta device through ``mg.parallelize(..., init=...)``
(``tests/meta_models.py``).

A transformers Llama and Qwen2-MoE, built under ``torch.device("meta")`` and filled with
``init=mg.load(folder)`` (a ``save_pretrained`` folder in shards: the index path; a DCP folder
of the same weights) or ``init="model"``, start from exactly the serial weights (``from_pretrained`` of the folder; the
unexpanded program's initializer) and train 3 AdamW steps within 1e-10 of the serial model, in
float64: tp=2, FSDP and replicated data parallel on 2 ranks, tp=2 x FSDP 2 on 4; and the
Qwen2-MoE under expert parallelism: ep=2 on 2 ranks, ep=2 x data parallel 2, ep=4 and ep=2 x
FSDP over 4 on 4, each rank holding its experts' share only and reading only their keys from
the folder (counted). Pipelines: Llama and Qwen2 (its embedding and head tied, on the first and
the last stage) under pp=2 on 2 ranks, pp=2 x tp=2 and pp=2 x FSDP 2 on 4, each rank's
parameter storage its stage's only (at most 0.6 of the model's bytes at pp=2); every layout x
init x folder kind, pp=2 x 2 replicas too, in the extended tier. One spawn per rank count.
"""

from __future__ import annotations

import re

import pytest

from tests import meta_models
from tests.distributed import run_ranks

pytest.importorskip("transformers")

TWO = [(f, layout, init) for f in ("llama", "qwen2_moe") for layout in ("tp2", "fsdp")
       for init in ("load", "model")] + [("llama", "replicate", "load"), ("llama", "tp2", "dcp"),
                                       ("qwen2_moe", "fsdp", "dcp"), ("qwen2_moe", "ep2", "load"),
                                       ("qwen2_moe", "ep2", "model"), ("qwen2_moe", "ep2_fsdp", "load"),
                                       ("qwen2_moe", "ep2", "dcp"), ("llama", "pp2", "load"),
                                       ("qwen2", "pp2", "model"), ("qwen2", "pp2", "load")]  # fmt: skip
FOUR = [("llama", "tp2_fsdp", "load"), ("qwen2_moe", "tp2_fsdp", "load"),
        ("llama", "tp2_fsdp", "model"), ("qwen2_moe", "tp2_fsdp", "dcp"),
        ("qwen2_moe", "ep2", "load"), ("qwen2_moe", "ep4", "load"),
        ("qwen2_moe", "ep2_fsdp", "load"), ("qwen2_moe", "ep2_fsdp", "model"),
        ("qwen2_moe", "ep2_fsdp", "dcp"), ("llama", "pp2_tp2", "load"),
        ("llama", "pp2_fsdp", "load")]  # fmt: skip
PIPELINES = [(f, layout, init) for f in ("llama", "qwen2") for layout in ("pp2_tp2", "pp2_fsdp", "pp2")
             for init in ("load", "model", "dcp")]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    directory = tmp_path_factory.mktemp("meta")
    return meta_models.expanded(directory), meta_models.save_folders(directory)


def _check(results, world):
    for case, initial, losses, final in results:
        assert initial == 0.0, (case, "initial weights differ from the serial program's", initial)
        ep = re.search(r" ep(\d)(_fsdp)? (\w+) held ([\d.]+) read ([\d.]+)", case)
        if ep is not None:  # each rank holds its experts only (FSDP: its part of them), and
            # reads only their keys
            share = 1 / (world if ep.group(2) else int(ep.group(1)))
            assert float(ep.group(4)) == share, (case, "experts held")
            assert float(ep.group(5)) == (share if ep.group(3) == "load" else 0), (case, "read")
        stage = re.search(r" stage ([\d.]+) real (\w+)", case)
        if stage is not None:  # a pipeline rank allocates its stage only: one of 2 layers
            # (about half the model; Qwen2's tied embedding and head is on both ends)
            assert float(stage.group(1)) < 0.6 and stage.group(2) == "True", (case, "stage")
        assert losses <= 1e-10, (case, "losses", losses)
        assert final <= 1e-10, (case, "parameters after 3 AdamW steps", final)


@pytest.mark.timeout(300)
def test_meta_models_on_2_ranks_equal_the_serial_program(prepared):
    code, folders = prepared
    results = run_ranks(meta_models.run_cases, 2, args=(code, folders, TWO), timeout=280)
    assert len(results[0]) == len(TWO)
    _check(results[0], 2)


@pytest.mark.timeout(300)
def test_meta_models_tp2_by_fsdp2_on_4_ranks_equal_the_serial_program(prepared):
    code, folders = prepared
    results = run_ranks(meta_models.run_cases, 4, args=(code, folders, FOUR), timeout=280)
    _check(results[0], 4)


@pytest.mark.timeout(300)
def test_meta_pipelines_in_every_combination_equal_the_serial_program(prepared):
    """The extended tier's pipelines: both inits and both folder kinds under pp=2 x tp=2,
    pp=2 x FSDP 2 and pp=2 x 2 data replicas, on 4 ranks."""
    code, folders = prepared
    results = run_ranks(meta_models.run_cases, 4, args=(code, folders, PIPELINES), timeout=280)
    _check(results[0], 4)
