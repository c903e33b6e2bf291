"""Mixed-precision companion benchmark (``kvcm bench mixed``).

A model whose layers each keep a low-precision full-attention buffer for every token and a
high-precision companion (a separate layer config in kvcm terms, twice the bytes per
token) holding the first N tokens as sinks and the last N as its window. The companion's
pool is sized for the running batch with a margin, so its cached window pages are evicted
while the low-precision pages of the same prefixes stay.

The workload: multi-turn sessions sharing a system prompt, turns interleaved round robin;
each turn's prompt is the session's whole previous conversation plus a new message. With
the companion REQUIRED, a match must find the companion's window at its endpoint, so it
collapses to the sinks; with SINK_REQUIRED_ONLY the sinks and the low-precision pages carry
the match and only the missing window (N tokens) is recomputed.

Every step is verified by the fingerprint engine (recomputed pages included). Reports the
prefix hit rate (reused tokens / looked-up tokens) of both runs on the same trace.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from typing import Any

from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    parse_with_quick,
    result_header,
    write_result,
)
from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.console import int_at_least
from kvcm_core.errors import ConfigError
from kvcm_core.manager import KVCacheManager
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.types import ReusePolicy


def make_config(policy: ReusePolicy, args: argparse.Namespace) -> KVCacheManagerConfig:
    """Low-precision full-attention buffers (``page_bytes``) plus a high-precision companion
    (twice the bytes) with ``window`` sink tokens and a ``window``-token window. The
    companion's pool is sized, as operators do, for the running batch with a margin
    (``--companion-margin``): its cached pages are the first to go under pressure."""
    layers: list[AttentionLayerConfig] = []
    for i in range(args.layers):
        layers.append(AttentionLayerConfig(
            layer_id=i, buffers=[BufferConfig(role="kv_fp8", size=args.page_bytes)]))
        layers.append(AttentionLayerConfig(
            layer_id=1000 + i,
            buffers=[BufferConfig(role="kv_bf16", size=2 * args.page_bytes)],
            sliding_window_size=args.window, num_sink_tokens=args.window,
            reuse_policy=policy))
    tpb = args.tokens_per_block
    per_request = 2 * (-(-args.window // tpb)) + args.chunk // tpb + 2
    companion_slots = int(args.batch * per_request * args.companion_margin)
    lp_bytes = args.gpu_blocks * args.page_bytes * args.layers
    companion_bytes = companion_slots * 2 * args.page_bytes * args.layers
    return KVCacheManagerConfig(
        tokens_per_block=tpb, layers=layers,
        levels=[LevelConfig(tier="gpu", quota=lp_bytes + companion_bytes)],
        pool_group_ratios=(lp_bytes, companion_bytes),
        kernel_backend="numpy")


def make_trace(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """Multi-turn sessions sharing a system prompt, their turns interleaved round robin:
    turn ``t`` of a session is its whole previous conversation plus a new message."""
    rng = random.Random(args.seed)
    system = [rng.randrange(50_000) for _ in range(args.prefix_len)]
    history = [list(system) for _ in range(args.sessions)]
    trace = []
    for _ in range(args.turns):
        for s in range(args.sessions):
            message = [rng.randrange(50_000) for _ in range(rng.randint(16, args.question_len))]
            answer = [rng.randrange(50_000) for _ in range(args.output_len)]
            prompt = history[s] + message
            trace.append((prompt + answer, len(prompt)))
            history[s] = prompt + answer
    return trace


def run(policy: ReusePolicy, args: argparse.Namespace, label: str = "") -> dict[str, Any]:
    m = KVCacheManager(make_config(policy, args))
    loop = EngineLoop(m, chunk_tokens=args.chunk, max_batch=args.batch)
    t0 = time.perf_counter()
    for i, (tokens, prompt_len) in enumerate(make_trace(args)):
        loop.submit(Request(i, tokens, prompt_len))
    try:
        loop.run()
    except RuntimeError as exc:  # the loop stalled: no request fits what the pools hold
        if not str(exc).startswith("engine loop"):
            raise
        loop.close_all()
        m.shutdown()
        raise ConfigError("--gpu-blocks", args.gpu_blocks,
                          f"with --companion-margin {args.companion_margin}: too few GPU "
                          f"slots for this workload, the {label or policy.name} run stalled "
                          f"({exc}): raise either, or lower --batch, --chunk or the "
                          f"lengths") from None
    stats = m.get_and_reset_iteration_stats()
    m.check_invariants()
    elapsed = time.perf_counter() - t0
    hit = stats.hit_tokens / stats.lookup_tokens if stats.lookup_tokens else 0.0
    dropped = sum(g.dropped_blocks for g in stats.groups)
    out = {
        "run": label or policy.name,
        "policy": policy.name,
        "hit_rate": hit,
        "lookup_tokens": stats.lookup_tokens,
        "hit_tokens": stats.hit_tokens,
        "dropped_blocks": dropped,
        "checked_pages": loop.engine.checked_pages,
        "seconds": elapsed,
    }
    m.shutdown()
    return out


#: What ``--quick`` changes: a run of a few seconds.
QUICK = {"sessions": 4, "turns": 3, "gpu_blocks": 512}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcm bench mixed", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--layers", type=int_at_least(1), default=2, help="model layers")
    ap.add_argument("--page-bytes", type=int_at_least(1), default=256,
                    help="bytes per page of each layer's low-precision buffer (the "
                         "companion's pages are twice that)")
    ap.add_argument("--tokens-per-block", type=int_at_least(1), default=16,
                    help="tokens per block (a power of two)")
    ap.add_argument("--window", type=int_at_least(1), default=64,
                    help="sink tokens and window tokens of the high-precision companion")
    ap.add_argument("--prefix-len", type=int_at_least(0), default=256,
                    help="tokens of the prompt every session shares")
    ap.add_argument("--question-len", type=int_at_least(16), default=128,
                    help="most tokens of each new message (16 up to this)")
    ap.add_argument("--output-len", type=int_at_least(0), default=32,
                    help="tokens of each answer")
    ap.add_argument("--sessions", type=int_at_least(1), default=16, help="chat sessions")
    ap.add_argument("--turns", type=int_at_least(1), default=6, help="turns per session")
    ap.add_argument("--batch", type=int_at_least(1), default=4, help="sessions running at once")
    ap.add_argument("--chunk", type=int_at_least(1), default=256, help="prefill chunk (tokens)")
    ap.add_argument("--gpu-blocks", type=int_at_least(1), default=2048,
                    help="GPU slots of the low-precision pool (too few for the workload: an "
                         "error naming it)")
    ap.add_argument("--companion-margin", type=float, default=1.3,
                    help="companion slots = running batch's need x this (a number > 0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token generator")
    add_output_options(ap, "4 sessions of 3 turns over 512 GPU slots")
    return ap


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, a margin the companion's pool cannot be sized by (exit 2)."""
    margin = args.companion_margin
    if not (math.isfinite(margin) and margin > 0):
        parser.error(f"argument --companion-margin: {margin}: must be a finite number > 0")
    tpb = args.tokens_per_block
    per_request = 2 * (-(-args.window // tpb)) + args.chunk // tpb + 2
    if int(args.batch * per_request * margin) < 1:
        parser.error(f"argument --companion-margin: {margin}: leaves the companion no GPU "
                     f"slot (--batch {args.batch} x {per_request} slots a request x "
                     f"{margin} < 1)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parse_with_quick(parser, argv, QUICK)
    _check(parser, args)
    results = [run(p, args) for p in (ReusePolicy.REQUIRED, ReusePolicy.SINK_REQUIRED_ONLY)]
    unbounded = argparse.Namespace(**{**vars(args), "gpu_blocks": args.gpu_blocks * 64,
                                      "companion_margin": args.companion_margin * 64})
    results.append(run(ReusePolicy.REQUIRED, unbounded, "unbounded (REQUIRED, 64x memory)"))
    for r in results:
        print(f"{r['run']:>32}: prefix hit rate {r['hit_rate']:.3f} "
              f"({r['hit_tokens']}/{r['lookup_tokens']} tokens), {r['dropped_blocks']} "
              f"blocks dropped, {r['checked_pages']} pages verified, {r['seconds']:.1f} s")
    doc = {
        **result_header("prefix hit rate of a mixed-precision companion: REQUIRED vs "
                        "SINK_REQUIRED_ONLY"),
        "config": vars(args),
        "results": results,
    }
    write_result(doc, args.out, "mixed_precision", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
