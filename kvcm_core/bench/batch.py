"""Benchmark of :class:`~kvcm_core.batch.Batch` (``kvcm bench batch``).

Two parts, written to one JSON result:

- **host** (the ``numpy`` backend, so only host work is timed): ``--rows`` decoding
  requests with ``--context``-token contexts seated in a Batch; each step
  ``Batch.resize`` gives every row one more token and publishes (the engine's per-step
  call); the commit of the step's tokens is timed apart, as ``kvcm bench manager`` does.
  Microseconds per row-step, overall, on steps where every row crosses a block boundary
  and on the others; beside it, vLLM's ``allocate_slots`` per request-step comes from the
  peer benchmark run in the same sitting.
- **device** (each available CUDA backend): ``--device-rows`` rows of
  ``--device-blocks`` blocks with ``--tables`` registered index tables; ``publish`` after
  every row gained a block (all rows dirty) and after one row did, each through one
  ``Batch.resize``: the device time of the work it queues (the stream held by a gate
  kernel while the host queues it, so host time is not in it) against a model measured
  in the same run: launches x the device time of an empty kernel launch + uploaded bytes
  / pinned host-to-device bandwidth + conversion bytes read and written /
  device-to-device bandwidth (read + written). The host time of each call is reported
  beside it.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvcm_core.batch import Batch
from kvcm_core.bench import (
    DeviceGate,
    HelpFormatter,
    add_output_options,
    parse_with_quick,
    result_header,
    split_steps,
    timed_calls,
    write_result,
)
from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.console import int_at_least
from kvcm_core.manager import KVCacheManager
from kvcm_core.plugins import get_plugin_manager

ns = time.perf_counter_ns
_EMPTY = 'extern "C" __global__ void kvcm_bench_batch_empty(unsigned long long x) {}\n'

#: What ``--quick`` changes: a run of a few seconds.
QUICK = {"block_sizes": [16], "rows": 32, "context": 256, "steps": 32, "reps": 1,
         "warmup": 0, "device_rows": 32, "device_blocks": 128}


def _manager(backend: str, tpb: int, slots: int, layers: int = 1) -> KVCacheManager:
    """Full-attention layers with K and V buffers of 16 bytes a page (bookkeeping only)."""
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb,
        layers=[AttentionLayerConfig(layer_id=i, buffers=[BufferConfig(role="k", size=16),
                                                          BufferConfig(role="v", size=16)])
                for i in range(layers)],
        levels=[LevelConfig(tier="gpu", quota=slots * 32 * layers)], kernel_backend=backend)
    return KVCacheManager(cfg)


def run_host(args: argparse.Namespace, tpb: int, seed: int) -> dict[str, float]:
    """One repetition of the host part."""
    rng = random.Random(seed)
    rows, ctx, steps = args.rows, args.context, args.steps
    m = _manager("numpy", tpb, rows * (-(-(ctx + steps) // tpb) + 1) + 64)
    b = Batch(m, rows, -(-(ctx + steps) // tpb) + 1)
    caches = []
    for i in range(rows):
        prompt = [rng.randrange(128_000) for _ in range(ctx)]
        c = m.create_kv_cache(None, prompt[:-1], id=i)
        assert c.resume() and c.resize(ctx)
        c.commit(prompt[c.history_length:])  # a partial match may have reused a few
        caches.append(c)
        b.add_kv_cache(c)
    b.publish()
    out = [[rng.randrange(128_000) for _ in range(rows)] for _ in range(steps)]
    gc.collect()
    gc.freeze()
    step_ns, commit_ns, boundary = [], [], []
    try:
        for s in range(steps):
            caps = np.fromiter((c.capacity + 1 for c in caches), dtype=np.int64, count=rows)
            boundary.append(caches[0].capacity % tpb == 0)
            t0 = ns()
            ok = b.resize(caps)
            t1 = ns()
            for c, tok in zip(caches, out[s], strict=True):
                c.commit((tok,))
            t2 = ns()
            if not all(ok):
                raise RuntimeError("a row could not grow")
            step_ns.append(t1 - t0)
            commit_ns.append(t2 - t1)
    finally:
        gc.unfreeze()
    res = {
        **split_steps(step_ns, boundary, rows, "resize_publish_us_per_row_step"),
        "commit_us_per_row_step": sum(commit_ns) / (steps * rows) / 1e3,
    }
    b.close()
    for c in caches:
        c.close()
    m.shutdown()
    return res


def _limits(backend: Any, reps: int) -> dict[str, float]:
    """Empty-launch device time, pinned H2D and D2D bandwidth, measured now."""
    out: dict[str, float] = {}
    module = backend.compile(_EMPTY)
    count = 1000

    def launches() -> None:
        for _ in range(count):
            module.launch("kvcm_bench_batch_empty", (1, 1, 1), (32, 1, 1), [np.uint64(0)])

    dev, host = timed_calls(backend, launches, reps, 1)
    out["launch_device_us"] = statistics.median(dev) / count * 1e6
    out["launch_host_us"] = statistics.median(host) / count * 1e6
    n = 64 << 20
    src_h, dst_d = backend.alloc_host(n), backend.alloc_device(n)
    src_d = backend.alloc_device(n)
    try:
        dev, _ = timed_calls(backend, lambda: backend.copy_bytes(dst_d, 0, src_h, 0, n),
                             reps, 1)
        out["h2d_gbps"] = n / statistics.median(dev) / 1e9
        dev, _ = timed_calls(backend, lambda: backend.copy_bytes(dst_d, 0, src_d, 0, n),
                             reps, 1)
        out["d2d_read_write_gbps"] = 2 * n / statistics.median(dev) / 1e9
    finally:
        for buf in (src_h, dst_d, src_d):
            buf.free()
    return out


def run_device(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """The device part on one CUDA backend."""
    tpb, rows, blocks = 16, args.device_rows, args.device_blocks
    layers = max(1, -(-args.tables // 2))
    # Headroom: resume refuses above max_util_for_resume (0.97 by default) of level 0.
    m = _manager(backend, tpb, int(rows * (blocks + 1) / 0.9) + 64, layers)
    be = m.backend
    limits = _limits(be, args.device_reps)
    b = Batch(m, rows, blocks)
    for i in range(args.tables):
        b.register_index_table(i // 2, ("k", "v")[i % 2])
    caches = []
    for i in range(rows):
        c = m.create_kv_cache(None, (), id=i)
        if not (c.resume() and c.resize((blocks - 2 * args.device_reps - 2) * tpb)):
            raise RuntimeError(f"row {i}: {c.last_refusal}")
        caches.append(c)
        b.add_kv_cache(c)
    b.publish()
    be.synchronize()
    results: dict[str, Any] = {"limits": limits}

    def model(launches: int, rows_up: int) -> float:
        up = rows_up * (blocks * 4 + 4)
        conv = args.tables * 2 * rows_up * blocks * 4
        return (launches * limits["launch_device_us"] * 1e-6 + up / (limits["h2d_gbps"] * 1e9)
                + conv / (limits["d2d_read_write_gbps"] * 1e9))

    # Each case is one Batch.resize (the engine's per-step call) in which every row, or
    # one row, gains a block; its publish uploads and converts those rows. The device time
    # is that of the work the call queues, measured with the stream held by a gate kernel
    # while the host queues it (so host time is not in it); the host time is the call's.
    gate = DeviceGate(be)
    gated = gate.time

    def case(name: str, grow_rows: list[int]) -> None:
        dev, host = [], []
        for _ in range(args.device_reps):
            caps = np.full(rows, -1, dtype=np.int64)
            caps[grow_rows] = [caches[r].capacity + tpb for r in grow_rows]
            d, h = gated(lambda caps=caps: b.resize(caps))
            dev.append(d)
            host.append(h)
        n = len(grow_rows)
        results[name] = {
            "rows_uploaded": n, "device_us_median": statistics.median(dev) * 1e6,
            "device_us_min": min(dev) * 1e6, "host_us_median": statistics.median(host) * 1e6,
            "model_us": model(2, n) * 1e6,
            "ratio_device_to_model": statistics.median(dev) / model(2, n)}

    try:
        case("all_rows_dirty", list(range(rows)))
        case("one_row_dirty", [rows // 2])
    finally:
        gate.close()
    b.close()
    for c in caches:
        c.close()
    m.shutdown()
    return results


def _agg(runs: list[dict[str, float]], fn: Any) -> dict[str, float]:
    return {k: fn([r[k] for r in runs]) for k in runs[0]}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcm bench batch", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--block-sizes", type=int_at_least(1), nargs="+", default=[16, 32],
                    help="tokens per block of the host part; each is measured in turn")
    ap.add_argument("--rows", type=int_at_least(1), default=256, help="decoding rows (host part)")
    ap.add_argument("--context", type=int_at_least(1), default=2048,
                    help="tokens of each row's context")
    ap.add_argument("--steps", type=int_at_least(1), default=128, help="decode steps timed")
    ap.add_argument("--reps", type=int_at_least(1), default=5,
                    help="timed repetitions of the host part")
    ap.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed repetitions first")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token generator")
    ap.add_argument("--device", choices=["auto", "none"], default="auto",
                    help="run the device part on every available CUDA backend (auto) or not")
    ap.add_argument("--device-rows", type=int_at_least(1), default=256,
                    help="rows of the device part")
    ap.add_argument("--device-blocks", type=int_at_least(1), default=2048,
                    help="blocks per row of the device part")
    ap.add_argument("--tables", type=int_at_least(0), default=4, help="registered index tables")
    ap.add_argument("--device-reps", type=int_at_least(1), default=9,
                    help="timed publishes per case")
    add_output_options(ap, "one block size, 32 rows, short contexts, one repetition")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parse_with_quick(_parser(), argv, QUICK)
    host: dict[str, Any] = {}
    for tpb in args.block_sizes:
        runs = []
        for rep in range(args.warmup + args.reps):
            r = run_host(args, tpb, args.seed + rep)
            tag = "warmup" if rep < args.warmup else f"rep{rep - args.warmup}"
            print(f"tpb={tpb} {tag}: resize+publish {r['resize_publish_us_per_row_step']:.3f} "
                  f"us/row-step (boundary {r['resize_publish_us_per_row_step_block_boundary']:.2f}"
                  f", other {r['resize_publish_us_per_row_step_no_new_block']:.3f}); commit "
                  f"{r['commit_us_per_row_step']:.3f}", flush=True)
            if rep >= args.warmup:
                runs.append(r)
        host[f"block_size_{tpb}"] = {"median": _agg(runs, statistics.median),
                                     "min": _agg(runs, min), "runs": runs}
    device: dict[str, Any] = {}
    if args.device == "auto":
        pm = get_plugin_manager()
        for name, spec in pm.kernel_backends().items():
            if not spec.capabilities.has_device or not pm.availability_of(spec)[0]:
                continue
            device[name] = run_device(args, name)
            for case in ("all_rows_dirty", "one_row_dirty"):
                d = device[name][case]
                print(f"[{name}] {case}: device {d['device_us_median']:.1f} us, model "
                      f"{d['model_us']:.1f} us (ratio {d['ratio_device_to_model']:.2f}); host "
                      f"{d['host_us_median']:.1f} us", flush=True)
    doc = {
        **result_header("kvcm Batch: Batch.resize + publish per decode step (host, numpy "
                        "backend) and publish with index-table conversion on the device"),
        "config": vars(args),
        "timer": "host: time.perf_counter_ns, median and min over reps of per-rep means, gc "
                 "frozen; device: events around each publish on the default stream",
        "host": host,
        "device": device,
    }
    write_result(doc, args.out, "batch", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
