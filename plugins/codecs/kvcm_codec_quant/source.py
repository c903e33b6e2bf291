"""CUDA C of the quantizing page codecs, compiled by whichever CUDA backend runs them
(``backend.compile``: the ``cupy`` and ``cuda`` backends both do).

The kernels follow :mod:`kvcm_codec_quant.reference` step for step (same operations, same
order, no fused multiply-add where the reference rounds twice), so their bytes equal the
NumPy reference's. One launch (``kvcm_quant_encode`` or ``kvcm_quant_decode``) handles
every segment of every block of a migration: ``blockIdx.y`` walks the (block, segment)
rows, each warp one unit of a row (a scale group of a lossy segment, :data:`RAW_CHUNK` bytes
of a raw one). The fast path (16-bit values in whole groups of 128, 8-byte aligned values,
4-byte aligned cold sections: what kvcm's own pools give) takes :data:`FAST_GROUPS` groups
per unit with all their loads issued first; it computes exactly what the general path does.
Registers are capped (:data:`LAUNCH_MIN_BLOCKS` blocks per multiprocessor) so that enough
warps, each with a unit's loads in flight, keep the memory busy.
"""

from __future__ import annotations

from kvcm_codec_quant.reference import RAW_CHUNK

__all__ = ["FAST_GROUPS", "LAUNCH_MIN_BLOCKS", "SEG_DESC_WORDS", "SOURCE", "WARPS_PER_BLOCK"]

#: int64 words of one segment descriptor (``SegDesc`` below).
SEG_DESC_WORDS = 16
#: Groups one warp takes per unit on the fast path (loads of all of them in flight).
FAST_GROUPS = 8
#: Thread blocks of 256 that should fit on one multiprocessor (caps registers per thread).
LAUNCH_MIN_BLOCKS = 4
#: Warps per thread block (256 threads).
WARPS_PER_BLOCK = 8

SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

#define RAW_CHUNK @RAW_CHUNK@
#define FAST_GROUPS @FAST_GROUPS@
#define LAUNCH_MIN_BLOCKS @LAUNCH_MIN_BLOCKS@
#define FLT_MAX_F 3.402823466e+38f

// One segment of the layout. pool_base / cold_base already include the region offset, the
// segment's offset in the slot and its section's offset in the cold page. fast: the fast
// path applies (units are then FAST_GROUPS groups each). Cold bytes [scale_end, payload)
// and [used, extent) of the section are padding, written as 0 by the warp of unit 0.
struct SegDesc {
    i64 pool_base, pool_stride, cold_base, cold_stride, size, elements, group_size,
        lossy, dtype, units, payload, group_bytes, fast, scale_end, used, extent;
};

__device__ __forceinline__ void zero_padding(const SegDesc& d, char* cold, int lane) {
    for (i64 j = d.scale_end + lane; j < d.payload; j += 32) cold[j] = 0;
    for (i64 j = d.used + lane; j < d.extent; j += 32) cold[j] = 0;
}

__device__ __forceinline__ float bits_f(u32 u) { return __uint_as_float(u); }

// A 16-bit element (bf16: dtype 0, fp16: dtype 1) to fp32, exactly.
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

__device__ __forceinline__ u32 encode_one(int mode, float v) {
    if (mode == 0) {
        const float a = fminf(fabsf(v), 448.0f);
        u32 code;
        if (a < 0.015625f) {
            code = (u32)rintf(__fmul_rn(a, 512.0f));
        } else {
            const u32 b = __float_as_uint(a);
            code = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
        }
        return code | ((__float_as_uint(v) >> 31) << 7);
    }
    const float q = qmax(mode);
    return (u32)(int)rintf(fminf(fmaxf(v, -q), q)) & (mode == 1 ? 0xffu : 0xfu);
}

