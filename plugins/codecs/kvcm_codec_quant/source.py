"""CUDA C of the quantizing page codecs, compiled by whichever CUDA backend runs them
(``backend.compile``: the ``cupy`` and ``cuda`` backends both do).

The kernels follow :mod:`kvcm_codec_quant.reference` step for step (same operations, same
order, no fused multiply-add where the reference rounds twice), so their bytes equal the
NumPy reference's. Every fp32 operation whose result a subnormal could change (multiply,
divide, min, max, round to integer) is written as PTX without ``.ftz``, and absolute values
and comparisons are done on the bits: the results do not depend on the compiler's
flush-to-zero setting. (CuPy appends ``-ftz=true`` to every NVRTC compilation; with plain C
operators the ``cupy`` backend flushed subnormal scales and values to zero and differed from
the reference, e.g. on a group whose largest magnitude is below ``448 * 2**-126``.)

One launch (``kvcm_quant_encode`` or ``kvcm_quant_decode``) handles every segment of every
block of a migration: ``blockIdx.y`` walks the (block, segment) rows. Three paths:

- **half-warp path** (``fast == 2``; variants ``hw*``): 16-bit values in whole groups of 128,
  16-byte aligned pages, 8-byte aligned cold sections (what kvcm's own pools give). A thread
  block takes ``QK_THREADS / 16 * QK_HW_GROUPS`` consecutive groups of a segment; each half
  warp one group per step, each thread 8 values of it with one 16-byte load, all
  ``QK_HW_GROUPS`` loads issued before any is used; the scale is reduced with 4 shuffles
  inside the half warp; codes go out as one 8-byte (fp8, int8) or 4-byte (int4) store per
  thread, so a warp reads 512 and writes 256 (128) contiguous bytes.
- **warp path** (``fast == 1``; the only fast path of variant ``legacy``): 16-bit values in
  whole groups of 128, 8-byte aligned; a warp per group, 8-byte loads, :data:`FAST_GROUPS`
  groups per warp.
- **general path** (everything else: fp32, other group sizes, unaligned regions, raw bytes):
  a warp per scale group (or per :data:`RAW_CHUNK` bytes of a raw segment).

Variants ``*x`` use the lean forms of the half-warp path (``QK_LEAN``: hardware e4m3x2 and
bf16x2 conversions, magic-number rounding, one division per warp; see the source).

A launch on shuffled slots needs a slot table, (pool slot, cold slot) per block. Variants
``*p*`` pass it as a kernel parameter (``kvcm_quant_encode_p<W>`` / ``..._decode_p<W>``
for W in :data:`PARAM_WORDS`: one 32-bit word a block, two when a slot is 2**16 or more):
it travels with the launch, so no copy on another engine precedes the kernel. ``*m``
variants have the kernel read the table from mapped pinned host memory; the others copy it
to the device on the launch's stream. ``hw4sxp2`` also takes each group's largest magnitude
with packed bf16x2 / f16x2 max instructions.

The variant is chosen by name (:data:`VARIANTS`; the codec reads ``KVCM_QUANT_KERNEL``) and
compiled on first use; each variant computes exactly the same bytes. The default,
:data:`DEFAULT_VARIANT`, was the fastest on an H200 in both GPU backends, on consecutive
and on shuffled slots (``benchmarks/results/h200-20261202-quant3``).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcm_codec_quant.reference import RAW_CHUNK

__all__ = [
    "DEFAULT_VARIANT",
    "FAST_GROUPS",
    "KERNEL_ENV",
    "PARAM_WORDS",
    "SEG_DESC_WORDS",
    "SLOT_TABLES",
    "SOURCE",
    "VARIANTS",
    "Variant",
    "source_for",
]

#: int64 words of one segment descriptor (``SegDesc`` below).
SEG_DESC_WORDS = 16
#: Groups one warp takes per unit on the warp path (loads of all of them in flight).
FAST_GROUPS = 8
#: Environment variable that picks the kernel variant.
KERNEL_ENV = "KVCM_QUANT_KERNEL"
#: How a launch gets its slot table (shuffled slots; consecutive ones need none):
#: ``device`` copied into device memory on the launch's stream before the launch; ``param``
#: as a kernel parameter (it travels with the launch); ``mapped`` read by the kernel from
#: pinned host memory mapped into the device's address space.
SLOT_TABLES = ("device", "param", "mapped")
#: Sizes (32-bit words) of the slot-table parameter of the ``param`` kernels: a launch takes
#: the smallest that holds its table (one word a block when every slot is below 2**16, else
#: two). The largest keeps the kernel's parameters under the 32764 bytes CUDA allows.
PARAM_WORDS = (1024, 4096, 8160)


@attrs.frozen
class Variant:
    """One compiled form of the codec kernels (all give the same bytes).

    ``hw_groups``: groups each half warp loads per step on the half-warp path (0: no
    half-warp path, the warp path serves aligned 16-bit segments); ``threads`` per block;
    ``min_blocks``: blocks per multiprocessor the register budget must allow;
    ``streaming``: page loads and code stores with the evict-first cache hint;
    ``lean``: the half-warp path's lean forms (hardware fp8 and bf16 conversions, one
    division per warp; see the source);
    ``slots``: how a launch on shuffled slots gets its slot table (one of
    :data:`SLOT_TABLES`; a ``param`` table too large for the parameter goes the ``device``
    way);
    ``packed_amax``: lean encode takes each group's largest magnitude with packed
    bf16x2 / f16x2 max instructions on the loaded words (fewer instructions, same value);
    ``plain_c_math`` (never in :data:`VARIANTS`): the fp32 operations as C intrinsics,
    which a ``-ftz=true`` compilation flushes (the tests use it to show the bug is caught)."""

    name: str
    hw_groups: int
    threads: int
    min_blocks: int
    streaming: bool = False
    lean: bool = False
    slots: str = attrs.field(default="device")
    packed_amax: bool = False
    plain_c_math: bool = False  # tests only: C float intrinsics, which -ftz=true flushes

    @slots.validator
    def _known_slots(self, _: Any, value: str) -> None:
        if value not in SLOT_TABLES:
            raise ValueError(f"slots={value!r}: must be one of {list(SLOT_TABLES)}")

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def hw_block_groups(self) -> int:
        """Groups one thread block covers per unit on the half-warp path."""
        return self.threads // 16 * self.hw_groups


#: Kernel variants by name (``KVCM_QUANT_KERNEL``).
VARIANTS = {v.name: v for v in (
    Variant("legacy", 0, 256, 4),
    Variant("hw2", 2, 256, 4),
    Variant("hw4", 4, 256, 4),
    Variant("hw4cs", 4, 256, 4, streaming=True),
    Variant("hw2s", 2, 128, 8),
    Variant("hw4s", 4, 128, 8),
    Variant("hw2x", 2, 256, 4, lean=True),
    Variant("hw4x", 4, 256, 4, lean=True),
    Variant("hw4xcs", 4, 256, 4, streaming=True, lean=True),
    Variant("hw4sx", 4, 128, 8, lean=True),
    Variant("hw8sx", 8, 128, 4, lean=True),
    Variant("hw4sxp", 4, 128, 8, lean=True, slots="param"),
    Variant("hw4sxm", 4, 128, 8, lean=True, slots="mapped"),
    Variant("hw4sxp2", 4, 128, 8, lean=True, slots="param", packed_amax=True),
)}
#: The variant used when ``KVCM_QUANT_KERNEL`` is unset (see docs/codecs.md for the sweep
#: that chose it: benchmarks/results/h200-20261202-quant3).
DEFAULT_VARIANT = "hw4sxp2"

SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

#define RAW_CHUNK @RAW_CHUNK@
#define FAST_GROUPS @FAST_GROUPS@
#ifndef QK_HW_GROUPS
#define QK_HW_GROUPS 0
#endif
#ifndef QK_THREADS
#define QK_THREADS 256
#endif
#ifndef QK_MIN_BLOCKS
#define QK_MIN_BLOCKS 4
#endif
#ifndef QK_STREAMING
#define QK_STREAMING 0
#endif
#ifndef QK_PLAIN_C_MATH
#define QK_PLAIN_C_MATH 0
#endif
#ifndef QK_LEAN
#define QK_LEAN 0
#endif
#ifndef QK_PARAM_SLOTS
#define QK_PARAM_SLOTS 0
#endif
#ifndef QK_PACKED_AMAX
#define QK_PACKED_AMAX 0
#endif
#define QK_HWPB (QK_THREADS / 16)
#define FLT_MAX_F 3.402823466e+38f

// One segment of the layout. pool_base / cold_base already include the region offset, the
// segment's offset in the slot and its section's offset in the cold page. fast: 2 the
// half-warp path, 1 the warp path, 0 the general path (units are counted for that path).
// Cold bytes [scale_end, payload) and [used, extent) of the section are padding, written as
// 0 by warp 0 of the unit-0 work.
struct SegDesc {
    i64 pool_base, pool_stride, cold_base, cold_stride, size, elements, group_size,
        lossy, dtype, units, payload, group_bytes, fast, scale_end, used, extent;
};

// -- fp32 arithmetic, IEEE whatever the compiler's flush-to-zero setting ----------------------
// PTX without .ftz keeps subnormal inputs and results (the reference's NumPy arithmetic does);
// -ftz=true only changes the instructions the compiler picks for C operators.
// QK_PLAIN_C_MATH (tests only) uses the C intrinsics instead, which -ftz=true flushes: the
// tests show that their extreme values catch that.
#if QK_PLAIN_C_MATH
__device__ __forceinline__ float f_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float f_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float f_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float f_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ int f_rint_s32(float a) { return (int)rintf(a); }
__device__ __forceinline__ u32 f_rint_u32(float a) { return (u32)rintf(a); }
#else
__device__ __forceinline__ float f_mul(float a, float b) {
    float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float f_div(float a, float b) {
    float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
// max / min ignore a NaN operand (as NumPy's fmax / fmin).
__device__ __forceinline__ float f_max(float a, float b) {
    float r; asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float f_min(float a, float b) {
    float r; asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
// Round to the nearest integer, ties to even (rint), as an integer.
__device__ __forceinline__ int f_rint_s32(float a) {
    int r; asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(a)); return r;
}
__device__ __forceinline__ u32 f_rint_u32(float a) {
    u32 r; asm("cvt.rni.u32.f32 %0, %1;" : "=r"(r) : "f"(a)); return r;
}
#endif
__device__ __forceinline__ float f_abs(float a) {
    return __uint_as_float(__float_as_uint(a) & 0x7fffffffu);
}

__device__ __forceinline__ void zero_padding(const SegDesc& d, char* cold, int lane) {
    for (i64 j = d.scale_end + lane; j < d.payload; j += 32) cold[j] = 0;
    for (i64 j = d.used + lane; j < d.extent; j += 32) cold[j] = 0;
}

__device__ __forceinline__ float bits_f(u32 u) { return __uint_as_float(u); }

// A 16-bit element (bf16: dtype 0, fp16: dtype 1; in the low 16 bits of h) to fp32, exactly.
__device__ __forceinline__ float from16(u32 h, int dtype) {
    if (dtype == 0) return bits_f(h << 16);
    float f;
    const u16 x = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// fp32 to a 16-bit element, rounding to nearest even (bf16 NaN: 0x7fc0).
__device__ __forceinline__ u32 to16(float y, int dtype) {
    if (dtype == 0) {
        const u32 u = __float_as_uint(y);
        if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
        return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    }
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(y));
    return (u32)h;
}

__device__ __forceinline__ float load_elem(const char* p, int dtype, i64 k) {
    if (dtype == 2) return ((const float*)p)[k];
    return from16(((const u16*)p)[k], dtype);
}

__device__ __forceinline__ void store_elem(char* p, int dtype, i64 k, float y) {
    if (dtype == 2) ((float*)p)[k] = y;
    else ((u16*)p)[k] = (u16)to16(y, dtype);
}

// Four elements k..k+3 (k + 3 < len): one vector load when aligned.
__device__ __forceinline__ void load4(const char* p, int dtype, i64 k, float v[4]) {
    const int item = dtype == 2 ? 4 : 2;
    const char* a = p + k * item;
    if (dtype != 2 && ((u64)a & 7) == 0) {
        const uint2 w = *(const uint2*)a;
        v[0] = from16(w.x & 0xffffu, dtype);
        v[1] = from16(w.x >> 16, dtype);
        v[2] = from16(w.y & 0xffffu, dtype);
        v[3] = from16(w.y >> 16, dtype);
        return;
    }
    if (dtype == 2 && ((u64)a & 15) == 0) {
        const float4 w = *(const float4*)a;
        v[0] = w.x; v[1] = w.y; v[2] = w.z; v[3] = w.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = load_elem(p, dtype, k + j);
}

__device__ __forceinline__ float read_f32(const char* p) {
    if (((u64)p & 3) == 0) return *(const float*)p;
    const unsigned char* b = (const unsigned char*)p;
    return bits_f((u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24));
}

__device__ __forceinline__ void write_f32(char* p, float f) {
    if (((u64)p & 3) == 0) { *(float*)p = f; return; }
    const u32 u = __float_as_uint(f);
    for (int j = 0; j < 4; ++j) p[j] = (char)((u >> (8 * j)) & 0xffu);
}

__device__ __forceinline__ float qmax(int mode) {
    return mode == 0 ? 448.0f : (mode == 1 ? 127.0f : 7.0f);
}

// scale = amax / Q; amax is in [0, inf] (a max over magnitudes starting at 0), so scale > 0
// is "its bits are not 0". inv = min(1 / scale, FLT_MAX), 0 for a zero scale.
__device__ __forceinline__ float scale_of(float amax, int mode) { return f_div(amax, qmax(mode)); }
__device__ __forceinline__ float inv_of(float scale) {
    return __float_as_uint(scale) != 0u ? f_min(f_div(1.0f, scale), FLT_MAX_F) : 0.0f;
}

__device__ __forceinline__ u32 encode_one(int mode, float v) {
    if (mode == 0) {
        const float a = f_min(f_abs(v), 448.0f);  // never NaN: min ignores a NaN |v|
        const u32 b = __float_as_uint(a);
        u32 code;
        if (b < 0x3c800000u) {  // a < 2**-6: e4m3 subnormals, exact scaling by 512
            code = f_rint_u32(f_mul(a, 512.0f));
        } else {
            code = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
        }
        return code | ((__float_as_uint(v) >> 31) << 7);
    }
    const float q = qmax(mode), nq = mode == 1 ? -127.0f : -7.0f;
    return (u32)f_rint_s32(f_min(f_max(v, nq), q)) & (mode == 1 ? 0xffu : 0xfu);
}

__device__ __forceinline__ float decode_one(int mode, u32 c) {
    if (mode == 0) {
        const u32 e = (c >> 3) & 15u, m = c & 7u;
        const float val = e == 0 ? f_mul((float)m, 0.001953125f)
                                 : bits_f(((e + 120u) << 23) | (m << 20));
        return bits_f(__float_as_uint(val) | ((c >> 7) << 31));  // sign bit, no fp negate
    }
    if (mode == 1) return (float)(int)(signed char)(unsigned char)c;
    return (float)((int)(c ^ 8u) - 8);
}

// Raw unit u: bytes [u * RAW_CHUNK, ...) of the segment, 32 lanes.
__device__ __forceinline__ void raw_unit(char* d, const char* s, i64 size, i64 u, int lane) {
    const i64 lo = u * RAW_CHUNK;
    const i64 hi = lo + RAW_CHUNK < size ? lo + RAW_CHUNK : size;
    if ((((u64)(d + lo) | (u64)(s + lo)) & 15) == 0) {
        const i64 n = (hi - lo) / 16;
        for (i64 i = lane; i < n; i += 32) ((uint4*)(d + lo))[i] = ((const uint4*)(s + lo))[i];
        for (i64 j = lo + n * 16 + lane; j < hi; j += 32) d[j] = s[j];
        return;
    }
    for (i64 j = lo + lane; j < hi; j += 32) d[j] = s[j];
}

__device__ __forceinline__ float warp_max(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = f_max(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

// -- general path: a warp per group ---------------------------------------------------------

// Lanes take elements in fours: lane l of pass i has k = 4 * (l + 32 * i).
__device__ void encode_group(const SegDesc& d, int mode, const char* x, char* cold, i64 u,
                             int lane) {
    const i64 g = d.group_size;
    const i64 k0 = u * g;
    const i64 len = d.elements - k0 < g ? d.elements - k0 : g;
    const int dtype = (int)d.dtype;
    const char* src = x + k0 * (dtype == 2 ? 4 : 2);
    float amax = 0.0f;
    for (i64 k = 4 * lane; k < len; k += 128) {
        if (k + 3 < len) {
            float v[4];
            load4(src, dtype, k, v);
#pragma unroll
            for (int j = 0; j < 4; ++j) amax = f_max(amax, f_abs(v[j]));
        } else {
            for (i64 j = k; j < len; ++j) amax = f_max(amax, f_abs(load_elem(src, dtype, j)));
        }
    }
    amax = warp_max(amax);
    const float scale = scale_of(amax, mode);
    const float inv = inv_of(scale);
    if (lane == 0) write_f32(cold + 4 * u, scale);
    unsigned char* q = (unsigned char*)(cold + d.payload + u * d.group_bytes);
    for (i64 k = 4 * lane; k < len; k += 128) {
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int m = len - k < 4 ? (int)(len - k) : 4;
        if (m == 4) {
            load4(src, dtype, k, v);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) if (j < m) v[j] = load_elem(src, dtype, k + j);
        }
        u32 c[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) c[j] = encode_one(mode, f_mul(v[j], inv));
        if (mode == 2) {
            unsigned char* o = q + k / 2;
            const u32 b0 = c[0] | (c[1] << 4), b1 = c[2] | (c[3] << 4);
            if (m == 4 && ((u64)o & 1) == 0) *(u16*)o = (u16)(b0 | (b1 << 8));
            else {
                o[0] = (unsigned char)b0;
                if (m > 2) o[1] = (unsigned char)b1;
            }
        } else {
            unsigned char* o = q + k;
            if (m == 4 && ((u64)o & 3) == 0) {
                *(u32*)o = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) if (j < m) o[j] = (unsigned char)c[j];
            }
        }
    }
}

__device__ void decode_group(const SegDesc& d, int mode, char* x, const char* cold, i64 u,
                             int lane) {
    const i64 g = d.group_size;
    const i64 k0 = u * g;
    const i64 len = d.elements - k0 < g ? d.elements - k0 : g;
    const int dtype = (int)d.dtype;
    char* dst = x + k0 * (dtype == 2 ? 4 : 2);
    const float scale = read_f32(cold + 4 * u);
    const unsigned char* q = (const unsigned char*)(cold + d.payload + u * d.group_bytes);
    for (i64 k = 4 * lane; k < len; k += 128) {
        const int m = len - k < 4 ? (int)(len - k) : 4;
        u32 c[4] = {0u, 0u, 0u, 0u};
        if (mode == 2) {
            const unsigned char* o = q + k / 2;
            const u32 b0 = o[0], b1 = m > 2 ? o[1] : 0u;
            c[0] = b0 & 15u; c[1] = b0 >> 4; c[2] = b1 & 15u; c[3] = b1 >> 4;
        } else {
            const unsigned char* o = q + k;
            if (m == 4 && ((u64)o & 3) == 0) {
                const u32 w = *(const u32*)o;
                c[0] = w & 0xffu; c[1] = (w >> 8) & 0xffu; c[2] = (w >> 16) & 0xffu; c[3] = w >> 24;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) if (j < m) c[j] = o[j];
            }
        }
        float y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) y[j] = f_mul(decode_one(mode, c[j]), scale);
        char* a = dst + k * (dtype == 2 ? 4 : 2);
        if (m == 4 && dtype != 2 && ((u64)a & 7) == 0) {
            uint2 w;
            w.x = to16(y[0], dtype) | (to16(y[1], dtype) << 16);
            w.y = to16(y[2], dtype) | (to16(y[3], dtype) << 16);
            *(uint2*)a = w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) if (j < m) store_elem(dst, dtype, k + j, y[j]);
        }
    }
}

// -- warp path: groups of 128 16-bit values; lane l holds values 4l..4l+3 of each group -----

__device__ void encode_fast(const SegDesc& d, int mode, const char* x, char* cold, i64 u,
                            int lane) {
    const int dtype = (int)d.dtype;
    const i64 ng = d.elements / 128, g0 = u * FAST_GROUPS;
    uint2 w[FAST_GROUPS];
#pragma unroll
    for (int j = 0; j < FAST_GROUPS; ++j) {
        w[j] = make_uint2(0u, 0u);
        if (g0 + j < ng) w[j] = ((const uint2*)(x + (g0 + j) * 256))[lane];
    }
#pragma unroll
    for (int j = 0; j < FAST_GROUPS; ++j) {
        const i64 g = g0 + j;
        const float v0 = from16(w[j].x & 0xffffu, dtype), v1 = from16(w[j].x >> 16, dtype);
        const float v2 = from16(w[j].y & 0xffffu, dtype), v3 = from16(w[j].y >> 16, dtype);
        float amax = f_max(f_max(0.0f, f_max(f_abs(v0), f_abs(v1))), f_max(f_abs(v2), f_abs(v3)));
        amax = warp_max(amax);
        if (g >= ng) continue;  // uniform over the warp, after the shuffles
        const float scale = scale_of(amax, mode);
        const float inv = inv_of(scale);
        if (lane == 0) *(float*)(cold + 4 * g) = scale;
        const u32 c0 = encode_one(mode, f_mul(v0, inv));
        const u32 c1 = encode_one(mode, f_mul(v1, inv));
        const u32 c2 = encode_one(mode, f_mul(v2, inv));
        const u32 c3 = encode_one(mode, f_mul(v3, inv));
        char* q = cold + d.payload + g * d.group_bytes;
        if (mode == 2) ((u16*)q)[lane] = (u16)(c0 | (c1 << 4) | (c2 << 8) | (c3 << 12));
        else ((u32*)q)[lane] = c0 | (c1 << 8) | (c2 << 16) | (c3 << 24);
    }
}

__device__ void decode_fast(const SegDesc& d, int mode, char* x, const char* cold, i64 u,
                            int lane) {
    const int dtype = (int)d.dtype;
    const i64 ng = d.elements / 128, g0 = u * FAST_GROUPS;
    u32 w[FAST_GROUPS];
    float s[FAST_GROUPS];
#pragma unroll
    for (int j = 0; j < FAST_GROUPS; ++j) {
        const i64 g = g0 + j;
        w[j] = 0u;
        s[j] = 0.0f;
        if (g < ng) {
            const char* q = cold + d.payload + g * d.group_bytes;
            s[j] = *(const float*)(cold + 4 * g);
            w[j] = mode == 2 ? (u32)((const u16*)q)[lane] : ((const u32*)q)[lane];
        }
    }
#pragma unroll
    for (int j = 0; j < FAST_GROUPS; ++j) {
        const i64 g = g0 + j;
        if (g >= ng) continue;
        const int shift = mode == 2 ? 4 : 8;
        const u32 mask = mode == 2 ? 0xfu : 0xffu;
        float y[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            y[i] = f_mul(decode_one(mode, (w[j] >> (shift * i)) & mask), s[j]);
        uint2 out;
        out.x = to16(y[0], dtype) | (to16(y[1], dtype) << 16);
        out.y = to16(y[2], dtype) | (to16(y[3], dtype) << 16);
        ((uint2*)(x + g * 256))[lane] = out;
    }
}

// -- half-warp path: a block takes QK_HWPB * QK_HW_GROUPS groups of 128 16-bit values --------
#if QK_HW_GROUPS

#if QK_STREAMING
#define QK_LD16(p) __ldcs(p)
#define QK_ST8(p, v) __stcs(p, v)
#define QK_ST4(p, v) __stcs(p, v)
#define QK_ST16(p, v) __stcs(p, v)
#else
#define QK_LD16(p) (*(p))
#define QK_ST8(p, v) (*(p) = (v))
#define QK_ST4(p, v) (*(p) = (v))
#define QK_ST16(p, v) (*(p) = (v))
#endif

__device__ __forceinline__ float half_warp_max(float a) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) a = f_max(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

__device__ __forceinline__ void unpack8(const uint4 w, int dtype, float v[8]) {
    const u32 p[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (dtype == 0) {
            v[2 * i] = bits_f(p[i] << 16);
            v[2 * i + 1] = bits_f(p[i] & 0xffff0000u);
        } else {
            v[2 * i] = from16(p[i] & 0xffffu, 1);
            v[2 * i + 1] = from16(p[i] >> 16, 1);
        }
    }
}

#if QK_LEAN
// -- lean forms of the half-warp path (variants *x): the same bytes with fewer instructions --
// * one division and one reciprocal per warp for all of its 2 * QK_HW_GROUPS groups (lane t
//   computes group (step t % K, half (t / K) % 2)), shuffled back;
// * fp8 codes by the hardware conversion cvt.rn.satfinite.e4m3x2.f32 (round to nearest even,
//   subnormals, saturation at +-448: the reference's rule for every value but NaN);
// * int codes by the round-to-nearest-even of adding 1.5 * 2**23 (exact for |v| <= 127);
// * decoded codes as exact fp32 by bit tricks (fp8: the code's bits in fp32's exponent and
//   mantissa places times 2**120, folded into the scale when that stays finite; ints: added
//   to 1.5 * 2**23), and bf16 / fp16 outputs by the packed conversions cvt.rn.bf16x2.f32 /
//   cvt.rn.f16x2.f32 (round to nearest even; NaN only from non-finite inputs).
__device__ __forceinline__ float f_add(float a, float b) {
    float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float f_rcp(float a) {
    float r; asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r;
}
// e4m3 codes of v0..v3 (v0 in the low byte).
__device__ __forceinline__ u32 e4m3x4(float v0, float v1, float v2, float v3) {
    u32 r;
    asm("{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        " cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n mov.b32 %0, {lo, hi};\n}"
        : "=r"(r) : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
    return r;
}
// y0 in the low half, rounded to nearest even (dtype 0: bf16, 1: fp16).
__device__ __forceinline__ u32 pack16x2(float y0, float y1, int dtype) {
    u32 r;
    if (dtype == 0) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y1), "f"(y0));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y1), "f"(y0));
    return r;
}
#define QK_MAGIC 12582912.0f  // 1.5 * 2**23: its ulp is 1
#if QK_PACKED_AMAX
// Larger of two pairs of 16-bit magnitudes (dtype 0: bf16, 1: fp16), half by half, as the
// packed max instructions give it: exact, subnormals kept (no .ftz), a NaN ignored when the
// other half is a number (both NaN: NaN, which the f_max with 0 after it then ignores), so
// the group's amax is the reference's (a max over |v| from 0 that skips NaN).
__device__ __forceinline__ u32 max16x2(u32 a, u32 b, int dtype) {
    u32 r;
    if (dtype == 0) asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    else asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
#endif

template <int MODE>
__device__ __forceinline__ void encode_hw(const SegDesc& d, const char* x, char* cold, i64 u) {
    constexpr int K = QK_HW_GROUPS;
    const int h = threadIdx.x >> 4, l = threadIdx.x & 15, lane = threadIdx.x & 31;
    const int dtype = (int)d.dtype;
    const i64 ng = d.elements >> 7;
    const i64 g0 = u * (i64)(QK_HWPB * K) + h;
    uint4 w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        w[j] = make_uint4(0u, 0u, 0u, 0u);
        if (g < ng) w[j] = QK_LD16((const uint4*)(x + g * 256) + l);
    }
    // amax of each step's group (every lane of its half warp holds it)
    float mine = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
#if QK_PACKED_AMAX
        const u32 m = max16x2(max16x2(w[j].x & 0x7fff7fffu, w[j].y & 0x7fff7fffu, dtype),
                              max16x2(w[j].z & 0x7fff7fffu, w[j].w & 0x7fff7fffu, dtype), dtype);
        float amax = f_max(f_max(0.0f, from16(m & 0xffffu, dtype)), from16(m >> 16, dtype));
#else
        float v[8];
        unpack8(w[j], dtype, v);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = f_max(amax, f_abs(v[i]));
#endif
        amax = half_warp_max(amax);
        if ((lane % K) == j) mine = amax;
    }
    // lane t: group (step t % K, half (t / K) & 1); one division, one reciprocal
    const float a = __shfl_sync(0xffffffffu, mine, ((lane / K) & 1) * 16 + (lane % K));
    const float sc = scale_of(a, MODE);
    const float iv = __float_as_uint(sc) != 0u ? f_min(f_rcp(sc), FLT_MAX_F) : 0.0f;
    const int back = ((lane >> 4) & 1) * K;
    char* codes = cold + d.payload;
    const i64 gb = d.group_bytes;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const float scale = __shfl_sync(0xffffffffu, sc, back + j);
        const float inv = __shfl_sync(0xffffffffu, iv, back + j);
        const i64 g = g0 + (i64)QK_HWPB * j;
        if (g >= ng) continue;
        if (l == 0) *(float*)(cold + 4 * g) = scale;
        float v[8];
        unpack8(w[j], dtype, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = f_mul(v[i], inv);
        char* q = codes + g * gb;
        if (MODE == 0) {
            QK_ST8((uint2*)q + l, make_uint2(e4m3x4(v[0], v[1], v[2], v[3]),
                                             e4m3x4(v[4], v[5], v[6], v[7])));
        } else {
            constexpr float Q = MODE == 1 ? 127.0f : 7.0f;
            u32 b[8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                b[i] = __float_as_uint(f_add(f_min(f_max(v[i], -Q), Q), QK_MAGIC));
            // low byte of each: the two's complement code
            const u32 lo = __byte_perm(__byte_perm(b[0], b[1], 0x0040),
                                       __byte_perm(b[2], b[3], 0x0040), 0x5410);
            const u32 hi = __byte_perm(__byte_perm(b[4], b[5], 0x0040),
                                       __byte_perm(b[6], b[7], 0x0040), 0x5410);
            if (MODE == 1) {
                QK_ST8((uint2*)q + l, make_uint2(lo, hi));
            } else {
                const u32 a0 = lo & 0x0f0f0f0fu, a1 = hi & 0x0f0f0f0fu;
                const u32 p0 = a0 | (a0 >> 4), p1 = a1 | (a1 >> 4);  // bytes 0, 2 hold pairs
                QK_ST4((u32*)q + l, __byte_perm(p0, p1, 0x6420));
            }
        }
    }
}

template <int MODE>
__device__ __forceinline__ void decode_hw(const SegDesc& d, char* x, const char* cold, i64 u) {
    constexpr int K = QK_HW_GROUPS;
    const int h = threadIdx.x >> 4, l = threadIdx.x & 15;
    const int dtype = (int)d.dtype;
    const i64 ng = d.elements >> 7;
    const i64 g0 = u * (i64)(QK_HWPB * K) + h;
    const char* codes = cold + d.payload;
    const i64 gb = d.group_bytes;
    uint2 w[K];
    float s[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        w[j] = make_uint2(0u, 0u);
        s[j] = 0.0f;
        if (g < ng) {
            s[j] = *(const float*)(cold + 4 * g);
            const char* q = codes + g * gb;
            if (MODE == 2) w[j].x = ((const u32*)q)[l];
            else w[j] = ((const uint2*)q)[l];
        }
    }
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        if (g >= ng) continue;
        float y[8];
        if (MODE == 0) {
            // value(code) = fp32 with the code's exponent and mantissa bits at bit 20, times
            // 2**120 (exact, subnormal codes too); times the scale: folded into one product
            // when scale * 2**120 is finite (same exact product, rounded once).
            const bool fold = __float_as_uint(s[j]) < 0x43800000u;  // 0 <= scale < 256
            const float m = fold ? f_mul(s[j], 0x1p120f) : 0x1p120f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const u32 c = ((i < 4 ? w[j].x : w[j].y) >> (8 * (i & 3))) & 0xffu;
                const u32 bits = ((c & 0x7fu) << 20) | ((c & 0x80u) << 24);
                const float t = f_mul(bits_f(bits), m);
                y[i] = fold ? t : f_mul(t, s[j]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float k;
                if (MODE == 1) {
                    const u32 c = ((i < 4 ? w[j].x : w[j].y) >> (8 * (i & 3))) & 0xffu;
                    k = f_add(bits_f(0x4b400000u | (c ^ 0x80u)), -(QK_MAGIC + 128.0f));
                } else {
                    const u32 c = (w[j].x >> (4 * i)) & 15u;
                    k = f_add(bits_f(0x4b400000u | (c ^ 8u)), -(QK_MAGIC + 8.0f));
                }
                y[i] = f_mul(k, s[j]);
            }
        }
        uint4 o;
        o.x = pack16x2(y[0], y[1], dtype);
        o.y = pack16x2(y[2], y[3], dtype);
        o.z = pack16x2(y[4], y[5], dtype);
        o.w = pack16x2(y[6], y[7], dtype);
        QK_ST16((uint4*)(x + g * 256) + l, o);
    }
}
#else  // QK_LEAN
// Half warp h of the block takes groups g0 + h + QK_HWPB * j (j < QK_HW_GROUPS): the two
// half warps of a warp read 512 contiguous bytes per step.
template <int MODE>
__device__ __forceinline__ void encode_hw(const SegDesc& d, const char* x, char* cold, i64 u) {
    const int h = threadIdx.x >> 4, l = threadIdx.x & 15;
    const int dtype = (int)d.dtype;
    const i64 ng = d.elements >> 7;
    const i64 g0 = u * (i64)(QK_HWPB * QK_HW_GROUPS) + h;
    uint4 w[QK_HW_GROUPS];
#pragma unroll
    for (int j = 0; j < QK_HW_GROUPS; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        w[j] = make_uint4(0u, 0u, 0u, 0u);
        if (g < ng) w[j] = QK_LD16((const uint4*)(x + g * 256) + l);
    }
    char* scales = cold;
    char* codes = cold + d.payload;
    const i64 gb = d.group_bytes;
#pragma unroll
    for (int j = 0; j < QK_HW_GROUPS; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        float v[8];
        unpack8(w[j], dtype, v);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = f_max(amax, f_abs(v[i]));
        amax = half_warp_max(amax);  // every lane of the warp takes part
        if (g >= ng) continue;
        const float scale = scale_of(amax, MODE);
        const float inv = inv_of(scale);
        if (l == 0) *(float*)(scales + 4 * g) = scale;
        u32 c[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) c[i] = encode_one(MODE, f_mul(v[i], inv));
        char* q = codes + g * gb;
        if (MODE == 2) {
            u32 packed = 0u;
#pragma unroll
            for (int i = 0; i < 8; ++i) packed |= c[i] << (4 * i);
            QK_ST4((u32*)q + l, packed);
        } else {
            const uint2 o = make_uint2(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24),
                                       c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24));
            QK_ST8((uint2*)q + l, o);
        }
    }
}

template <int MODE>
__device__ __forceinline__ void decode_hw(const SegDesc& d, char* x, const char* cold, i64 u) {
    const int h = threadIdx.x >> 4, l = threadIdx.x & 15;
    const int dtype = (int)d.dtype;
    const i64 ng = d.elements >> 7;
    const i64 g0 = u * (i64)(QK_HWPB * QK_HW_GROUPS) + h;
    const char* codes = cold + d.payload;
    const i64 gb = d.group_bytes;
    uint2 w[QK_HW_GROUPS];
    float s[QK_HW_GROUPS];
#pragma unroll
    for (int j = 0; j < QK_HW_GROUPS; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        w[j] = make_uint2(0u, 0u);
        s[j] = 0.0f;
        if (g < ng) {
            s[j] = *(const float*)(cold + 4 * g);
            const char* q = codes + g * gb;
            if (MODE == 2) w[j].x = ((const u32*)q)[l];
            else w[j] = ((const uint2*)q)[l];
        }
    }
#pragma unroll
    for (int j = 0; j < QK_HW_GROUPS; ++j) {
        const i64 g = g0 + (i64)QK_HWPB * j;
        if (g >= ng) continue;
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            u32 c;
            if (MODE == 2) c = (w[j].x >> (4 * i)) & 15u;
            else c = ((i < 4 ? w[j].x : w[j].y) >> (8 * (i & 3))) & 0xffu;
            y[i] = f_mul(decode_one(MODE, c), s[j]);
        }
        uint4 o;
        o.x = to16(y[0], dtype) | (to16(y[1], dtype) << 16);
        o.y = to16(y[2], dtype) | (to16(y[3], dtype) << 16);
        o.z = to16(y[4], dtype) | (to16(y[5], dtype) << 16);
        o.w = to16(y[6], dtype) | (to16(y[7], dtype) << 16);
        QK_ST16((uint4*)(x + g * 256) + l, o);
    }
}

#endif  // QK_LEAN

template <bool encode>
__device__ __forceinline__ void hw_unit(const SegDesc& d, int mode, char* pool, char* cold,
                                        i64 u) {
    if (encode) {
        if (mode == 0) encode_hw<0>(d, pool, cold, u);
        else if (mode == 1) encode_hw<1>(d, pool, cold, u);
        else encode_hw<2>(d, pool, cold, u);
    } else {
        if (mode == 0) decode_hw<0>(d, pool, cold, u);
        else if (mode == 1) decode_hw<1>(d, pool, cold, u);
        else decode_hw<2>(d, pool, cold, u);
    }
}
#endif  // QK_HW_GROUPS

// Where block pi of a launch lives: (pool slot, cold slot).
// ListSlots: int2 pairs in device memory (uploaded, variants with slots "device") or in
// mapped pinned host memory (slots "mapped"), or none: block i is pool slot base_lo + i and
// cold slot base_hi + i (base = base_lo | base_hi << 32).
struct ListSlots {
    const int2* pairs;
    u64 base;
    __device__ __forceinline__ int2 operator()(u32 i) const {
        return pairs != nullptr ? pairs[i]
                                : make_int2((int)((u32)base + i), (int)((u32)(base >> 32) + i));
    }
};

#if QK_PARAM_SLOTS
// ParamSlots (variants with slots "param"): the slot table is a kernel parameter (it travels
// with the launch: no copy, no dependency on another engine). Narrow: word i is
// pool | cold << 16 (both < 2**16); wide: words 2i, 2i + 1.
template <int W>
struct SlotWords {
    u32 w[W];
};

template <int W>
struct ParamSlots {
    const SlotWords<W>* t;
    u32 wide;
    __device__ __forceinline__ int2 operator()(u32 i) const {
        if (wide) return make_int2((int)t->w[2 * i], (int)t->w[2 * i + 1]);
        const u32 x = t->w[i];
        return make_int2((int)(x & 0xffffu), (int)(x >> 16));
    }
};
#endif

// rows = npairs * nseg < 2**32: blockIdx.y walks the (block, segment) rows.
template <bool encode, typename Slots>
__device__ __forceinline__ void quant_pages(u64 descs, u64 nseg, u64 npairs, u64 mode,
                                            const Slots& slots) {
    const SegDesc* D = (const SegDesc*)descs;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 ns = (u32)nseg;
    const u32 rows = (u32)npairs * ns;
    for (u32 r = blockIdx.y; r < rows; r += gridDim.y) {
        const u32 seg = r % ns, pi = r / ns;
        const SegDesc& d = D[seg];
        const int2 pr = slots(pi);
        char* pool = (char*)(d.pool_base + (i64)pr.x * d.pool_stride);
        char* cold = (char*)(d.cold_base + (i64)pr.y * d.cold_stride);
#if QK_HW_GROUPS
        if (d.fast == 2) {
            for (i64 u = blockIdx.x; u < d.units; u += gridDim.x) {
                if (encode && u == 0 && warp == 0) zero_padding(d, cold, lane);
                hw_unit<encode>(d, (int)mode, pool, cold, u);
            }
            continue;
        }
#endif
        for (i64 u = (i64)blockIdx.x * warps + warp; u < d.units; u += (i64)gridDim.x * warps) {
            if (encode && u == 0) zero_padding(d, cold, lane);
            if (!d.lossy) {
                if (encode) raw_unit(cold, pool, d.size, u, lane);
                else raw_unit(pool, cold, d.size, u, lane);
            } else if (d.fast == 1) {
                if (encode) encode_fast(d, (int)mode, pool, cold, u, lane);
                else decode_fast(d, (int)mode, pool, cold, u, lane);
            } else if (encode) {
                encode_group(d, (int)mode, pool, cold, u, lane);
            } else {
                decode_group(d, (int)mode, pool, cold, u, lane);
            }
        }
    }
}

// One launch per call: every segment of every block, encoded (GPU pages to cold pages) or
// decoded (cold pages to GPU pages). pairs: the int2 slot table's address, or 0 for
// consecutive slots from slot_base.
extern "C" __global__ void __launch_bounds__(QK_THREADS, QK_MIN_BLOCKS)
kvcm_quant_encode(u64 descs, u64 nseg, u64 pairs, u64 npairs, u64 mode, u64 slot_base) {
    quant_pages<true>(descs, nseg, npairs, mode, ListSlots{(const int2*)pairs, slot_base});
}

extern "C" __global__ void __launch_bounds__(QK_THREADS, QK_MIN_BLOCKS)
kvcm_quant_decode(u64 descs, u64 nseg, u64 pairs, u64 npairs, u64 mode, u64 slot_base) {
    quant_pages<false>(descs, nseg, npairs, mode, ListSlots{(const int2*)pairs, slot_base});
}

#if QK_PARAM_SLOTS
// The same with the slot table of W words as a parameter (kvcm_quant_encode_p<W>, ...).
#define QK_PARAM_KERNELS(W)                                                                   \
extern "C" __global__ void __launch_bounds__(QK_THREADS, QK_MIN_BLOCKS)                       \
kvcm_quant_encode_p##W(u64 descs, u64 nseg, u64 npairs, u64 mode, u64 wide,                  \
                       const __grid_constant__ SlotWords<W> table) {                         \
    quant_pages<true>(descs, nseg, npairs, mode, ParamSlots<W>{&table, (u32)wide});           \
}                                                                                             \
extern "C" __global__ void __launch_bounds__(QK_THREADS, QK_MIN_BLOCKS)                       \
kvcm_quant_decode_p##W(u64 descs, u64 nseg, u64 npairs, u64 mode, u64 wide,                  \
                       const __grid_constant__ SlotWords<W> table) {                         \
    quant_pages<false>(descs, nseg, npairs, mode, ParamSlots<W>{&table, (u32)wide});          \
}
@PARAM_KERNELS@
#endif
""".replace("@RAW_CHUNK@", str(RAW_CHUNK)).replace("@FAST_GROUPS@", str(FAST_GROUPS)).replace(
    "@PARAM_KERNELS@", "\n".join(f"QK_PARAM_KERNELS({w})" for w in PARAM_WORDS))


def source_for(variant: Variant) -> str:
    """The CUDA C of ``variant``: its defines, then :data:`SOURCE`."""
    return (f"#define QK_HW_GROUPS {variant.hw_groups}\n#define QK_THREADS {variant.threads}\n"
            f"#define QK_MIN_BLOCKS {variant.min_blocks}\n"
            f"#define QK_STREAMING {int(variant.streaming)}\n"
            f"#define QK_LEAN {int(variant.lean)}\n"
            f"#define QK_PLAIN_C_MATH {int(variant.plain_c_math)}\n"
            f"#define QK_PARAM_SLOTS {int(variant.slots == 'param')}\n"
            f"#define QK_PACKED_AMAX {int(variant.packed_amax)}\n" + SOURCE)
