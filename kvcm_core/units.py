"""Byte sizes written the way people write them (``"8GiB"``, ``"512 MB"``, ``4096``)."""

from __future__ import annotations

import re

from kvcm_core.errors import ConfigError

__all__ = ["format_size", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, field: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts non-negative ints and strings such as ``"8GiB"``, ``"1.5 GB"`` or ``"4096"``.

    Raises:
        ConfigError: naming ``field`` when the value is not a size.
    """
    if isinstance(value, bool):
        raise ConfigError(field, value, "must be a byte count (int) or a size such as '8GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, "must be >= 0 bytes")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            nbytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if nbytes != int(nbytes):
                raise ConfigError(field, value, "must be a whole number of bytes")
            return int(nbytes)
    raise ConfigError(
        field, value, "must be a byte count (int) or a size such as '8GiB', '512MB', '4096'"
    )


def format_size(nbytes: int) -> str:
    """Format ``nbytes`` with a binary unit, e.g. ``format_size(3 << 30) == '3.0 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
