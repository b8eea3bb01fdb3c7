from macrogen import target


def place(a, tracker):
    target = tracker.span
    if target("cuda"):
        a.cuda()


def other(a):
    for mg in range(3):
        pass
    if target("cuda"):
        a.cuda()
