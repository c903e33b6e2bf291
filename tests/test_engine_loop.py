"""The engine loop shared by the tests and ``kvcm simulate``: it must finish any workload
that fits the GPU one request at a time, whatever the pressure and the policies."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    ReusePolicy,
)
from kvcm_core.testing.engine import EngineLoop, Request

#: Examples per property (``KVCM_PROPERTY_EXAMPLES`` raises it for a longer soak).
PROPERTY_EXAMPLES = int(os.environ.get("KVCM_PROPERTY_EXAMPLES", "30"))


def _manager(policy: ReusePolicy, slots: int) -> KVCacheManager:
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=64)],
                                     reuse_policy=policy)],
        levels=[LevelConfig(tier="gpu", quota=slots * 64)], kernel_backend="numpy"))


@pytest.mark.parametrize("policy", [ReusePolicy.PRIVATE, ReusePolicy.REQUIRED])
def test_engine_loop_never_sacrifices_an_older_request_for_a_newer_one(policy):
    # Nothing reusable (PRIVATE) and a GPU that holds about two requests: preempting the
    # oldest request for a newer one would restart it from zero forever (a livelock).
    m = _manager(policy, slots=12)  # a 44-token request needs 11 slots alone
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, 1000, int(rng.integers(20, 44))).tolist(),
                    int(rng.integers(1, 20))) for i in range(8)]
    loop = EngineLoop(m, chunk_tokens=4, max_batch=8)
    done = loop.run(reqs, max_steps=3000, on_step=lambda _: m.check_invariants())
    assert sorted(r.id for r in done) == list(range(8))
    assert sum(r.preemptions for r in reqs) > 0  # the pressure was real
    m.clear_reusable_blocks()
    stats = m.get_storage_statistics(0)
    assert stats.free == stats.total


def _two_level_manager(levels: int) -> KVCacheManager:
    tiers = [LevelConfig(tier="gpu", quota=16 * 64), LevelConfig(tier="host", quota=64 * 64)]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=64)])],
        levels=tiers[:levels], kernel_backend="numpy", max_util_for_resume=0.6))


@pytest.mark.parametrize("levels", [1, 2])
def test_a_refused_waiting_request_keeps_its_cache_only_when_a_colder_level_exists(levels):
    # Below the GPU a refused request keeps its cache (its held pages can move down) and
    # is retried with a resume, not a new create_kv_cache; on one level its claims are
    # given back while it waits. Either way every request finishes with every page
    # checked at every step.
    m = _two_level_manager(levels)
    created: list[object] = []
    create = m.create_kv_cache

    def counting_create(*args, **kwargs):
        cache = create(*args, **kwargs)
        created.append(cache)
        return cache

    m.create_kv_cache = counting_create  # type: ignore[method-assign]
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 1000, 32).tolist()
    loop = EngineLoop(m, chunk_tokens=16, max_batch=4)
    loop.run([Request("warm", [*shared, 7], 33)], on_step=lambda _: m.check_invariants())
    busy = Request("busy", rng.integers(0, 1000, 40).tolist(), 32)
    loop.submit(busy)
    for _ in range(2):  # 8 of the GPU's 16 pages locked: 8 more would pass 0.6 * 16
        loop.step()
    late = Request("late", [*shared, 1, 2, 3, 4], 36)
    loop.submit(late)
    loop.step()
    assert late in loop.waiting, "the pressure must refuse the late request first"
    if levels == 1:
        assert late.cache is None
    else:
        kept = late.cache
        assert kept is not None and kept.status.name == "SUSPENDED"
        assert kept.history_length == 32  # its matched prefix, held while it waits
        loop.step()
        assert late.cache is kept or late in loop.running
    loop.run(on_step=lambda _: m.check_invariants())
    assert {r.id for r in loop.finished} == {"warm", "busy", "late"}
    per_request = {c.id for c in created}
    assert per_request == {"warm", "busy", "late"}
    if levels == 2:
        assert len(created) == 3  # never created again while it waited
    else:
        assert len(created) > 3
    loop.close()
    m.shutdown()


def _shared_prefix_workload(seed: int, gpu: int, host: int, preempt: str):
    """40 requests over 4 shared prompt prefixes, a small GPU and a smaller host level:
    held pages fill the host, so suspending frees nothing and the loop stalls often."""
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=64)])],
        levels=[LevelConfig(tier="gpu", quota=gpu * 64),
                LevelConfig(tier="host", quota=host * 64)],
        kernel_backend="numpy", max_util_for_resume=0.97))
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1000, int(rng.integers(8, 40))).tolist() for _ in range(4)]
    reqs = []
    for i in range(40):
        prefix = prefixes[int(rng.integers(0, 4))]
        asked = rng.integers(0, 1000, int(rng.integers(1, 12))).tolist()
        answer = rng.integers(0, 1000, int(rng.integers(1, 12))).tolist()
        reqs.append(Request(i, prefix + asked + answer, len(prefix) + len(asked)))
    return m, EngineLoop(m, chunk_tokens=8, max_batch=6, preempt_mode=preempt), reqs


@given(seed=st.integers(0, 10_000), sizes=st.sampled_from([(18, 6), (20, 8), (24, 8)]),
       preempt=st.sampled_from(["auto", "recompute"]))
@example(seed=9771, sizes=(18, 6), preempt="recompute")  # a kept cache blocked growth
@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
def test_only_the_head_of_the_queue_keeps_a_refused_cache_and_stalls_end(seed, sizes, preempt):
    # A refused request keeps its cache only while it is first in line (it is the only
    # one retried): a request put in front of it (a stall's recompute, a lost resume, a
    # recompute preemption) makes it give its claims back, and so does a running request
    # that cannot grow (the kept claims may hold the pages it needs). A stall's recomputed
    # request is not admitted again before the oldest suspended one steps, else the same
    # preemptions could repeat for ever. Both livelocked such workloads before.
    m, loop, reqs = _shared_prefix_workload(seed, *sizes, preempt)

    def check(_):
        m.check_invariants()
        kept = [i for i, r in enumerate(loop.waiting) if r.cache is not None]
        assert kept in ([], [0]), f"waiting requests holding a cache at {kept}"

    done = loop.run(reqs, max_steps=5000, on_step=check)
    assert sorted(r.id for r in done) == list(range(40))
    loop.close()
    m.shutdown()


@pytest.mark.parametrize("levels", [1, 2])
def test_a_request_that_cannot_fit_level_0_alone_stops_the_loop_instead_of_cycling(
        levels: int) -> None:
    """A request whose prefill chunk alone needs more GPU slots than level 0 has: with a
    colder level the loop suspended, stalled and recomputed it for ever; it must stop with
    the no-progress error, naming the request, as it does on one level."""
    lv = [LevelConfig(tier="gpu", quota=4 * 64 + 32),
          LevelConfig(tier="host", quota=64 * 64)][:levels]
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4, kernel_backend="numpy", levels=lv, max_util_for_resume=1.0,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=64)])]))
    loop = EngineLoop(m, chunk_tokens=8, max_batch=2)
    with pytest.raises(RuntimeError, match=r"made no progress.*\b0\b"):
        loop.run([Request(0, list(range(1, 25)), prompt_len=20)], max_steps=300)
    loop.close_all()
    m.check_invariants()
    m.shutdown()
