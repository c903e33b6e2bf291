"""Host-overhead benchmark of the manager (``kvcm bench manager``).

Replays the workload shapes of the vLLM peer benchmark
(``benchmarks/peer/vllm_host_overhead.py`` in the repository, which drives vLLM's KV cache
manager the same way) so the two can be compared side by side, in one sitting, on the same
machine:

- decode: ``--decode-batch`` running requests with ``--decode-context``-token contexts,
  one token per request-step: ``resize(capacity + 1)`` then ``commit([token])`` (the
  allocation and the block hashing/publishing vLLM splits into ``allocate_slots`` and
  appending the token), microseconds per request-step;
- prefill: ``--prefill-requests`` requests of ``--prefill-len`` tokens sharing a
  ``--prefix-len``-token prefix: ``create_kv_cache`` (lookup, hashing the matched blocks)
  + ``resume`` + ``resize``, microseconds per request and per matched block; the commit of
  the prompt (hashing and publishing the new blocks) is timed apart;
- lookup scaling: ``probe_reuse`` of a prompt matching ``--lookup-match`` blocks with 10k,
  100k and 1M other blocks cached, microseconds per matched block (tokens as a list and
  as an int32 array), beside the floor measured in the same run: the block-key rule alone
  (one running SHA-256 updated by each block, its digest, one dict lookup, on the same
  index, the blocks cut beforehand). Every size's manager is built first; the sizes and
  variants then take turns, one timed mean of 20 calls each per repetition (25 by
  default), after as many calls untimed; the flatness figures are the largest median over
  the sizes divided by the smallest (1 is flat).

The numpy backend is used (no device work is timed): this measures host overhead only.
Results are written as JSON with the machine, versions and date, to a new file
``host_overhead-YYYYmmdd-HHMMSS.json`` in ``--out`` (never over an existing one).
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    parse_with_quick,
    result_header,
    split_steps,
    write_result,
)
from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.console import int_at_least
from kvcm_core.errors import ConfigError
from kvcm_core.manager import KVCacheManager
from kvcm_core.radix import scope_root_key

VOCAB = 128_000
ns = time.perf_counter_ns


def make_manager(tpb: int, num_blocks: int, page_bytes: int = 16) -> KVCacheManager:
    """One full-attention layer with tiny pages: only bookkeeping is measured."""
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv",
                                                                        size=page_bytes)])],
        levels=[LevelConfig(tier="gpu", quota=num_blocks * page_bytes)],
        kernel_backend="numpy",
    )
    return KVCacheManager(cfg)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _too_few_slots(args: argparse.Namespace, part: str, lower: str) -> ConfigError:
    return ConfigError("--num-blocks", args.num_blocks,
                       f"too few GPU slots for the {part} part: raise it, or lower {lower}")


def run_decode(args: argparse.Namespace, tpb: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    batch, ctx, steps = args.decode_batch, args.decode_context, args.decode_steps
    m = make_manager(tpb, args.num_blocks)
    caches = []
    for i in range(batch):
        prompt = rand_tokens(rng, ctx)
        c = m.create_kv_cache(None, prompt[:-1], id=i)
        if not (c.resume() and c.resize(ctx)):
            raise _too_few_slots(args, "decode", "--decode-batch or --decode-context")
        c.commit(prompt[c.history_length:])
        caches.append(c)
    out = [[rng.randrange(VOCAB) for _ in range(batch)] for _ in range(steps)]
    gc.collect()
    gc.freeze()
    step_ns = []
    table_ns = []
    boundary = []
    for s in range(steps):
        toks = out[s]
        boundary.append(caches[0].capacity % tpb == 0)
        t0 = ns()
        for c, tok in zip(caches, toks, strict=True):
            if not c.resize(c.capacity + 1):
                raise _too_few_slots(args, "decode", "--decode-batch, --decode-context or "
                                                     "--decode-steps")
            c.commit((tok,))
        t1 = ns()
        for c in caches:
            c.get_base_page_indices(0)
        t2 = ns()
        step_ns.append(t1 - t0)
        table_ns.append(t2 - t1)
    blocks = [c.num_blocks for c in caches]
    free_ns = close_all(m, caches)
    gc.unfreeze()
    res = {
        **split_steps(step_ns, boundary, batch, "resize_commit_us_per_req_step"),
        "page_table_us_per_req_step": sum(table_ns) / (steps * batch) / 1e3,
        "close_us_per_request": sum(free_ns) / batch / 1e3,
        "close_us_per_block": sum(free_ns) / sum(blocks) / 1e3,
    }
    m.shutdown()
    return res


def close_all(m: KVCacheManager, caches: list[Any]) -> list[int]:
    """Close each cache, timed (ns each), then the work the closes deferred, timed as one
    more entry: a close queues its pages, and their insertion into the eviction policy
    runs at the next use of the queue (here: read at once), where vLLM's ``free`` does
    all of it in the call. Summed, the entries are the closes' whole cost."""
    out = []
    for c in caches:
        t0 = ns()
        c.close()
        out.append(ns() - t0)
    t0 = ns()
    for store in m.storage_levels.stores[0]:
        store.droppable  # noqa: B018 (the read inserts what the closes queued)
    out.append(ns() - t0)
    return out


