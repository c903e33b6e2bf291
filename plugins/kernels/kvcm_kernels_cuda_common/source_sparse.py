"""CUDA C of the sparse-attention kernels (resolve / pin, and unit copies for fetch and
flush), compiled with :mod:`.source` into one module (it uses ``copy_span`` from there).

The rules are :mod:`kvcm_core.sparse.reference`'s; the kernels must give its bytes.
"""

from __future__ import annotations

__all__ = [
    "SPARSE_COPY_DESC_WORDS",
    "SPARSE_KERNEL_NAMES",
    "SPARSE_RESOLVE_THREADS",
    "SPARSE_SHARED_LIMIT",
    "SPARSE_SOURCE",
]

#: Working sets up to this many entries sort their eviction keys (v1, 64 KiB of keys) or keep
#: their stamps (v2) in shared memory; larger ones use global memory (the scratch
#: ``SparseResolve.keys``, the state tables).
SPARSE_SHARED_LIMIT = 8192
#: Threads of one resolve block (one block per row; two blocks share an SM).
SPARSE_RESOLVE_THREADS = 512
#: int64 words of one buffer's copy descriptor (``SparseCells`` below).
SPARSE_COPY_DESC_WORDS = 8

SPARSE_KERNEL_NAMES = ("kvcm_sparse_resolve", "kvcm_sparse_copy")

