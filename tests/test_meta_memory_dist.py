"""Peak memory of build-and-load (``tests/meta_models.py``, ``bench/meta_memory.py``): a Llama
of 306 MB of fp32 parameters (1.2 GB with its gradients and AdamW state: 16x one rank's share),
built on the meta device and loaded with ``init=mg.load`` under FSDP on 4 ranks, peaks on every
rank within 1.3 x (its share + the largest layer) of RSS beyond what it held before, and so does
the same cut into 2 pipeline stages first (pp=2 x FSDP 2); built with
its values on every rank first, as without ``init=``, it peaks at the whole model."""

from __future__ import annotations

import pytest

from tests import meta_models
from tests.distributed import run_ranks

pytest.importorskip("transformers")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["meta", "meta_pp"])
def test_meta_build_and_load_peaks_at_the_share_plus_one_layer(tmp_path, how):
    """``meta_pp``: cut into 2 pipeline stages first, FSDP over each stage's 2 ranks."""
    folder = meta_models.save_memory_folder(tmp_path, 6)
    code = meta_models.expanded(tmp_path)
    for rank in run_ranks(meta_models.measure_memory, 4, args=(code, folder, 6, how),
                          timeout=280):  # fmt: skip
        assert rank["total"] >= 4 * rank["share"]
        assert rank["peak"] <= 1.3 * (rank["share"] + rank["largest"]), rank
