import torch
import macrogen as mg
from transformers import LlamaConfig, LlamaForCausalLM

TP = mg.define(2)

run = mg.launch()
model = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=4)).to(run.device)
model = mg.parallelize(model, tp=TP, tp_plan="hf", dp="replicate")  # the plan the model ships
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
