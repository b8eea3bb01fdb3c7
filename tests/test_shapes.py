"""Template checks remembered by shape (macrogen/expand/fast/shapes.py): a text that skips the check
is one Python's parser and symbol table accept, and the output is the same without them."""

from __future__ import annotations

import random
import symtable

import pytest

from macrogen.expand import codegen, fast
from macrogen.expand.fast.shapes import Checked
from tests.test_golden import CASES, GOLDEN, expand_case


def _valid(text: str) -> bool:
    try:
        symtable.symtable(text, "<t>", "exec")
    except SyntaxError:
        return False
    return True


def _hit(checked: str, text: str) -> bool:
    known: Checked[None] = Checked()
    assert _valid(checked)
    known.add(checked, None)
    return known.find(text) is not None


@pytest.mark.parametrize(
    "checked, text",
    [
        (
            "def f_1(x):\n    return x + 12  # at a.py:3\n",
            "def f_7(x):\n    return x + 57  # at a.py:9\n",
        ),
        ("class Net0(_Net0_serial):\n    pass\n", "class Net4(_Net4_serial):\n    pass\n"),
        ("x = 1.e5 + 0.25 + 10\n", "x = 1.e9 + 0.75 + 90\n"),
        ("x = 100_000\n", "x = 900_001\n"),
        ("s = f'{a1!r:>10} {a2}'\n", "s = f'{a3!r:>70} {a4}'\n"),
    ],
)
def test_the_same_shape_skips_the_check(checked: str, text: str) -> None:
    assert _hit(checked, text) and _valid(text)


@pytest.mark.parametrize(
    "checked, text",
    [
        ("def f(a1, a2):\n    pass\n", "def f(a1, a1):\n    pass\n"),  # duplicate parameter
        ("def f(a1, a1x):\n    pass\n", "def f(a1, a1x):\n    global a1\n"),  # another shape
        ("def f(x1):\n    global x2\n    x2 = 1\n", "def f(x1):\n    global x1\n    x1 = 1\n"),
        ("x = 10\n", "x = 01\n"),  # a leading zero
        ("x = 10\n", "x = 00\n"),  # valid, but another kind of number
        ("x = 0o17\n", "x = 0o18\n"),  # not a digit of octal
        ("x = 0b10\n", "x = 0b12\n"),
        ("x = 1e5\n", "x = 1e9\n"),  # words such as 1e5 must be equal
        ('s = "\\x41"\n', 's = "\\x4g"\n'),  # a backslash: always checked
        ("s = 'a1'\n", "s = 'a\u00b9'\n"),  # not ASCII: always checked
        ("class C1:\n    __a1 = 1\n", "class C2:\n    __a1 = 1\n"),  # a private name
    ],
)
def test_other_shapes_are_checked(checked: str, text: str) -> None:
    assert not _hit(checked, text)


def _mutations(text: str, rng: random.Random, n: int) -> list[str]:
    spots = [i for i, c in enumerate(text) if c.isdigit()]
    out = []
    for _ in range(n):
        chars = list(text)
        for i in rng.sample(spots, min(len(spots), rng.randint(1, 3))):
            chars[i] = rng.choice("0123456789")
        out.append("".join(chars))
    return out


BASES = [
    "def f(a1, a2, b3=10):\n    return a1 + a2 * 0.5e3 + 0x1f + 0b10 + 0o17 + 1_000 + 00\n",
    "def g1(x1):\n    global y2\n    y2 = x1\n    return [z3 for z3 in range(9) if (w4 := z3)]\n",
    "def h(p1):\n    def i2():\n        nonlocal p1\n        p1 = 3\n    return f'{p1!r:>8} {p1:08d}' + 's7'\n",
    "class K1:\n    def m1(self, k1=1, k2=2):\n        return self.k3(k1=1, k2=2) + 1.e5 + 3j\n",
]


@pytest.mark.parametrize("base", BASES)
def test_a_remembered_shape_never_passes_invalid_python(base: str) -> None:
    rng = random.Random(base)
    known: Checked[None] = Checked()
    known.add(base, None)
    hits = 0
    for text in _mutations(base, rng, 400):
        if known.find(text) is not None:
            hits += 1
            assert _valid(text), text
    assert hits  # (the rules let some through)


@pytest.mark.parametrize(
    "name", [c for c in CASES if "parallel" in c or c.startswith(("tile", "fused"))][:30]
)
def test_goldens_the_same_with_every_template_checked(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codegen.clear_checked()
    expand_case(GOLDEN / name)
    remembered = expand_case(GOLDEN / name)  # each template's text found by its shape
    monkeypatch.setattr(fast, "ENABLED", False)
    assert expand_case(GOLDEN / name) == remembered
