import torch

import macrogen as mg

EVERY = mg.define(50)


def train(model, opt, steps, ckpt_dir):
    # the training loop
    for step in mg.resumable(range(steps), model=model, optimizer=opt, dir=ckpt_dir, every=EVERY):
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def train_from(model, data):
    from macrogen import resumable as checkpointed

    for batch in checkpointed(data, model=model, dir="ckpt", every=10, keep=mg.tunable(3, choices=[1, 3])):
        model(batch).sum().backward()
