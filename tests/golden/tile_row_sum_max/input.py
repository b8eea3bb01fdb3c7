import torch
import macrogen as mg


@mg.tile(i=16, j=128)
def row_sum_max(total, biggest, x):
    M, N = x.shape
    for i in range(M):
        s = 0.0
        m = float("-inf")
        for j in range(N):
            s += x[i, j]
            m = max(m, x[i, j])
        total[i] = s
        biggest[i] = m
