"""Sizes, rates, budgets and percentages: parsing user text and formatting numbers for people.

Every parser takes the text a user typed and returns plain numbers in base units (bytes, bytes per
second, seconds, fractions). Every bad input raises :class:`hloopt.errors.UserError` whose one-line
message quotes the bad text and says what is accepted.

Unit conventions (invariants):
  * ``KB, MB, GB, TB, PB`` are decimal (10**3k); ``KiB, MiB, GiB, TiB, PiB`` are binary (2**10k).
  * ``B`` means bytes and must be upper case; a lower-case ``b`` means bits and is rejected, because
    vendors quote links in Gb/s (bits) and GB/s (bytes) and confusing them is an 8x error.
  * A bare prefix such as ``16G`` is rejected: it is ambiguous between GB and GiB.
  * A plain number is bytes (sizes) or bytes per second (rates).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hloopt.errors import UserError

__all__ = [
    "Budget",
    "format_bytes",
    "format_rate",
    "format_seconds",
    "parse_budget",
    "parse_bytes",
    "parse_percent",
    "parse_rate",
]

_PREFIX_EXP = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SIZE_RE = re.compile(rf"^\s*(?P<num>{_NUMBER})\s*(?P<unit>[A-Za-z]*)\s*$")
_RATE_RE = re.compile(rf"^\s*(?P<num>{_NUMBER})\s*(?P<unit>[A-Za-z]*)\s*(?P<per>/\s*s(?:ec)?)?\s*$")

_SIZE_HELP = "a size such as 16GiB, 512 MiB, 16 GB or 1.5e9 (bytes)"
_RATE_HELP = "a rate such as 25GB/s, 25 GiB/s or 2.5e10 (bytes/s)"
_BUDGET_HELP = "a size such as 12GiB or a share of HBM such as 75%"
_PERCENT_HELP = "a percentage between 0% and 100% such as 3%"


def _unit_multiplier(unit: str, text: str, help_text: str) -> int:
    """Bytes per ``unit`` (``''``, ``B``, ``KB``, ``KiB``...); raises UserError naming ``text``."""
    if unit == "":
        return 1
    if not unit.endswith("B"):
        if unit.endswith("b"):
            raise UserError(f"{text!r}: bits are not accepted; give bytes (capital B), e.g. {help_text}")
        raise UserError(f"{text!r}: unknown or ambiguous unit {unit!r}; expected {help_text}")
    stem = unit[:-1]
    binary = stem.lower().endswith("i")
    if binary:
        stem = stem[:-1]
        if stem == "":
            raise UserError(f"{text!r}: unknown unit {unit!r}; expected {help_text}")
    exp = _PREFIX_EXP.get(stem.lower())
    if exp is None:
        raise UserError(f"{text!r}: unknown unit {unit!r}; expected {help_text}")
    return (1024 if binary else 1000) ** exp


def _finite_nonnegative(value: float, text: str, help_text: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{text!r}: must be a finite, non-negative amount; expected {help_text}")
    return value


def parse_bytes(text: str | int) -> int:
    """Parse a size (``"16GiB"``, ``"16 GB"``, ``"1.5e9"``, ``"512MiB"``) into whole bytes.

    Fractions of a byte are rounded to the nearest byte. Raises UserError on anything else.
    """
    if isinstance(text, bool):
        raise UserError(f"{text!r}: expected {_SIZE_HELP}")
    if isinstance(text, int):
        if text < 0:
            raise UserError(f"{text!r}: must be non-negative; expected {_SIZE_HELP}")
        return text
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise UserError(f"{text!r}: not a size; expected {_SIZE_HELP}")
    mult = _unit_multiplier(m["unit"], str(text), _SIZE_HELP)
    value = _finite_nonnegative(float(m["num"]), str(text), _SIZE_HELP)
    return int(round(value * mult))


def parse_rate(text: str | float | int) -> float:
    """Parse a transfer rate (``"25GB/s"``, ``"25 GiB/s"``, ``"900GB/s"``) into bytes per second.

    A plain number is bytes per second; a unit must end in ``/s`` (or ``/sec``).
    """
    if isinstance(text, bool):
        raise UserError(f"{text!r}: expected {_RATE_HELP}")
    if isinstance(text, (int, float)):
        return _finite_nonnegative(float(text), repr(text), _RATE_HELP)
    m = _RATE_RE.match(str(text))
    if m is None:
        raise UserError(f"{text!r}: not a rate; expected {_RATE_HELP}")
    unit = m["unit"]
    if unit.lower().endswith("ps") and len(unit) > 2 and m["per"] is None:
        stem = unit[:-2]
        if stem.endswith("b"):
            raise UserError(f"{text!r}: bits are not accepted; give bytes (capital B), e.g. {_RATE_HELP}")
        raise UserError(f"{text!r}: write it as {m['num']}{stem}/s; expected {_RATE_HELP}")
    if unit and m["per"] is None:
        raise UserError(f"{text!r}: a rate needs '/s' after the unit; expected {_RATE_HELP}")
    if m["per"] is not None and not unit:
        raise UserError(f"{text!r}: missing unit before '/s'; expected {_RATE_HELP}")
    mult = _unit_multiplier(unit, str(text), _RATE_HELP)
    return _finite_nonnegative(float(m["num"]), str(text), _RATE_HELP) * mult


def parse_percent(text: str | float) -> float:
    """Parse ``"3%"`` into the fraction ``0.03``; the ``%`` sign is required (0% to 100%)."""
    s = str(text).strip()
    if not s.endswith("%"):
        raise UserError(f"{text!r}: not a percentage; expected {_PERCENT_HELP}")
    num = s[:-1].strip()
    if not re.fullmatch(_NUMBER, num):
        raise UserError(f"{text!r}: not a percentage; expected {_PERCENT_HELP}")
    value = float(num)
    if not (math.isfinite(value) and 0.0 <= value <= 100.0):
        raise UserError(f"{text!r}: out of range; expected {_PERCENT_HELP}")
    return value / 100.0


@dataclass(frozen=True)
class Budget:
    """A device-memory budget: either an absolute size or a share of the device's HBM.

    Exactly one of ``bytes`` and ``fraction`` is set.
    """

    #: Absolute budget in bytes.
    bytes: int | None = None
    #: Share of the device's HBM capacity, in (0, 1].
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("Budget needs exactly one of bytes= or fraction=")

    def resolve(self, hbm_bytes: int) -> int:
        """The budget in bytes for a device with ``hbm_bytes`` of HBM (fractions round down)."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(hbm_bytes * self.fraction)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        assert self.fraction is not None
        return f"{self.fraction * 100:g}%"


