"""Malformed input never gives a traceback, an exit 3, a hang or a partial write.

Hypothesis generates files (broken syntax, encoding cookies, paths with
newlines, huge and deep inputs, out-of-range macro arguments, malformed tuning
databases) and runs each through ``expand_files``, the function behind
``macrogen expand``, in this process. Every run must exit 0 or 1, print no
traceback, stay within a time bound and, when it fails, leave no output and no
temporary file behind. Seeded (derandomized): the same examples in every CI run.

``MACROGEN_FUZZ_SCALE=10`` runs ten times as many examples.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import signal
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macrogen.commands.expand import expand_files
from macrogen.expand import expand_source
from macrogen.expand.sites import nfkc

SCALE = int(os.environ.get("MACROGEN_FUZZ_SCALE", "1"))
TIME_BOUND = 20  # seconds per example: far above any clean run, far below "hangs"
COUNTS: Counter[str] = Counter()


def fuzz(examples: int):
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_bound(seconds: int):
    def alarm(signum, frame):
        raise Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def run(source: bytes, *, name: str = "m.py", tuning: bytes | None = None, **options) -> int:
    """Expand one generated file to an output file; check the invariants; return the status."""
    COUNTS["tried"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "src" / name
        src.parent.mkdir()
        src.write_bytes(source)
        out = root / "out"
        out.mkdir()
        if tuning is not None:
            (root / "tuning.json").write_bytes(tuning)
            options["tuning"] = str(root / "tuning.json")
        before = snapshot(root)
        stdout, stderr = io.BytesIO(), io.StringIO()
        try:
            with time_bound(TIME_BOUND), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the user's invalid escapes are not ours
                status = expand_files(
                    [str(src)], out_dir=str(out), stdout=stdout, stderr=stderr, **options
                )
        except Hang:
            COUNTS["hang"] += 1
            raise AssertionError(f"no answer within {TIME_BOUND} s") from None
        except BaseException:
            COUNTS["traceback"] += 1
            raise AssertionError(f"traceback:\n{traceback.format_exc()}") from None
        err = stderr.getvalue()
        if status not in (0, 1) or "Traceback" in err:
            COUNTS["traceback"] += 1
            raise AssertionError(f"exit {status}:\n{err}")
        after = snapshot(root)
        written = {k: v for k, v in after.items() if k not in before or before[k] != v}
        if status != 0 or any(".tmp" in k for k in after):
            if written:
                COUNTS["partial"] += 1
                raise AssertionError(f"exit {status} but wrote {sorted(written)}:\n{err}")
        else:
            result = (out / name).read_bytes()
            if result != source and _compiles(source):  # expanded code compiles if its input does
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    compile(result, "<expanded>", "exec", dont_inherit=True)
        COUNTS["clean"] += 1
        return status


def _compiles(source: bytes) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, "<input>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


# -- syntax --------------------------------------------------------------------------------
TOKENS = st.sampled_from(
    list("abgmx_019 ():,.=[]{}'\"#\\\n\t\r+-*/@;")
    + [
        "mg.",
        "macrogen",
        "define(",
        "with ",
        "if ",
        "def f():\n    ",
        "\n    ",
        "tunable(",
        "fused_allreduce()",
        "\x00",
        "\u2028",
        "ｍg",
        "lambda",
        "async ",
        "class C:",
        "yield",
        "'''",
    ]  # fmt: skip
)
HEADERS = st.sampled_from(
    ["", "import macrogen as mg\n", "from macrogen import *\n", "import macrogen as ｍg\n"]
)


@fuzz(800)
@given(header=HEADERS, body=st.lists(TOKENS, max_size=60).map("".join))
def test_syntax(header, body):
    run((header + body).encode("utf-8", "surrogatepass"))


# -- encodings -----------------------------------------------------------------------------
COOKIES = st.sampled_from(
    [
        "rot13",
        "latin-1",
        "ascii",
        "utf-8",
        "utf-16",
        "utf-32",
        "cp1252",
        "koi8-r",
        "base64",
        "hex",
        "zlib_codec",
        "bz2",
        "nonesuch",
        "utf-8-sig",
        "utf_8",
        "mbcs",
        "idna",
        "punycode",
        "undefined",
        "unicode_escape",
        "raw_unicode_escape",
        "uu",
    ]  # fmt: skip
)
STRINGS = st.sampled_from(
    [
        "'\\u4e2d'",
        "'\\xe9'",
        "'\\U0001f600'",
        "'caf\\xe9'",
        "'\\N{GREEK SMALL LETTER ALPHA}'",
        "'plain'",
        "b'\\xff'",
        "'\\udcff'",
        "'\\\\u4e2d'",
        "'\\u2028'",
        "'\\x00'",
    ]  # fmt: skip
)


@fuzz(700)
@given(
    cookie=COOKIES,
    where=st.sampled_from(["line1", "line2", "line3", "bom"]),
    value=STRINGS,
    raw=st.binary(max_size=6),
    body=st.sampled_from(["define", "fused", "comment"]),
)
def test_encodings(cookie, where, value, raw, body):
    code = "import macrogen as mg\nimport torch.distributed as dist\n"
    if body == "define":
        code += f"NAME = mg.define({value})\n"
    elif body == "fused":
        code += (
            f"def f(a):\n    with mg.fused_allreduce():  # {value}\n        dist.all_reduce(a)\n"
        )
    else:
        code += f"X = mg.define(1)  # {value}\n"
    cookie_line = f"# -*- coding: {cookie} -*-\n"
    data = code.encode("ascii")
    if where == "line1":
        data = cookie_line.encode() + data
    elif where == "line2":
        data = b"#!/usr/bin/env python\n" + cookie_line.encode() + data
    elif where == "line3":
        data = b"\n\n" + cookie_line.encode() + data  # not a cookie on line 3
    else:
        data = b"\xef\xbb\xbf" + cookie_line.encode() + data
    run(data + b"# " + raw + b"\n")


# -- paths ---------------------------------------------------------------------------------
NAME_PARTS = st.sampled_from(
    [
        "m",
        "\n",
        "\r",
        "\r\n",
        "import os; os.system('echo PWNED')  #",
        '"""',
        "'''",
        "\\",
        "\\x",
        "\\N",
        "é",
        "中",
        "\u2028",
        "\x85",
        " ",
        "#",
        "{x}",
        "%s",
        "\t",
        "'",
        '"',
    ]  # fmt: skip
)
PROGRAM = """\
import torch.nn as nn
import torch.distributed as dist
import macrogen as mg

WIDTH = mg.define(4)
BLOCK = mg.tunable(64, choices=[32, 64])


def sync(a, b):
    with mg.fused_allreduce(block=mg.tunable(256, choices=[256, 1024])):
        dist.all_reduce(a)
        dist.all_reduce(b)
"""


