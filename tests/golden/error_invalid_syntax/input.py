import macrogen as mg

def f(:
    pass
