"""The pre-filter that returns a file as it is (``may_use_macros``) never skips a file
whose macros Python would reach, including NFKC-equivalent spellings of ``macrogen``."""

from __future__ import annotations

import ast
import unicodedata
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macrogen.expand import expand_source, may_use_macros

# Every character that Python's identifier normalization (NFKC) reads as one of the
# letters of "macrogen": fullwidth, superscript, mathematical bold/italic/script...
# (all of them lie in the BMP or the Mathematical Alphanumeric Symbols block, as of
# Unicode 15; scanning only these keeps the test fast).
SPELLINGS: dict[str, list[str]] = {letter: [] for letter in "macrogen"}
for code in [*range(0x80, 0x10000), *range(0x1D400, 0x1D800)]:
    normal = unicodedata.normalize("NFKC", chr(code))
    if normal in SPELLINGS and chr(code).isidentifier():
        SPELLINGS[normal].append(chr(code))

FULLWIDTH = "".join(chr(ord(c) - ord("a") + 0xFF41) for c in "macrogen")  # ｍａｃｒｏｇｅｎ


def spelled(draw_letter: st.DrawFn) -> str:
    """macrogen, each letter as written or as a random NFKC-equivalent character."""
    return "".join(
        draw_letter(st.sampled_from([letter, *SPELLINGS[letter]])) for letter in "macrogen"
    )


@st.composite
def package_names(draw: st.DrawFn) -> str:
    return spelled(draw)


def identifiers_in(source: str) -> set[str]:
    """Every identifier of a file as Python reads it (normalized), import names included."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
            if node.asname:
                names.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
    return names


def test_there_are_other_spellings():
    assert all(SPELLINGS[letter] for letter in "macrogen")


@pytest.mark.parametrize(
    "source",
    [
        f"import {FULLWIDTH} as mg\nA = mg.define(3)\n",
        f"import {FULLWIDTH}\nA = {FULLWIDTH}.define(3)\n",
        f"from {FULLWIDTH} import define\nA = define(3)\n",
        f"from {FULLWIDTH}.markers import define as d\nA = d(3)\n",
        "import \U0001d426acrogen as mg\nA = mg.define(3)\n",  # a mathematical bold m
    ],
)
def test_a_non_ascii_spelling_of_the_package_expands(source: str):
    assert "macrogen" not in source and may_use_macros(source)
    result = expand_source(source, path="m.py")
    assert result.changed and result.sites == (("define", 2),)
    assert "A = 3\n" in result.code


def test_files_without_the_name_are_skipped():
    assert not may_use_macros("import torch\nx = torch.zeros(3)\n")
    assert not may_use_macros("# café, naïve, ｆｕｌｌｗｉｄｔｈ\nπ = 3.14\n")
    assert may_use_macros("# mentions macrogen in a comment\n")  # over-approximate by design


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
FILLER = st.sampled_from(
    [
        "",
        " ",
        "x",
        "_",
        "é",
        "\u0301",
        "\u00b7",
        "ｍ",
        "ａ",
        "\uff10",
        ".",
        "(",
        "#",
        "'",
        "\n",
        "1",
    ]
)


@SETTINGS
@given(package_names(), st.sampled_from(["import {} as mg", "from {} import define as d"]))
def test_every_spelling_python_accepts_is_kept(name: str, form: str):
    source = form.format(name) + "\n"
    try:
        names = identifiers_in(source)
    except SyntaxError:
        return
    assert "macrogen" in names  # Python reads this spelling as the package
    assert may_use_macros(source)


@SETTINGS
@given(st.lists(FILLER, max_size=4), package_names(), st.lists(FILLER, max_size=4))
def test_the_filter_is_sound_around_any_context(before: list[str], name: str, after: list[str]):
    """Whatever surrounds the name, if Python reads ``macrogen`` the filter says True."""
    source = "import os\n" + "".join(before) + name + "".join(after) + "\n"
    try:
        names = identifiers_in(source)
    except (SyntaxError, ValueError):
        return
    if "macrogen" in names:
        assert may_use_macros(source)
