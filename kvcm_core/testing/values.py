"""Typed element values as bytes, for the tools that fill and check typed pages (the
fingerprint engine, the codec conformance suite, ``kvcm bench codecs``).

``dtype`` is a buffer dtype name (``"bf16"``, ``"fp16"``, ``"fp32"``); bytes are
little-endian. fp32 to bf16 rounds to nearest even (NaN becomes 0x7fc0), fp32 to fp16 is
IEEE round to nearest even: the rounding the lossy page codecs use.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EXTREME_KINDS", "ITEMSIZE", "extreme_values", "from_bytes", "round_to", "to_bytes"]

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


#: The kinds of scale group :func:`extreme_values` cycles through.
EXTREME_KINDS = ("kv-like", "subnormal", "tiny", "zeros", "largest", "fp8 ties",
                 "int8 ties", "int4 ties")
_LARGEST = {"bf16": 3.3895314e38, "fp16": 65504.0, "fp32": 3.4028235e38}
_TIES = {
    # amax 448 (scale 1 for fp8): saturation at +-448, ties between e4m3 codes (432 between
    # 416 and 448, 17, 19, 8.5, 9.5, 232) and between subnormal codes (1.5 and 0.5 * 2**-9)
    "fp8 ties": (448.0, -448.0, 432.0, -432.0, 17.0, 19.0, -17.0, 8.5, 9.5, 232.0,
                 1.5 * 2.0**-9, 2.0**-10, -(2.0**-10), -9.5),
    # amax 127 (scale 1 for int8) and 7 (scale 1 for int4): halves round to even
    "int8 ties": (127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, -3.5),
    "int4 ties": (7.0, -7.0, 0.5, 1.5, 2.5, 3.5, -3.5, 6.5, -6.5, -0.5, 4.5, -5.5),
}


def extreme_values(rng: np.random.Generator, blocks: int, groups: int, group: int,
                   dtype: str) -> np.ndarray:
    """fp32 ``[blocks, groups * group]`` values (finite in ``dtype``; no NaN, no infinity)
    whose scale group ``i`` of block ``b`` is of kind ``EXTREME_KINDS[(i + b) % 8]``:

    - ``kv-like``: normal values, one of them 40x larger;
    - ``subnormal``: fp32 subnormals of random sign (bf16 keeps many; fp16 rounds them to 0);
    - ``tiny``: normals just above 2**-126, so that ``amax / Q`` is subnormal;
    - ``zeros``: +0 and -0;
    - ``largest``: up to the dtype's largest finite magnitude, with a few tiny values
      (scaled to subnormals or to zero);
    - ``fp8 ties`` / ``int8 ties`` / ``int4 ties``: ``amax`` 448 / 127 / 7 (scale exactly 1
      for that codec), with saturation at +-Q and values halfway between two codes (round
      to nearest even), the rest random multiples of 0.5.

    The kinds that reach subnormal fp32 scales or values make a kernel compiled with
    flush-to-zero differ from an IEEE reference.
    """
    out = np.zeros((blocks, groups, group), dtype=np.float32)
    for b in range(blocks):
        for i in range(groups):
            kind = EXTREME_KINDS[(i + b) % len(EXTREME_KINDS)]
            row = out[b, i]
            if kind == "kv-like":
                row[:] = rng.normal(0.0, 1.0, group)
                row[rng.integers(0, group)] *= np.float32(40.0)
            elif kind == "subnormal":
                bits = rng.integers(1, 1 << 23, group, dtype=np.uint32)
                bits |= rng.integers(0, 2, group, dtype=np.uint32) << np.uint32(31)
                row[:] = bits.view(np.float32)
            elif kind == "tiny":
                row[:] = (rng.uniform(1.0, 64.0, group) * 2.0**-126
                          * rng.choice([-1.0, 1.0, 0.0], group))
            elif kind == "zeros":
                row[:] = rng.choice([0.0, -0.0], group)
            elif kind == "largest":
                top = _LARGEST[dtype]
                row[:] = rng.uniform(-1.0, 1.0, group) * top
                row[0] = np.float32(top) if dtype != "fp32" else np.float32(-top)
                # values whose scaled value v = x / scale is subnormal, or 0 of either sign
                row[1 : min(group, 5)] = np.array([1e-3, -1e-3, 1e-40, -1e-40],
                                                  np.float32)[: min(group, 5) - 1]
            else:
                fixed = np.array(_TIES[kind], dtype=np.float32)
                amax = float(fixed[0])
                row[:] = np.round(rng.uniform(-amax, amax, group) * 2.0) / 2.0
                take = min(group, len(fixed))
                row[:take] = fixed[:take]
    return out.reshape(blocks, groups * group)
