import torch
import macrogen as mg


@mg.tile(i=2, j=1024)
def softmax(out, x):
    M, N = x.shape
    for i in range(M):
        m = float("-inf")
        for j in range(N):
            m = max(m, x[i, j])
        s = 0.0
        for j in range(N):
            s += torch.exp(x[i, j] - m)
        for j in range(N):
            out[i, j] = torch.exp(x[i, j] - m) / s
