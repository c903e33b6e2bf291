"""Byte sizes written the way people write them (``"8GiB"``, ``"1.5 GB"``, ``4096``).

Decimal units (``k``, ``KB``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary units
(``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024; units are case-insensitive and may be
separated from the number by spaces. Fractions are exact (``"1.5 KiB" == 1536``) and must
come out as a whole number of bytes, at most :data:`MAX_SIZE` (8 EiB: an int64).
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

from kvcm_core.errors import ConfigError

__all__ = ["MAX_SIZE", "format_size", "parse_size"]

#: The largest size :func:`parse_size` accepts: ``2**63 - 1`` bytes (8 EiB), what an int64
#: byte count holds (every quota, offset and allocation size is one).
MAX_SIZE = (1 << 63) - 1

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TOO_LARGE = "is too large: a size is at most 8 EiB (2**63 - 1 bytes)"
_RULE = "must be a byte count (int) or a size such as '8GiB', '1.5 GB', '4096'"


def parse_size(value: object, field: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts non-negative integers (including NumPy integers), integral floats (TOML writes
    ``8e9`` as a float) and strings such as ``"8GiB"``, ``"1.5 GB"`` or ``"4096"``.

    Args:
        value: the size to read.
        field: the configuration field it came from, named in errors.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: naming ``field`` when the value is not a size, or is larger than
            :data:`MAX_SIZE`.
    """
    if isinstance(value, bool):
        raise ConfigError(field, value, _RULE)
    nbytes: Fraction | int
    if isinstance(value, numbers.Integral):
        nbytes = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(field, value, "must be a whole, finite number of bytes")
        nbytes = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(field, value, _RULE)
        try:
            nbytes = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(field, value, _TOO_LARGE) from None
        if nbytes.denominator != 1:
            raise ConfigError(field, value, "must be a whole number of bytes")
        nbytes = int(nbytes)
    else:
        raise ConfigError(field, value, _RULE)
    if nbytes < 0:
        raise ConfigError(field, value, "must be >= 0 bytes")
    if nbytes > MAX_SIZE:
        raise ConfigError(field, value, _TOO_LARGE)
    return nbytes


def format_size(nbytes: int) -> str:
    """Format ``nbytes`` with a binary unit, e.g. ``format_size(3 << 30) == '3.0 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
