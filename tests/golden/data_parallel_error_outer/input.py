"""Wrong uses of data_parallel's outer optimizer and overlap: each reported at its position."""

import torch.nn as nn

import macrogen as mg


@mg.data_parallel(sync_every=4, outer=mg.outer_sgd(lr=0))
class A(nn.Module):
    pass


@mg.data_parallel(sync_every=4, outer=mg.outer_sgd(momentum=0.0))
class B(nn.Module):
    pass


@mg.data_parallel(sync_every=4, outer="nesterov")
class C(nn.Module):
    pass


@mg.data_parallel(sync_every=2, overlap=True, delay=3)
class D(nn.Module):
    pass


@mg.data_parallel(sync_every=4, delay=1)
class E(nn.Module):
    pass


@mg.data_parallel(sync_every=4, outer=mg.outer_sgd(lr=0.7, betas=(0.9, 0.95)))
class F(nn.Module):
    pass


OUTER = mg.outer_sgd()
