"""The names macrogen's parallel layouts are spoken in, in one torch-free place.

The pass (macro validation at expansion time), the autotuner (layouts and their
feasibility) and the runtime (the engine that applies a layout) all read these:
a style, a data-parallel mode or a schedule added here is known to all three.
Nothing here imports torch, so the pass stays light.
"""

from __future__ import annotations

from typing import Any

# -- tensor parallel ---------------------------------------------------------------------------

# A plan entry's style, as mg.parallelize(tp_plan={path: style}) takes it. A path names a module,
# a parameter (sharded only: its module runs as it is) or an int attribute (divide).
STYLES = (
    "colwise",  # out features sharded; the output is this rank's slice of the last dim
    "colwise_gather_output",  # the same, the output gathered whole
    "rowwise",  # in features sharded (a whole input is split); the output all-reduced
    "vocab",  # an embedding's rows (the vocabulary) sharded; lookups all-reduced
    "embedding_colwise",  # an embedding's columns sharded; the output gathered
    "divide",  # an int attribute (a head count) divided by tp
    "replicate",  # kept whole on every rank
    "replicate_grad_allreduce",  # kept whole, its gradients summed (it sees this rank's heads only)
    "all_reduce",  # a module computing a partial sum: its output all-reduced, its inputs' gradients too
    "sequence_parallel",  # a per-token module run on this rank's slice of the sequence (dim 1)
    "mla_kv_a_proj",  # an MLA kv_a projection: the rope part's gradient summed
    "moe_experts",  # a mixture of experts' experts: all_reduce over their sharded 3-D weights
    "moe_identity_expert",  # an identity expert inside moe_experts: counted on one rank
    "shard_experts",  # a 3-D experts parameter: whole experts per rank (dim 0)
    # sequence parallelism (Megatron-SP): between them each rank holds its slice of the
    # sequence (dim 1), (B, T / tp, C)
    "colwise_from_sequence",  # colwise, its input (a sequence slice) all-gathered along T first
    "rowwise_to_sequence",  # rowwise, its partial outputs reduce-scattered along T
    "sequence_slice",  # a per-token module run on the slice it receives; its gradients summed
    "from_sequence",  # a module whose first input (a sequence slice) is gathered whole on entry
)
# (style, k): k packed blocks along the sharded dim, each block sharded (a fused qkv, gate_up)
PACKED = ("colwise", "rowwise", "colwise_from_sequence")
# (style, n): the rope part's width
SIZED = ("mla_kv_a_proj",)
# a table held by parameter-server ranks (a plan entry of mg.parallelize, not a TP style)
SERVER = "server"

# transformers' style names (``model._tp_plan``, ``config.base_model_tp_plan``) -> ours;
# "mla_kv_a_proj" takes its rope width from the model's config (``qk_rope_head_dim``)
HF_STYLES: dict[str, Any] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_gather_output",
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_rep": "rowwise",
    "rowwise_split_input": "rowwise",
    "embedding_rowwise": "vocab",
    "embedding_colwise": "embedding_colwise",
    "packed_colwise": ("colwise", 2),
    "packed_rowwise": ("rowwise", 2),
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicate_grad_allreduce",
    "local_params": "replicate",  # every planned module runs on its local tensors already
    "all_reduce": "all_reduce",
    "sequence_parallel": "sequence_parallel",
    "mla_kv_a_proj": "mla_kv_a_proj",
    "moe_tp_experts": "moe_experts",
    "moe_identity_expert": "moe_identity_expert",
    "grouped_gemm": "shard_experts",
}


def style_problem(value: Any) -> str | None:
    """Why ``value`` is no style of STYLES (``"colwise"``, ``("colwise", 3)``), or None."""
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and value[0] in PACKED + SIZED:
            n = value[1]
            if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
                return None
            return f"({value[0]!r}, n) takes an int n >= 1, not {n!r}"
        return (
            f"a style with a number is (style, n) for style {', '.join(PACKED + SIZED)}, not"
            f" {value!r}"
        )
    if isinstance(value, str) and value in STYLES:
        return None
    return f"unknown style {value!r}"


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
