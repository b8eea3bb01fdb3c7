import torch.nn as nn
from macrogen import data_parallel as dp, tunable


@dp(bucket_mb=tunable(25, choices=[1, 4, 16, 25, 64]), compress=tunable(None, choices=[None, "bf16"]))
class Net(nn.Linear):
    pass


@dp
class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
