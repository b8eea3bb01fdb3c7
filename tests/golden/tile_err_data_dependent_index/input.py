import torch
import macrogen as mg


@mg.tile(i=64)
def gather(out, x, idx):
    (N,) = idx.shape
    for i in range(N):
        out[i] = x[idx[i]]