@fuzz(100)
@given(parts=st.lists(NAME_PARTS, min_size=1, max_size=5))
def test_paths(parts):
    name = "".join(parts).replace("/", "_") + ".py"
    status = run(PROGRAM.encode(), name=name)
    assert status == 0


def test_a_path_that_is_python_after_its_newline_stays_a_comment(tmp_path):
    name = "m\nimport os; os.system('echo PWNED')  #\r__import__('sys').exit(7)\n.py"
    src = tmp_path / name
    src.write_text(PROGRAM)
    out = io.BytesIO()
    assert expand_files([str(src)], stdout=out, stderr=io.StringIO()) == 0
    code = out.getvalue().decode()
    tree = ast.parse(code)
    calls = {
        n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and hasattr(n.func, "attr")
    }
    assert "system" not in calls and "exit" not in calls
    assert "import os" not in [ln.strip() for ln in code.splitlines()]
    COUNTS["tried"] += 1
    COUNTS["clean"] += 1


# -- huge and deep -------------------------------------------------------------------------
@fuzz(30)
@given(
    items=st.integers(1, 25_000),
    form=st.sampled_from(["list", "sum", "dict", "nested-list", "string"]),
)
def test_huge(items, form):
    if form == "list":
        value = "[" + ", ".join(["1"] * items) + "]"
    elif form == "sum":
        value = "+".join(["1"] * min(items, 30_000))
    elif form == "dict":
        value = "{" + ", ".join(f"{i}: {i}" for i in range(min(items, 15_000))) + "}"
    elif form == "nested-list":
        depth = min(items, 5_000)
        value = "[" * depth + "]" * depth
    else:
        value = repr("x" * items * 10)
    run(f"import macrogen as mg\nA = mg.define({value})\n".encode())


