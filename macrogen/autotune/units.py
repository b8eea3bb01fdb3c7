"""The values ``macrogen plan`` and ``macrogen autotune`` take on their command lines, read one way.

    count("--world-size", "64")         -> 64          (ASCII digits; 1e9 is a whole number too)
    size("--gpu-memory", "80GB")        -> 80e9        (B: bytes; b: bits, 80Gb = 10 GB)
    size("--gpu-memory", "512MiB")      -> 536870912   (a unit is needed: 80 alone is refused)
    bandwidth("--link", "400Gb/s")      -> 50e9        (bytes per second)
    number("--speedup", "2.5")          -> 2.5         (finite; nan and inf are no numbers here)

Every problem is a ``UsageError`` naming the option and the text it was given, so both
commands print it as one line and exit 2 (bad usage). Pure: no torch.
"""

from __future__ import annotations

import math
import re

# an unsigned decimal (no sign, no nan, no inf: what the options mean is a positive amount)
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
# decimal and binary prefixes (case-insensitive: no option means milli-anything)
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_PREFIXES.update({"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50})
_SIZE = re.compile(rf"({_NUMBER})\s*(?:([kKmMgGtTpP][iI]?)?(B|b))?", re.ASCII)
# more than any machine has of anything counted here (ranks, rows, tokens): a bound checked
# before the power of ten is computed, so that 1e999999999 is an error, not an hour of work
LARGEST = 2**62
_COUNT = re.compile(r"([0-9]+)(?:[eE]([0-9]+))?", re.ASCII)


class UsageError(ValueError):
    """A command-line value that can't be used; the message names the option."""


def count(option: str, text: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number of ``minimum`` or more (``maximum`` or less): ASCII digits, or digits
    with a whole power of ten (``1e9``)."""
    m = _COUNT.fullmatch(text.strip())
    if m is None:
        raise UsageError(f"{option} {text!r}: expected a whole number such as 64")
    top = LARGEST if maximum is None else min(maximum, LARGEST)
    digits, exponent = m.group(1).lstrip("0"), int(m.group(2) or 0)
    if len(digits) + exponent > len(str(top)):  # too many digits to be at most ``top``
        raise UsageError(f"{option} must be at most {top}, not {text}")
    value: int = int(m.group(1)) * 10**exponent
    if value < minimum:
        raise UsageError(f"{option} must be at least {minimum}, not {text}")
    if value > top:
        raise UsageError(f"{option} must be at most {top}, not {text}")
    return value


def size(option: str, text: str) -> float:
    """A positive size in bytes: ``80GB``, ``512MiB``, ``1e9B`` (bytes), ``80Gb`` (bits). A
    number without its unit is refused: ``--gpu-memory 80`` means 80 GB to whoever typed it."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or m.group(3) is None:
        raise UsageError(
            f"{option} {text!r}: expected a size with its unit, such as 80GB or 512MiB"
            " (B: bytes, b: bits)"
        )
    return _positive(option, text, float(m.group(1)) * _scale(m.group(2), m.group(3)))


def bandwidth(option: str, text: str) -> float:
    """Bytes per second from ``900GB/s`` or ``400Gb/s``."""
    body = text.strip()
    m = _SIZE.fullmatch(body[:-2]) if body.endswith("/s") else None
    if m is None or m.group(3) is None:
        raise UsageError(f"{option} {text!r}: expected a bandwidth such as 900GB/s or 400Gb/s")
    return _positive(option, text, float(m.group(1)) * _scale(m.group(2), m.group(3)))


def number(option: str, text: str, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """A finite decimal above ``minimum`` (or equal to it, ``inclusive``)."""
    if re.fullmatch(_NUMBER, text.strip(), re.ASCII) is None:
        raise UsageError(f"{option} {text!r}: expected a number such as 2.5")
    value = float(text)
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
        bound = f"at least {minimum:g}" if inclusive else f"above {minimum:g}"
        raise UsageError(f"{option} must be {bound}, not {text}")
    return value


def _scale(prefix: str | None, unit: str | None) -> float:
    return _PREFIXES[(prefix or "").lower()] / (8 if unit == "b" else 1)


def _positive(option: str, text: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{option} {text!r}: must be a positive, finite amount")
    return value
