import macrogen as mg

SIZE = mg.define(8)


def place(a, mg):
    # mg is a parameter here, not macrogen: nothing to expand
    if mg.target("cuda"):
        a.cuda()


def place_real(a):
    if mg.target("cuda"):
        a.cuda()
