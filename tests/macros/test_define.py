"""define(v): an expansion-time constant, written back as a literal."""

from macrogen.expand import expand_source
from tests.helpers import assert_expands, expansion_errors


def test_literal_is_written_back_with_its_comment():
    assert_expands(
        """\
        import macrogen as mg

        D_MODEL = mg.define(256)  # residual width
        """,
        """\
        import macrogen as mg

        # macrogen: define at test.py:3
        D_MODEL = 256  # residual width
        """,
    )


def test_arithmetic_on_defined_constants():
    assert_expands(
        """\
        import macrogen as mg
        D = mg.define(256)
        H = mg.define(D // 64 - 1)
        F = mg.define(-(2 ** 3) * 0.5)
        """,
        """\
        import macrogen as mg
        # macrogen: define at test.py:2
        D = 256
        # macrogen: define at test.py:3
        H = 3
        # macrogen: define at test.py:4
        F = -4.0
        """,
    )


def test_containers_and_strings():
    assert_expands(
        """\
        from macrogen import define
        PLAN = define({"qkv": "colwise", "sizes": [1, 2.5, None, True], "pair": ("a", 'b')})
        """,
        """\
        from macrogen import define
        # macrogen: define at test.py:2
        PLAN = {'qkv': 'colwise', 'sizes': [1, 2.5, None, True], 'pair': ('a', 'b')}
        """,
    )


def test_positional_or_keyword_value():
    assert_expands(
        "import macrogen as mg\nA = mg.define(value=3)\n",
        "import macrogen as mg\n# macrogen: define at test.py:2\nA = 3\n",
    )


def test_code_after_a_define_is_untouched():
    src = "import macrogen as mg\nA = mg.define(1)\n\n\ndef f( x ):  # odd\n    return A+x\n"
    out = expand_source(src, path="test.py").code
    assert out.endswith("\n\n\ndef f( x ):  # odd\n    return A+x\n")


def test_errors():
    assert expansion_errors(
        """\
        import macrogen as mg
        A = mg.define()
        B = mg.define(open("x"))
        C = mg.define(undefined_name)
        D = mg.define(1, 2)
        E, F = mg.define((1, 2))
        G = mg.define(1 / 0)
        H = mg.define(f"{A}")
        """
    ) == [
        "test.py:2:5: error: define() takes the value: define(256)",
        "test.py:3:15: error: this is not known at expansion time: a macro argument must be a literal, a define()d constant or a tunable()",
        "test.py:4:15: error: 'undefined_name' is not known at expansion time: a macro argument must be a literal, a define()d constant or a tunable()",
        "test.py:5:18: error: this macro takes 1 positional argument(s) (value)",
        "test.py:6:1: error: define() must be assigned to one name: NAME = define(...)",
        "test.py:7:15: error: can't evaluate this at expansion time: division by zero",
        "test.py:8:15: error: this is not known at expansion time: a macro argument must be a literal, a define()d constant or a tunable()",
    ]


def test_inside_a_function_is_an_error():
    assert expansion_errors(
        """\
        import macrogen as mg
        def f():
            A = mg.define(1)
        """
    ) == ["test.py:3:9: error: define() must be assigned to a name at module level"]


def test_expansion_reports_no_tunables_for_defines():
    result = expand_source("import macrogen as mg\nA = mg.define(1)\n")
    assert result.changed and result.tunables == {} and result.sites == (("define", 2),)
