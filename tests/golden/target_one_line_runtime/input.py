from macrogen import target

if target("cuda"): BACKEND = "nccl"
else: BACKEND = "gloo"