def run_prefill(args: argparse.Namespace, tpb: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed + 1_000_003)
    n, length, prefix = args.prefill_requests, args.prefill_len, args.prefix_len
    m = make_manager(tpb, args.num_blocks)
    system = rand_tokens(rng, prefix)
    prompts = [system + rand_tokens(rng, length - prefix) for _ in range(n)]
    gc.collect()
    gc.freeze()
    create_ns, alloc_ns, commit_ns, hits = [], [], [], []
    caches = []
    for i, p in enumerate(prompts):
        t0 = ns()
        c = m.create_kv_cache(None, p, id=i)
        t1 = ns()
        if not (c.resume() and c.resize(length)):
            raise _too_few_slots(args, "prefill", "--prefill-requests or --prefill-len")
        t2 = ns()
        c.commit(p[c.history_length:])
        t3 = ns()
        create_ns.append(t1 - t0)
        alloc_ns.append(t2 - t1)
        commit_ns.append(t3 - t2)
        hits.append(c.stats.reused_blocks)
        caches.append(c)
    blocks = [c.num_blocks for c in caches]
    free_ns = close_all(m, caches)
    gc.unfreeze()
    warm = [i for i, h in enumerate(hits) if h > 0]
    expect = prefix // tpb
    # A warm request reuses the shared prefix's full blocks, and now and then one partial
    # block more (its first suffix token equals another request's): count full blocks.
    if len(warm) != n - 1 or any(not expect <= hits[i] <= expect + 1 for i in warm):
        raise RuntimeError(f"unexpected hits {sorted(set(hits))[:6]} (expected {expect})")
    matched = expect * len(warm)
    wsum = lambda xs: sum(xs[i] for i in warm)  # noqa: E731
    res = {
        "matched_blocks_per_warm_request": expect,
        "create_us_per_request": wsum(create_ns) / len(warm) / 1e3,
        "resume_resize_us_per_request": wsum(alloc_ns) / len(warm) / 1e3,
        "total_us_per_request": (wsum(create_ns) + wsum(alloc_ns)) / len(warm) / 1e3,
        # The whole cycle (hashing, lookup, allocation, publishing the new blocks): what
        # the peer's cycle_us_per_request times (its allocate_slots publishes them).
        "cycle_us_per_request": (wsum(create_ns) + wsum(alloc_ns) + wsum(commit_ns))
        / len(warm) / 1e3,
        "lookup_us_per_matched_block": wsum(create_ns) / matched / 1e3,
        # The median request: without the garbage-collector pauses a mean carries.
        "lookup_us_per_matched_block_median_request":
            statistics.median(create_ns[i] for i in warm) / expect / 1e3,
        "total_us_per_matched_block": (wsum(create_ns) + wsum(alloc_ns)) / matched / 1e3,
        "commit_us_per_new_block": wsum(commit_ns) / (len(warm) * (length - prefix) // tpb) / 1e3,
        "close_us_per_request": sum(free_ns) / n / 1e3,
        "close_us_per_block": sum(free_ns) / sum(blocks) / 1e3,
    }
    m.shutdown()
    return res


def fill_cache(m: KVCacheManager, rng: random.Random, blocks: int, tpb: int,
               per_prompt: int = 256) -> int:
    """Cache ``blocks`` distinct full blocks in ``m``: random prompts of ``per_prompt``
    blocks, each created, resumed, grown, committed and closed. Returns the prompts made."""
    filled = i = 0
    while filled < blocks:
        nblk = min(per_prompt, blocks - filled)
        p = rand_tokens(rng, nblk * tpb)
        c = m.create_kv_cache(None, p, id=("f", i))
        c.resume()
        c.resize(len(p))
        c.commit(p[c.history_length:])
        c.close()
        filled += nblk
        i += 1
    return i


def run_lookup_scaling(args: argparse.Namespace, tpb: int, seed: int) -> dict[str, Any]:
    """probe_reuse cost per matched block with N other blocks cached. Every size's manager
    is built first; then the sizes and the variants take turns, one timed mean each per
    repetition (see :func:`_timed`), so that a slow stretch of the machine lands on every
    size alike rather than on whichever size was being timed then (the flatness figure
    compares the sizes)."""
    rng = random.Random(seed + 7)
    out: dict[str, Any] = {}
    match_blocks = args.lookup_match
    per_prompt = 256  # blocks per filler prompt
    built = []
    for cached in args.lookup_sizes:
        m = make_manager(tpb, cached + 4 * match_blocks + per_prompt, page_bytes=4)
        fill_cache(m, rng, cached, tpb, per_prompt)
        target = rand_tokens(rng, match_blocks * tpb)
        c = m.create_kv_cache(None, target, id="t")
        c.resume()
        c.resize(len(target))
        c.commit(target[c.history_length:])
        c.close()
        probe = target + rand_tokens(rng, tpb)
        probe_arr = np.asarray(probe, dtype=np.int32)
        # The floor of any lookup by this key rule in CPython: one running SHA-256 updated
        # by each block, its digest and one dict lookup per block, on the same index,
        # nothing else (the blocks are cut beforehand).
        blocks = np.frombuffer(probe_arr.tobytes(), dtype=f"V{4 * tpb}").tolist()
        # Tokens as a list; as an int32 array (what engines usually hold: no per-token
        # conversion from Python ints); the floor.
        built.append((cached, m, probe, probe_arr, blocks))
    gc.collect()
    gc.freeze()
    calls = []
    for _, m, probe, probe_arr, blocks in built:
        calls += [functools.partial(m.probe_reuse, None, probe),
                  functools.partial(m.probe_reuse, None, probe_arr),
                  functools.partial(_bare_walk, m.tree.index, blocks)]
    times = _timed(args.lookup_reps, tuple(calls))
    gc.unfreeze()
    for k, (cached, m, probe, probe_arr, blocks) in enumerate(built):
        reps, reps_arr, reps_bare = times[3 * k : 3 * k + 3]
        got = m.probe_reuse(None, probe)
        got_arr = m.probe_reuse(None, probe_arr)
        found = _bare_walk(m.tree.index, blocks)
        if found != match_blocks:
            raise RuntimeError(f"bare walk matched {found} blocks, expected {match_blocks}")
        if got != match_blocks * tpb or got_arr != got:
            raise RuntimeError(f"probe matched {got}/{got_arr}, expected {match_blocks * tpb}")
        row = out[str(cached)] = {
            "cached_blocks": m.tree.num_nodes,
            "us_per_matched_block_min": min(reps) / match_blocks / 1e3,
            "us_per_matched_block_median": statistics.median(reps) / match_blocks / 1e3,
            "int32_array_us_per_matched_block_median":
                statistics.median(reps_arr) / match_blocks / 1e3,
            "bare_us_per_matched_block_median":
                statistics.median(reps_bare) / match_blocks / 1e3,
        }
        row["int32_array_ratio_to_bare"] = (row["int32_array_us_per_matched_block_median"]
                                            / row["bare_us_per_matched_block_median"])
        m.shutdown()
    del built, calls
    gc.collect()
    sizes = [str(s) for s in args.lookup_sizes]
    if len(sizes) > 1:
        # Flatness: the largest median over the sizes divided by the smallest (>= 1; 1 is
        # flat), whichever sizes they fall at.
        for name, field in (("ratio_largest_to_smallest_median", "us_per_matched_block_median"),
                            ("int32_array_ratio_largest_to_smallest_median",
                             "int32_array_us_per_matched_block_median"),
                            ("bare_ratio_largest_to_smallest_median",
                             "bare_us_per_matched_block_median")):
            medians = [out[s][field] for s in sizes]
            out[name] = max(medians) / min(medians)
    return out


def _timed(reps: int, calls: tuple[Any, ...], inner: int = 20) -> list[list[float]]:
    """Nanoseconds per call of each of ``calls``, the mean of ``inner`` calls, ``reps``
    times, after the same number of calls untimed (the first size was otherwise timed
    cold: about twice as slow, the bare floor too, in the 2026-12-04 sitting). The calls
    take turns, one timed mean each per repetition, so that a burst of load on the
    machine (a few milliseconds to a few seconds, here) lands on every call alike and on
    a part of the repetitions only."""
    for _ in range(reps * inner):
        for call in calls:
            call()
    out: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for call, times in zip(calls, out, strict=True):
            t0 = ns()
            for _ in range(inner):
                call()
            times.append((ns() - t0) / inner)
    return out


def _bare_walk(index: dict[bytes, int], blocks: list[bytes]) -> int:
    """Blocks (4-byte tokens each, cut beforehand) found by keying them with the default
    scope's running prefix hash and looking each key up in ``index``: the lookup with
    nothing but the key rule and the dict."""
    h = hashlib.sha256(scope_root_key(None))
    update = h.update
    digest = h.digest
    get = index.get
    n = 0
    for block in blocks:
        update(block)
        if get(digest()) is None:
            break
        n += 1
    return n


def _agg(runs: list[dict[str, float]], fn: Any) -> dict[str, float]:
    return {k: fn([r[k] for r in runs]) for k in runs[0]}


#: What ``--quick`` changes: a run of a few seconds.
QUICK = {"block_sizes": [16], "num_blocks": 16384, "decode_batch": 32, "decode_context": 512,
         "decode_steps": 16, "prefill_requests": 64, "prefill_len": 1024, "prefix_len": 512,
         "lookup_sizes": [1_000, 10_000], "lookup_reps": 2, "reps": 1, "warmup": 0}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcm bench manager", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--block-sizes", type=int_at_least(1), nargs="+", default=[16, 32],
                    help="tokens per block; each size is measured in turn")
    ap.add_argument("--num-blocks", type=int_at_least(1), default=131072,
                    help="GPU slots of the decode and prefill managers (too few: an error "
                         "naming the part they ran out in)")
    ap.add_argument("--decode-batch", type=int_at_least(1), default=256,
                    help="requests running in each decode step")
    ap.add_argument("--decode-context", type=int_at_least(1), default=2048,
                    help="tokens of each decoding request's context")
    ap.add_argument("--decode-steps", type=int_at_least(1), default=128, help="decode steps timed")
    ap.add_argument("--prefill-requests", type=int_at_least(2), default=512,
                    help="requests of the prefill (prefix reuse) part, at least 2 (the "
                         "first one warms the cache)")
    ap.add_argument("--prefill-len", type=int_at_least(2), default=4096,
                    help="prompt tokens of each prefill request")
    ap.add_argument("--prefix-len", type=int_at_least(1), default=2048,
                    help="tokens every prefill prompt shares: at least the largest block "
                         "size, and a block less than --prefill-len")
    ap.add_argument("--lookup-sizes", type=int_at_least(1), nargs="+",
                    default=[10_000, 100_000, 1_000_000],
                    help="other blocks cached while timing probe_reuse (one run per size)")
    ap.add_argument("--lookup-match", type=int_at_least(1), default=64,
                    help="blocks the probed prompt matches")
    ap.add_argument("--lookup-reps", type=int_at_least(1), default=25,
                    help="repetitions of each lookup")
    ap.add_argument("--reps", type=int_at_least(1), default=5,
                    help="timed repetitions of decode+prefill")
    ap.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed repetitions first")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token generator")
    ap.add_argument("--cpu", type=int_at_least(-2), default=-1,
                    help="pin to this CPU, one this process may run on (-1: the last "
                         "one; -2: no pinning)")
    add_output_options(ap, "block size 16, 16384 slots, 32 x 512-token decode for 16 "
                           "steps, 64 prefill requests, lookups over 1k and 10k blocks, "
                           "one repetition and no warmup")
    return ap


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, lengths and a CPU the benchmark cannot run with (exit 2)."""
    tpb = max(args.block_sizes)
    if args.prefix_len < tpb or args.prefill_len - args.prefix_len < tpb:
        parser.error(f"--prefix-len {args.prefix_len} with --prefill-len {args.prefill_len}: "
                     f"the shared prefix and the rest of each prompt must each hold a block "
                     f"of the largest block size ({tpb} tokens)")
    if args.cpu >= 0 and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        if args.cpu not in cpus:
            parser.error(f"argument --cpu: {args.cpu}: not a CPU this process may run on "
                         f"({', '.join(map(str, cpus))}; -1: the last one; -2: no pinning)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parse_with_quick(parser, argv, QUICK)
    _check(parser, args)
    pinned = None
    if args.cpu != -2 and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        pinned = cpus[-1] if args.cpu == -1 else args.cpu
        os.sched_setaffinity(0, {pinned})
    results: dict[str, Any] = {}
    for tpb in args.block_sizes:
        dec, pre = [], []
        for rep in range(args.warmup + args.reps):
            d = run_decode(args, tpb, args.seed + rep)
            p = run_prefill(args, tpb, args.seed + rep)
            tag = "warmup" if rep < args.warmup else f"rep{rep - args.warmup}"
            print(f"tpb={tpb} {tag}: decode {d['resize_commit_us_per_req_step']:.3f} "
                  f"us/req-step, prefill lookup {p['lookup_us_per_matched_block']:.3f} "
                  f"us/matched block, {p['total_us_per_request']:.1f} us/req, cycle "
                  f"{p['cycle_us_per_request']:.1f} us/req", flush=True)
            if rep >= args.warmup:
                dec.append(d)
                pre.append(p)
        results[f"block_size_{tpb}"] = {
            "decode": {"median": _agg(dec, statistics.median), "min": _agg(dec, min),
                       "runs": dec},
            "prefill_prefix_reuse": {"median": _agg(pre, statistics.median),
                                     "min": _agg(pre, min), "runs": pre},
        }
    tpb0 = args.block_sizes[0]
    results["lookup_scaling"] = {"block_size": tpb0,
                                 **run_lookup_scaling(args, tpb0, args.seed)}
    print("lookup scaling:", json.dumps(results["lookup_scaling"], indent=1), flush=True)
    doc = {
        **result_header("kvcm KVCacheManager host (CPU) overhead, numpy backend, workload "
                        "shapes of the vLLM peer benchmark benchmarks/peer/vllm_host_overhead.py"),
        "pinned_cpu": pinned,
        "config": vars(args),
        "timer": "time.perf_counter_ns; median and min over reps of per-rep means; gc frozen "
                 "after setup",
        "results": results,
    }
    write_result(doc, args.out, "host_overhead", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
