"""Toy macros that exist only for tests: each is one module plus its templates,
written against ``macrogen.macro`` (the macro SDK) and registered by the test that uses
it, to show that a new macro needs no change to ``macrogen/expand`` or
``macrogen/autotune``. They model the next macros' site forms:

- ``toy_shard``: ``opt = mg.toy_shard(torch.optim.SGD(...))`` (assign) and
  ``train(mg.toy_shard(...))`` (call) -- the sharded optimizer's forms;
- ``toy_resumable``: ``for step in mg.toy_resumable(range(n), every=2):`` (loop);
- ``toy_pipeline``: ``@mg.toy_pipeline(stages=2)`` stacked with ``@mg.data_parallel``;
- ``toy_span``: ``with mg.toy_span("fwd") as span:`` (with, keeping ``as``).
"""

from __future__ import annotations

from pathlib import Path

from tests.toy_macros import toy_pipeline, toy_resumable, toy_shard, toy_span

TEMPLATES = Path(__file__).parent / "templates"
ALL = (toy_pipeline, toy_resumable, toy_shard, toy_span)
