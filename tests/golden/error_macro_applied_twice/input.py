import torch.nn as nn

import macrogen as mg


@mg.data_parallel(bucket_mb=4)
@mg.data_parallel()
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


@mg.tile(i=32)
@mg.tile(i=64)
def double(out, x):
    for i in range(x.shape[0]):
        out[i] = x[i] * 2.0
