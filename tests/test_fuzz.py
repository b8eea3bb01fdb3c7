"""No input makes the pass raise anything but its own report (ExpansionError).

Random source text, random mutations of the golden inputs, and random macro
calls with random arguments, in every syntactic place. When the pass succeeds,
its output must be valid Python. And valid files, built from documented uses
only, which must expand without any error. Bounded: a few hundred examples in all.
"""

from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macrogen.expand import ExpansionError, expand_source

GOLDEN_INPUTS = sorted(
    p.read_text(encoding="utf-8", errors="replace")
    for p in (Path(__file__).parent / "golden").glob("*/input.py")
)
FUZZ = settings(
    max_examples=int(os.environ.get("MACROGEN_FUZZ_EXAMPLES", "80")),
    deadline=None,
    derandomize="MACROGEN_FUZZ_EXAMPLES" not in os.environ,  # CI: the same examples every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
OPTIONS = st.fixed_dictionaries(
    {
        "target": st.sampled_from([None, "cpu", "cuda"]),
        "tuning": st.dictionaries(
            st.sampled_from(["BLOCK", "A", "sync.fused_allreduce.block", "f.x"]),
            st.one_of(st.integers(-5, 2048), st.sampled_from(["bf16", None, 1.5])),
            max_size=3,
        ),
    }
)


def check(source: str, options: dict) -> None:
    try:
        with warnings.catch_warnings():  # the user's invalid escapes are not ours to report
            warnings.simplefilter("ignore")
            result = expand_source(source, path="fuzz.py", **options)
    except ExpansionError as e:
        assert e.diagnostics
        for d in e.diagnostics:
            assert d.line >= 1 and d.col >= 1
            assert d.render().startswith(f"fuzz.py:{d.line}:{d.col}: error: ")
        return
    if not result.changed:  # returned as given (a file without sites may even be invalid)
        assert result.code == source
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ast.parse(result.code)


# -- random text ------------------------------------------------------------------------
PYTHONISH = st.lists(
    st.sampled_from(
        list("abcgmtx_01 ():,.=[]{}'\"#\\\n\t+-*/@") + ["mg.", "macrogen", "define", "with ", "if "]
    ),
    max_size=80,
).map("".join)


@FUZZ
@given(
    text=PYTHONISH,
    header=st.sampled_from(["", "import macrogen as mg\n", "from macrogen import *\n"]),
    options=OPTIONS,
)
def test_random_text(text, header, options):
    check(header + text, options)


# -- mutations of valid files -------------------------------------------------------------
@st.composite
def mutated(draw) -> str:
    lines = draw(st.sampled_from(GOLDEN_INPUTS)).splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "indent", "dedent", "chars"]))
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "indent":
            lines[i] = "    " + lines[i]
        elif kind == "dedent":
            lines[i] = lines[i].lstrip(" ")
        else:
            at = draw(st.integers(0, len(lines[i])))
            junk = draw(st.text(alphabet="()[]:,.=mg_x1'\" \n", max_size=4))
            cut = draw(st.integers(0, 3))
            lines[i] = lines[i][:at] + junk + lines[i][at + cut :]
    return "".join(lines)


@FUZZ
@given(source=mutated(), options=OPTIONS)
def test_mutated_golden_inputs(source, options):
    check(source, options)


# -- random macro calls with random arguments -------------------------------------------------
NAMES = st.sampled_from(["A", "BLOCK", "x", "mg", "True", "None", "dist", "undefined"])
LITERALS = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.sampled_from(["0", "1e309", "-0.0", "1j", "10**10**10", "2**4096", "1" + "0" * 5000]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(alphabet="abc'\"\\ ", max_size=5).map(repr),
    st.sampled_from(['b"x"', 'f"{A}"', '"a" "b"', "...", "'cuda'", "'cpu'"]),
)
MACROS = [
    "define",
    "tunable",
    "target",
    "fused_allreduce",
    "tile",
    "data_parallel",
    "tensor_parallel",
    "nope",
]


def expressions() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(
                inner, st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "<<", "and"]), inner
            ).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(st.sampled_from(["-", "+", "not ", "~"]), inner).map(
                lambda t: f"{t[0]}{t[1]}"
            ),
            st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
            st.lists(inner, max_size=3).map(lambda xs: "(" + ", ".join(xs) + ",)"),
            st.lists(inner, min_size=1, max_size=3).map(lambda xs: "{" + ", ".join(xs) + "}"),
            st.lists(st.tuples(inner, inner), max_size=2).map(
                lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}"
            ),
            st.tuples(st.sampled_from(MACROS + ["len", "x.y"]), arguments(inner)).map(
                lambda t: f"mg.{t[0]}({t[1]})" if t[0] in MACROS else f"{t[0]}({t[1]})"
            ),
            inner.map(lambda e: f"*{e}"),
            inner.map(lambda e: f"x[{e}]"),
        )

    return st.recursive(st.one_of(LITERALS, NAMES), extend, max_leaves=8)