SPARSE_SOURCE = r"""
// ---- sparse attention ------------------------------------------------------------------

#define SP_KEY_MAX 0xffffffffffffffffULL
#define SP_ENTRY_BITS 24

// The unit of slot s (-1: unused). Pin mode (sel == 0): in-flight unit lo + s below hi.
__device__ __forceinline__ i64 sp_unit(const int* sel, i64 s, i64 lo, i64 hi, i64 max_units) {
    if (sel == 0) {
        const i64 u = lo + s;
        return (u < hi && u < max_units) ? u : -1;
    }
    const i64 u = sel[s];
    return (u >= 0 && u < max_units) ? u : -1;
}

// Slots are taken in rounds of SP_PER * blockDim.x: slot s0 + q * T + t is thread t's q-th
// slot of the round at s0, so slot order is (round, q, warp, lane). Each thread keeps its
// round's units, first slots and entries in registers and issues their loads together.
#define SP_PER 4
#define SP_KPT 8  // keys a thread holds in the register sort
#define SP_FULL 0xffffffffu

struct SpRound {
    int u[SP_PER];  // unit of the slot, -1: unused
    int e[SP_PER];  // entry of a first slot's unit, -1: a miss; -2: not a first slot
};

// The units, first-slot test and entries of a thread's slots in the round at s0.
__device__ __forceinline__ void sp_load_round(SpRound& R, const int* sel, i64 s0, i64 ns,
                                              i64 lo, i64 hi, i64 max_units, const int* first,
                                              const int* entry_of) {
    const i64 T = blockDim.x, t = threadIdx.x;
#pragma unroll
    for (int q = 0; q < SP_PER; ++q) {
        const i64 s = s0 + q * T + t;
        R.u[q] = s < ns ? (int)sp_unit(sel, s, lo, hi, max_units) : -1;
    }
    int f[SP_PER];
#pragma unroll
    for (int q = 0; q < SP_PER; ++q) f[q] = R.u[q] >= 0 ? first[R.u[q]] : -1;
#pragma unroll
    for (int q = 0; q < SP_PER; ++q) {
        const i64 s = s0 + q * T + t;
        R.e[q] = (R.u[q] >= 0 && f[q] == (int)s) ? entry_of[R.u[q]] : -2;
    }
}

// Bitonic sort of P keys (a power of two), one compare-exchange per pair and stage, every
// stage through memory: for P larger than the block holds in registers.
__device__ void sp_sort_pairs(u64* keys, i64 P) {
    const i64 T = blockDim.x, t = threadIdx.x;
    for (i64 k = 2; k <= P; k <<= 1) {
        for (i64 j = k >> 1; j > 0; j >>= 1) {
            for (i64 p = t; p < P / 2; p += T) {
                const i64 i = ((p & ~(j - 1)) << 1) | (p & (j - 1));
                const i64 ixj = i | j;
                const u64 a = keys[i], b = keys[ixj];
                if ((a > b) == ((i & k) == 0)) { keys[i] = b; keys[ixj] = a; }
            }
            __syncthreads();
        }
    }
}

// Compare-exchange: a gets the smaller key when up, the larger one otherwise.
__device__ __forceinline__ void sp_cx(u64& a, u64& b, bool up) {
    if ((a > b) == up) { const u64 c = a; a = b; b = c; }
}

// A stage whose pairs are in one thread (J = 1, 2, 4): constant register indices.
template <int J>
__device__ __forceinline__ void sp_stage_in(u64 (&x)[SP_KPT], i64 t, i64 k) {
#pragma unroll
    for (int m = 0; m < SP_KPT; ++m) {
        if ((m & J) == 0) sp_cx(x[m], x[m | J], ((SP_KPT * t + m) & k) == 0);
    }
}

// The same network with thread t holding keys SP_KPT * t .. SP_KPT * t + 7 in registers
// (threads t < P / SP_KPT, whole warps: 256 <= P <= SP_KPT * blockDim.x): partners 1 to 4
// apart are in the thread, 8 to 128 apart in the warp (shuffles), 256 and more apart in
// other warps (through memory). Element x of a pair keeps the smaller key when its bit j
// is clear and the stage ascends there ((x & k) == 0), or when both are set.
__device__ void sp_sort_registers(u64* keys, i64 P) {
    const i64 t = threadIdx.x;
    const bool on = SP_KPT * t < P;
    u64 x[SP_KPT];
#pragma unroll
    for (int m = 0; m < SP_KPT; ++m) x[m] = on ? keys[SP_KPT * t + m] : 0;
    for (i64 k = 2; k <= P; k <<= 1) {
        for (i64 j = k >> 1; j > 0; j >>= 1) {
            if (j >= 32 * SP_KPT) {
                __syncthreads();  // every key of the last stage was read
                if (on) {
#pragma unroll
                    for (int m = 0; m < SP_KPT; ++m) keys[SP_KPT * t + m] = x[m];
                }
                __syncthreads();
                if (on) {
#pragma unroll
                    for (int m = 0; m < SP_KPT; ++m) {
                        const i64 i = SP_KPT * t + m;
                        const u64 y = keys[i ^ j];
                        const bool keep_min = ((i & j) == 0) == ((i & k) == 0);
                        x[m] = keep_min ? (x[m] < y ? x[m] : y) : (x[m] > y ? x[m] : y);
                    }
                }
            } else if (j >= SP_KPT) {
                if (on) {
#pragma unroll
                    for (int m = 0; m < SP_KPT; ++m) {
                        const i64 i = SP_KPT * t + m;
                        const u64 y = __shfl_xor_sync(SP_FULL, x[m], (int)(j / SP_KPT));
                        const bool keep_min = ((i & j) == 0) == ((i & k) == 0);
                        x[m] = keep_min ? (x[m] < y ? x[m] : y) : (x[m] > y ? x[m] : y);
                    }
                }
            } else if (on) {
                if (j == 4) sp_stage_in<4>(x, t, k);
                else if (j == 2) sp_stage_in<2>(x, t, k);
                else sp_stage_in<1>(x, t, k);
            }
        }
    }
    __syncthreads();  // every key of the last memory stage was read
    if (on) {
#pragma unroll
        for (int m = 0; m < SP_KPT; ++m) keys[SP_KPT * t + m] = x[m];
    }
    __syncthreads();
}

// One block per row (grid-strided; blockDim.x a multiple of 32, at most 512: two blocks
// share an SM). Per row:
// dedup (first slot per unit, atomicMin on first[]), hits protect their entries, misses in
// slot order take the entries of the ascending eviction keys ((stamp + 1) << 24 | entry;
// protected: max), sorted bitonically in shared memory (use_shared) or in the row's
// global scratch. A miss's rank in slot order comes from warp ballots and a scan of the
// per-warp counts.
extern "C" __global__ void __launch_bounds__(512, 2)
kvcm_sparse_resolve(u64 rows, u64 ns, u64 wsu, u64 P, u64 max_units, u64 ut, u64 lease_ptr,
                    u64 marks_ptr, u64 resident_ptr, u64 stamp_ptr, u64 tick_ptr,
                    u64 entry_of_ptr, u64 first_ptr, u64 sel_ptr, u64 map_ptr, u64 mu_ptr,
                    u64 me_ptr, u64 mc_ptr, u64 cnt_ptr, u64 keys_ptr, u64 use_shared) {
    extern __shared__ u64 sp_smem[];
    __shared__ int sp_off[SP_PER * 32];  // misses per (q, warp), then their exclusive prefix
    __shared__ int sp_tot[3];            // hits, misses, misses of the current round
    const int* lease_of = (const int*)lease_ptr;
    const i64 T = blockDim.x, t = threadIdx.x;
    const int lane = (int)(t & 31), warp = (int)(t >> 5), nwarps = (int)((T + 31) >> 5);
    const i64 round = SP_PER * T;
    for (i64 r = blockIdx.x; r < (i64)rows; r += gridDim.x) {
        const int L = lease_of[r];
        int* emap = (int*)map_ptr + r * (i64)ns;
        if (L < 0) {
            for (i64 s = t; s < (i64)ns; s += T) emap[s] = -1;
            if (t == 0) ((int*)mc_ptr)[r] = 0;
            continue;
        }
        const int* marks = (const int*)marks_ptr + 2 * (i64)L;
        const i64 lo = (i64)marks[0] / (i64)ut;
        // in-flight units [lo, hi): those holding a token of [history, capacity)
        const i64 hi = marks[1] > marks[0] ? ((i64)marks[1] + (i64)ut - 1) / (i64)ut : lo;
        int* resident = (int*)resident_ptr + (i64)L * wsu;
        i64* stamp = (i64*)stamp_ptr + (i64)L * wsu;
        int* entry_of = (int*)entry_of_ptr + (i64)L * max_units;
        int* first = (int*)first_ptr + (i64)L * max_units;
        const int* sel = sel_ptr ? (const int*)sel_ptr + r * (i64)ns : 0;
        u64* keys = use_shared ? sp_smem : (u64*)keys_ptr + r * (i64)P;
        const i64 tick = ((const i64*)tick_ptr)[L];
        if (t == 0) { sp_tot[0] = 0; sp_tot[1] = 0; }
        // 1. eviction keys (pinned entries and the padding: max); first slot of each unit
        for (i64 e0 = 0; e0 < (i64)P; e0 += SP_PER * T) {
            int v[SP_PER];
            i64 st[SP_PER];
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const i64 e = e0 + q * T + t;
                v[q] = e < (i64)wsu ? resident[e] : 0;
                st[q] = e < (i64)wsu ? stamp[e] : 0;
            }
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const i64 e = e0 + q * T + t;
                if (e < (i64)P)
                    keys[e] = (e >= (i64)wsu || (v[q] >= lo && v[q] < hi)) ? SP_KEY_MAX
                              : (((u64)(st[q] + 1) << SP_ENTRY_BITS) | (u64)e);
            }
        }
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const i64 s = s0 + q * T + t;
                const i64 u = s < (i64)ns ? sp_unit(sel, s, lo, hi, max_units) : -1;
                if (u >= 0) atomicMin(first + u, (int)s);
            }
        }
        __syncthreads();
        // 2. hits protect their entries; the row's hits and misses
        int my_hits = 0, my_misses = 0;
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            SpRound R;
            sp_load_round(R, sel, s0, ns, lo, hi, max_units, first, entry_of);
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                if (R.e[q] >= 0) { keys[R.e[q]] = SP_KEY_MAX; ++my_hits; }
                else if (R.e[q] == -1) ++my_misses;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            my_hits += __shfl_down_sync(SP_FULL, my_hits, off);
            my_misses += __shfl_down_sync(SP_FULL, my_misses, off);
        }
        if (lane == 0) { atomicAdd(&sp_tot[0], my_hits); atomicAdd(&sp_tot[1], my_misses); }
        __syncthreads();
        // 3. ascending keys (bitonic; P a power of two, at least 256), when a miss needs
        // one (a pin whose in-flight units are all held already, most decode steps, skips
        // it; the condition is the same for the whole block)
        if (sp_tot[1] > 0) {
            if ((i64)P <= SP_KPT * T) sp_sort_registers(keys, (i64)P);
            else sp_sort_pairs(keys, (i64)P);
        }
        // 4. misses, in slot order, take the entries of the smallest keys; every resolved
        // unit is stamped. (A unit's classification cannot change under another thread: an
        // evicted entry held no selected unit, and only a unit's first slot inserts it.)
        int carry = 0;
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            SpRound R;
            sp_load_round(R, sel, s0, ns, lo, hi, max_units, first, entry_of);
            int rank[SP_PER];
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const unsigned bal = __ballot_sync(SP_FULL, R.e[q] == -1);
                if (lane == 0) sp_off[q * nwarps + warp] = __popc(bal);
                rank[q] = __popc(bal & ((1u << lane) - 1u));
            }
            __syncthreads();
            if (warp == 0) {  // exclusive prefix over (q, warp), up to 4 counts a lane
                int c[4], sum = 0;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const int idx = lane * 4 + m;
                    c[m] = idx < SP_PER * nwarps ? sp_off[idx] : 0;
                    sum += c[m];
                }
                int inc = sum;
                for (int off = 1; off < 32; off <<= 1) {
                    const int y = __shfl_up_sync(SP_FULL, inc, off);
                    if (lane >= off) inc += y;
                }
                int run = inc - sum;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const int idx = lane * 4 + m;
                    if (idx < SP_PER * nwarps) sp_off[idx] = run;
                    run += c[m];
                }
                if (lane == 31) sp_tot[2] = inc;
            }
            __syncthreads();
            int k[SP_PER], old[SP_PER];
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                k[q] = carry + sp_off[q * nwarps + warp] + rank[q];
                if (R.e[q] == -1) {
                    const u64 key = keys[k[q]];
                    R.e[q] = key == SP_KEY_MAX ? -3
                             : (int)(key & ((1ULL << SP_ENTRY_BITS) - 1));
                    k[q] = -1 - k[q];  // marks a miss (its rank is -1 - k)
                }
            }
#pragma unroll
            for (int q = 0; q < SP_PER; ++q)
                old[q] = (k[q] < 0 && R.e[q] >= 0) ? resident[R.e[q]] : -1;
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const i64 s = s0 + q * T + t;
                const int e = R.e[q] == -3 ? -1 : R.e[q];
                if (k[q] < 0) {
                    const int kk = -1 - k[q];
                    if (e >= 0) {
                        if (old[q] >= 0) entry_of[old[q]] = -1;
                        resident[e] = R.u[q];
                        entry_of[R.u[q]] = e;
                    }
                    ((int*)mu_ptr)[r * (i64)ns + kk] = R.u[q];
                    ((int*)me_ptr)[r * (i64)ns + kk] = e;
                }
                if (e >= 0) stamp[e] = tick * (i64)wsu + s;
            }
            carry += sp_tot[2];
            __syncthreads();  // sp_off and sp_tot[2] are rewritten by the next round
        }
        // 5. the entry map; first[] back to INT32_MAX (no one reads it any more)
        for (i64 s0 = 0; s0 < (i64)ns; s0 += round) {
            int u[SP_PER], ent[SP_PER];
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const i64 s = s0 + q * T + t;
                u[q] = s < (i64)ns ? (int)sp_unit(sel, s, lo, hi, max_units) : -1;
            }
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) ent[q] = u[q] >= 0 ? entry_of[u[q]] : -1;
#pragma unroll
            for (int q = 0; q < SP_PER; ++q) {
                const i64 s = s0 + q * T + t;
                if (s < (i64)ns) emap[s] = ent[q];
                if (u[q] >= 0) first[u[q]] = 0x7fffffff;
            }
        }
        if (t == 0) {
            ((i64*)tick_ptr)[L] = tick + 1;
            ((int*)mc_ptr)[r] = sp_tot[1];
            if (sel) {
                ((i64*)cnt_ptr)[2 * r] += sp_tot[0];
                ((i64*)cnt_ptr)[2 * r + 1] += sp_tot[1];
            }
        }
        __syncthreads();
    }
}

// One sparse buffer: host pages (base with the buffer's offset, slot stride) and its
// arena cells (base with the buffer's first cell, cell stride).
struct SparseCells {
    i64 host, host_stride, cells, cell_stride, unit_bytes, upp, lease_cells, pad;
};

// Fetch (flush == 0): the units of each row's miss list, host page to cell. Flush: units
// [ranges[r].x, ranges[r].y) through entry_of, cell to host page. Grid: x strides over a
// row's units, y over rows, z over buffers; a block copies one unit at a time.
extern "C" __global__ void __launch_bounds__(1024)
kvcm_sparse_copy(u64 descs, u64 ndescs, u64 rows, u64 ns, u64 max_units, u64 row_elems,
                 u64 flush, u64 table_ptr, u64 lease_ptr, u64 mu_ptr, u64 me_ptr, u64 mc_ptr,
                 u64 entry_of_ptr, u64 ranges_ptr) {
    const SparseCells* D = (const SparseCells*)descs;
    const int* table = (const int*)table_ptr;
    for (i64 b = blockIdx.z; b < (i64)ndescs; b += gridDim.z) {
        const SparseCells c = D[b];
        for (i64 r = blockIdx.y; r < (i64)rows; r += gridDim.y) {
            const int L = ((const int*)lease_ptr)[r];
            if (L < 0) continue;
            i64 first = 0, count;
            if (flush) {
                const int2 rg = ((const int2*)ranges_ptr)[r];
                first = rg.x < 0 ? 0 : rg.x;
                const i64 end = (i64)rg.y < (i64)max_units ? (i64)rg.y : (i64)max_units;
                count = end - first;
            } else {
                count = ((const int*)mc_ptr)[r];
            }
            for (i64 k = blockIdx.x; k < count; k += gridDim.x) {
                i64 u, e;
                if (flush) {
                    u = first + k;
                    e = ((const int*)entry_of_ptr)[(i64)L * max_units + u];
                } else {
                    u = ((const int*)mu_ptr)[r * (i64)ns + k];
                    e = ((const int*)me_ptr)[r * (i64)ns + k];
                }
                if (e < 0 || u < 0) continue;
                const int slot = table[r * (i64)row_elems + u / c.upp];
                if (slot < 0) continue;
                char* h = (char*)(c.host + (i64)slot * c.host_stride + (u % c.upp) * c.unit_bytes);
                char* q = (char*)(c.cells + ((i64)L * c.lease_cells + e / c.upp) * c.cell_stride
                                  + (e % c.upp) * c.unit_bytes);
                if (flush) copy_span(h, q, c.unit_bytes);
                else copy_span(q, h, c.unit_bytes);
            }
        }
    }
}
"""
