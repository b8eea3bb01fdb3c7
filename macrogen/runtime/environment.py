"""Environment variables, read one way: a bad value is an error naming the variable.

    rank = environment.whole("RANK", 0, low=0)               # ASCII digits only
    port = environment.whole("MASTER_PORT", None, low=1, high=65535)
    seconds = environment.seconds("MACROGEN_TIMEOUT")         # None when unset
    kind = environment.choice("MACROGEN_SERVER_TRANSPORT", "p2p", ("p2p", "rpc"))
    show = environment.flag("MACROGEN_SHOW_EXPANDED")        # 1/0, true/false, yes/no, on/off

``int()`` alone takes "²", "١٢" and " 7 ", and says only "invalid literal for int()";
torch takes a port of 99999 to a pybind TypeError and a timeout of 1e-9 s to a failure
far from the cause. Here every value is checked where it is read, and the error says
which variable, what it holds, and what is expected. Torch-free: the import hook and the
command line read their variables through it too.
"""

from __future__ import annotations

import math
import os
import re
from typing import overload

_DECIMAL = re.compile(r"[+]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)


class EnvironmentValueError(ValueError):
    """An environment variable holds a value macrogen cannot use."""


def text(name: str) -> str | None:
    """The variable's value, stripped; None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def is_set(name: str) -> bool:
    """The variable is in the environment, whatever it holds (torchrun's RANK, even blank)."""
    return name in os.environ


@overload
def whole(
    name: str,
    default: int,
    *,
    low: int | None = None,
    high: int | None = None,
    blank_is_unset: bool = False,
) -> int: ...


@overload
def whole(
    name: str,
    default: None,
    *,
    low: int | None = None,
    high: int | None = None,
    blank_is_unset: bool = False,
) -> int | None: ...


def whole(
    name: str,
    default: int | None,
    *,
    low: int | None = None,
    high: int | None = None,
    blank_is_unset: bool = False,
) -> int | None:
    """The variable as a whole number (ASCII digits, an optional leading "-"), within
    ``low``..``high``; ``default`` when unset (and when blank, with ``blank_is_unset``)."""
    raw = os.environ.get(name)
    if raw is None or (blank_is_unset and not raw.strip()):
        return default
    value = raw.strip()
    digits = value[1:] if value.startswith("-") else value
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 30:
        raise EnvironmentValueError(f"{name}={raw!r}: expected {_range(low, high)}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise EnvironmentValueError(f"{name}={raw!r}: expected {_range(low, high)}")
    return number


def seconds(name: str, *, low: float = 1.0, high: float = 365 * 24 * 3600) -> float | None:
    """The variable as a number of seconds within ``low``..``high``; None when unset or
    blank. (A decimal number: "90", "2.5"; no "inf", "nan" or digits of other scripts.)"""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip()
    number = float(value) if _DECIMAL.fullmatch(value) else math.nan
    if not low <= number <= high:  # (NaN fails too)
        raise EnvironmentValueError(
            f"{name}={raw!r}: expected a positive number of seconds, at least {low:g} and at"
            f" most {high:.0f}; unset it for the default"
        )
    return number


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(name: str) -> bool:
    """The variable as a switch: 1/true/yes/on, or 0/false/no/off (any case); unset or blank
    is off."""
    value = text(name)
    if value is None or value.lower() in _OFF:
        return False
    if value.lower() in _ON:
        return True
    raise EnvironmentValueError(
        f"{name}={os.environ.get(name)!r}: expected 1 or 0 (or true/false, yes/no, on/off)"
    )


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The variable as one of ``choices`` (case-insensitive); ``default`` when unset or blank."""
    value = text(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise EnvironmentValueError(
            f"{name}={os.environ.get(name)!r}: expected one of {', '.join(choices)}"
        )
    return value.lower()


def _range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"a whole number from {low} to {high}"
    if low is not None:
        return f"a whole number >= {low}"
    if high is not None:
        return f"a whole number <= {high}"
    return "a whole number"
