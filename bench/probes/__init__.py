"""Issue 43's probe battery: hostile inputs and environments, each case in a process of its
own, judged ok / traceback / hang / silent wrong (``python -m bench.probes``; see
``__main__.py`` for the options and ``verdicts.py`` for how a run is judged).

Modules, cheapest cases first: ``env_cases`` (every variable the runtime reads),
``cli_cases`` (plan / autotune / verify / expand values and files), ``second_round``
(issue 27's import forms, macros applied twice, tampered checkpoints), ``docs_cases``
(README.md's and docs/'s code blocks), ``program_cases`` (applied twice on every path,
parity on 2 ranks, @tile indexes, tuning records, verify, compile, the parameter server).
"""
