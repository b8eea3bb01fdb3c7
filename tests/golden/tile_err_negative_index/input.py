import torch
import macrogen as mg


@mg.tile(i=64)
def shift(out, x):
    (M,) = x.shape
    for i in range(M):
        out[i] = x[i - 1]
