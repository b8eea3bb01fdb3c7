"""target(kind): a branch chosen at expansion time, or a run-time device check."""

import pytest

from tests.helpers import assert_expands, expansion_errors

IF_ELSE = """\
import macrogen as mg
def pick():
    if mg.target("cuda"):
        return "triton"
    else:
        return "eager"
"""


def test_with_target_cuda_only_the_cuda_branch_stays():
    assert_expands(
        IF_ELSE,
        """\
        import macrogen as mg
        def pick():
            # macrogen: target at test.py:3
            return "triton"
        """,
        target="cuda",
    )


def test_with_target_cpu_only_the_else_branch_stays():
    assert_expands(
        IF_ELSE,
        """\
        import macrogen as mg
        def pick():
            # macrogen: target at test.py:3
            return "eager"
        """,
        target="cpu",
    )


def test_without_target_a_runtime_check():
    assert_expands(
        IF_ELSE,
        """\
        import macrogen as mg

        # ---- macrogen: generated from test.py; edit the source, not this block ----
        import torch
        def pick():
            # macrogen: target at test.py:3
            if torch.cuda.is_available():
                return "triton"
            else:
                return "eager"
        """,
    )


def test_runtime_check_reuses_the_files_torch_import():
    assert_expands(
        """\
        import torch as th
        from macrogen import target
        if target("cpu"):
            X = 1
        """,
        """\
        import torch as th
        from macrogen import target
        # macrogen: target at test.py:3
        if not th.cuda.is_available():
            X = 1
        """,
    )


def test_a_false_branch_without_else_leaves_pass():
    assert_expands(
        'import macrogen as mg\nif mg.target("cuda"):\n    X = 1\n',
        "import macrogen as mg\n# macrogen: target at test.py:2\npass\n",
        target="cpu",
    )


def test_the_elif_after_a_false_target_becomes_an_if():
    assert_expands(
        """\
        import os, macrogen as mg
        if mg.target("cuda"):
            X = 1
        elif os.environ.get("Y"):
            X = 2
        else:
            X = 3
        """,
        """\
        import os, macrogen as mg
        # macrogen: target at test.py:2
        if os.environ.get("Y"):
            X = 2
        else:
            X = 3
        """,
        target="cpu",
    )


def test_one_line_suites():
    assert_expands(
        'from macrogen import target\nif target("cuda"): A = 1; B = 2\nelse: A = 0\n',
        "from macrogen import target\n# macrogen: target at test.py:2\nA = 1; B = 2\n",
        target="cuda",
    )


def test_elif_chain_at_run_time():
    assert_expands(
        """\
        import os
        import torch
        import macrogen as mg
        if os.environ.get("META"):
            D = "meta"
        elif mg.target("cuda"):
            D = "cuda"
        else:
            D = "cpu"
        """,
        """\
        import os
        import torch
        import macrogen as mg
        if os.environ.get("META"):
            D = "meta"
        elif torch.cuda.is_available():
            D = "cuda"
        else:
            D = "cpu"
        """,
    )


def test_nested_targets_expand_inside_out():
    assert_expands(
        """\
        import macrogen as mg
        if mg.target("cuda"):
            if mg.target("cpu"):
                X = 1
            Y = 2
        """,
        """\
        import macrogen as mg
        # macrogen: target at test.py:2
        # macrogen: target at test.py:3
        pass
        Y = 2
        """,
        target="cuda",
    )


@pytest.mark.parametrize("target", [None, "cpu", "cuda"])
def test_errors(target):
    assert expansion_errors(
        """\
        import macrogen as mg
        if mg.target("tpu"):
            pass
        if mg.target():
            pass
        if mg.target("cuda") and True:
            pass
        x = mg.target("cuda")
        if mg.target(kind="cuda", extra=1):
            pass
        """,
        target=target,
    ) == [
        "test.py:2:14: error: target() takes one of ['cpu', 'cuda'], not 'tpu'",
        "test.py:4:4: error: target() takes the device kind, one of ['cpu', 'cuda']",
        'test.py:6:4: error: target() can\'t be used here: target() is the whole test of an if statement: if target("cuda"): ...',
        'test.py:8:5: error: target() can\'t be used here: target() is the whole test of an if statement: if target("cuda"): ...',
        "test.py:9:33: error: unknown argument 'extra' (arguments: kind)",
    ]


def test_elif_with_a_fixed_target_says_what_to_do():
    assert expansion_errors(
        'import os, macrogen as mg\nif os.environ.get("A"):\n    pass\nelif mg.target("cuda"):\n    pass\n',
        target="cuda",
    ) == [
        "test.py:4:6: error: with --target, target() can't be an elif test; nest the if in the else branch"
    ]


def test_a_local_torch_is_not_taken_for_the_module():
    assert_expands(
        """\
        import torch
        import macrogen as mg
        def f(torch):
            if mg.target("cuda"):
                return 1
        def g():
            if mg.target("cuda"):
                return 2
        """,
        """\
        import torch
        import macrogen as mg

        # ---- macrogen: generated from test.py; edit the source, not this block ----
        import torch as _mg_torch
        def f(torch):
            # macrogen: target at test.py:4
            if _mg_torch.cuda.is_available():
                return 1
        def g():
            # macrogen: target at test.py:7
            if torch.cuda.is_available():
                return 2
        """,
    )
