"""Checked template output, remembered by its shape: its text with every digit as ``0``.

Each site renders the same templates with other names (``_mlp_3_kernel``) and
line numbers (``ops.py:57``), so checking every text with Python's parser costs
the same again and again. A text whose shape matches one that passed the check
is valid Python too, without a check, where these hold (else it is checked):

- both are ASCII without a backslash: string contents (no escapes) and comments
  can't make a text invalid, and no two spellings name one identifier;
- the texts' words (runs of letters, digits and ``_``) correspond one to one,
  position by position: a name that differs differs everywhere (the old name is
  in no part of the new text, the new one in no part of the old) and no two
  become one, so two names are the same in one text exactly where they are the
  same in the other (a duplicate parameter, a ``global`` after a use);
- a word that differs begins with a letter or ``_`` (a name, or the exponent
  after ``1.``: any digits read the same) or is digits and ``_`` only that
  agree on a leading zero and on being all zeros (what decides whether a
  decimal number is valid); a word such as ``0x1f`` or ``1e5`` must be equal;
- no private name (``__x``): name mangling could make a differing class name
  collide with another name.

The two texts then differ only where Python's tokenizer sees the same kind of
token, numbers of the same validity and names in the same pattern, so the
parser and the symbol table accept both or neither. ``tests/test_shapes.py``
checks these rules on texts that differ in one way each.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

from macrogen.expand import fast

LIMIT = 4096  # shapes remembered at most (a file's sites need a few per template)

_WORD = re.compile(r"\w+", re.ASCII)
_ZEROS = bytes.maketrans(b"123456789", b"000000000")  # (bytes: ten times faster than str)

T = TypeVar("T")


class Checked(Generic[T]):
    """Shapes of texts that passed a check, each with a value computed from its text."""

    def __init__(self) -> None:
        self._known: dict[bytes, tuple[str, list[str], T]] = {}  # shape: text, its lines, value

    def clear(self) -> None:
        self._known.clear()

    def find(self, text: str) -> tuple[T, dict[str, str]] | None:
        """The value of a checked text of this shape, and the names that differ mapped
        to this text's; None if there is none or the rules above don't hold."""
        if not fast.ENABLED or "\\" in text or not text.isascii():
            return None
        known = self._known.get(text.encode().translate(_ZEROS))
        if known is None:
            return None
        old_text, old_lines, value = known
        names: dict[str, str] = {}  # the differing names, old to new
        news: set[str] = set()
        # the shape keeps the lines, so only the lines that differ can hold other words
        for old_line, line in zip(old_lines, text.split("\n")):
            if old_line == line:
                continue
            for old, word in zip(_WORD.findall(old_line), _WORD.findall(line)):
                if old == word:
                    continue
                if old[0] in "0123456789":  # (so is the other's): a number, not a name
                    if not _same_number(old, word):
                        return None
                elif names.setdefault(old, word) != word:
                    return None  # one old name, two new ones
                else:
                    news.add(word)
        if len(news) != len(names):
            return None  # two old names, one new one
        # each differing name differs everywhere: the old one is nowhere in this text, the
        # new one nowhere in the old (as a part of a word either: an overcautious test)
        if any(old in text for old in names) or any(word in old_text for word in news):
            return None
        return value, names

    def add(self, text: str, value: T) -> None:
        """Remember ``text``, which passed the check, and ``value``."""
        if not fast.ENABLED or "\\" in text or not text.isascii():
            return
        if any(w.startswith("__") and not w.endswith("__") for w in set(_WORD.findall(text))):
            return  # a private name: mangled
        if len(self._known) >= LIMIT:
            self._known.clear()
        self._known[text.encode().translate(_ZEROS)] = (text, text.split("\n"), value)


def _same_number(old: str, new: str) -> bool:
    """Two runs of digits (and ``_``) that are valid, or invalid, in the same places."""
    if not (old.replace("_", "").isdigit() and new.replace("_", "").isdigit()):
        return False  # 0x1f, 1e5, 1j: equal or checked
    return (old[0] == "0") == (new[0] == "0") and (old.strip("0_") == "") == (new.strip("0_") == "")
