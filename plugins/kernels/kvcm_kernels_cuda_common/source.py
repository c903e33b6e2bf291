"""CUDA C source of the kvcm kernels, shared by the ``cupy`` and ``cuda`` backends.

Every kernel takes only 64-bit parameters (addresses as ``unsigned long long``), so both
backends launch them with one argument convention. Tables of work (copy descriptors, pairs,
fingerprint descriptors) live in device memory, staged from pinned memory by a copy on the
same stream: no host synchronisation per call.
"""

from __future__ import annotations

__all__ = [
    "CONV_JOB_WORDS",
    "COPY_CHUNK_BYTES_PER_THREAD",
    "COPY_DESC_WORDS",
    "FP_DESC_WORDS",
    "KERNEL_NAMES",
    "SOURCE",
]

#: int64 words of one copy descriptor (``CopyDesc`` below).
COPY_DESC_WORDS = 8
#: int64 words of one conversion job (``ConvJob`` below).
CONV_JOB_WORDS = 16
#: int64 words of one fingerprint descriptor (``FpDesc`` below).
FP_DESC_WORDS = 8
#: Bytes of a page that one block copies per work item, per thread of the block (16-byte
#: vectors, 4 in flight): 32 KiB with the default 512 threads.
COPY_CHUNK_BYTES_PER_THREAD = 64

KERNEL_NAMES = (
    "kvcm_copy_pages",
    "kvcm_convert_page_indices",
    "kvcm_convert_page_tables",
    "kvcm_fingerprint_write",
    "kvcm_fingerprint_check",
)

SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// ---- copy_pages ------------------------------------------------------------------------

// One copy_pages call of a batch: page i of the pair (d, s) goes from src + s * src_stride
// to dst + d * dst_stride (offsets already added to the bases).
struct CopyDesc {
    i64 dst, dst_stride, src, src_stride, page_bytes, first_pair, chunks, pad;
};

// Copy len bytes with the block's threads, U vectors of type V in flight per thread.
// d and s share their misalignment modulo sizeof(V): a byte-wise head aligns both.
template <typename V, int U>
__device__ __forceinline__ void copy_vectors(char* d, const char* s, i64 len) {
    const i64 W = (i64)sizeof(V);
    i64 head = (i64)((W - ((u64)d & (u64)(W - 1))) & (u64)(W - 1));
    if (head > len) head = len;
    for (i64 i = threadIdx.x; i < head; i += blockDim.x) d[i] = s[i];
    V* dv = (V*)(d + head);
    const V* sv = (const V*)(s + head);
    const i64 n = (len - head) / W;
    const i64 step = blockDim.x;
    i64 i = threadIdx.x;
    for (; i + (U - 1) * step < n; i += U * step) {
        V r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) r[u] = sv[i + u * step];
#pragma unroll
        for (int u = 0; u < U; ++u) dv[i + u * step] = r[u];
    }
    for (; i < n; i += step) dv[i] = sv[i];
    for (i64 j = head + n * W + threadIdx.x; j < len; j += step) d[j] = s[j];
}

__device__ __forceinline__ void copy_span(char* d, const char* s, i64 len) {
    const u64 x = (u64)d ^ (u64)s;
    if ((x & 15) == 0) copy_vectors<uint4, 4>(d, s, len);
    else if ((x & 7) == 0) copy_vectors<uint2, 4>(d, s, len);
    else if ((x & 3) == 0) copy_vectors<u32, 4>(d, s, len);
    else copy_vectors<unsigned char, 4>(d, s, len);
}

// Grid: x over chunks of a page, y over pairs of the whole batch (both grid-strided).
extern "C" __global__ void __launch_bounds__(1024)
kvcm_copy_pages(u64 descs, u64 ndescs, u64 pairs, u64 npairs, u64 chunk_bytes) {
    const CopyDesc* D = (const CopyDesc*)descs;
    const int2* P = (const int2*)pairs;
    for (i64 row = blockIdx.y; row < (i64)npairs; row += gridDim.y) {
        int t = 0;
        if (ndescs > 1) {
            int lo = 0, hi = (int)ndescs - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (D[mid].first_pair <= row) lo = mid; else hi = mid - 1;
            }
            t = lo;
        }
        const i64 chunks = D[t].chunks;
        if ((i64)blockIdx.x >= chunks) continue;
        const i64 page_bytes = D[t].page_bytes;
        const int2 pr = P[row];
        char* d = (char*)(D[t].dst + (i64)pr.x * D[t].dst_stride);
        const char* s = (const char*)(D[t].src + (i64)pr.y * D[t].src_stride);
        for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
            const i64 lo = c * (i64)chunk_bytes;
            const i64 rest = page_bytes - lo;
            copy_span(d + lo, s + lo, rest < (i64)chunk_bytes ? rest : (i64)chunk_bytes);
        }
    }
}

