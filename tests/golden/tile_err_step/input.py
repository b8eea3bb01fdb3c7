import torch
import macrogen as mg


@mg.tile(i=64)
def strided(out, x):
    (N,) = x.shape
    for i in range(0, N, 2):
        out[i] = x[i]
