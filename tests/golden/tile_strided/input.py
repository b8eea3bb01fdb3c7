import torch
import macrogen as mg


@mg.tile(i=4, j=8)
def strided(out, x, total):
    M, N = x.shape
    for i in range(1, M, 2):
        s = 0.0
        for j in range(0, N - 1, 3):
            s += x[i, j + 1]
        total[i] = s
        for j in range(2, N, 2):
            out[i, j] = x[i - 1, j] * s
