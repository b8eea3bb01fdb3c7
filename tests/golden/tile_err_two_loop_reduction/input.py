import torch
import macrogen as mg


@mg.tile(i=4)
def total(out, x):
    B, M, N = x.shape
    for i in range(B):
        s = 0.0
        for j in range(M):
            for k in range(N):
                s += x[i, j, k]
        out[i] = s
