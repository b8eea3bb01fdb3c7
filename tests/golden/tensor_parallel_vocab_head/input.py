import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


# nanoGPT's head: the logits that go into the loss stay split over the vocabulary
# (returned as a DTensor), those returned for generate() are gathered.
@mg.tensor_parallel(plan={"transformer.wte": "vocab", "lm_head": "colwise"})
class GPT(nn.Module):
    def __init__(self, vocab_size: int = 50304, n_embd: int = 768):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(vocab_size, n_embd), ln_f=nn.LayerNorm(n_embd))
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        x = self.transformer.ln_f(self.transformer.wte(idx))
        if targets is not None:
            # if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0):
        for _ in range(max_new_tokens):
            logits, _ = self(idx)
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx
