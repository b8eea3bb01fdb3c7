import torch
import macrogen as mg


@mg.tile(a=1, b=1, c=1, d=64)
def deep(out, x):
    A, B, C, D = x.shape
    for a in range(A):
        for b in range(B):
            for c in range(C):
                for d in range(D):
                    out[a, b, c, d] = x[a, b, c, d]
