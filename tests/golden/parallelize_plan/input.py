import torch.nn as nn
import macrogen as mg
from transformers import GPT2Config, GPT2LMHeadModel


def build(config: GPT2Config) -> nn.Module:
    model = GPT2LMHeadModel(config)
    # GPT-2's Conv1D layers; c_attn packs q, k and v: each block split on its own
    return mg.parallelize(
        model,
        tp=mg.tunable(2, choices=[1, 2, 4]),
        tp_plan={
            "transformer.h.*.attn.c_attn": ("colwise", 3),
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.attn.split_size": "divide",
            "transformer.h.*.attn.num_heads": "divide",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
        },
        dp="zero1",
        bucket_mb=16,
    )


def data_only(model):
    return mg.parallelize(model, dp="replicate", compress="bf16", accumulate=4)
