import torch
import macrogen as mg


@mg.tile(i=4, j=64)
def lse(out, x):
    M, N = x.shape
    for i in range(M):
        m = 0.0
        s = 0.0
        for j in range(N):
            m_new = max(m, x[i, j])
            s = s * torch.exp(m - m_new) + torch.exp(x[i, j] - m_new)
            m = m_new
        out[i] = m + torch.log(s)
