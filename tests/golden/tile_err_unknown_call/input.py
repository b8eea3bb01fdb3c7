import torch
import macrogen as mg


@mg.tile(i=64, j=64)
def erf(out, x):
    M, N = x.shape
    for i in range(M):
        for j in range(N):
            out[i, j] = torch.erf(x[i, j])
