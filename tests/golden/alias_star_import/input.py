from macrogen import *

SIZE = define(8)
WIDTH = tunable(4, choices=[4, 8])


def place(a):
    if target("cuda"):
        a.cuda()
