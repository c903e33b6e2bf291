"""The cold page layout of the quantizing page codecs and their NumPy reference.

Every rule here is what the CUDA kernels (:mod:`kvcm_codec_quant.source`) do too, in the
same order, so that both give the same bits.

**Cold page.** A pool group's slots are cut into *segments*, pool by pool and by offset
within the slot: each buffer place is one segment, bytes no buffer covers (and places that
overlap without being identical) are raw segments. A segment is *lossy* when its buffer is
``bf16``, ``fp16`` or ``fp32`` and not ``exact`` (places that several life cycles share
must agree on dtype and group size, else the segment is raw). Each segment owns a section
of the cold page starting at a multiple of 16 bytes, in segment order:

- raw segment: its bytes, unchanged;
- lossy segment of ``n`` elements in groups of ``g = min(group_size, n)`` (a group never
  spans more than the segment: a ``group_size`` larger than the buffer's values gives one
  group of ``n``, whose codes take ``n`` bytes, not ``group_size``; ``G = ceil(n / g)``
  groups, the last one possibly short): ``G`` little-endian fp32 scales, then, from the
  next multiple of 16, group ``i``'s codes at ``i * B`` (``B = g`` bytes for fp8 and int8,
  ``ceil(g / 2)`` for int4; int4 packs element ``2j`` in the low nibble of byte ``j``,
  ``2j + 1`` in its high nibble, a missing last element as 0).

Every byte of a cold page that no segment's data fills (padding between scales and codes,
after a short last group, between sections, at the end) is 0: cold pages are fully defined.

The page size is the end of the last section rounded up to 16 bytes: it depends on the
layout only.

**Encoding a group** (``x`` its values as fp32; bf16 and fp16 widen exactly):

1. ``amax = fmax(0, |x_0|, |x_1|, ...)`` (``fmax`` ignores NaN);
2. ``scale = amax / Q`` in fp32 (one correctly rounded division; ``Q`` is 448 for fp8
   e4m3, 127 for int8, 7 for int4);
3. ``inv = min(1 / scale, FLT_MAX)`` in fp32 when ``scale > 0``, else 0 (an all-zero
   group has scale 0 and codes 0);
4. ``v = x * inv`` (one fp32 multiplication, never fused);
5. fp8: ``a = min(|v|, 448)``; below ``2**-6`` the code is ``rint(a * 512)`` (subnormals,
   exact scaling), else the fp32 bits of ``a`` rounded to nearest even at bit 20 minus
   ``120 << 3``; the sign bit of ``v`` is bit 7 (code 0x7f, NaN, is never written).
   int8 / int4: ``rint(min(max(v, -Q), Q))``, two's complement.

``rint`` rounds half to even. **Decoding**: ``y = value(code) * scale`` (one fp32
multiplication), then to the buffer's dtype: bf16 by rounding the fp32 bits to nearest even
at bit 16 (NaN becomes 0x7fc0), fp16 by IEEE round to nearest even, fp32 as is.

**Error bound** (per element, for a group whose largest magnitude is 1; errors scale with
the group's ``amax``): half a code step at the top of the range plus the rounding of the
decoded value to bf16 (``2**-8``) and of ``scale`` and ``inv`` (a few fp32 ulps). Finite
inputs only: NaN and infinities give unspecified codes.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kvcm_core.codec import BufferPlace, PageLayout

__all__ = [
    "BOUNDS",
    "MODES",
    "QMAX",
    "Plan",
    "Segment",
    "decode_pages",
    "encode_pages",
    "make_plan",
]

#: Codec modes, as the kernels number them.
MODES = {"fp8": 0, "int8": 1, "int4": 2}
#: Largest code magnitude per mode.
QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
#: Declared error bound per mode (see the module docstring).
BOUNDS = {"fp8": 0.045, "int8": 0.009, "int4": 0.08}
#: Element types a lossy segment can have, as the kernels number them, and their sizes.
LOSSY_DTYPES = {"bf16": (0, 2), "fp16": (1, 2), "fp32": (2, 4)}
_ALIGN = 16
_FLT_MAX = np.float32(np.finfo(np.float32).max)


def _up(n: int, k: int = _ALIGN) -> int:
    return -(-n // k) * k


@attrs.frozen
class Segment:
    """One segment of a pool slot and its section of the cold page.

    ``dtype`` is ``None`` for raw segments. ``units`` is what one warp of the kernel works
    on: groups of a lossy segment, chunks of :data:`RAW_CHUNK` bytes of a raw one.
    """

    pool: int
    offset: int  # in the pool slot
    size: int  # bytes in the pool slot
    cold_offset: int  # of the section in the cold page
    dtype: str | None = None
    group_size: int = 0

    @property
    def elements(self) -> int:
        return self.size // LOSSY_DTYPES[self.dtype][1] if self.dtype else 0

    @property
    def groups(self) -> int:
        return -(-self.elements // self.group_size) if self.dtype else 0

    def payload_offset(self) -> int:
        """Offset of the codes from the section start."""
        return _up(4 * self.groups)

    def group_bytes(self, mode: str) -> int:
        return -(-self.group_size // 2) if mode == "int4" else self.group_size

    def used_bytes(self, mode: str) -> int:
        """Bytes of the section that hold data (the rest, up to the next section, is 0)."""
        if not self.dtype:
            return self.size
        rest = self.elements - (self.groups - 1) * self.group_size
        last = -(-rest // 2) if mode == "int4" else rest
        return self.payload_offset() + (self.groups - 1) * self.group_bytes(mode) + last

    def section_bytes(self, mode: str) -> int:
        if not self.dtype:
            return self.size
        return self.payload_offset() + self.groups * self.group_bytes(mode)


#: Bytes of a raw segment that one warp copies per unit of work.
RAW_CHUNK = 1024


@attrs.frozen
class Plan:
    """The segments of a layout for one codec mode, and the cold page size."""

    mode: str
    segments: tuple[Segment, ...]
    cold_page_size: int


def _kind(places: Sequence[BufferPlace]) -> tuple[str | None, int]:
    """(dtype, group size) of a lossy segment, or (None, 0) for a raw one."""
    first = places[0]
    same = all((p.dtype, p.group_size, p.exact) == (first.dtype, first.group_size, first.exact)
               for p in places)
    if not same or first.exact or first.dtype not in LOSSY_DTYPES:
        return None, 0
    return first.dtype, first.group_size


def _pool_segments(pool: int, slot: int, places: list[BufferPlace]) -> list[tuple]:
    """``(offset, size, dtype, group_size)`` covering ``[0, slot)`` of one pool."""
    ranges: dict[tuple[int, int], list[BufferPlace]] = {}
    for p in places:
        ranges.setdefault((p.offset, p.size), []).append(p)
    out: list[tuple] = []
    end = 0
    for (off, size), group in sorted(ranges.items()):
        if size <= 0:
            continue
        if off < end:  # overlaps the previous segment without being it: merge as raw
            last = out.pop()
            stop = max(last[0] + last[1], off + size)
            out.append((last[0], stop - last[0], None, 0))
            end = stop
            continue
        if off > end:
            out.append((end, off - end, None, 0))
        out.append((off, size, *_kind(group)))
        end = off + size
    if end < slot:
        out.append((end, slot - end, None, 0))
    return out


def make_plan(layout: PageLayout, mode: str) -> Plan:
    """The cold page layout of ``layout`` under ``mode`` (see the module docstring).

    Raises:
        ValueError: a place outside its pool slot, or a layout with no bytes.
    """
    if layout.page_bytes <= 0:
        raise ValueError(f"layout.slot_sizes={layout.slot_sizes}: a block needs > 0 bytes")
    segments: list[Segment] = []
    at = 0
    for pool, slot in enumerate(layout.slot_sizes):
        places = [p for p in layout.buffers if p.pool == pool]
        for p in places:
            if p.offset < 0 or p.offset + p.size > slot:
                raise ValueError(f"buffer {(p.layer_id, p.role)} at {p.offset}+{p.size} "
                                 f"outside pool {pool}'s {slot}-byte slot")
        for off, size, dtype, gs in _pool_segments(pool, slot, places):
            if dtype:  # a group never spans more than the segment's values (one group
                gs = min(gs, size // LOSSY_DTYPES[dtype][1])  # either way: same codes)
            seg = Segment(pool, off, size, at, dtype, gs)
            segments.append(seg)
            at = _up(at + seg.section_bytes(mode))
    return Plan(mode, tuple(segments), max(at, _ALIGN))


# -- element conversions -----------------------------------------------------------------


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Little-endian element bytes ``uint8 [..., n * size]`` as fp32 ``[..., n]`` (exact)."""
    if dtype == "bf16":
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "fp16":
        return raw.view("<f2").astype(np.float32)
    return raw.view("<f4").astype(np.float32)


