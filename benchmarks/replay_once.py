"""Issue 9's trace replay (`kvcm bench trace`'s replay) once, after one warm-up replay, between
two os.sched_yield() calls, so that `valgrind --tool=callgrind --dump-before=sched_yield`
isolates the measured replay's instructions (dump file *.2; see levels_ir.sh). The disk
level's I/O deadline is raised to 600 s (valgrind runs some 50x slower; the deadline only
bounds waits). The trace: $KVCM_TRACE (default .whl/mooncake_synthetic.jsonl).

Usage: python benchmarks/replay_once.py [kvcm bench trace options]
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs

from kvcm_core.bench import trace as bench_trace
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.simulate.mooncake import prompt_tokens, read_trace

_make_config = bench_trace.make_config


def make_config(args: argparse.Namespace, disk: str | None) -> KVCacheManagerConfig:
    """The bench's configuration, its disk level with a 600 s I/O deadline."""
    cfg = _make_config(args, disk)
    return attrs.evolve(cfg, levels=[
        attrs.evolve(lv, io_deadline_s=600.0) if lv.tier == "disk" else lv
        for lv in cfg.levels])


def main() -> None:
    bench_trace.make_config = make_config
    argv = [os.environ.get("KVCM_TRACE", ".whl/mooncake_synthetic.jsonl"), "--limit", "1000",
            "--block-size", "64", "--reps", "1", *sys.argv[1:]]
    args = bench_trace.parse_with_quick(bench_trace._parser(), argv, bench_trace.QUICK)
    prompts = [prompt_tokens(r) for r in read_trace(args.trace, args.limit)]
    bench_trace.replay(args, prompts)  # warm-up: first-use costs out of the measure
    os.sched_yield()
    run = bench_trace.replay(args, prompts)
    os.sched_yield()
    print(f"replay: hit rate {run['hit_rate']:.4f}, {run['us_per_request']:.1f} us/request "
          f"(wall clock, distorted under valgrind), onboard {run['onboard_blocks']}, "
          f"offload {run['offload_blocks']}, dropped {run['dropped_blocks']}")


if __name__ == "__main__":
    main()
