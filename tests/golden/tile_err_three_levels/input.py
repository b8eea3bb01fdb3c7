import torch
import macrogen as mg


@mg.tile(i=4)
def deep(out, x):
    M, N = x.shape
    for i in range(M):
        c = x[i, 0]
        for j in range(N):
            for k in range(N):
                t = 0.0
                for l in range(N):
                    t += x[k, l]
                out[i, j] += t * c
