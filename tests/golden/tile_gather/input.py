import math
import torch
import macrogen as mg


@mg.tile(i=8, j=16)
def gather(out, sums, table, idx, perm, x):
    M, N = out.shape
    for i in range(M):
        s = 0.0
        for j in range(N):
            s += table[idx[i], j] * x[i, perm[j]]
        sums[i] = s
        for j in range(N):
            out[i, j] = table[idx[i], j] + x[i, perm[j]]
