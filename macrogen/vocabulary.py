"""The names macrogen's parallel layouts are spoken in, in one torch-free place.

The pass (macro validation at expansion time), the autotuner (layouts and their
feasibility) and the runtime (the engine that applies a layout) all read these:
a style, a data-parallel mode or a schedule added here is known to all three.
Nothing here imports torch, so the pass stays light.
"""

from __future__ import annotations

from typing import Any

# -- tensor parallel ---------------------------------------------------------------------------

# A plan entry's style, as mg.parallelize(tp_plan={path: style}) takes it; ("colwise", k) is k
# packed blocks (a fused qkv), each block's out features sharded.
STYLES = ("colwise", "colwise_gather_output", "rowwise", "vocab", "divide", "replicate")
# a table held by parameter-server ranks (a plan entry of mg.parallelize, not a TP style)
SERVER = "server"

# transformers' style names (``model._tp_plan``, ``config.base_model_tp_plan``) -> ours
HF_STYLES: dict[str, Any] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_gather_output",
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_rep": "rowwise",
    "embedding_rowwise": "vocab",
    "packed_colwise": ("colwise", 2),
    "replicate": "replicate",
}

# -- data parallel -----------------------------------------------------------------------------

# mg.parallelize(dp=...): gradients averaged (replicate), ZeRO-1 (zero1, with shard_optimizer),
# FSDP2 (fsdp), or nothing over the data dim (none)
DP_MODES = ("replicate", "zero1", "fsdp", "none")
# the data-parallel modes a searched layout (layout="auto") may take: "none" trains diverging
# replicas on several data ranks, so no search offers it
LAYOUT_DP_MODES = ("replicate", "zero1", "fsdp")

# -- pipeline ----------------------------------------------------------------------------------

# torch.distributed.pipelining's schedules by our names; the first is the default
SCHEDULES = ("1f1b", "gpipe", "interleaved")
DEFAULT_SCHEDULE = SCHEDULES[0]


def one_of(names: tuple[str, ...]) -> str:
    """``"a", "b" or "c"``: the names as an error message lists what is accepted."""
    quoted = [f'"{n}"' for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
