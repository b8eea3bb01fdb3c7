import macrogen as mg

BLOCK = mg.define(mg.tunable(64, choices=[32, 64]) * 2)