@fuzz(40)
@given(
    depth=st.integers(1, 120),
    form=st.sampled_from(["def", "class", "if", "with", "paren"]),
)
def test_deep(depth, form):
    lines = ["import macrogen as mg", "import torch.distributed as dist"]
    if form == "paren":
        lines.append("A = mg.define(" + "(" * depth + "1" + ")" * depth + ")")
    else:
        for d in range(depth):
            head = {"def": f"def f{d}(a):", "class": f"class C{d}:", "if": "if a:",
                    "with": "with open(a):"}[form]  # fmt: skip
            lines.append("    " * d + head)
        ind = "    " * depth
        lines += [ind + "with mg.fused_allreduce():", ind + "    dist.all_reduce(a)"]
    run(("\n".join(lines) + "\n").encode())


# -- argument ranges -----------------------------------------------------------------------
NUMBERS = st.sampled_from(
    [
        "0",
        "-1",
        "16",
        "1024",
        "2**20",
        "2**21",
        "2**4000",
        "2**4097",
        "10**10**10",
        "1e309",
        "-1e309",
        "1e308*10",
        "1e309-1e309",
        "0.5",
        "4.0",
        "True",
        "None",
        "'1024'",
        "1j",
        "1e309j",
        "[16]",
        "(16,)",
        "{16}",
        "-(2**63)",
        "2**63",
        "float('inf')",
        "1/0",
        "0**-1",
        "16.0",
        "17",
        "2**16+0",
        "mg.tunable(16, choices=[16, 2**30])",
        "X",
        "X*2",
    ]  # fmt: skip
)


@fuzz(300)
@given(
    macro=st.sampled_from(
        [
            "block",
            "bucket_mb",
            "first_bucket_mb",
            "accumulate",
            "define",
            "tunable",
            "tile",
            "tp_size",
        ]
    ),  # fmt: skip
    value=NUMBERS,
    define=NUMBERS,
)
def test_argument_ranges(macro, value, define):
    head = f"import torch.nn as nn\nimport torch.distributed as dist\nimport macrogen as mg\nX = mg.define({define})\n"
    if macro == "block":
        body = (
            f"def f(a):\n    with mg.fused_allreduce(block={value}):\n        dist.all_reduce(a)\n"
        )
    elif macro in ("bucket_mb", "first_bucket_mb", "accumulate"):
        body = f"@mg.data_parallel({macro}={value})\nclass M(nn.Module):\n    pass\n"
    elif macro == "define":
        body = f"Y = mg.define({value})\n"
    elif macro == "tunable":
        body = f"Y = mg.tunable({value}, choices=[{value}, 1])\n"
    elif macro == "tile":
        body = (
            f"@mg.tile(i={value})\ndef k(out, x):\n    for i in range(x.shape[0]):\n"
            "        out[i] = x[i] * 2.0\n"
        )
    else:
        body = (
            f"@mg.tensor_parallel(plan={{'fc': 'colwise'}}, size={value})\nclass M(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n"
        )
    run((head + body).encode())


# -- tuning databases ----------------------------------------------------------------------
JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(allow_nan=False),
    st.sampled_from(["9", "m.py", "BLOCK", "cpu", "", "macrogen-tuning"]),
)  # fmt: skip
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "key",
                    "winner",
                    "generation",
                    "candidates",
                    "values",
                    "file",
                    "source_hash",
                    "python",
                    "BLOCK",
                    "target",
                    "time_s",
                ]
            ),  # fmt: skip
            inner,
            max_size=4,
        ),
    ),
    max_leaves=10,
)
TUNABLE = "import macrogen as mg\nBLOCK = mg.tunable(2, choices=[1, 2, 4])\n"


