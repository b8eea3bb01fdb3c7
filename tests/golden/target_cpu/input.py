import macrogen as mg


def pick():
    # choose the kernel
    if mg.target("cuda"):
        kind = "triton"
        return kind
    else:
        return "torch"


if mg.target("cpu"):
    DEVICE = "cpu"

if mg.target("cuda"): FAST = True
else: FAST = False

if mg.target("cuda"):
    USE_NCCL = True