// ---- convert_page_indices --------------------------------------------------------------

// out[i * expansion + e] = in[i] * scale + offset + e (wrapping int64, as NumPy), or -1 for
// -1; any result outside [-1, INT32_MAX] sets *flag.
// SWA scratch (scratch_stop > scratch_begin): element i is block b = i % width of its row;
// blocks in [scratch_begin, scratch_stop) map, whatever in[i], to
// page = ids[p * spb / unit_scale] * unit_scale + (p * spb % unit_scale + unit_offset) %
// unit_scale (p = b - scratch_begin), out = page * expansion + e. The host checked the
// arguments (0 <= unit_offset < unit_scale <= INT32_MAX, ids in [0, INT32_MAX] and enough
// of them), so nothing here wraps.
// One span of a row conversion (threads first, first + step, ...), shared by both kernels:
// returns 1 when a result fell outside [-1, INT32_MAX].
__device__ __forceinline__ int convert_span(const int* in, int* out, i64 n, i64 scale,
                                            i64 offset, i64 expansion, i64 width,
                                            i64 scratch_begin, i64 scratch_stop, i64 spb,
                                            i64 unit_scale, i64 unit_offset, const int* ids,
                                            i64 first, i64 step) {
    int bad = 0;
    for (i64 i = first; i < n; i += step) {
        const int v = in[i];
        int* o = out + i * expansion;
        if (scratch_stop > scratch_begin) {
            const i64 b = i % width;
            if (b >= scratch_begin && b < scratch_stop) {
                const i64 total = (b - scratch_begin) * spb;
                i64 sub = total % unit_scale + unit_offset;
                if (sub >= unit_scale) sub -= unit_scale;
                const i64 page = ((i64)ids[total / unit_scale] * unit_scale + sub) * expansion;
                for (i64 e = 0; e < expansion; ++e) {
                    const i64 w = page + e;
                    if (w > 2147483647LL) bad = 1;
                    o[e] = (int)w;
                }
                continue;
            }
        }
        if (v == -1) {
            for (i64 e = 0; e < expansion; ++e) o[e] = -1;
            continue;
        }
        const u64 base = (u64)(i64)v * (u64)scale + (u64)offset;
        for (i64 e = 0; e < expansion; ++e) {
            const i64 w = (i64)(base + (u64)e);
            if (w > 2147483647LL || w < -1LL) bad = 1;
            o[e] = (int)w;
        }
    }
    return bad;
}

extern "C" __global__ void
kvcm_convert_page_indices(u64 in_ptr, u64 out_ptr, u64 n, i64 scale, i64 offset,
                          i64 expansion, u64 flag_ptr, i64 width, i64 scratch_begin,
                          i64 scratch_stop, i64 spb, i64 unit_scale, i64 unit_offset,
                          u64 ids_ptr) {
    const int bad = convert_span((const int*)in_ptr, (int*)out_ptr, (i64)n, scale, offset,
                                 expansion, width, scratch_begin, scratch_stop, spb,
                                 unit_scale, unit_offset, (const int*)ids_ptr,
                                 blockIdx.x * (i64)blockDim.x + threadIdx.x,
                                 (i64)gridDim.x * blockDim.x);
    if (bad) *(volatile int*)flag_ptr = 1;
}

// ---- convert_page_tables ---------------------------------------------------------------

// One row of one table: n slot ids at in (blocks of width per beam) to n * expansion page
// indices at out, with the row's scratch arguments (scratch_stop <= scratch_begin: none).
struct ConvJob {
    i64 in, out, n, width, scale, offset, expansion, scratch_begin, scratch_stop, spb,
        unit_scale, unit_offset, ids, pad0, pad1, pad2;
};

// Every job of every table in one launch: blockIdx.y walks the jobs, x the row.
extern "C" __global__ void
kvcm_convert_page_tables(u64 jobs_ptr, u64 njobs, u64 flag_ptr) {
    const ConvJob* jobs = (const ConvJob*)jobs_ptr;
    int bad = 0;
    for (i64 j = blockIdx.y; j < (i64)njobs; j += gridDim.y) {
        const ConvJob jb = jobs[j];
        bad |= convert_span((const int*)jb.in, (int*)jb.out, jb.n, jb.scale, jb.offset,
                            jb.expansion, jb.width, jb.scratch_begin, jb.scratch_stop,
                            jb.spb, jb.unit_scale, jb.unit_offset, (const int*)jb.ids,
                            blockIdx.x * (i64)blockDim.x + threadIdx.x,
                            (i64)gridDim.x * blockDim.x);
    }
    if (bad) *(volatile int*)flag_ptr = 1;
}

