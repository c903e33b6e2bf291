"""CUDA C of the third resolve kernel (``KVCM_SPARSE_RESOLVE=v3``) and its v4 form (the default).

Same rules and bytes as the NumPy reference (:mod:`kvcm_core.sparse.reference`) and the
first two kernels; the second kernel's ranking (free entries by index, then stamps a window
at a time in a shared bitmap, the sort as fallback) done with fewer barriers and no global
round trip after the lookups:

- the block size is a compile-time constant (256, 512 or 1024 threads: one kernel each) and
  indices are 32-bit;
- a thread owns *contiguous* slots (4 a round) and entries (a run of ``ept``, a multiple of
  8), so ranks in index order are a per-thread count plus a block scan of one value per
  thread; every block scan takes one barrier (each warp scans the warp totals itself);
- the row's state is read once, coalesced, into shared memory (stamps, residents, a byte
  per entry for "protected", the slots' units); the evicted unit of an entry comes from
  there, and a repeated slot takes its unit's entry from its first slot's result in shared
  memory instead of reading ``entry_of`` back;
- the first window starts at the smallest stamp of the unpinned entries (found while they
  are loaded), so free entries and the first window are ranked in one pass over the entries:
  two passes and three barriers where v2's free entries and one window take three passes
  and fifteen barriers;
- the dedup scratch ``first`` is restored as soon as every slot has read it.

Rows whose working set exceeds the shared limit, or whose shared memory would exceed
``SPARSE_V3_MAX_SHARED``, run the second kernel (stamps in global memory). The algorithm in
NumPy is :func:`kvcm_core.sparse.resolve_model.resolve_model` with ``variant="v3"``.

``KVCM_SPARSE_RESOLVE=v4`` is the same kernel with one change: the first slot of each unit
is found in a hash table in shared memory (open addressing, at most half full, in the space
the window bitmap and the miss order take later) instead of by ``atomicMin`` on the global
scratch ``first``, which it leaves untouched: one shared atomic and one shared probe per
slot instead of a global atomic, a global read and a global write.
"""

from __future__ import annotations

__all__ = ["SPARSE_V3_KERNELS", "SPARSE_V3_MAX_SHARED", "SPARSE_V3_SOURCE", "SPARSE_V3_THREADS",
           "sparse_v3_kernel", "sparse_v3_shared_bytes"]

#: Block sizes the third kernel is compiled for.
SPARSE_V3_THREADS = (256, 512, 1024)
SPARSE_V3_KERNELS = tuple(f"kvcm_sparse_resolve_{v}_{t}" for v in ("v3", "v4")
                          for t in SPARSE_V3_THREADS)
#: Dynamic shared memory a v3 block may take: Hopper's 227 KiB a block less the kernel's
#: static shared memory (at most about 9 KiB, for 1024 threads) and a margin.
SPARSE_V3_MAX_SHARED = 212 << 10


def sparse_v3_kernel(threads: int, version: str = "v3") -> str:
    """The name of the third kernel (``version`` ``"v3"``, or ``"v4"``: the shared hash) for
    blocks of ``threads``."""
    if threads not in SPARSE_V3_THREADS:
        raise ValueError(f"sparse_threads={threads}: {version} runs blocks of "
                         f"{', '.join(map(str, SPARSE_V3_THREADS))} threads")
    return f"kvcm_sparse_resolve_{version}_{threads}"


