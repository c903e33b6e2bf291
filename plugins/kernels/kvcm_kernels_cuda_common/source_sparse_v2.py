"""CUDA C of the second resolve kernel (``KVCM_SPARSE_RESOLVE=v2``; ``v3`` and the default ``v4``
run it for working sets past its shared memory).

Same rules and bytes as :mod:`kvcm_kernels_cuda_common.source_sparse`'s
``kvcm_sparse_resolve`` (the NumPy reference :mod:`kvcm_core.sparse.reference`), without
sorting the eviction keys in the common case. One block per row (and selection group); the
row's stamps are copied into shared memory once (working sets up to the shared limit), the
protected entries are a bitmap in shared memory, and the order in which misses take entries
is found by ranking instead of sorting:

1. free candidates (stamp ``-1``) rank by index (ballots and a block scan);
2. the other candidates rank by stamp, a *window* of stamps at a time: stamps are distinct
   within a row (``tick * working_set_units + slot``), so the candidates whose stamps lie in
   ``[m, m + window)`` (``m`` the smallest stamp not ranked yet) set one bit each in a
   shared bitmap, and a candidate's rank is the number of set bits below its own (a block
   scan of the words' bit counts). Windows repeat until the misses have their entries.
3. Anything the windows cannot do (two candidates with one stamp, a negative stamp other
   than ``-1``, more than ``max_windows`` windows) falls back to the bitonic sort of the
   first kernel, in the row's global scratch.

:mod:`kvcm_core.sparse.resolve_model` is the same algorithm in NumPy, checked against the
reference on the host.
"""

from __future__ import annotations

__all__ = ["SPARSE_V2_ITEMS", "SPARSE_V2_KERNEL", "SPARSE_V2_MAX_SHARED", "SPARSE_V2_SOURCE",
           "sparse_v2_shared_bytes", "sparse_v2_window_bits"]

#: Slots (and entries) a thread holds per round: a row of up to ``ITEMS * threads`` slots
#: keeps its slots in registers from the lookup to the writes (more: re-read per phase).
SPARSE_V2_ITEMS = 8
SPARSE_V2_KERNEL = "kvcm_sparse_resolve_v2"
#: Dynamic shared memory a v2 block may take (Hopper: 227 KiB a block, less the kernel's
#: 2 KiB of static shared memory); rows that need more run the first kernel.
SPARSE_V2_MAX_SHARED = 224 << 10


def sparse_v2_window_bits(threads: int) -> int:
    """The widest stamp window of a block: one 128-bit word of bitmap per thread."""
    return 128 * threads


