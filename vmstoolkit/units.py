"""Sizes: one parser and one formatter shared by the API and the CLI.

>>> parse_size("80GiB")
85899345920
>>> parse_size(4096)
4096
>>> format_size(3 * 2**30 + 2**29)
'3.50 GiB'
"""

from __future__ import annotations

import re
from fractions import Fraction

from vmstoolkit.errors import InvalidSizeError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
}
MAX_SIZE = (1 << 63) - 1
"""The largest size taken: no device, host array, driver call or compiled path (int64 everywhere)
holds more bytes. A larger one is a typo (``--capacity 99999999999999999999999GiB``), refused."""

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, whole: bool = False) -> int:
    """Bytes from an ``int`` or a string such as ``"80GiB"``, ``"512 MiB"``, ``"1.5GB"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024, decimal
    units (kB, MB, GB, TB) powers of 1000. The number is read exactly (no float rounding) and
    rounded to a byte; with ``whole=True`` a size that is not a whole number of bytes
    (``"1.5"``, ``"0.3KiB"``) is refused instead. Raises :class:`~vmstoolkit.errors.InvalidSizeError`
    (a ``ValueError``) naming the value when it is not a size or is larger than :data:`MAX_SIZE`;
    zero is allowed here (callers that need a positive size check it). Runtime complexity: O(length).

    >>> parse_size("1.5GiB") == 3 * 2**29
    True
    >>> parse_size("1.5", whole=True)
    Traceback (most recent call last):
    ...
    vmstoolkit.errors.InvalidSizeError: not a whole number of bytes: '1.5'
    """
    if isinstance(value, bool):
        raise InvalidSizeError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidSizeError(f"size must not be negative: {value}")
        return _at_most_max(value, value)
    if not isinstance(value, str):
        raise InvalidSizeError(f"not a size: {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise InvalidSizeError(f"not a size: {value!r} (expected e.g. 4096, '512MiB', '80GiB')")
    number, unit = m.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise InvalidSizeError(f"unknown size unit {unit!r} in {value!r} (use B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)")
    exact = Fraction(number) * factor
    if whole and exact.denominator != 1:
        raise InvalidSizeError(f"not a whole number of bytes: {value!r}")
    return _at_most_max(round(exact), value)


def _at_most_max(n: int, value: int | str) -> int:
    if n > MAX_SIZE:
        raise InvalidSizeError(f"size {value} is larger than {MAX_SIZE} bytes (2**63 - 1), more than any device holds")
    return n


def format_size(nbytes: int | float) -> str:
    """A human-readable binary size: ``'1.00 GiB'``, ``'512.00 MiB'``, ``'12 B'``. Runtime complexity: O(1)."""
    n = float(nbytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= factor:
            return f"{sign}{n / factor:.2f} {unit}"
    return f"{sign}{int(n)} B"


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``. Runtime complexity: O(1)."""
    return -(-n // multiple) * multiple