// ---- fingerprint engine ----------------------------------------------------------------

// Page at addr of page_bytes bytes cut into slots token slots; only bytes [lo, hi) (the
// slots [begin, end), computed on the host) are written or checked. Slot t covers bytes
// [t * P / R, (t + 1) * P / R) and holds the record (token, position + t, tag0, tag1).
struct FpDesc {
    i64 addr, page_bytes, slots, lo, hi, position;
    u64 tags;
    i64 token_row;
};

__device__ __forceinline__ i64 slot_first(i64 t, i64 p, i64 r) { return (t * p) / r; }

__device__ __forceinline__ u32 record_byte(u32 r0, u32 r1, u32 r2, u32 r3, int b) {
    const u32 w = b < 4 ? r0 : (b < 8 ? r1 : (b < 12 ? r2 : r3));
    return (w >> ((b & 3) * 8)) & 0xffu;
}

// The 16 expected bytes at page bytes [j0, j0 + 16) as four little-endian words, and a
// mask of those inside [lo, hi).
__device__ __forceinline__ u32 fp_build(const FpDesc& f, const u32* tokens, i64 j0,
                                        u32 out[4]) {
    const i64 p = f.page_bytes, r = f.slots;
    const i64 jstart = j0 < f.lo ? f.lo : j0;
    i64 slot = ((jstart + 1) * r - 1) / p;
    i64 first = slot_first(slot, p, r);
    i64 next = slot_first(slot + 1, p, r);
    const u32 r2 = (u32)f.tags, r3 = (u32)(f.tags >> 32);
    u32 r0 = tokens[f.token_row + slot];
    u32 r1 = (u32)(u64)(f.position + slot);
    u32 mask = 0;
    out[0] = out[1] = out[2] = out[3] = 0;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const i64 j = j0 + k;
        if (j >= f.lo && j < f.hi) {
            if (j >= next) {
                do {
                    ++slot;
                    first = next;
                    next = slot_first(slot + 1, p, r);
                } while (j >= next);
                r0 = tokens[f.token_row + slot];
                r1 = (u32)(u64)(f.position + slot);
            }
            const int b = (int)((j - first) & 15);
            out[k >> 2] |= record_byte(r0, r1, r2, r3, b) << ((k & 3) * 8);
            mask |= 1u << k;
        }
    }
    return mask;
}

// Grid: y over pages, x over 16-byte units (aligned in memory) of the page's [lo, hi).
template <bool CHECK>
__device__ __forceinline__ void fingerprint(u64 descs, u64 n, u64 tokens_ptr, u64 bad_ptr) {
    const FpDesc* D = (const FpDesc*)descs;
    const u32* tokens = (const u32*)tokens_ptr;
    for (i64 i = blockIdx.y; i < (i64)n; i += gridDim.y) {
        const FpDesc f = D[i];
        if (f.hi <= f.lo) continue;
        const u64 a0 = ((u64)f.addr + (u64)f.lo) & ~(u64)15;
        const u64 a1 = ((u64)f.addr + (u64)f.hi + 15) & ~(u64)15;
        const i64 units = (i64)((a1 - a0) >> 4);
        bool ok = true;
        for (i64 u = blockIdx.x * (i64)blockDim.x + threadIdx.x; u < units;
             u += (i64)gridDim.x * blockDim.x) {
            unsigned char* q = (unsigned char*)(a0 + (u64)u * 16);
            const i64 j0 = (i64)((u64)q - (u64)f.addr);
            u32 w[4];
            const u32 mask = fp_build(f, tokens, j0, w);
            if (mask == 0xffffu) {
                if (CHECK) {
                    const uint4 v = *(const uint4*)q;
                    ok = ok && v.x == w[0] && v.y == w[1] && v.z == w[2] && v.w == w[3];
                } else {
                    *(uint4*)q = make_uint4(w[0], w[1], w[2], w[3]);
                }
            } else {
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    if (mask & (1u << k)) {
                        const unsigned char want = (unsigned char)(w[k >> 2] >> ((k & 3) * 8));
                        if (CHECK) ok = ok && q[k] == want;
                        else q[k] = want;
                    }
                }
            }
        }
        if (CHECK && !ok) ((volatile int*)bad_ptr)[i] = 1;
    }
}

extern "C" __global__ void kvcm_fingerprint_write(u64 descs, u64 n, u64 tokens) {
    fingerprint<false>(descs, n, tokens, 0);
}

extern "C" __global__ void kvcm_fingerprint_check(u64 descs, u64 n, u64 tokens, u64 bad) {
    fingerprint<true>(descs, n, tokens, bad);
}
"""
