import os

import macrogen as mg


def device_name():
    if os.environ.get("FORCE_META"):
        return "meta"
    elif mg.target("cuda"):
        return "cuda"
    elif mg.target("cpu"):
        return "cpu"
    else:
        return "unknown"
