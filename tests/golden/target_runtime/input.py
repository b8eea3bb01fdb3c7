import macrogen as mg


def pick():
    if mg.target("cuda"):
        return "triton"
    else:
        return "torch"


if mg.target("cpu"):
    DEVICE = "cpu"
