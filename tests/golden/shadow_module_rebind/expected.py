import macrogen as mg

mg = object()

SIZE = mg.define(8)
