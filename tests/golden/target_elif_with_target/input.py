import os

import macrogen as mg

if os.environ.get("X"):
    pass
elif mg.target("cuda"):
    pass
