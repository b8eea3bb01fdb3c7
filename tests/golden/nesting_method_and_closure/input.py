import macrogen as mg

SIZE = mg.define(8)


class Trainer:
    def step(self, loss, seen):
        def place():
            if mg.target("cuda"):
                return loss.cuda()
            return loss

        place()
        if mg.target("cpu"):
            return loss.cpu()
        return loss


def outer(x):
    def inner(y):
        if mg.target("cuda"):
            y.cuda()

    inner(x)
