"""shard_optimizer: what it expands to, its errors, and the serial (unexpanded) behaviour.

Distributed parity (2 and 4 ranks, against serial and ZeroRedundancyOptimizer) is
in ``tests/test_zero_dist.py``, through an expanded ``mg.shard_optimizer`` site.
"""

import torch

import macrogen as mg
from tests.helpers import assert_expands, expansion_errors


def test_the_optimizer_expression_is_kept_and_wrapped():
    assert_expands(
        """\
        import torch
        import macrogen as mg

        model = torch.nn.Linear(4, 4)
        opt = mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
        """,
        """\
        import torch
        import macrogen as mg

        # ---- macrogen: generated from test.py; edit the source, not this block ----
        from macrogen.runtime import shard_optimizer as _mg_shard_optimizer

        model = torch.nn.Linear(4, 4)
        # macrogen: shard_optimizer at test.py:5
        opt = _mg_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), where='test.py:5')
        """,
    )


def test_a_call_anywhere_and_comments_inside_are_kept():
    assert_expands(
        """\
        import torch
        from macrogen import shard_optimizer

        def configure(model):
            return shard_optimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),  # momentum later
            )
        """,
        """\
        import torch
        from macrogen import shard_optimizer

        # ---- macrogen: generated from test.py; edit the source, not this block ----
        from macrogen.runtime import shard_optimizer as _mg_shard_optimizer

        def configure(model):
            # macrogen: shard_optimizer at test.py:5
            return _mg_shard_optimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),  # momentum later
                where='test.py:5',
            )
        """,
    )


def test_errors_say_what_is_supported():
    src = "import macrogen as mg\nopt = mg.shard_optimizer()\n"
    assert expansion_errors(src) == [
        "test.py:2:7: error: shard_optimizer() takes the optimizer:"
        " opt = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=...))"
    ]
    decorator = "import macrogen as mg\n@mg.shard_optimizer\ndef f():\n    pass\n"
    errors = expansion_errors(decorator)
    assert len(errors) == 1 and "shard_optimizer" in errors[0], errors


def test_unexpanded_it_is_the_optimizer_itself():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert mg.shard_optimizer(opt) is opt