@st.composite
def databases(draw) -> bytes:
    kind = draw(st.sampled_from(["record", "record", "record", "top", "text", "deep"]))
    if kind == "text":
        return draw(st.binary(max_size=20))
    if kind == "deep":
        return b"[" * draw(st.integers(1, 100_000))
    if kind == "top":
        return json.dumps(draw(JSON)).encode()
    from macrogen.autotune import database

    record = {
        "key": {"file": "m.py", "target": "cpu"},
        "generation": 1,
        "source_hash": database.source_hash(TUNABLE),
        "candidates": [],
        "winner": {"BLOCK": 4},
    }
    for field in draw(st.lists(st.sampled_from(sorted(record) + ["extra"]), max_size=3)):
        if draw(st.booleans()):
            record.pop(field, None)
        else:
            record[field] = draw(JSON)
    if draw(st.booleans()):
        record["winner"] = {"BLOCK": draw(st.sampled_from(
            [True, 4.0, 4, "4", [4], {"python": "4"}, {"python": "(("}, {"python": 4}, None, 3]
        ))}  # fmt: skip
    db = {"format": "macrogen-tuning", "version": 2, "records": [record]}
    return json.dumps(db).encode()


@fuzz(300)
@given(db=databases())
def test_tuning_databases(db):
    run(TUNABLE.encode(), tuning=db)


def test_the_hook_imports_with_any_of_these_databases(tmp_path, monkeypatch):
    """A malformed macrogen_tuning.json beside a module: a warning and the defaults."""
    from macrogen import hook

    for var in (hook.DISABLE_ENV, hook.CACHE_DIR_ENV, hook.TUNING_ENV, hook.SHOW_ENV):
        monkeypatch.delenv(var, raising=False)
    src = tmp_path / "m.py"
    src.write_text(TUNABLE)
    for i, bad in enumerate(
        [b"{", b'{"format": "macrogen-tuning", "version": 2, "records": [{}]}', b"[" * 100_000,
         b'{"format": "macrogen-tuning", "version": 2, "records": [{"key": {}, "generation": "9"}]}',
         b'{"format": "macrogen-tuning", "version": 2, "records": [{"key": {"file": "m.py"}, "winner": []}]}']
    ):  # fmt: skip
        (tmp_path / hook.TUNING_FILE).write_bytes(bad)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = hook.load(src, f"m{i}", hook.options(cache_dir=tmp_path / f"cache{i}"))
        namespace: dict = {}
        exec(code, namespace)
        assert namespace["BLOCK"] == 2  # the default
        COUNTS["tried"] += 1
        COUNTS["clean"] += 1


# -- import forms -------------------------------------------------------------------------
# (the header, how the block names the macro; "{a}" is the alias drawn)
IMPORT_FORMS = [
    ("import macrogen as {a}\n", "{a}.fused_allreduce"),
    ("import macrogen\n", "macrogen.fused_allreduce"),
    ("import macrogen.markers as {a}\n", "{a}.fused_allreduce"),
    ("import macrogen.markers\n", "macrogen.markers.fused_allreduce"),
    ("import macrogen.markers\n", "macrogen.fused_allreduce"),
    ("import torch, macrogen.markers as {a}\n", "{a}.fused_allreduce"),
    ("from macrogen import markers as {a}\n", "{a}.fused_allreduce"),
    ("from macrogen import markers\n", "markers.fused_allreduce"),
    ("from macrogen import fused_allreduce as {a}\n", "{a}"),
    ("from macrogen.markers import fused_allreduce as {a}\n", "{a}"),
    ("from macrogen.markers import (fused_allreduce)\n", "fused_allreduce"),
    ("from macrogen import *\n", "fused_allreduce"),
    ("from macrogen.markers import *\n", "fused_allreduce"),
]
NOT_MACROGEN = [  # forms that do not reach the markers: the file comes out as it went in
    ("import macrogen_extra as {a}\n", "{a}.fused_allreduce"),
    ("from macrogen.runtime import markers as {a}\n", "{a}.fused_allreduce"),
    ("from .macrogen import markers as {a}\n", "{a}.fused_allreduce"),
]
ALIASES = st.sampled_from(["mg", "m", "mm", "markers", "ｍg", "macrogen_", "_x"])


