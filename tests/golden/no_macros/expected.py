#!/usr/bin/env python
"""No macros at all: the file comes out unchanged, byte for byte."""
import torch  # comment kept


def f(x):   # odd spacing kept
    return  x+1
