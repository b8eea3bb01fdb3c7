import torch
import macrogen as mg


@mg.tile(i=32, j=64, num_warps=8)
def bias_gelu(out, x, b):
    """out = gelu(x + b), b broadcast over rows."""
    M, N = x.shape
    for i in range(M):
        for j in range(N):
            v = x[i, j] + b[j]
            out[i, j] = 0.5 * v * (1.0 + torch.tanh(0.79788456 * (v + 0.044715 * v * v * v)))
