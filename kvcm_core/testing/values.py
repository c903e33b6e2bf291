"""Typed element values as bytes, for the tools that fill and check typed pages (the
fingerprint engine, the codec conformance suite, ``kvcm bench codecs``).

``dtype`` is a buffer dtype name (``"bf16"``, ``"fp16"``, ``"fp32"``); bytes are
little-endian. fp32 to bf16 rounds to nearest even (NaN becomes 0x7fc0), fp32 to fp16 is
IEEE round to nearest even: the rounding the lossy page codecs use.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ITEMSIZE", "from_bytes", "round_to", "to_bytes"]

#: Bytes per element of the typed dtypes.
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    h = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, np.uint32(0x7FC0), h).astype("<u2")


def to_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values as ``uint8`` element bytes (the last axis ``itemsize`` times longer)."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "bf16":
        out = _bf16_bits(values)
    else:
        out = values.astype("<f2" if dtype == "fp16" else "<f4")
    return out.view(np.uint8).reshape(*values.shape[:-1], -1) if values.ndim else \
        out.reshape(1).view(np.uint8)


def from_bytes(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Element bytes (last axis) as fp32 values (exact)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if dtype == "bf16":
        out = (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        out = raw.view("<f2" if dtype == "fp16" else "<f4").astype(np.float32)
    return out


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values rounded to the dtype's values, as fp32."""
    return from_bytes(to_bytes(values, dtype), dtype)
