import torch.nn as nn
import macrogen as mg


@mg.data_parallel(bucket_mb=0, compress="int8")
class A(nn.Module):
    pass


@mg.data_parallel(accumulate=mg.tunable(2, choices=[1, 2, 0]))
class B(nn.Module):
    pass


@mg.data_parallel()
def not_a_class():
    pass


@mg.data_parallel(broadcast_buffers="yes")
class C:
    pass