@fuzz(150)
@given(
    form=st.sampled_from(IMPORT_FORMS + NOT_MACROGEN),
    alias=ALIASES,
    local=st.booleans(),  # the import inside the function instead of at module level
    padding=st.integers(0, 2),
)
def test_import_forms(form, alias, local, padding):
    """Every public import form expands the block as ``import macrogen as mg`` does."""
    header, use = (part.format(a=alias) for part in form)
    body = (
        "def f(a, b):\n"
        + ("    " + header if local else "")
        + f"    with {use}():\n        dist.all_reduce(a)\n        dist.all_reduce(b)\n"
    )
    source = ("" if local else header) + "import torch.distributed as dist\n" + "\n" * padding
    source += "\n" + body
    COUNTS["import forms"] += 1
    assert run(source.encode()) == 0
    result = expand_source(source, path="m.py")
    if form in NOT_MACROGEN:
        assert not result.changed
        return
    assert result.changed, f"not expanded:\n{source}"
    assert [name for name, _ in result.sites] == ["fused_allreduce"]
    assert re.search(r"\n    _fused_allreduce_l\d+\(a, b\)\n", result.code), result.code


# -- comprehension scopes --------------------------------------------------------------------
@st.composite
def comprehensions(draw, name: str) -> tuple[str, bool]:
    """A comprehension that mentions ``name``, and whether it binds ``name`` outside itself."""
    kind = draw(st.sampled_from(["list", "set", "gen", "dict"]))
    where = draw(st.sampled_from(["first for", "inner for", "nested", "walrus", "element"]))
    element = draw(st.sampled_from([name, f"{name}.tlie", f"{name}.fused_allreduce", "0"]))
    outside = False
    if where == "first for":
        head, fors = element, f"for {name} in ()"
    elif where == "inner for":
        head, fors = element, f"for y in () for {name} in y"
    elif where == "nested":
        head, fors = f"[{element} for {name} in y]", "for y in ()"
    elif where == "walrus":
        head, fors, outside = f"({name} := y)", "for y in ()", True
    else:  # a use, not a binding
        head, fors = name, "for y in ()"
    return {
        "list": f"[{head} {fors}]",
        "set": "{" + f"{head} {fors}" + "}",
        "gen": f"({head} {fors})",
        "dict": "{" + f"{head}: 1 {fors}" + "}",
    }[kind], outside


@fuzz(150)
@given(data=st.data(), alias=st.sampled_from(["mg", "m", "ｍg"]), where=st.sampled_from(
    ["module", "function", "class"]))  # fmt: skip
def test_comprehension_scopes(data, alias, where):
    """A comprehension's for names are its own: the macros around it still expand."""
    comprehension, outside = data.draw(comprehensions(nfkc(alias)))
    comprehension = comprehension.replace(nfkc(alias), alias, 1)  # another spelling, same name
    use = f"{nfkc(alias)}.fused_allreduce"
    block = f"    with {use}():\n        dist.all_reduce(a)\n        dist.all_reduce(b)\n"
    source = f"import macrogen as {alias}\nimport torch.distributed as dist\n\n"
    if where == "module":
        source += f"G = {comprehension}\n\n\ndef f(a, b):\n" + block
    elif where == "function":
        source += f"\ndef f(a, b):\n    G = {comprehension}\n" + block
    else:  # a class body's names are not the methods': only the class is shadowed
        source += f"\nclass C:\n    G = {comprehension}\n\n\ndef f(a, b):\n" + block
        outside = False
    COUNTS["comprehension scopes"] += 1
    assert run(source.encode()) == 0
    result = expand_source(source, path="m.py")
    assert result.changed is not outside, f"{'' if outside else 'not '}expanded:\n{source}"


CATEGORIES = ("import forms", "comprehension scopes")


def test_counts(capsys):
    """The tally over this file's examples (printed with -s; also the closing note's figures)."""
    with capsys.disabled():
        print(
            "\nreliability fuzz: "
            + ", ".join(
                f"{k} {COUNTS[k]}" for k in ("tried", "clean", "traceback", "hang", "partial")
            )
        )
        print("reliability fuzz categories: " + ", ".join(f"{k} {COUNTS[k]}" for k in CATEGORIES))
    assert COUNTS["traceback"] == COUNTS["hang"] == COUNTS["partial"] == 0
