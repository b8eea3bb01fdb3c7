import macrogen as mg

BLOCK = mg.tunable(48, choices=[32, 64, 128])
WIDTH = mg.tunable(4)
DEPTH = mg.tunable(2, choices=[])
REPEAT = mg.tunable(2, choices=[2, 2])
