"""The pass's speed machinery, behind one switch: the pass does what libcst does, faster.

About 1,500 lines exist only for speed (docs/expand.md's goal: a macro-dense file
expands in at most 2.5 x libcst's parse of it; bench/README.md has the figures):

- ``statements.py``: ``ast`` cuts the file into top-level statements, libcst parses
  only those that mention macrogen, and positions come without a codegen
  (``extents.py``, ``layout.py`` for form feeds in indentation);
- ``drive.py``: the transform's own walk (libcst's ``visit`` less the syntax leaves);
- ``parsing.py``: libcst's parse without re-validating the nodes its parser built;
- ``printing.py``: statements kept as parsed print as their source lines;
- ``rendered.py``: a template's statements spliced and printed as their text;
- ``shapes.py``: a template text with the shape of one already checked skips the check.

``ENABLED = False`` turns every shortcut off but the cut (whose fallback is the
whole file's parse): libcst's parse, visit and printing, and every template
checked. ``tests/test_pass_shortcuts.py`` expands the goldens and the odd files
both ways and compares the bytes: the plain way is the oracle.
"""

ENABLED = True  # False: plain libcst (the tests compare the two)
