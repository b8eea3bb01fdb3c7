import torch
import macrogen as mg


@mg.tile(i=64)
def early(out, x):
    (N,) = x.shape
    for i in range(N):
        out[i] = x[i]
        return out