def sparse_v2_shared_bytes(threads: int, wsu: int, keys: int, ns: int,
                           shared_stamps: bool) -> int:
    """Dynamic shared memory of one block: stamps (int64, when kept in shared memory), the
    protected bitmap (one bit per key), the window bitmap, per-thread bit-count prefixes and
    the miss order (one int per slot)."""
    stamps = 8 * wsu if shared_stamps else 0
    stamps = -(-stamps // 16) * 16
    prot = -(-(4 * (keys // 32)) // 16) * 16
    return stamps + prot + 16 * threads + 4 * threads + 4 * ns


SPARSE_V2_SOURCE = r"""
// ---- sparse resolve, second kernel: ranks instead of a sort ---------------------------

#define SP2_ITEMS 8
#define SP2_MAXCNT (SP2_ITEMS * 32)

// Exclusive ranks of the flagged items among a block's items q * T + t (index order:
// q, then warp, then lane), and their total. Every thread calls it (it synchronizes).
template <int N>
__device__ __forceinline__ int sp2_rank(const bool (&f)[N], int (&rank)[N], int* cnt, int* tot) {
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    const int nw = (int)(blockDim.x >> 5);
    const unsigned below = (1u << lane) - 1u;
#pragma unroll
    for (int q = 0; q < N; ++q) {
        const unsigned b = __ballot_sync(SP_FULL, f[q]);
        if (lane == 0) cnt[q * nw + warp] = __popc(b);
        rank[q] = __popc(b & below);
    }
    __syncthreads();
    if (warp == 0) {
        const int n = N * nw, per = (n + 31) / 32;
        int sum = 0;
        for (int m = 0; m < per; ++m) {
            const int i = lane * per + m;
            sum += i < n ? cnt[i] : 0;
        }
        int inc = sum;
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(SP_FULL, inc, off);
            if (lane >= off) inc += y;
        }
        int run = inc - sum;
        for (int m = 0; m < per; ++m) {
            const int i = lane * per + m;
            if (i < n) { const int c = cnt[i]; cnt[i] = run; run += c; }
        }
        if (lane == 31) *tot = inc;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < N; ++q) rank[q] += cnt[q * nw + warp];
    const int total = *tot;
    __syncthreads();  // cnt and tot are reused by the next call
    return total;
}

// Exclusive prefix of one value per thread, in thread order, and the total.
__device__ __forceinline__ int sp2_scan(int v, int* cnt, int* tot, int& total) {
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    const int nw = (int)(blockDim.x >> 5);
    int inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(SP_FULL, inc, off);
        if (lane >= off) inc += y;
    }
    if (lane == 31) cnt[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const int c = lane < nw ? cnt[lane] : 0;
        int w = c;
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(SP_FULL, w, off);
            if (lane >= off) w += y;
        }
        if (lane < nw) cnt[lane] = w - c;
        if (lane == 31) *tot = w;
    }
    __syncthreads();
    const int out = cnt[warp] + inc - v;
    total = *tot;
    __syncthreads();
    return out;
}

// The block's minimum of one value per thread (slot: a shared word, any value on entry).
__device__ __forceinline__ u64 sp2_min(u64 v, u64* slot) {
    for (int off = 16; off > 0; off >>= 1) {
        const u64 y = __shfl_xor_sync(SP_FULL, v, off);
        v = y < v ? y : v;
    }
    if (threadIdx.x == 0) *slot = SP_KEY_MAX;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicMin(slot, v);
    __syncthreads();
    const u64 out = *slot;
    __syncthreads();
    return out;
}

__device__ __forceinline__ bool sp2_prot(const u32* prot, i64 e) {
    return (prot[e >> 5] >> (e & 31)) & 1u;
}

__device__ void sp2_sorted_order(int k, i64 wsu, i64 P, const i64* st, const u32* prot,
                                 int* order, u64* keys);

// The order in which the row's k misses take entries: order[i] is the entry of the i-th
// smallest (stamp, index) among the candidates (-1 where there are fewer than k).
__device__ void sp2_order(int k, i64 wsu, i64 P, const i64* st, const u32* prot, u32* bm,
                          int* tp, int* order, u64* keys, i64 window, i64 max_windows,
                          int* cnt, int* tot, u64* mslot) {
    const i64 T = blockDim.x, t = threadIdx.x;
    const i64 round = SP2_ITEMS * T;
    // 1. free candidates, by index; the smallest other stamp
    int taken = 0;
    bool bad = false;
    u64 mn = SP_KEY_MAX;
    for (i64 e0 = 0; e0 < wsu; e0 += round) {
        bool fr[SP2_ITEMS];
        int rk[SP2_ITEMS];
#pragma unroll
        for (int q = 0; q < SP2_ITEMS; ++q) {
            const i64 e = e0 + q * T + t;
            const bool cand = e < wsu && !sp2_prot(prot, e);
            const i64 s = cand ? st[e] : 0;
            fr[q] = cand && s == -1;
            bad |= cand && s < -1;
            if (cand && s >= 0 && (u64)s < mn) mn = (u64)s;
        }
        const int total = sp2_rank<SP2_ITEMS>(fr, rk, cnt, tot);
#pragma unroll
        for (int q = 0; q < SP2_ITEMS; ++q) {
            if (fr[q] && taken + rk[q] < k) order[taken + rk[q]] = (int)(e0 + q * T + t);
        }
        taken += total;
    }
    bool fallback = __syncthreads_or(bad);
    u64 m = sp2_min(mn, mslot);
    // 2. windows of stamps [m, m + window), each a bitmap of window bits
    uint4* bm4 = (uint4*)bm;
    for (i64 it = 0; !fallback && taken < k && m != SP_KEY_MAX; ++it) {
        if (it >= max_windows) { fallback = true; break; }
        bm4[t] = make_uint4(0u, 0u, 0u, 0u);
        __syncthreads();
        bool clash = false;
        u64 next = SP_KEY_MAX;
        for (i64 e0 = 0; e0 < wsu; e0 += round) {
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                const i64 e = e0 + q * T + t;
                if (e >= wsu || sp2_prot(prot, e)) continue;
                const i64 s = st[e];
                if (s < 0 || (u64)s < m) continue;
                const u64 b = (u64)s - m;
                if (b < (u64)window) {
                    const u32 bit = 1u << (b & 31);
                    clash |= (atomicOr(bm + (b >> 5), bit) & bit) != 0;
                } else if ((u64)s < next) {
                    next = (u64)s;
                }
            }
        }
        if (__syncthreads_or(clash)) { fallback = true; break; }
        const uint4 w = bm4[t];
        int count;
        const int pre = sp2_scan(__popc(w.x) + __popc(w.y) + __popc(w.z) + __popc(w.w), cnt, tot,
                                 count);
        tp[t] = pre;
        __syncthreads();
        for (i64 e0 = 0; e0 < wsu; e0 += round) {
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                const i64 e = e0 + q * T + t;
                if (e >= wsu || sp2_prot(prot, e)) continue;
                const i64 s = st[e];
                if (s < 0 || (u64)s < m || (u64)s - m >= (u64)window) continue;
                const u64 b = (u64)s - m;
                const u64 wi = b >> 5;
                const uint4 W = bm4[wi >> 2];
                const u32 part = (1u << (b & 31)) - 1u;
                const int j = (int)(wi & 3);
                int rank = tp[wi >> 2];
                rank += j > 0 ? __popc(W.x) : __popc(W.x & part);
                if (j >= 1) rank += j > 1 ? __popc(W.y) : __popc(W.y & part);
                if (j >= 2) rank += j > 2 ? __popc(W.z) : __popc(W.z & part);
                if (j >= 3) rank += __popc(W.w & part);
                if (taken + rank < k) order[taken + rank] = (int)e;
            }
        }
        taken += count;
        m = sp2_min(next, mslot);  // synchronizes: the bitmap is free again
    }
    if (fallback) sp2_sorted_order(k, wsu, P, st, prot, order, keys);
}

// The order by the first kernel's sort of every eviction key, in the row's global scratch
// (the fallback).
__device__ void sp2_sorted_order(int k, i64 wsu, i64 P, const i64* st, const u32* prot,
                                 int* order, u64* keys) {
    const i64 T = blockDim.x, t = threadIdx.x;
    for (i64 e = t; e < P; e += T) {
        const bool cand = e < wsu && !sp2_prot(prot, e);
        keys[e] = cand ? (((u64)(st[e] + 1) << SP_ENTRY_BITS) | (u64)e) : SP_KEY_MAX;
    }
    __syncthreads();
    sp_sort_pairs(keys, P);  // through memory: no register arrays on this cold path
    for (i64 i = t; i < k; i += T) {
        const u64 key = keys[i];
        order[i] = key == SP_KEY_MAX ? -1 : (int)(key & ((1ULL << SP_ENTRY_BITS) - 1));
    }
    __syncthreads();
}

// The units of a thread's slots of the round at s0 (-1: unused).
__device__ __forceinline__ void sp2_units(int (&u)[SP2_ITEMS], const int* sel, i64 s0, i64 ns,
                                          i64 lo, i64 hi, i64 max_units) {
    const i64 T = blockDim.x, t = threadIdx.x;
#pragma unroll
    for (int q = 0; q < SP2_ITEMS; ++q) {
        const i64 s = s0 + q * T + t;
        u[q] = s < ns ? (int)sp_unit(sel, s, lo, hi, max_units) : -1;
    }
}

// One block per row (grid-strided; blockDim.x a multiple of 32, at most 1024). A slot's
// class x: an entry >= 0 (a hit at its unit's first slot), -2 (unused, or not its unit's
// first slot), -3 - i (the i-th miss in slot order). Rows of more than SP2_ITEMS * T slots
// keep x in the entry map between phases.
extern "C" __global__ void __launch_bounds__(1024, 1)
kvcm_sparse_resolve_v2(u64 rows, u64 ns, u64 wsu, u64 P, u64 max_units, u64 ut, u64 lease_ptr,
                       u64 marks_ptr, u64 resident_ptr, u64 stamp_ptr, u64 tick_ptr,
                       u64 entry_of_ptr, u64 first_ptr, u64 sel_ptr, u64 map_ptr, u64 mu_ptr,
                       u64 me_ptr, u64 mc_ptr, u64 cnt_ptr, u64 keys_ptr, u64 shared_stamps,
                       u64 window, u64 max_windows) {
    extern __shared__ __align__(16) unsigned char sp2_smem[];
    __shared__ int sp2_cnt[SP2_MAXCNT];
    __shared__ int sp2_tot;
    __shared__ int sp2_hits;
    __shared__ u64 sp2_m;
    const i64 T = blockDim.x, t = threadIdx.x;
    const int lane = (int)(t & 31);
    const i64 round = SP2_ITEMS * T;
    const bool single = (i64)ns <= round;
    // shared layout: stamps (optional), protected bits, window bitmap, prefixes, order
    const i64 st_bytes = shared_stamps ? ((8 * (i64)wsu + 15) / 16) * 16 : 0;
    i64* sst = (i64*)sp2_smem;
    u32* prot = (u32*)(sp2_smem + st_bytes);
    u32* bm = prot + ((((i64)P / 32) + 3) / 4) * 4;
    int* tp = (int*)(bm + 4 * T);
    int* order = tp + T;
    for (i64 r = blockIdx.x; r < (i64)rows; r += gridDim.x) {
        const int L = ((const int*)lease_ptr)[r];
        int* emap = (int*)map_ptr + r * (i64)ns;
        if (L < 0) {
            for (i64 s = t; s < (i64)ns; s += T) emap[s] = -1;
            if (t == 0) ((int*)mc_ptr)[r] = 0;
            continue;
        }
        const int* marks = (const int*)marks_ptr + 2 * (i64)L;
        const int h0 = marks[0], c0 = marks[1];
        const i64 lo = (i64)h0 / (i64)ut;
        const i64 hi = c0 > h0 ? ((i64)c0 + (i64)ut - 1) / (i64)ut : lo;
        int* resident = (int*)resident_ptr + (i64)L * wsu;
        i64* stamp = (i64*)stamp_ptr + (i64)L * wsu;
        int* entry_of = (int*)entry_of_ptr + (i64)L * max_units;
        int* first = (int*)first_ptr + (i64)L * max_units;
        const int* sel = sel_ptr ? (const int*)sel_ptr + r * (i64)ns : 0;
        const i64 tick = ((const i64*)tick_ptr)[L];
        const i64* st = shared_stamps ? sst : stamp;
        // 0. the slots' units (first slot of each unit: atomicMin on first[]); protected
        // bits of the pinned entries and the padding; stamps into shared memory
        int u[SP2_ITEMS], x[SP2_ITEMS];
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            sp2_units(u, sel, s0, ns, lo, hi, max_units);
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q)
                if (u[q] >= 0) atomicMin(first + u[q], (int)(s0 + q * T + t));
        }
        for (i64 e0 = 0; e0 < (i64)P; e0 += round) {
            int v[SP2_ITEMS];
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                const i64 e = e0 + q * T + t;
                v[q] = e < (i64)wsu ? resident[e] : 0;
                if (shared_stamps && e < (i64)wsu) sst[e] = stamp[e];
            }
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                const i64 e = e0 + q * T + t;
                const bool pinned = e >= (i64)wsu || (v[q] >= lo && v[q] < hi);
                const unsigned b = __ballot_sync(SP_FULL, pinned);
                if (lane == 0 && e < (i64)P) prot[e >> 5] = b;
            }
        }
        for (i64 i = t; i < (i64)ns; i += T) order[i] = -1;
        if (t == 0) sp2_hits = 0;
        __syncthreads();
        // 1. hits protect their entries; misses ranked in slot order
        int k = 0, my_hits = 0;
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            if (!single) sp2_units(u, sel, s0, ns, lo, hi, max_units);
            int f[SP2_ITEMS];
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                f[q] = u[q] >= 0 ? first[u[q]] : -1;
                x[q] = u[q] >= 0 ? entry_of[u[q]] : -2;
            }
            bool miss[SP2_ITEMS];
            int rk[SP2_ITEMS];
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                const i64 s = s0 + q * T + t;
                if (u[q] < 0 || f[q] != (int)s) x[q] = -2;
                miss[q] = x[q] == -1;
                if (x[q] >= 0) {
                    atomicOr(prot + (x[q] >> 5), 1u << (x[q] & 31));
                    ++my_hits;
                }
            }
            const int total = sp2_rank<SP2_ITEMS>(miss, rk, sp2_cnt, &sp2_tot);
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                if (miss[q]) x[q] = -3 - (k + rk[q]);
                const i64 s = s0 + q * T + t;
                if (!single && s < (i64)ns) emap[s] = x[q];
            }
            k += total;
        }
        for (int off = 16; off > 0; off >>= 1) my_hits += __shfl_down_sync(SP_FULL, my_hits, off);
        if (lane == 0 && my_hits) atomicAdd(&sp2_hits, my_hits);
        __syncthreads();
        // 2. the entries the misses take, in order
        if (k > 0)
            sp2_order(k, (i64)wsu, (i64)P, st, prot, bm, tp, order, (u64*)keys_ptr + r * (i64)P,
                      (i64)window, (i64)max_windows, sp2_cnt, &sp2_tot, &sp2_m);
        // 3. misses move in; every resolved unit is stamped; the map of first slots
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            if (!single) {
                sp2_units(u, sel, s0, ns, lo, hi, max_units);
#pragma unroll
                for (int q = 0; q < SP2_ITEMS; ++q) {
                    const i64 s = s0 + q * T + t;
                    x[q] = s < (i64)ns ? emap[s] : -2;
                }
            }
            int e[SP2_ITEMS], old[SP2_ITEMS];
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) e[q] = x[q] <= -3 ? order[-3 - x[q]] : x[q];
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q)
                old[q] = (x[q] <= -3 && e[q] >= 0) ? resident[e[q]] : -1;
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q) {
                const i64 s = s0 + q * T + t;
                if (x[q] <= -3) {
                    const int i = -3 - x[q];
                    if (e[q] >= 0) {
                        if (old[q] >= 0) entry_of[old[q]] = -1;
                        resident[e[q]] = u[q];
                        entry_of[u[q]] = e[q];
                    }
                    ((int*)mu_ptr)[r * (i64)ns + i] = u[q];
                    ((int*)me_ptr)[r * (i64)ns + i] = e[q];
                }
                if (x[q] != -2 && e[q] >= 0) stamp[e[q]] = tick * (i64)wsu + s;
                if (s < (i64)ns && (x[q] != -2 || u[q] < 0)) emap[s] = x[q] == -2 ? -1 : e[q];
            }
        }
        __syncthreads();  // entry_of is final
        // 4. slots after their unit's first take its entry; first[] back to INT32_MAX
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            bool dup[SP2_ITEMS];
            if (single) {
#pragma unroll
                for (int q = 0; q < SP2_ITEMS; ++q) dup[q] = u[q] >= 0 && x[q] == -2;
            } else {
                sp2_units(u, sel, s0, ns, lo, hi, max_units);
                int f[SP2_ITEMS];
#pragma unroll
                for (int q = 0; q < SP2_ITEMS; ++q) f[q] = u[q] >= 0 ? first[u[q]] : -1;
#pragma unroll
                for (int q = 0; q < SP2_ITEMS; ++q)
                    dup[q] = u[q] >= 0 && f[q] != (int)(s0 + q * T + t);
            }
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q)
                if (dup[q]) emap[s0 + q * T + t] = entry_of[u[q]];
        }
        __syncthreads();  // every read of first[] is done
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            if (!single) sp2_units(u, sel, s0, ns, lo, hi, max_units);
#pragma unroll
            for (int q = 0; q < SP2_ITEMS; ++q)
                if (u[q] >= 0) first[u[q]] = 0x7fffffff;
        }
        if (t == 0) {
            ((i64*)tick_ptr)[L] = tick + 1;
            ((int*)mc_ptr)[r] = k;
            if (sel) {
                ((i64*)cnt_ptr)[2 * r] += sp2_hits;
                ((i64*)cnt_ptr)[2 * r + 1] += k;
            }
        }
        __syncthreads();
    }
}
"""
