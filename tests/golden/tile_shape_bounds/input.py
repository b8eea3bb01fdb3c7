import torch
import macrogen as mg


@mg.tile(i=8, j=16)
def shape_bounds(out, x, b, n):
    for i in range(len(x)):
        s = 0.0
        for j in range(1, x.size(1) - 1):
            s += x[i, j] * b[j]
        for j in range(n):
            out[i, j] = s + x[i, j]
