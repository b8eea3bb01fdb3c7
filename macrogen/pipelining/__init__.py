"""A pipelined ``forward``, read and cut: pure Python, shared by the ``@pipeline`` macro (at
expansion) and the runtime (``mg.parallelize(pp=N)`` at run time, ``macrogen.runtime.pipeline``).

- ``units``: forward as units (statements, a ModuleList loop's blocks) and where stages can
  be cut from them: the value each cut carries, split names, balance (no ``ast``, no torch);
- ``analysis``: forward's source read with ``ast`` into those units;
- ``code``: each statement as the function a stage runs (the user's lines, copied).

(Not ``macrogen.pipeline``: that name is the ``@mg.pipeline`` marker.)
"""