def parse_budget(text: str) -> Budget:
    """Parse ``"12GiB"`` into ``Budget(bytes=...)`` or ``"75%"`` into ``Budget(fraction=0.75)``."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            fraction = parse_percent(s)
        except UserError:
            raise UserError(f"{text!r}: not a budget; expected {_BUDGET_HELP} (0% < share <= 100%)") from None
        if fraction <= 0:
            raise UserError(f"{text!r}: a budget must be above 0%; expected {_BUDGET_HELP}")
        return Budget(fraction=fraction)
    try:
        n = parse_bytes(s)
    except UserError:
        raise UserError(f"{text!r}: not a budget; expected {_BUDGET_HELP}") from None
    if n <= 0:
        raise UserError(f"{text!r}: a budget must be above 0 bytes; expected {_BUDGET_HELP}")
    return Budget(bytes=n)


def _three_digits(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def format_bytes(n: int | float) -> str:
    """``12.3 GiB``: binary units, three significant digits; below 1 KiB exact bytes (``512 B``)."""
    sign = "-" if n < 0 else ""
    x = float(abs(n))
    if x < 1024:
        return f"{sign}{int(x)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024.0
        if x < 1024 or unit == "PiB":
            return f"{sign}{_three_digits(x)} {unit}"
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """``25.0 GB/s``: decimal units as vendors quote links, three significant digits."""
    x = float(bytes_per_s)
    for unit in ("B/s", "KB/s", "MB/s", "GB/s", "TB/s"):
        if abs(x) < 1000 or unit == "TB/s":
            return f"{_three_digits(x)} {unit}"
        x /= 1000.0
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """``1.23 ms``: seconds in s/ms/us/ns with three significant digits."""
    x = float(s)
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
        if abs(x) >= scale or unit == "ns":
            return f"{_three_digits(x / scale)} {unit}"
    raise AssertionError("unreachable")
