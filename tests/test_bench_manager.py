"""``kvcm bench manager`` times the same work as its vLLM peer
(``benchmarks/peer/vllm_host_overhead.py``): a close's whole cost, the insertion into the
eviction policy it defers included (vLLM's ``free`` pays all of it in the call), and a
request's whole cycle (hashing, lookup, allocation, publishing the new blocks: vLLM's
``allocate_slots`` publishes them)."""

from __future__ import annotations

import random

from kvcm_core.bench import manager as bench


def _small_args():
    return bench._parser().parse_args([
        "--num-blocks", "2048", "--decode-batch", "8", "--decode-context", "64",
        "--decode-steps", "4", "--prefill-requests", "6", "--prefill-len", "128",
        "--prefix-len", "64"])


def test_close_all_times_the_policy_insertion_the_closes_deferred():
    m = bench.make_manager(16, 2048)
    try:
        rng = random.Random(0)
        caches = []
        for i in range(5):
            p = bench.rand_tokens(rng, 100)
            c = m.create_kv_cache(None, p, id=i)
            assert c.resume() and c.resize(len(p))
            c.commit(p[c.history_length:])
            caches.append(c)
        stores = m.storage_levels.stores[0]
        timed = bench.close_all(m, caches)
        assert len(timed) == len(caches) + 1  # each close, then the deferred part
        # Nothing the closes queued is left for a later, untimed, use of the queue.
        assert all(not s._released for s in stores)
        assert sum(len(s.droppable) for s in stores) == sum(
            s.num_slots - s.num_free for s in stores)
    finally:
        m.shutdown()


def test_prefill_cycle_is_create_resume_resize_and_commit_of_warm_requests():
    res = bench.run_prefill(_small_args(), 16, seed=0)
    assert res["cycle_us_per_request"] > res["total_us_per_request"] > 0
    blocks = (128 - 64) // 16
    commit = res["commit_us_per_new_block"] * blocks
    assert abs(res["cycle_us_per_request"] - res["total_us_per_request"] - commit) < \
        1e-6 * res["cycle_us_per_request"] + 1e-9


def test_lookup_timing_gives_every_call_its_turn_in_each_repetition():
    """A slow stretch of the machine must land on every size and variant alike: the calls
    alternate within each repetition (warm-up included), never all of one call first."""
    order: list[str] = []
    calls = (lambda: order.append("a"), lambda: order.append("b"), lambda: order.append("c"))
    times = bench._timed(2, calls, inner=1)
    assert order == ["a", "b", "c"] * 4  # two warm-up rounds, then two timed ones
    assert [len(t) for t in times] == [2, 2, 2]


def test_lookup_scaling_reports_every_size_from_managers_built_before_timing():
    args = bench._parser().parse_args(["--lookup-sizes", "300", "2000", "--lookup-reps", "2",
                                    "--lookup-match", "8"])
    out = bench.run_lookup_scaling(args, 16, 0)
    for size in (300, 2000):
        row = out[str(size)]
        assert row["cached_blocks"] >= size + 8  # the fillers and the probed prompt
        assert 0 < row["us_per_matched_block_min"] <= row["us_per_matched_block_median"]
    assert out["ratio_largest_to_smallest_median"] >= 1.0