__device__ __forceinline__ float decode_one(int mode, u32 c) {
    if (mode == 0) {
        const u32 e = (c >> 3) & 15u, m = c & 7u;
        const float val = e == 0 ? __fmul_rn((float)m, 0.001953125f)
                                 : bits_f(((e + 120u) << 23) | (m << 20));
        return (c >> 7) ? -val : val;
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
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

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
            for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
        } else {
            for (i64 j = k; j < len; ++j) amax = fmaxf(amax, fabsf(load_elem(src, dtype, j)));
        }
    }
    amax = warp_max(amax);
    const float scale = __fdiv_rn(amax, qmax(mode));
    const float inv = scale > 0.0f ? fminf(__fdiv_rn(1.0f, scale), FLT_MAX_F) : 0.0f;
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
        for (int j = 0; j < 4; ++j) c[j] = encode_one(mode, __fmul_rn(v[j], inv));
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
        for (int j = 0; j < 4; ++j) y[j] = __fmul_rn(decode_one(mode, c[j]), scale);
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

// Fast path: groups of 128 16-bit values; lane l holds values 4l..4l+3 of each group.
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
        float amax = fmaxf(fmaxf(0.0f, fmaxf(fabsf(v0), fabsf(v1))), fmaxf(fabsf(v2), fabsf(v3)));
        amax = warp_max(amax);
        if (g >= ng) continue;  // uniform over the warp, after the shuffles
        const float scale = __fdiv_rn(amax, qmax(mode));
        const float inv = scale > 0.0f ? fminf(__fdiv_rn(1.0f, scale), FLT_MAX_F) : 0.0f;
        if (lane == 0) *(float*)(cold + 4 * g) = scale;
        const u32 c0 = encode_one(mode, __fmul_rn(v0, inv));
        const u32 c1 = encode_one(mode, __fmul_rn(v1, inv));
        const u32 c2 = encode_one(mode, __fmul_rn(v2, inv));
        const u32 c3 = encode_one(mode, __fmul_rn(v3, inv));
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
            y[i] = __fmul_rn(decode_one(mode, (w[j] >> (shift * i)) & mask), s[j]);
        uint2 out;
        out.x = to16(y[0], dtype) | (to16(y[1], dtype) << 16);
        out.y = to16(y[2], dtype) | (to16(y[3], dtype) << 16);
        ((uint2*)(x + g * 256))[lane] = out;
    }
}

// pairs: int2 (pool slot, cold slot) per block; rows = npairs * nseg.
template <bool encode>
__device__ __forceinline__ void quant_pages(u64 descs, u64 nseg, u64 pairs, u64 npairs,
                                            u64 mode) {
    const SegDesc* D = (const SegDesc*)descs;
    const int2* P = (const int2*)pairs;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 rows = (i64)npairs * (i64)nseg;
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const SegDesc& d = D[r % (i64)nseg];
        const int2 pr = P[r / (i64)nseg];
        char* pool = (char*)(d.pool_base + (i64)pr.x * d.pool_stride);
        char* cold = (char*)(d.cold_base + (i64)pr.y * d.cold_stride);
        for (i64 u = (i64)blockIdx.x * warps + warp; u < d.units; u += (i64)gridDim.x * warps) {
            if (encode && u == 0) zero_padding(d, cold, lane);
            if (!d.lossy) {
                if (encode) raw_unit(cold, pool, d.size, u, lane);
                else raw_unit(pool, cold, d.size, u, lane);
            } else if (d.fast) {
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
// decoded (cold pages to GPU pages).
extern "C" __global__ void __launch_bounds__(256, LAUNCH_MIN_BLOCKS)
kvcm_quant_encode(u64 descs, u64 nseg, u64 pairs, u64 npairs, u64 mode) {
    quant_pages<true>(descs, nseg, pairs, npairs, mode);
}

extern "C" __global__ void __launch_bounds__(256, LAUNCH_MIN_BLOCKS)
kvcm_quant_decode(u64 descs, u64 nseg, u64 pairs, u64 npairs, u64 mode) {
    quant_pages<false>(descs, nseg, pairs, npairs, mode);
}
""".replace("@RAW_CHUNK@", str(RAW_CHUNK)).replace("@FAST_GROUPS@", str(FAST_GROUPS)).replace(
    "@LAUNCH_MIN_BLOCKS@", str(LAUNCH_MIN_BLOCKS))
