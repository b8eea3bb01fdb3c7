import macrogen as mg


@mg.tlie(i=64)
def kernel(x):
    return x


WIDTH = mg.defne(4)
