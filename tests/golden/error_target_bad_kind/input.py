import macrogen as mg

if mg.target("tpu"):
    pass

if mg.target():
    pass
