import torch
import macrogen as mg


@mg.tile(i=64)
def relu(out, x):
    (N,) = x.shape
    for i in range(N):
        if x[i] > 1:
            v = 1.0
        elif x[i] > 0:
            out[i] = x[i]
