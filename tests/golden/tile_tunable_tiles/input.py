import torch
import macrogen as mg


BLOCK = mg.tunable(64, choices=[32, 64, 128])


@mg.tile(i=BLOCK, num_warps=mg.tunable(4, choices=[2, 4, 8]))
def scale_shift(out, x, alpha, beta):
    (N,) = x.shape
    for i in range(N):
        out[i] = alpha * x[i] + beta
