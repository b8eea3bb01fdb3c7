import torch
import macrogen as mg


@mg.tile(i=64, j=64, k=32, num_stages=3)
def matmul(out, a, b):
    M, K = a.shape
    _, N = b.shape
    for i in range(M):
        for j in range(N):
            for k in range(K):
                out[i, j] += a[i, k] * b[k, j]
