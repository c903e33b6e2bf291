"""Property tests: random request workloads on a small GPU quota (quality.md §3
"Model-based tests", one level for now).

Hypothesis draws prompt and output lengths, shared prefixes, scopes, chunk sizes and the
order of resume / step / suspend / close. Every step goes through the fingerprint engine
and is followed by ``check_invariants``; a resize or resume that fails must leave every
counter, page table and length unchanged; ``probe_reuse`` must equal what
``create_kv_cache`` then reuses; and after every cache closed and
``clear_reusable_blocks()``, every slot is free.
"""

from __future__ import annotations

import os
from typing import Any

from conftest import (
    Driver,
    assert_all_free,
    assert_invariants,
    full_layers,
    hybrid_layers,
    make_manager,
    snapshot_state,
    tokens,
    windowed_layers,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core import CacheStatus, ReuseScope
from kvcm_core.testing.engine import EngineLoop, Request

MODELS = {
    "full": (full_layers, 14),
    "windowed": (windowed_layers, 10),
    "hybrid": (hybrid_layers, 14),
}
SCOPES = [None, ReuseScope(salt="other")]
PREFIXES = [tokens(24, seed=1000 + i) for i in range(3)]
MAX_LEN = 44

#: ``KVCM_PROPERTY_EXAMPLES=2000`` for a longer local soak.
_settings = settings(max_examples=int(os.environ.get("KVCM_PROPERTY_EXAMPLES", "35")),
                     deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _new_tokens(data: st.DataObject) -> list[int]:
    prefix = PREFIXES[data.draw(st.integers(0, len(PREFIXES) - 1), label="prefix")]
    keep = data.draw(st.integers(0, len(prefix)), label="prefix_len")
    extra = data.draw(st.integers(0, MAX_LEN - keep), label="suffix_len")
    toks = prefix[:keep] + tokens(extra, seed=data.draw(st.integers(0, 5), label="seed"))
    if len(toks) < 2:
        toks = [*toks, 7, 8][:2]
    return toks


@_settings
@given(data=st.data(), model=st.sampled_from(sorted(MODELS)), snapshots=st.booleans(),
       partial=st.booleans(), backoff=st.sampled_from([0, 0, 3]))
def test_random_workloads_keep_kv_exact_and_leak_no_slot(data, model, snapshots, partial,
                                                          backoff):
    layers, slots = MODELS[model]
    m = make_manager(layers(), slots=slots, commit_min_snapshot=snapshots,
                     enable_partial_reuse=partial, reuse_match_backoff=backoff)
    d = Driver(m)
    open_caches: list[Any] = []

    def state() -> Any:
        return snapshot_state(m, *open_caches)

    for _ in range(data.draw(st.integers(5, 45), label="ops")):
        active = [c for c in open_caches if c.status is CacheStatus.ACTIVE]
        suspended = [c for c in open_caches if c.status is CacheStatus.SUSPENDED]
        runnable = [c for c in active if c.history_length < len(d.toks[id(c)])]
        ops = ["new"] if len(open_caches) < 5 else []
        ops += ["step"] * 3 if runnable else []
        ops += ["suspend"] if active else []
        ops += ["resume"] if suspended else []
        ops += ["close"] if open_caches else []
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "new":
            toks = _new_tokens(data)
            scope = SCOPES[data.draw(st.integers(0, 1), label="scope")]
            probe = m.probe_reuse(scope, toks[:-1])
            c = d.create(toks, scope)
            assert c.history_length == probe
            assert c.capacity == c.num_committed_tokens == probe
            open_caches.append(c)
        elif op == "step":
            c = data.draw(st.sampled_from(runnable), label="cache")
            left = len(d.toks[id(c)]) - c.history_length
            n = data.draw(st.integers(1, min(9, left)), label="chunk")
            before = state()
            if not d.step(c, n):
                assert state() == before  # OOM leaves no trace
        elif op == "suspend":
            data.draw(st.sampled_from(active), label="cache").suspend()
        elif op == "resume":
            c = data.draw(st.sampled_from(suspended), label="cache")
            before = state()
            if not c.resume():
                assert state() == before
                assert c.status is CacheStatus.SUSPENDED
        else:
            c = data.draw(st.sampled_from(open_caches), label="cache")
            c.close()
            open_caches.remove(c)
        assert_invariants(m)
        live = [c for c in open_caches if c.status is CacheStatus.ACTIVE]
        if live:
            d.check(*live)  # nobody else overwrote an active request's pages
    for c in open_caches:
        c.close()
    assert_all_free(m)
    m.shutdown()


@_settings
@given(data=st.data(), model=st.sampled_from(sorted(MODELS)), snapshots=st.booleans(),
       chunk=st.integers(1, 12), max_batch=st.integers(1, 4),
       budget=st.sampled_from([None, 8, 16]))
def test_random_engine_loop_runs_finish_exact_and_leak_no_slot(data, model, snapshots,
                                                               chunk, max_batch, budget):
    layers, _ = MODELS[model]
    # Room for max_batch requests at once: with one level a suspended request keeps its
    # pages on the GPU, so an over-committed batch can livelock the loop (see
    # test_engine_loop_finishes_a_request_that_already_holds_its_pages).
    m = make_manager(layers(), slots=12 * max_batch + 2, commit_min_snapshot=snapshots)
    n = data.draw(st.integers(1, 10), label="requests")
    requests = []
    for i in range(n):
        toks = _new_tokens(data)
        prompt = data.draw(st.integers(1, len(toks)), label="prompt_len")
        requests.append(Request(i, toks, prompt))

    def after(report: Any) -> None:
        assert_invariants(m)

    loop = EngineLoop(m, chunk_tokens=chunk, max_batch=max_batch, token_budget=budget)
    done = loop.run(requests, max_steps=5000, on_step=after)
    assert sorted(r.id for r in done) == list(range(n))
    assert all(r.cache.status is CacheStatus.CLOSED for r in done)
    # A second pass over the same prompts reuses at least what a probe promises now.
    for r in requests:
        probe = m.probe_reuse(None, r.tokens[: max(0, r.prompt_len - 1)])
        again = m.create_kv_cache(None, r.tokens[: max(0, r.prompt_len - 1)])
        assert again.history_length == probe
        again.close()
    assert_all_free(m)
    m.shutdown()
