import macrogen as mg

BLOCK = mg.tunable(64, choices=[32, 64, 128])
WIDTH = mg.tunable(4, choices=[2, 4])