def arguments(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    keyword = st.sampled_from(
        ["", "", "choices=", "default=", "block=", "kind=", "value=", "op=", "x="]
    )
    return st.lists(st.tuples(keyword, inner), max_size=3).map(
        lambda args: ", ".join(k + v for k, v in args)
    )


@st.composite
def macro_file(draw) -> str:
    expr = expressions()
    args = arguments(expr)
    macro = st.sampled_from(MACROS)
    lines = [
        draw(
            st.sampled_from(
                [
                    "import macrogen as mg",
                    "import macrogen as mg, macrogen",
                    "from macrogen import *\nimport macrogen as mg",
                ]
            )
        ),
        "import torch.distributed as dist",
        f"A = mg.define({draw(expr)})",
    ]
    for _ in range(draw(st.integers(1, 4))):
        form = draw(
            st.sampled_from(["assign", "with", "if", "elif", "decorator", "expr", "nested"])
        )
        m, a = draw(macro), draw(args)
        if form == "assign":
            lines.append(f"{draw(st.sampled_from(['B', 'BLOCK', 'x, y', 'x.y']))} = mg.{m}({a})")
        elif form == "with":
            calls = draw(st.lists(st.tuples(expr, arguments(expr)), min_size=1, max_size=3))
            body = "".join(
                f"        dist.all_reduce({t}{', ' + r if r else ''})\n" for t, r in calls
            )
            lines.append(f"def f(x):\n    with mg.{m}({a}):\n{body}")
        elif form == "if":
            lines.append(f"if mg.{m}({a}):\n    x = 1\nelse:\n    x = 2")
        elif form == "elif":
            lines.append(f"if x:\n    pass\nelif mg.{m}({a}):\n    pass")
        elif form == "decorator":
            lines.append(
                f"@mg.{m}({a})\nclass C:\n    @mg.{draw(macro)}\n    def f(self):\n        pass"
            )
        elif form == "expr":
            lines.append(f"print(mg.{m}({a}))")
        else:
            lines.append(
                f"class K:\n    def f(self, mg):\n        return mg.{m}({a})\n    Z = mg.{m}({a})"
            )
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@FUZZ
@given(source=macro_file(), options=OPTIONS)
def test_random_macro_calls(source, options):
    check(source, options)


@st.composite
def plausible_file(draw) -> str:
    """Mostly valid uses, so that the fuzz also reaches the code that expands."""
    small = st.one_of(
        st.integers(-64, 4096).map(str),
        st.sampled_from(["'bf16'", "None", "A", "A * 2", "(1, 'x')"]),
    )
    lines = [
        "import torch.distributed as dist",
        "import macrogen as mg",
        f"A = mg.define({draw(st.integers(1, 9))})",
    ]
    for n in range(draw(st.integers(1, 6))):
        form = draw(st.sampled_from(["define", "tunable", "target", "fused", "nested"]))
        if form == "define":
            value = draw(
                st.one_of(
                    small, st.lists(small, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")
                )
            )
            lines.append(f"D{n} = mg.define({value})  # note")
        elif form == "tunable":
            choices = draw(st.lists(st.integers(1, 512), min_size=1, max_size=4, unique=True))
            default = draw(st.sampled_from(choices + [7]))
            lines.append(f"T{n} = mg.tunable({default}, choices={choices})")
        elif form == "target":
            kind = draw(st.sampled_from(["'cuda'", "'cpu'", "kind='cpu'"]))
            tail = draw(
                st.sampled_from(["", "\nelse:\n    y = 2", "\nelif x:\n    y = 3\nelse:\n    pass"])
            )
            lines.append(f"if mg.target({kind}):\n    y = 1{tail}")
        else:
            k = draw(st.integers(1, 4))
            op = draw(
                st.sampled_from(
                    ["", ", op=dist.ReduceOp.MAX", ", group=g", ", dist.ReduceOp.SUM, g"]
                )
            )
            block = draw(
                st.sampled_from(
                    ["", "block=256", "block=A", "block=mg.tunable(64, choices=[64, 128])"]
                )
            )
            body = "".join(f"        dist.all_reduce(t{i}{op})\n" for i in range(k))
            indent = "    " if form == "nested" else ""
            fn = f"def sync{n}(g, {', '.join(f't{i}' for i in range(k))}):\n    with mg.fused_allreduce({block}):\n{body}"
            if form == "nested":
                fn = f"class C{n}:\n" + "".join(indent + line + "\n" for line in fn.splitlines())
            lines.append(fn)
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@FUZZ
@given(source=plausible_file(), options=OPTIONS)
def test_plausible_macro_files(source, options):
    check(source, options)


def test_deep_nesting_is_reported_not_crashed():
    deep = "import macrogen as mg\nA = mg.define(" + "+".join(["1"] * 20000) + ")\n"
    check(deep, {})
    nested = "import macrogen as mg\nA = mg.define(" + "[" * 150 + "]" * 150 + ")\n"
    check(nested, {})


# -- valid files: these must expand, without any error ------------------------------------------
# The oracle above accepts any ExpansionError, so a regression that refuses valid input would
# pass it. Files built here only use macros as documented, so expanding them must succeed, give
# one site per use, compile, and give the same bytes again.
BLOCKS = st.sampled_from([16, 64, 256, 1024, 4096])


@st.composite
def valid_file(draw) -> tuple[str, dict, int]:
    """(source, options, number of macro sites)"""
    target = draw(st.sampled_from([None, "cpu", "cuda"]))
    tuning: dict = {}
    lines = [
        "import torch.distributed as dist",
        "import torch.nn as nn",
        draw(
            st.sampled_from(
                ["import macrogen as mg", "import macrogen as mg\nfrom macrogen import *"]
            )
        ),
        "",
        "A = mg.define(4)",
    ]
    sites = 1
    for n in range(draw(st.integers(1, 6))):
        form = draw(
            st.sampled_from(
                ["define", "tunable", "target", "fused", "fused_nested", "data_parallel"]
            )
        )
        sites += 1
        if form == "define":
            value = draw(
                st.sampled_from(["A * 2", "'bf16'", "[1, 2.5, None]", "{'a': (1, 2)}", "-A"])
            )
            lines.append(f"D{n} = mg.define({value})  # note {n}")
        elif form == "tunable":
            choices = draw(st.lists(st.integers(1, 512), min_size=1, max_size=4, unique=True))
            lines.append(f"T{n} = mg.tunable({draw(st.sampled_from(choices))}, choices={choices})")
            if draw(st.booleans()):
                tuning[f"T{n}"] = draw(st.sampled_from(choices))
        elif form == "target":
            kind = draw(st.sampled_from(["'cuda'", "'cpu'", "kind='cpu'"]))
            tails = ["", "\nelse:\n    y = 2"]
            if target is None:  # an elif target() needs the run-time check
                tails.append(f"\nelif mg.target({kind}):\n    y = 3")
            tail = draw(st.sampled_from(tails))
            sites += tail.count("mg.target")
            lines.append(f"if mg.target({kind}):\n    y = 1{tail}")
        elif form in ("fused", "fused_nested"):
            k = draw(st.integers(1, 4))
            op = draw(
                st.sampled_from(
                    ["", ", op=dist.ReduceOp.MAX", ", group=g", ", dist.ReduceOp.SUM, g"]
                )
            )
            block = draw(st.one_of(st.just(""), BLOCKS.map(lambda b: f"block={b}")))
            if draw(st.booleans()):
                choices = draw(st.lists(BLOCKS, min_size=1, max_size=3, unique=True))
                block = f"block=mg.tunable({choices[0]}, choices={choices})"
            body = "".join(f"        dist.all_reduce(t{i}{op})\n" for i in range(k))
            params = ", ".join(f"t{i}" for i in range(k))
            fn = f"def sync{n}(g, {params}):\n    with mg.fused_allreduce({block}):\n{body}"
            if form == "fused_nested":
                fn = f"class C{n}:\n" + "".join("    " + line + "\n" for line in fn.splitlines())
            lines.append(fn)
        else:
            args = draw(
                st.sampled_from(
                    ["", "(bucket_mb=4)", "(compress='bf16', accumulate=2)",
                     "(bucket_mb=mg.tunable(25, choices=[1, 25]))", "(broadcast_buffers=False)"]
                )
            )  # fmt: skip
            lines.append(
                f"@mg.data_parallel{args}\nclass Net{n}(nn.Module):\n"
                "    def __init__(self):\n        super().__init__()\n"
                "        self.fc = nn.Linear(A, A)\n\n"
                "    def forward(self, x):\n        return self.fc(x)\n"
            )
    return "\n".join(lines) + "\n", {"target": target, "tuning": tuning}, sites


@settings(FUZZ, max_examples=int(os.environ.get("MACROGEN_FUZZ_EXAMPLES", "15")))
@given(case=valid_file())
def test_valid_files_expand_without_error(case):
    source, options, sites = case
    try:
        result = expand_source(source, path="fuzz.py", **options)
    except ExpansionError as e:
        pytest.fail(f"a valid file was refused:\n{e}\n--- options {options}\n{source}")
    assert result.changed and len(result.sites) == sites, (result.sites, source)
    compile(result.code, "fuzz.py", "exec")
    assert expand_source(source, path="fuzz.py", **options).code == result.code
