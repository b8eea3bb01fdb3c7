"""tunable(default, choices=[...]): the default, or the tuning database's value."""

from macrogen.expand import expand_source
from tests.helpers import assert_expands, expansion_errors

SRC = """\
import macrogen as mg
BLOCK = mg.tunable(64, choices=[32, 64, 128])
"""


def test_module_constant_takes_its_default():
    assert_expands(
        SRC,
        """\
        import macrogen as mg
        # macrogen: tunable at test.py:2
        # tunable BLOCK = 64 (the default); choices [32, 64, 128]
        BLOCK = 64
        """,
    )


def test_module_constant_takes_the_tuned_value():
    assert_expands(
        SRC,
        """\
        import macrogen as mg
        # macrogen: tunable at test.py:2
        # tunable BLOCK = 128 (tuned); choices [32, 64, 128]
        BLOCK = 128
        """,
        tuning={"BLOCK": 128},
    )


def test_expansion_lists_every_tunable_and_the_header_too():
    result = expand_source(SRC, path="m.py", tuning={"BLOCK": 32})
    (t,) = result.tunables.values()
    assert (t.key, t.default, t.choices, t.value, t.line, t.tuned) == (
        "BLOCK",
        64,
        (32, 64, 128),
        32,
        2,
        True,
    )
    assert "# tunable BLOCK = 32 (tuned; choices [32, 64, 128])\n" in result.code


def test_as_a_macro_argument_keyed_by_site_and_parameter():
    src = """\
import torch.nn as nn
import macrogen as mg
@mg.data_parallel(bucket_mb=mg.tunable(16, choices=[4, 16]))
class Net(nn.Module):
    pass
"""
    default = expand_source(src)
    assert list(default.tunables) == ["Net.bucket_mb"]
    assert "bucket_mb=16," in default.code
    tuned = expand_source(src, tuning={"Net.bucket_mb": 4})
    assert "bucket_mb=4," in tuned.code and "bucket_mb=16," not in tuned.code


def test_a_tunable_constant_can_feed_a_macro_argument():
    src = """\
import torch.nn as nn
import macrogen as mg
BUCKET = mg.tunable(8, choices=[4, 8])
@mg.data_parallel(bucket_mb=BUCKET)
class Net(nn.Module):
    pass
"""
    assert "bucket_mb=4," in expand_source(src, tuning={"BUCKET": 4}).code


def test_choices_may_be_a_tuple_of_strings():
    result = expand_source(
        'import macrogen as mg\nMODE = mg.tunable("bf16", choices=("fp16", "bf16"))\n'
    )
    assert "MODE = 'bf16'\n" in result.code


def test_errors():
    assert expansion_errors(
        """\
        import macrogen as mg
        A = mg.tunable(48, choices=[32, 64])
        B = mg.tunable(4)
        C = mg.tunable(choices=[1])
        D = mg.tunable(1, choices=[])
        E = mg.tunable(1, choices=[1, 1])
        F = mg.tunable(1, choices=1)
        G = mg.tunable(1, choices=[1], step=2)
        H = mg.define(mg.tunable(1, choices=[1]) + 1)
        """
    ) == [
        "test.py:2:16: error: the default 48 is not one of the choices [32, 64]",
        "test.py:3:5: error: tunable() needs choices=[...] to search: tunable(64, choices=[32, 64, 128])",
        "test.py:4:5: error: tunable() needs a default: tunable(64, choices=[32, 64, 128])",
        "test.py:5:27: error: choices must be a non-empty list of literals",
        "test.py:6:27: error: choices must not repeat a value",
        "test.py:7:27: error: choices must be a non-empty list of literals",
        "test.py:8:37: error: unknown argument 'step' (arguments: default, choices)",
        "test.py:9:15: error: this is not known at expansion time: a macro argument must be a literal, a define()d constant or a tunable()",
    ]


def test_a_tuned_value_outside_the_choices_is_an_error():
    assert expansion_errors(SRC, tuning={"BLOCK": 48}) == [
        "test.py:2:9: error: the tuning database chose 48 for 'BLOCK', which is not one of its choices [32, 64, 128]"
    ]
