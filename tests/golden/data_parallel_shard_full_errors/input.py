import torch
import torch.nn as nn
import macrogen as mg


@mg.data_parallel(shard="zero3")
class A(nn.Module):
    pass


@mg.data_parallel(shard="full", bucket_mb=4)
class B(nn.Module):
    pass


@mg.data_parallel(cpu_offload=True)
class C(nn.Module):
    pass


@mg.data_parallel(shard="full", shard_units="blocks.*")
class D(nn.Module):
    pass


@mg.data_parallel(shard="full")
class E(nn.Module):
    pass


opt = mg.shard_optimizer(torch.optim.AdamW(E().parameters()))
