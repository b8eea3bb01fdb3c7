import torch
import macrogen as mg


@mg.tile(i=4, j=64)
def cumsum(out, x):
    M, N = x.shape
    for i in range(M):
        s = 0.0
        for j in range(N):
            s += x[i, j]
            out[i, j] = s