def from_f32(y: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values as little-endian element bytes, rounded to nearest even."""
    if dtype == "bf16":
        u = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
        h = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        return np.where(nan, np.uint32(0x7FC0), h).astype("<u2").view(np.uint8)
    if dtype == "fp16":
        return y.astype("<f2").view(np.uint8)
    return y.astype("<f4").view(np.uint8)


def _fp8_codes(v: np.ndarray) -> np.ndarray:
    a = np.fmin(np.abs(v), np.float32(448.0))
    sub = np.rint(a * np.float32(512.0)).astype(np.uint32)
    bits = a.view(np.uint32)
    norm = ((bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1)))
            >> np.uint32(20)) - np.uint32(120 << 3)
    code = np.where(a < np.float32(2.0**-6), sub, norm)
    sign = (v.view(np.uint32) >> np.uint32(31)) << np.uint32(7)
    return (code | sign).astype(np.uint8)


def _fp8_values(code: np.ndarray) -> np.ndarray:
    c = code.astype(np.uint32)
    e = (c >> np.uint32(3)) & np.uint32(15)
    m = c & np.uint32(7)
    sub = m.astype(np.float32) * np.float32(2.0**-9)
    norm = (((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20))).view(np.float32)
    val = np.where(e == 0, sub, norm)
    return np.where(c >> np.uint32(7) != 0, -val, val)


def _int_codes(v: np.ndarray, q: float) -> np.ndarray:
    lim = np.float32(q)
    return np.rint(np.fmin(np.fmax(v, -lim), lim)).astype(np.int8)


# -- groups ----------------------------------------------------------------------------------


def encode_groups(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` fp32 ``[..., G, g]`` (padded with zeros) to ``(scales [..., G], codes)``;
    codes are ``uint8 [..., G, g]`` (int4: ``[..., G, ceil(g / 2)]``, packed)."""
    amax = np.fmax.reduce(np.abs(x), axis=-1, initial=np.float32(0.0)).astype(np.float32)
    scale = (amax / np.float32(QMAX[mode])).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(scale > 0, np.fmin(np.float32(1.0) / scale, _FLT_MAX), np.float32(0.0))
    v = (x * inv.astype(np.float32)[..., None]).astype(np.float32)
    if mode == "fp8":
        return scale, _fp8_codes(v)
    codes = _int_codes(v, QMAX[mode]).view(np.uint8)
    if mode == "int8":
        return scale, codes
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    nib = codes & np.uint8(15)
    return scale, (nib[..., 0::2] | (nib[..., 1::2] << np.uint8(4))).astype(np.uint8)


def decode_groups(scale: np.ndarray, codes: np.ndarray, mode: str, g: int) -> np.ndarray:
    """Inverse of :func:`encode_groups`: fp32 ``[..., G, g]``."""
    if mode == "fp8":
        val = _fp8_values(codes)
    elif mode == "int8":
        val = codes.view(np.int8).astype(np.float32)
    else:
        nib = np.stack([codes & np.uint8(15), codes >> np.uint8(4)], axis=-1)
        nib = nib.reshape(*codes.shape[:-1], -1)[..., :g].astype(np.int32)
        val = ((nib ^ 8) - 8).astype(np.float32)
    # A scale near float32's limit times a large code is +-inf, as on the GPU (IEEE
    # multiply): the extreme-value tests compare exactly that.
    with np.errstate(over="ignore"):
        return (val * scale.astype(np.float32)[..., None]).astype(np.float32)


# -- pages -----------------------------------------------------------------------------------


def _grouped(values: np.ndarray, seg: Segment) -> np.ndarray:
    n, per = values.shape[0], seg.groups * seg.group_size
    out = np.zeros((n, per), dtype=np.float32)
    out[:, : values.shape[1]] = values
    return out.reshape(n, seg.groups, seg.group_size)


def encode_pages(plan: Plan, pools: Sequence[np.ndarray]) -> np.ndarray:
    """Cold pages ``uint8 [n, cold_page_size]`` of blocks whose pool slots are
    ``pools[p]`` (``uint8 [n, slot size of pool p]``). Padding bytes are 0."""
    n = pools[0].shape[0] if pools else 0
    out = np.zeros((n, plan.cold_page_size), dtype=np.uint8)
    for seg in plan.segments:
        src = np.ascontiguousarray(pools[seg.pool][:, seg.offset : seg.offset + seg.size])
        at = seg.cold_offset
        if not seg.dtype:
            out[:, at : at + seg.size] = src
            continue
        scale, codes = encode_groups(_grouped(to_f32(src, seg.dtype), seg), plan.mode)
        out[:, at : at + 4 * seg.groups] = scale.astype("<f4").view(np.uint8)
        start = at + seg.payload_offset()
        keep = seg.used_bytes(plan.mode) - seg.payload_offset()
        out[:, start : start + keep] = codes.reshape(n, -1)[:, :keep]
    return out


def decode_pages(plan: Plan, cold: np.ndarray, pools: Sequence[np.ndarray]) -> None:
    """Decode cold pages ``uint8 [n, cold_page_size]`` into ``pools[p]`` (``uint8 [n,
    slot size]``, written in place; bytes of no segment are left as they are)."""
    n = cold.shape[0]
    for seg in plan.segments:
        at = seg.cold_offset
        dst = pools[seg.pool]
        if not seg.dtype:
            dst[:, seg.offset : seg.offset + seg.size] = cold[:, at : at + seg.size]
            continue
        scale = np.ascontiguousarray(cold[:, at : at + 4 * seg.groups]).view("<f4")
        gb = seg.group_bytes(plan.mode)
        body = np.zeros((n, seg.groups * gb), dtype=np.uint8)
        keep = seg.used_bytes(plan.mode) - seg.payload_offset()
        start = at + seg.payload_offset()
        body[:, :keep] = cold[:, start : start + keep]
        y = decode_groups(scale.astype(np.float32), body.reshape(n, seg.groups, gb),
                          plan.mode, seg.group_size)
        y = y.reshape(n, -1)[:, : seg.elements]
        dst[:, seg.offset : seg.offset + seg.size] = from_f32(y, seg.dtype).reshape(n, -1)
