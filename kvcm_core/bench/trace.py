"""Replay of a public serving trace through the manager (``kvcm bench trace FILE``).

Replays a Mooncake-format trace (see :mod:`kvcm_core.simulate.mooncake` for the format and
the token rule) one request after another, manager only, the way the peer benchmark
``benchmarks/peer/vllm_trace_replay.py`` (in the repository) replays it through vLLM's
scheduler-side KV cache manager (hashing, ``get_computed_blocks``, ``allocate_slots``,
``free``), so that the two can be compared side by side in one sitting:

- prompts only (no decode), in file order, each turned into int32 tokens by the token rule
  before the timed replay (token synthesis is not timed);
- per request, timed as a whole with ``time.perf_counter_ns``:
  ``cache = manager.create_kv_cache(None, prompt)`` (hash the prompt's blocks, walk the
  prefix tree, claim the matched pages), ``cache.resume()`` (bring them to the GPU level),
  ``cache.resize(len(prompt))`` (pages for the rest), ``cache.commit(prompt[reused:])``
  (hash and publish the new full blocks) and ``cache.close()`` (publish the trailing
  partial block, make the pages evictable);
- with ``--tail-hint`` (off by default, so that the replay stays like-for-like with the
  peer's), pages of blocks that reach past the prompt's last full 512-token trace block
  get eviction priority 0 through a ``priority_callback``: the trace names no token beyond
  its hash ids, so such a block can only be shared by a later prompt with the same id
  there (on this trace: almost never), and the LRU-512 reference never holds it. This is
  the knowledge an engine passes with the public priority callback;
- one full-attention layer with one 64-byte buffer per block, the ``numpy`` kernel
  backend (no device work: host overhead only), a GPU level of ``--gpu-tokens`` tokens and
  optionally a host and a disk level below it;
- ``--reps`` repetitions, each with a fresh manager after ``gc.collect()`` (the garbage
  collector stays on, as in the peer); median and min over repetitions.

Beside the measured hit rate (reused prompt tokens / prompt tokens) it prints what the
trace allows: the infinite-cache hit rate at the same block size under kvcm's matching
rules (and with full blocks only, and with vLLM's rules), and the hit rate of an exact LRU
over 512-token blocks holding the summed capacity of the levels. The results are written
as JSON to a new file ``trace-YYYYmmdd-HHMMSS.json`` in ``--out`` (never over an existing
one).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    parse_with_quick,
    result_header,
    write_result,
)
from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.errors import ConfigError
from kvcm_core.eviction import DEFAULT_PRIORITY
from kvcm_core.frame import FRAME_OVERHEAD
from kvcm_core.manager import KVCacheManager
from kvcm_core.simulate.mooncake import (
    TRACE_BLOCK,
    TraceError,
    chain_nodes,
    infinite_hits,
    lru_block_hits,
    lru_hits,
    prompt_tokens,
    read_trace,
)

PAGE_BYTES = 64
#: Bytes before slot 0 of a disk tier's pool file (``kvcm_tier_disk.HEADER_BYTES``, named
#: here: the core imports no plugin; a test checks that the two agree).
DISK_HEADER_BYTES = 4096
ns = time.perf_counter_ns


class _Usage(Exception):
    """A bad option or a trace/configuration the replay cannot run: exit status 2."""


def make_config(args: argparse.Namespace, disk_path: str | None) -> KVCacheManagerConfig:
    """One attention layer, one 64-byte buffer; the GPU level and the optional host and
    disk levels hold ``tokens // block_size`` pages each. The disk level is framed (every
    page carries a :data:`~kvcm_core.frame.FRAME_OVERHEAD`-byte frame counted against its
    quota: more than the 64-byte page itself here, a rounding error on a real model's
    page), so its quota includes the frames: it holds the tokens asked for."""
    bs = args.block_size
    levels = [LevelConfig(tier="gpu", quota=args.gpu_tokens // bs * PAGE_BYTES)]
    if args.host_tokens:
        levels.append(LevelConfig(tier="host", quota=args.host_tokens // bs * PAGE_BYTES))
    if args.disk_tokens:
        levels.append(LevelConfig(tier="disk", quota=args.disk_tokens // bs *
                                  (PAGE_BYTES + FRAME_OVERHEAD),
                                  options={"path": disk_path}))
    return KVCacheManagerConfig(
        tokens_per_block=bs,
        layers=[AttentionLayerConfig(layer_id=0,
                                     buffers=[BufferConfig(role="kv", size=PAGE_BYTES)])],
        levels=levels,
        kernel_backend="numpy",
        enable_partial_reuse=not args.no_partial_reuse,
    )


def disk_bytes_needed(args: argparse.Namespace) -> int:
    """The bytes the disk level's file takes (0 without one): its header, then one slot
    per block of ``--disk-tokens``, each a page and its frame. The disk tier reserves them
    all when the manager is made (``posix_fallocate``)."""
    if not args.disk_tokens:
        return 0
    return DISK_HEADER_BYTES + args.disk_tokens // args.block_size * (PAGE_BYTES +
                                                                       FRAME_OVERHEAD)


def check_disk_space(args: argparse.Namespace, free: int, where: str) -> None:
    """Refuse (``_Usage``: exit status 2) a disk level larger than the ``free`` bytes of
    ``where``, the directory its temporary directory is made in."""
    need = disk_bytes_needed(args)
    if need > free:
        raise _Usage(f"--disk-tokens {args.disk_tokens}: the disk level needs {need:,} bytes "
                     f"({args.disk_tokens // args.block_size:,} slots of "
                     f"{PAGE_BYTES + FRAME_OVERHEAD} bytes and a {DISK_HEADER_BYTES}-byte "
                     f"header) in {where}, which has {free:,} bytes free: lower "
                     "--disk-tokens or point TMPDIR at a larger file system")


def replay(args: argparse.Namespace, prompts: list[np.ndarray]) -> dict[str, Any]:
    """One repetition: a fresh manager, every prompt in order, each request timed."""
    disk = tempfile.mkdtemp(prefix="kvcm-bench-trace-") if args.disk_tokens else None
    try:
        manager = KVCacheManager(make_config(args, disk))
        try:
            gc.collect()
            hit = tot = 0
            t = 0
            bs = args.block_size
            for i, prompt in enumerate(prompts):
                hint = None
                if args.tail_hint:  # blocks from ``cut`` on end past the last full id
                    cut = len(prompt) // TRACE_BLOCK * TRACE_BLOCK // bs
                    hint = _tail_hint(cut)
                s = ns()
                cache = manager.create_kv_cache(None, prompt, priority_callback=hint)
                try:
                    ok = cache.resume() and cache.resize(len(prompt))
                    if ok:
                        reused = cache.history_length
                        cache.commit(prompt[reused:])
                finally:  # (on an error too: the shutdown below refuses open caches, and
                    cache.close()  # its refusal would hide the error itself)
                t += ns() - s
                if not ok:
                    raise _Usage(f"request {i} ({len(prompt)} tokens) does not fit the GPU "
                                 f"level ({args.gpu_tokens} tokens): raise --gpu-tokens")
                hit += reused
                tot += len(prompt)
            stats = manager.get_and_reset_iteration_stats()
            levels = []
            for lv in range(len(manager.config.levels)):
                st = manager.get_storage_statistics(lv)
                levels.append({k: getattr(st, k, None) for k in
                               ("total", "free", "evictable", "used_bytes", "total_bytes")})
            groups = stats.groups
            io = {lv: {k: getattr(q.stats, k) for k in q.stats.__slots__}
                  for lv, q in enumerate(manager.storage_levels.io) if q is not None}
        finally:
            manager.shutdown()
    finally:
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)
    blocks = tot / args.block_size
    return {
        "hit_rate": hit / tot,
        "reused_tokens": hit,
        "prompt_tokens": tot,
        "us_per_request": t / 1e3 / len(prompts),
        "us_per_block": t / 1e3 / blocks,
        "total_s": t / 1e9,
        "reused_blocks_by_level": list(stats.reused_blocks_by_level),
        "onboard_blocks": sum(g.onboard_blocks for g in groups),
        "offload_blocks": sum(g.offload_blocks for g in groups),
        "dropped_blocks": sum(g.dropped_blocks for g in groups),
        "levels_at_end": levels,
        "io": io,
    }


def _tail_hint(cut: int) -> Any:
    """Priority callback: 0 for blocks ``>= cut``, the default below."""
    return lambda b: 0 if b >= cut else DEFAULT_PRIORITY


def bounds(records: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The trace's infinite-cache and LRU-512 hit rates (exact, from the token rule)."""
    nodes = chain_nodes(records)
    total = sum(r.input_length for r in records)
    capacity = args.gpu_tokens + args.host_tokens + args.disk_tokens

    def rate(hits: np.ndarray) -> float:
        return int(hits.sum()) / total

    bs = args.block_size
    return {
        "infinite_hit_rate": rate(infinite_hits(records, bs, rule="partial", nodes=nodes)),
        "infinite_hit_rate_full_blocks": rate(
            infinite_hits(records, bs, rule="blocks", nodes=nodes)),
        "infinite_hit_rate_vllm_rules": rate(
            infinite_hits(records, bs, rule="vllm", nodes=nodes)),
        "lru512_capacity_tokens": capacity,
        "lru512_hit_rate": rate(lru_hits(records, capacity, nodes=nodes)),
        "lru_block_hit_rate": rate(lru_block_hits(records, capacity, bs, nodes=nodes))
        if TRACE_BLOCK % bs == 0 else None,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcm bench trace", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("trace", metavar="FILE", help="a Mooncake-format trace (JSON lines)")
    ap.add_argument("--limit", type=int, default=0, metavar="N",
                    help="replay the first N requests (0: all)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per block (power of 2)")
    ap.add_argument("--gpu-tokens", type=int, default=3_000_000,
                    help="tokens the GPU level holds")
    ap.add_argument("--host-tokens", type=int, default=0,
                    help="add a host level holding this many tokens (0: none)")
    ap.add_argument("--disk-tokens", type=int, default=0,
                    help="add a disk level (in a temporary directory) holding this many "
                         "tokens (0: none); refused up front when the file system of the "
                         "temporary directory has less free space than it takes")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (fresh manager each)")
    ap.add_argument("--no-partial-reuse", action="store_true",
                    help="enable_partial_reuse=False: reuse full blocks only, as vLLM does")
    ap.add_argument("--tail-hint", action="store_true",
                    help="priority 0 (through a priority callback) for blocks past a "
                         "prompt's last full 512-token trace block (off: like-for-like with "
                         "the peer)")
    add_output_options(ap, "the first 100 requests, one repetition")
    return ap


#: What ``--quick`` changes.
QUICK = {"limit": 100, "reps": 1}


def _check(args: argparse.Namespace) -> None:
    if args.limit < 0:
        raise _Usage(f"--limit {args.limit}: must be >= 0 (0: every request)")
    bs = args.block_size
    if bs < 1 or bs & (bs - 1):
        raise _Usage(f"--block-size {bs}: must be a power of two")
    if args.reps < 1:
        raise _Usage(f"--reps {args.reps}: must be >= 1")
    for name in ("host_tokens", "disk_tokens"):
        value = getattr(args, name)
        if value < 0:
            raise _Usage(f"--{name.replace('_', '-')} {value}: must be >= 0 (0: no level)")
        if 0 < value < bs:
            raise _Usage(f"--{name.replace('_', '-')} {value}: must hold at least one block "
                         f"({bs} tokens)")
    if args.gpu_tokens < bs:
        raise _Usage(f"--gpu-tokens {args.gpu_tokens}: must hold at least one block "
                     f"({bs} tokens)")


def _print_table(doc: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvcm_core.console import make_console

    console = make_console()
    cfg, res = doc["config"], doc["results"]
    levels = f"gpu {cfg['gpu_tokens']:,}"
    if cfg["host_tokens"]:
        levels += f" + host {cfg['host_tokens']:,}"
    if cfg["disk_tokens"]:
        levels += f" + disk {cfg['disk_tokens']:,}"
    table = Table(title=f"kvcm bench trace: {escape(str(res['trace']))}, "
                        f"{res['requests']} requests, "
                        f"{res['prompt_tokens']:,} prompt tokens, block size "
                        f"{cfg['block_size']}, levels (tokens) {levels}",
                  title_justify="left")
    lru_bs = res.get("lru_block_hit_rate")
    for column in ("kvcm hit rate", "infinite cache", "infinite, full blocks",
                   "LRU-512", f"LRU-{cfg['block_size']}", "us/request median",
                   "us/request min", "us/block median", "us/block min"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{res['hit_rate']:.4f}", f"{res['infinite_hit_rate']:.4f}",
        f"{res['infinite_hit_rate_full_blocks']:.4f}",
        f"{res['lru512_hit_rate']:.4f}", "-" if lru_bs is None else f"{lru_bs:.4f}",
        f"{res['us_per_request_median']:.1f}", f"{res['us_per_request_min']:.1f}",
        f"{res['us_per_block_median']:.3f}", f"{res['us_per_block_min']:.3f}",
    )
    console.print(table)
    console.print(
        f"infinite cache: what an unbounded cache reuses under kvcm's matching rules "
        f"(partial reuse {'off' if cfg['no_partial_reuse'] else 'on'}); full blocks: "
        f"without partial reuse; vLLM's rules "
        f"(full blocks, the last prompt token computed): "
        f"{res['infinite_hit_rate_vllm_rules']:.4f}. LRU-512: an exact LRU over "
        f"{TRACE_BLOCK}-token blocks holding {res['lru512_capacity_tokens']:,} tokens; "
        f"LRU-{cfg['block_size']}: the same at this block size, each request's blocks "
        "released deepest first as kvcm releases them (it keeps the blocks past a prompt's "
        "last full 512-token block, which LRU-512 never holds).",
        highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parse_with_quick(parser, argv, QUICK)
        _check(args)
        if args.disk_tokens:  # (the replay's disk level lives in a temporary directory)
            where = tempfile.gettempdir()
            check_disk_space(args, shutil.disk_usage(where).free, where)
        records = read_trace(args.trace, args.limit)
        prompts = [prompt_tokens(r) for r in records]  # not timed
        make_config(args, "unused")  # configuration errors before any work
        runs = []
        for rep in range(args.reps):
            run = replay(args, prompts)
            print(f"rep {rep}: hit rate {run['hit_rate']:.4f}, "
                  f"{run['us_per_request']:.1f} us/request, {run['us_per_block']:.3f} "
                  f"us/block", flush=True)
            runs.append(run)
    except (TraceError, ConfigError, _Usage) as exc:
        print(f"kvcm bench trace: {exc}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "trace": args.trace.replace("\\", "/").rsplit("/", 1)[-1],
        "requests": len(records),
        "prompt_tokens": runs[0]["prompt_tokens"],
        "hit_rate": runs[0]["hit_rate"],
        "hit_rate_all_reps_equal": len({r["hit_rate"] for r in runs}) == 1,
        "us_per_request_median": statistics.median(r["us_per_request"] for r in runs),
        "us_per_request_min": min(r["us_per_request"] for r in runs),
        "us_per_block_median": statistics.median(r["us_per_block"] for r in runs),
        "us_per_block_min": min(r["us_per_block"] for r in runs),
        **bounds(records, args),
        "runs": runs,
    }
    doc = {
        **result_header("kvcm KVCacheManager replaying a Mooncake-format trace, prompts "
                        "only, sequential (host time per request and per block, numpy "
                        "backend), beside the trace's infinite-cache and LRU-512 hit rates"),
        "config": vars(args),
        "token_rule": "token i of 512-token block id h: (h * 7919 + i * 131) % 1000003 + 1; "
                      "prompt cut to input_length",
        "timer": "time.perf_counter_ns around create_kv_cache, resume, resize, commit, close "
                 "of each request (token synthesis not timed); gc.collect() before each "
                 "rep, gc enabled; median and min over reps of the per-rep means",
        "results": results,
    }
    _print_table(doc)
    write_result(doc, args.out, "trace", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