def sparse_v3_shared_bytes(threads: int, wsu: int, ns: int, version: str = "v3") -> int:
    """Dynamic shared memory of one block: per entry (padded to 8) a stamp, a resident and a
    protected byte (13 bytes); the window bitmap (16 bytes a thread); per slot (padded to
    4) a unit, a class and a miss order (12 bytes). v4: the hash table (8 bytes a slot of
    at least twice ``ns``, a power of two) shares the space of the bitmap and the order."""
    wsp = -(-wsu // 8) * 8
    nsp = -(-ns // 4) * 4
    if version == "v3":
        return 13 * wsp + 16 * threads + 12 * nsp
    hash_slots = 32
    while hash_slots < 2 * ns:
        hash_slots *= 2
    prot = -(-wsp // 16) * 16
    return 12 * wsp + prot + 8 * nsp + max(16 * threads + 4 * nsp, 8 * hash_slots)


SPARSE_V3_SOURCE = r"""
// ---- sparse resolve, third kernel ------------------------------------------------------

#define SP3_SI 4            // slots a thread holds per round (contiguous)
#define SP3_DUP 0x40000000  // class of a repeated slot: SP3_DUP + its unit's first slot

// Exclusive prefixes over the block's threads (thread order) of two values a thread, and
// their totals; one barrier. wt: 64 ints, not used by the previous call (callers alternate
// two buffers). With intra_b, thread t's exclusive prefix of b within its warp goes to
// intra_b[t] (before the barrier) and each warp w writes the exclusive prefixes of b over
// warps to its own row wex_b[w * 32 + *] (after it; the warp synchronizes itself).
template <int T>
__device__ __forceinline__ void sp3_scan2(int a, int b, int* wt, int& ea, int& eb, int& ta,
                                          int& tb, int* intra_b, int* wex_b) {
    constexpr int NW = T / 32;
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    int ia = a, ib = b;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int ya = __shfl_up_sync(SP_FULL, ia, off);
        const int yb = __shfl_up_sync(SP_FULL, ib, off);
        if (lane >= off) { ia += ya; ib += yb; }
    }
    if (lane == 31) { wt[warp] = ia; wt[32 + warp] = ib; }
    if (intra_b) intra_b[t] = ib - b;
    __syncthreads();
    const int wa = lane < NW ? wt[lane] : 0;
    const int wb = lane < NW ? wt[32 + lane] : 0;
    int xa = wa, xb = wb;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int ya = __shfl_up_sync(SP_FULL, xa, off);
        const int yb = __shfl_up_sync(SP_FULL, xb, off);
        if (lane >= off) { xa += ya; xb += yb; }
    }
    ta = __shfl_sync(SP_FULL, xa, 31);
    tb = __shfl_sync(SP_FULL, xb, 31);
    ea = __shfl_sync(SP_FULL, xa - wa, warp) + ia - a;
    eb = __shfl_sync(SP_FULL, xb - wb, warp) + ib - b;
    if (wex_b) {
        wex_b[warp * 32 + lane] = xb - wb;
        __syncwarp();
    }
}

// A thread's 8 entries from eb: protected bytes (one word) and stamps (shared memory).
__device__ __forceinline__ void sp3_load8(const unsigned char* prot, const i64* sst, int eb,
                                          u64& pw, i64 (&sv)[8]) {
    pw = *(const u64*)(prot + eb);
    const longlong2* p = (const longlong2*)(sst + eb);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const longlong2 v = p[h];
        sv[2 * h] = v.x;
        sv[2 * h + 1] = v.y;
    }
}

// The order by the first kernel's sort of every eviction key, in the row's global scratch
// (the fallback: equal stamps, a stamp below -1, or more windows than allowed).
__device__ void sp3_sorted_order(int k, int wsu, i64 P, const i64* sst,
                                 const unsigned char* prot, int* order, u64* keys) {
    const i64 T = blockDim.x, t = threadIdx.x;
    for (i64 e = t; e < P; e += T) {
        const bool cand = e < wsu && !prot[e];
        keys[e] = cand ? (((u64)(sst[e] + 1) << SP_ENTRY_BITS) | (u64)e) : SP_KEY_MAX;
    }
    __syncthreads();
    sp_sort_pairs(keys, P);
    for (i64 i = t; i < k; i += T) {
        const u64 key = keys[i];
        order[i] = key == SP_KEY_MAX ? -1 : (int)(key & ((1ULL << SP_ENTRY_BITS) - 1));
    }
    __syncthreads();
}

// v4: the row's first slot of each unit in a shared hash table (open addressing, 2^hb
// slots of unit keys and min-slot values, at most half full) instead of the global scratch.
__device__ __forceinline__ u32 sp3_hash(int u, int hb) {
    return ((u32)u * 2654435761u) >> (32 - hb);
}
__device__ __forceinline__ void sp3_hash_insert(int* hk, int* hv, int hb, int u, int s) {
    const u32 mask = (1u << hb) - 1u;
    for (u32 h = sp3_hash(u, hb);; h = (h + 1u) & mask) {
        const int prev = atomicCAS(hk + h, -1, u);
        if (prev == -1 || prev == u) { atomicMin(hv + h, s); return; }
    }
}
__device__ __forceinline__ int sp3_hash_find(const int* hk, const int* hv, int hb, int u) {
    const u32 mask = (1u << hb) - 1u;
    u32 h = sp3_hash(u, hb);
    while (hk[h] != u) h = (h + 1u) & mask;
    return hv[h];
}

// One block of T threads per row (grid-strided). Slot classes (cls): -1 unused; an entry
// >= 0 (a hit, at its unit's first slot); -3 - i (the i-th miss in slot order); SP3_DUP + f
// (a repeated slot whose unit's first slot is f). Phase 3 replaces a first slot's class by
// its final entry, which phase 4 gives the repeated slots.
template <int T, bool HASH>
__device__ __forceinline__ void sp3_resolve(
        u64 rows, u64 ns_, u64 wsu_, u64 P, u64 max_units, u64 ut, u64 lease_ptr,
        u64 marks_ptr, u64 resident_ptr, u64 stamp_ptr, u64 tick_ptr, u64 entry_of_ptr,
        u64 first_ptr, u64 sel_ptr, u64 map_ptr, u64 mu_ptr, u64 me_ptr, u64 mc_ptr,
        u64 cnt_ptr, u64 keys_ptr, u64 window_, u64 max_windows_) {
    constexpr int NW = T / 32;
    constexpr int ROUND = SP3_SI * T;
    extern __shared__ __align__(16) unsigned char sp3_smem[];
    __shared__ int s_wt[2][64];
    __shared__ int s_intra[T];
    __shared__ int s_wex[NW * 32];
    __shared__ u64 s_min[3];  // [0]: smallest unpinned stamp; [1], [2]: next window's start
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    const int ns = (int)ns_, wsu = (int)wsu_;
    const int wsp = (wsu + 7) & ~7;
    const int nsp = (ns + 3) & ~3;
    const int ept = ((wsp + T - 1) / T + 7) & ~7;  // entries a thread owns (contiguous)
    i64* sst = (i64*)sp3_smem;
    int* rs = (int*)(sp3_smem + 8 * (i64)wsp);
    u32* bm;
    int *uu, *cls, *order;
    unsigned char* prot;
    int hb = 5;  // v4: hash slots 2^hb >= 2 * ns
    if (HASH)
        while ((1 << hb) < 2 * ns) ++hb;
    int* hk = 0;
    int* hv = 0;
    if (!HASH) {
        bm = (u32*)(sp3_smem + 12 * (i64)wsp);
        uu = (int*)(bm + 4 * T);
        cls = uu + nsp;
        order = cls + nsp;
        prot = (unsigned char*)(order + nsp);
    } else {  // the hash is dead after phase 1: the window bitmap and the order reuse it
        prot = sp3_smem + 12 * (i64)wsp;
        uu = (int*)(prot + ((wsp + 15) & ~15));
        cls = uu + nsp;
        bm = (u32*)(cls + nsp);
        order = (int*)(bm + 4 * T);
        hk = (int*)bm;
        hv = hk + (1 << hb);
        for (int i = t; i < (1 << hb); i += T) { hk[i] = -1; hv[i] = 0x7fffffff; }
    }
    const u64 W = window_;
    const int maxw = (int)max_windows_;
    int ph = 0;  // scan buffer
    if (t < 3) s_min[t] = SP_KEY_MAX;
    __syncthreads();
    for (i64 r = blockIdx.x; r < (i64)rows; r += gridDim.x) {
        const int L = ((const int*)lease_ptr)[r];
        int* emap = (int*)map_ptr + r * (i64)ns;
        if (L < 0) {
            for (int s = t; s < ns; s += T) emap[s] = -1;
            if (t == 0) ((int*)mc_ptr)[r] = 0;
            continue;
        }
        const int* marks = (const int*)marks_ptr + 2 * (i64)L;
        const int h0 = marks[0], c0 = marks[1];
        const i64 lo = (i64)h0 / (i64)ut;
        const i64 hi = c0 > h0 ? ((i64)c0 + (i64)ut - 1) / (i64)ut : lo;
        int* resident = (int*)resident_ptr + (i64)L * wsu;
        i64* stamp = (i64*)stamp_ptr + (i64)L * wsu;
        int* entry_of = (int*)entry_of_ptr + (i64)L * (i64)max_units;
        int* first = (int*)first_ptr + (i64)L * (i64)max_units;
        const int* sel = sel_ptr ? (const int*)sel_ptr + r * (i64)ns : 0;
        const i64 tick = ((const i64*)tick_ptr)[L];
        int* miss_unit = (int*)mu_ptr + r * (i64)ns;
        int* miss_entry = (int*)me_ptr + r * (i64)ns;
        // 0. (coalesced) the slots' units, first slots by atomicMin on first[]; the entries'
        // stamps and residents into shared memory, pinned entries (and the padding)
        // protected; the smallest unpinned stamp; the window bitmap cleared
        for (int s0 = 0; s0 < ns; s0 += ROUND) {
            int u[SP3_SI];
#pragma unroll
            for (int q = 0; q < SP3_SI; ++q) {
                const int s = s0 + q * T + t;
                u[q] = s < ns ? (int)sp_unit(sel, s, lo, hi, max_units) : -1;
            }
#pragma unroll
            for (int q = 0; q < SP3_SI; ++q) {
                const int s = s0 + q * T + t;
                if (HASH) {
                    if (u[q] >= 0) sp3_hash_insert(hk, hv, hb, u[q], s);
                    if (s < nsp) uu[s] = u[q];
                } else {
                    if (u[q] >= 0) atomicMin(first + u[q], s);
                    if (s < nsp) { uu[s] = u[q]; order[s] = -1; }
                }
            }
        }
        u64 mn = SP_KEY_MAX;
        bool bad = false;
        for (int e0 = 0; e0 < wsp; e0 += 8 * T) {
            int v[8];
            i64 sv[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int e = e0 + q * T + t;
                v[q] = e < wsu ? resident[e] : -1;
                sv[q] = e < wsu ? stamp[e] : -1;
            }
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int e = e0 + q * T + t;
                if (e < wsp) {
                    const bool pinned = e >= wsu || ((i64)v[q] >= lo && (i64)v[q] < hi);
                    prot[e] = pinned ? 1 : 0;
                    rs[e] = v[q];
                    sst[e] = sv[q];
                    if (!pinned) {
                        bad |= sv[q] < -1;
                        if (sv[q] >= 0 && (u64)sv[q] < mn) mn = (u64)sv[q];
                    }
                }
            }
        }
        if (!HASH) ((uint4*)bm)[t] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const u64 y = __shfl_xor_sync(SP_FULL, mn, off);
            mn = y < mn ? y : mn;
        }
        if (lane == 0 && mn != SP_KEY_MAX) atomicMin(&s_min[0], mn);
        const bool any_bad = __syncthreads_or(bad) != 0;
        // 1. (contiguous slots) first slot, hit or miss; hits protect their entries; misses
        // numbered in slot order (one scan a round, which also counts the hits)
        int k = 0, hits = 0;
        for (int s0 = 0; s0 < nsp; s0 += ROUND) {
            const int sb = s0 + SP3_SI * t;
            int u[SP3_SI], f[SP3_SI], x[SP3_SI];
            if (sb < nsp) {
                const int4 uv = *(const int4*)(uu + sb);
                u[0] = uv.x; u[1] = uv.y; u[2] = uv.z; u[3] = uv.w;
            } else {
#pragma unroll
                for (int q = 0; q < SP3_SI; ++q) u[q] = -1;
            }
#pragma unroll
            for (int q = 0; q < SP3_SI; ++q) {
                x[q] = u[q] >= 0 ? entry_of[u[q]] : -1;
                if (HASH) f[q] = u[q] >= 0 ? sp3_hash_find(hk, hv, hb, u[q]) : -1;
                else f[q] = u[q] >= 0 ? first[u[q]] : -1;
            }
            int nm = 0, nh = 0;
#pragma unroll
            for (int q = 0; q < SP3_SI; ++q) {
                const int s = sb + q;
                if (u[q] < 0) {
                    x[q] = -1;
                } else if (f[q] != s) {
                    x[q] = SP3_DUP + f[q];
                } else if (x[q] >= 0) {
                    prot[x[q]] = 1;
                    ++nh;
                } else {
                    x[q] = -3 - nm;
                    ++nm;
                }
            }
            int em, eh, tm, th;
            sp3_scan2<T>(nm, nh, s_wt[ph], em, eh, tm, th, nullptr, nullptr);
            ph ^= 1;
            if (sb < nsp) {
#pragma unroll
                for (int q = 0; q < SP3_SI; ++q)
                    if (x[q] <= -3) x[q] -= k + em;
                *(int4*)(cls + sb) = make_int4(x[0], x[1], x[2], x[3]);
            }
            k += tm;
            hits += th;
        }
        if (HASH) {  // the hash is dead: clear the bitmap and the order in its place
            ((uint4*)bm)[t] = make_uint4(0u, 0u, 0u, 0u);
            for (int i = t; i < nsp; i += T) order[i] = -1;
            __syncthreads();
        }
        // 2. the entries the misses take, in order (order[i] for miss i; -1 past the
        // candidates): free candidates by index and the first window of stamps in one
        // pass, further windows if needed, the sort if the windows cannot do it
        if (k > 0) {
            bool fallback = any_bad;
            u64 m = s_min[0];
            int taken = 0;
            for (int it = 0; !fallback; ++it) {
                const bool win = it < maxw && m != SP_KEY_MAX;
                const u64 w = win ? W : 0;
                bool clash = false;
                u64 next = SP_KEY_MAX;
                int nf = 0;
                for (int c = 0; c < ept; c += 8) {
                    const int eb = t * ept + c;
                    if (eb >= wsp) break;
                    u64 pw;
                    i64 sv[8];
                    sp3_load8(prot, sst, eb, pw, sv);
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        if ((pw >> (8 * q)) & 0xffu) continue;
                        const i64 s = sv[q];
                        if (s == -1) { nf += it == 0; continue; }
                        if (s < 0 || (u64)s < m) continue;
                        const u64 b = (u64)s - m;
                        if (b < w) {
                            const u32 bit = 1u << (b & 31);
                            clash |= (atomicOr(bm + (b >> 5), bit) & bit) != 0;
                        } else if ((u64)s < next) {
                            next = (u64)s;
                        }
                    }
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) {
                    const u64 y = __shfl_xor_sync(SP_FULL, next, off);
                    next = y < next ? y : next;
                }
                if (lane == 0 && next != SP_KEY_MAX) atomicMin(&s_min[1 + (it & 1)], next);
                if (__syncthreads_or(clash)) { fallback = true; break; }
                const uint4 own = ((const uint4*)bm)[t];
                const int nb = __popc(own.x) + __popc(own.y) + __popc(own.z) + __popc(own.w);
                int ef, ebits, tf, tbits;
                sp3_scan2<T>(nf, nb, s_wt[ph], ef, ebits, tf, tbits, s_intra, s_wex);
                ph ^= 1;
                const u64 nxt = s_min[1 + (it & 1)];
                if (t == 0) s_min[1 + ((it + 1) & 1)] = SP_KEY_MAX;  // the next window's
                const int base = taken + (it == 0 ? tf : 0);  // windows rank after free ones
                int lf = ef;  // this thread's next free rank (first pass only)
                for (int c = 0; c < ept; c += 8) {
                    const int eb = t * ept + c;
                    if (eb >= wsp) break;
                    u64 pw;
                    i64 sv[8];
                    sp3_load8(prot, sst, eb, pw, sv);
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        if ((pw >> (8 * q)) & 0xffu) continue;
                        const i64 s = sv[q];
                        if (s == -1) {
                            if (it == 0) {
                                if (lf < k) order[lf] = eb + q;
                                ++lf;
                            }
                            continue;
                        }
                        if (s < 0 || (u64)s < m) continue;
                        const u64 b = (u64)s - m;
                        if (b >= w) continue;
                        const int wi = (int)(b >> 5);
                        const int owner = wi >> 2, j = wi & 3;
                        const uint4 O = ((const uint4*)bm)[owner];
                        const u32 part = (1u << (b & 31)) - 1u;
                        int rank = base + s_intra[owner] + s_wex[warp * 32 + (owner >> 5)];
                        rank += j > 0 ? __popc(O.x) : __popc(O.x & part);
                        if (j >= 1) rank += j > 1 ? __popc(O.y) : __popc(O.y & part);
                        if (j >= 2) rank += j > 2 ? __popc(O.z) : __popc(O.z & part);
                        if (j >= 3) rank += __popc(O.w & part);
                        if (rank < k) order[rank] = eb + q;
                    }
                }
                taken = base + tbits;
                m = nxt;
                __syncthreads();  // the order is written; the bitmap may be cleared
                if (taken >= k || m == SP_KEY_MAX) break;
                if (!win || it + 1 >= maxw) { fallback = true; break; }
                ((uint4*)bm)[t] = make_uint4(0u, 0u, 0u, 0u);
                __syncthreads();
            }
            if (fallback)
                sp3_sorted_order(k, wsu, (i64)P, sst, prot, order,
                                 (u64*)keys_ptr + r * (i64)P);
        }
        // 3. (contiguous slots) misses move in (the evicted unit from shared memory), every
        // resolved unit is stamped, first slots mapped; first[] restored
        const i64 tbase = tick * (i64)wsu;
        for (int s0 = 0; s0 < nsp; s0 += ROUND) {
            const int sb = s0 + SP3_SI * t;
            if (sb >= nsp) continue;
            const int4 cv = *(const int4*)(cls + sb);
            const int4 uv = *(const int4*)(uu + sb);
            int c[SP3_SI] = {cv.x, cv.y, cv.z, cv.w};
            const int u[SP3_SI] = {uv.x, uv.y, uv.z, uv.w};
#pragma unroll
            for (int q = 0; q < SP3_SI; ++q) {
                const int s = sb + q;
                if (!HASH && u[q] >= 0) first[u[q]] = 0x7fffffff;
                if (c[q] >= SP3_DUP) continue;
                int e = c[q];
                if (c[q] <= -3) {
                    const int i = -3 - c[q];
                    e = order[i];
                    if (e >= 0) {
                        const int old = rs[e];
                        if (old >= 0) entry_of[old] = -1;
                        resident[e] = u[q];
                        entry_of[u[q]] = e;
                    }
                    miss_unit[i] = u[q];
                    miss_entry[i] = e;
                }
                if (e >= 0) stamp[e] = tbase + s;
                if (s < ns) emap[s] = e;
                c[q] = e;
            }
            *(int4*)(cls + sb) = make_int4(c[0], c[1], c[2], c[3]);
        }
        __syncthreads();  // first slots' entries are final in cls
        // 4. repeated slots take their first slot's entry
        for (int s0 = 0; s0 < nsp; s0 += ROUND) {
            const int sb = s0 + SP3_SI * t;
            if (sb >= nsp) continue;
            const int4 cv = *(const int4*)(cls + sb);
            const int c[SP3_SI] = {cv.x, cv.y, cv.z, cv.w};
#pragma unroll
            for (int q = 0; q < SP3_SI; ++q)
                if (c[q] >= SP3_DUP && sb + q < ns) emap[sb + q] = cls[c[q] - SP3_DUP];
        }
        if (HASH)  // the order was last read before the barrier above: the next row's hash
            for (int i = t; i < (1 << hb); i += T) { hk[i] = -1; hv[i] = 0x7fffffff; }
        if (t == 0) {
            ((i64*)tick_ptr)[L] = tick + 1;
            ((int*)mc_ptr)[r] = k;
            if (sel) {
                ((i64*)cnt_ptr)[2 * r] += hits;
                ((i64*)cnt_ptr)[2 * r + 1] += k;
            }
            s_min[0] = s_min[1] = s_min[2] = SP_KEY_MAX;
        }
        __syncthreads();
    }
}

#define SP3_KERNEL(V, H, T, B)                                                              \
extern "C" __global__ void __launch_bounds__(T, B)                                          \
kvcm_sparse_resolve_##V##_##T(u64 rows, u64 ns, u64 wsu, u64 P, u64 max_units, u64 ut,        \
                           u64 lease_ptr, u64 marks_ptr, u64 resident_ptr, u64 stamp_ptr,   \
                           u64 tick_ptr, u64 entry_of_ptr, u64 first_ptr, u64 sel_ptr,      \
                           u64 map_ptr, u64 mu_ptr, u64 me_ptr, u64 mc_ptr, u64 cnt_ptr,    \
                           u64 keys_ptr, u64 window, u64 max_windows) {                     \
    sp3_resolve<T, H>(rows, ns, wsu, P, max_units, ut, lease_ptr, marks_ptr, resident_ptr,     \
                   stamp_ptr, tick_ptr, entry_of_ptr, first_ptr, sel_ptr, map_ptr, mu_ptr,  \
                   me_ptr, mc_ptr, cnt_ptr, keys_ptr, window, max_windows);                 \
}
SP3_KERNEL(v3, false, 256, 2)
SP3_KERNEL(v3, false, 512, 2)
SP3_KERNEL(v3, false, 1024, 1)
SP3_KERNEL(v4, true, 256, 2)
SP3_KERNEL(v4, true, 512, 2)
SP3_KERNEL(v4, true, 1024, 1)
"""
