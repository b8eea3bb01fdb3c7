import torch
import macrogen as mg


@mg.tile(i=4, j=8)
def causal(out, rows, x, alpha):
    M, N = x.shape
    for i in range(M):
        m = float("-inf")
        for j in range(N):
            if j <= i:
                m = max(m, x[i, j])
        s = 0.0
        for j in range(N):
            if j <= i:
                s += torch.exp(x[i, j] - m)
        for j in range(N):
            if j <= i:
                out[i, j] = torch.exp(x[i, j] - m) / s
        if s > alpha:
            r = s
        elif m < 0.5:
            r = -m
        else:
            r = 0.0
        rows[i] = r
