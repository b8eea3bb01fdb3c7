from macrogen import define as const
from macrogen import target as on

SIZE = const(8)


def place(a):
    if on("cuda"):
        a = a.cuda()
    return a
