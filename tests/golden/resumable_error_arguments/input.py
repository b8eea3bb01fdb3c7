import macrogen as mg


def train(model, steps):
    for step in mg.resumable(range(steps), model=model, dir="ckpt", every=0):
        pass
    for step in mg.resumable(range(steps), model=model, every=5):
        pass
    for step in mg.resumable(range(steps), model=model, dir="ckpt", every=5, keeep=2):
        pass
    it = mg.resumable(range(steps), model=model, dir="ckpt", every=5)
