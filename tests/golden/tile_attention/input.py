import torch
import macrogen as mg


@mg.tile(i=32, e=32, j=32, k=32)
def attention(out, q, kk, v, scale):
    M, D = q.shape
    N, E = v.shape
    for i in range(M):
        for e in range(E):
            m = float("-inf")
            for j in range(N):
                s = 0.0
                for k in range(D):
                    s += q[i, k] * kk[j, k]
                m = max(m, s * scale)
            l = 0.0
            for j in range(N):
                s = 0.0
                for k in range(D):
                    s += q[i, k] * kk[j, k]
                l += torch.exp(s * scale - m)
            acc = 0.0
            for j in range(N):
                s = 0.0
                for k in range(D):
                    s += q[i, k] * kk[j, k]
                acc += torch.exp(s * scale - m) * v[j, e]
            out[i, e] = acc / l
