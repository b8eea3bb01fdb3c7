"""``mg.parallelize(pp=2, pp_split=...)``: stages of uneven blocks, equal to the serial program.

The GPT of tests/test_parallelize_pipeline_dist.py (4 blocks, tied embedding and head) cut
with ``pp_split=[3, 1]`` (stage 0's device 3x as fast: it takes 3 blocks, the last stage
1 and the head) and with ``pp_split="measured"`` (whatever the probes said: every rank
cuts alike), trained 3 AdamW steps on 2 gloo ranks: losses, gradients and parameters
within 1e-10 of the serial run in float64 (that file's ``_check``).
"""

from __future__ import annotations

from tests import test_parallelize_pipeline_dist as base
from tests.helpers import expand, load_module

SOURCE = base.SOURCE.replace(
    '    if variant == "1f1b":',
    '    if variant == "uneven":\n'
    "        return mg.parallelize(model, pp=2, microbatches=4, pp_split=[3, 1])\n"
    '    if variant == "measured":\n'
    '        return mg.parallelize(model, pp=2, microbatches=4, pp_split="measured")\n'
    '    if variant == "1f1b":',
)


def test_uneven_stages_train_as_the_serial_program(tmp_path, monkeypatch):
    assert SOURCE != base.SOURCE
    monkeypatch.setattr(base, "SOURCE", SOURCE)  # (its _check expands and runs this one)
    results = base._check(tmp_path, 2, ["uneven", "measured"])
    for rank in results:
        described = rank["uneven"][3]
        assert "stage 0: wte, wpe, blocks.0-2 | stage 1: blocks.3" in described, described
        assert rank["measured"][3] == results[0]["measured"][3]  # one cut on every rank


def test_serially_the_split_leaves_the_model_whole(tmp_path):
    # (no process group: the unexpanded program's answer, the model not cut)
    module = load_module(expand(SOURCE), "pp_uneven_serial", tmp_path)
    model = module.parallel(module.GPT(), "uneven")
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in module.GPT().parameters()
    )
