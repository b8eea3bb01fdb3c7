import torch
import macrogen as mg


@mg.tile(i=64)
def strided(out, x, step):
    (N,) = x.shape
    for i in range(0, N, step):
        out[i] = x[i]
