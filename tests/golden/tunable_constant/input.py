import macrogen as mg

BLOCK = mg.tunable(64, choices=[32, 64, 128])
BUCKET_MB = mg.tunable(25, choices=[1, 4, 16, 25, 64])  # tuned below
SCALE = BLOCK * 2


def block():
    return BLOCK
