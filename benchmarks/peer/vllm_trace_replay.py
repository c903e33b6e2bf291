#!/usr/bin/env python3
"""A Mooncake-format trace (format and token rule: benchmarks/README.md, "The trace format
and the token rule") through vLLM's own scheduler-side KV cache manager: prefix caching
on, one GPU pool of --gpu-tokens tokens, nothing else.

Each request, in file order: build the vLLM Request (which hashes its prompt's blocks),
get_computed_blocks, allocate_slots for the rest of the prompt, mark it computed, free it.
Prints the prefix hit rate and the host time per request and per block (everything above
included). Run it in the venv of benchmarks/peer/README.md beside kvcm's own replay of the same trace, in
one sitting, and compare medians of several runs.

usage: vllm_trace_replay.py TRACE [--limit N] [--block-size 64] [--gpu-tokens 3000000]
       [--reps 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import numpy as np

import vllm
import vllm_host_overhead as vh
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import RequestStatus

TRACE_BLOCK = 512


def trace_tokens(rec) -> list[int]:
    """The Mooncake token rule (the same as kvcm bench trace's)."""
    i = np.arange(TRACE_BLOCK, dtype=np.int64)
    ids = np.asarray(rec["hash_ids"], dtype=np.int64)[:, None]
    toks = ((ids * 7919 + i * 131) % 1_000_003 + 1).reshape(-1)
    return toks[: rec["input_length"]].tolist()


def replay(reqs, block_size, gpu_tokens, hash_fn):
    hasher = get_request_block_hasher(block_size, hash_fn)
    mgr = vh.make_manager(block_size, gpu_tokens // block_size, 1 << 21)
    prompts = [trace_tokens(r) for r in reqs]  # token synthesis is not timed
    gc.collect()
    hit = tot = 0
    t = 0
    for i, toks in enumerate(prompts):
        s = time.perf_counter_ns()
        req = vh.make_request(f"r{i}", toks, hasher)
        blocks, n_hit, _ = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.FINISHED_STOPPED
        mgr.free(req)
        t += time.perf_counter_ns() - s
        hit += n_hit
        tot += len(toks)
    return hit / tot, t / 1e3 / len(prompts), t / 1e3 / (tot / block_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=0, help="first N requests (0: all)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--gpu-tokens", type=int, default=3_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(args.trace) as f:
        reqs = [json.loads(line) for line in f]
    if args.limit:
        reqs = reqs[: args.limit]
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    runs = [replay(reqs, args.block_size, args.gpu_tokens, hash_fn) for _ in range(args.reps)]
    out = dict(
        peer=f"vllm {vllm.__version__}", python=platform.python_version(),
        trace=args.trace.rsplit("/", 1)[-1], requests=len(reqs),
        block_size=args.block_size, gpu_tokens=args.gpu_tokens, hit_rate=runs[0][0],
        us_per_request_median=statistics.median(r[1] for r in runs),
        us_per_request_min=min(r[1] for r in runs),
        us_per_block_median=statistics.median(r[2] for r in runs),
    )
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
