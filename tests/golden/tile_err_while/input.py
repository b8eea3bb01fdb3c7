import torch
import macrogen as mg


@mg.tile(i=64)
def spin(out, x):
    (N,) = x.shape
    for i in range(N):
        while x[i] > 1.0:
            out[i] = 0.0
