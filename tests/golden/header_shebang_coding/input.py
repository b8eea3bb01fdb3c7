#!/usr/bin/env python3
# -*- coding: latin-1 -*-
"""Header placement: the shebang and the coding cookie stay on lines 1-2."""
import macrogen as mg

NAME = mg.define("café")
