"""The size syntax of acache's settings and limits: '20GiB', '512m', 1048576 -> bytes.

Shared by acache.config (sizes of keys) and acache.data.limit (upload rates), so neither
imports the other for it.
"""
from __future__ import annotations

import re
from fractions import Fraction

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
         "tib": 1 << 40}
_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


class Bad(ValueError):
    """A value that cannot be used; the message says why (the caller names key and source)."""


def size(value: object) -> int:
    """'20GiB' / '512m' / 1048576 -> bytes: a whole number of bytes, never a bool or a fraction."""
    if isinstance(value, bool):
        raise Bad("expected a size (e.g. 20GiB, 512MiB), not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise Bad("a size cannot be negative")
        return value
    m = _NUMBER.fullmatch(str(value))
    if not m or m.group(2).lower() not in UNITS:
        raise Bad("cannot read it as a size (e.g. 20GiB, 512MiB, or a whole number of bytes)")
    n = Fraction(m.group(1)) * UNITS[m.group(2).lower()]
    if n.denominator != 1:
        raise Bad("not a whole number of bytes (a size without a unit is in bytes)")
    return int(n)


def size_rounded(text: str) -> int:
    """'1.5GiB' -> bytes, rounded (a rate need not be a whole number of bytes)."""
    m = _NUMBER.fullmatch(text)
    if not m or m.group(2).lower() not in UNITS:
        raise Bad("not a size")
    return round(float(m.group(1)) * UNITS[m.group(2).lower()])
