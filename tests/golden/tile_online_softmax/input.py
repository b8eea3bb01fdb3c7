import torch
import macrogen as mg


@mg.tile(i=4, j=8)
def online_softmax(out, lse, x):
    M, N = x.shape
    for i in range(M):
        m = float("-inf")
        s = 0.0
        for j in range(N):
            m_new = max(m, x[i, j])
            s = s * torch.exp(m - m_new) + torch.exp(x[i, j] - m_new)
            m = m_new
        lse[i] = m + torch.log(s)
        for j in range(N):
            out[i, j] = torch.exp(x[i, j] - m) / s
