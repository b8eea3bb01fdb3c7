import torch
import macrogen as mg


@mg.tile(i=64)
def scatter(out, x, idx):
    (N,) = idx.shape
    for i in range(N):
        out[idx[i]] = x[i]
