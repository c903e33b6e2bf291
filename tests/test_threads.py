"""One scheduler thread drives a manager and what it made (caches, batches): a mutating
call from another thread raises ``InvalidStateError`` naming both threads and changes
nothing, so the owner carries on, fingerprint-verified, and closes everything;
``bind_thread()`` hands ownership over; ``check_thread=False`` turns the check off."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import full_layers, make_config, make_manager, tokens

from kvcm_core import InvalidStateError, KVCacheManager
from kvcm_core.testing.engine import EngineLoop, Request


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    shared = tokens(12, seed=99)
    return [Request(i, shared + rng.integers(0, 1000, int(rng.integers(8, 30))).tolist(),
                    prompt_len=16) for i in range(n)]


def _intruder_calls(m: KVCacheManager, loop: EngineLoop, victim: Any) -> list[
        Callable[[], object]]:
    """Every kind of mutating call another thread might make."""
    assert loop.batch is not None
    return [
        lambda: m.create_kv_cache(None, tokens(8)),
        lambda: m.probe_reuse(None, tokens(8)),
        lambda: m.clear_reusable_blocks(),
        lambda: m.resize(0, 1 << 20),
        lambda: m.flush_events(),
        lambda: m.shutdown(),
        lambda: victim.resize(victim.capacity + 4),
        lambda: victim.commit([1]),
        lambda: victim.suspend(),
        lambda: victim.close(),
        lambda: victim.get_base_page_indices(0),
        lambda: loop.batch.publish(),
        lambda: loop.batch.remove_kv_cache(victim),
    ]


def test_four_threads_driving_one_manager_get_invalid_state_errors_and_change_nothing() -> None:
    m = make_manager(full_layers(), slots=64)
    loop = EngineLoop(m, chunk_tokens=8, max_batch=8)
    reqs = _requests(24)
    for r in reqs:
        loop.submit(r)
    loop.step()  # the main thread mutates first: it owns the manager
    victim = loop.running[0].cache
    calls = _intruder_calls(m, loop, victim)
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def intrude() -> None:
        start.wait()
        for _ in range(20):
            for call in calls:
                try:
                    call()
                except BaseException as exc:  # every kind is recorded and judged below
                    errors.append(exc)
                else:
                    errors.append(AssertionError("a call from another thread went through"))

    threads = [threading.Thread(target=intrude, name=f"intruder-{i}") for i in range(4)]
    for t in threads:
        t.start()
    start.wait()
    while not loop.idle:  # the owner keeps scheduling meanwhile, every step verified
        loop.step()
        m.check_invariants()
    for t in threads:
        t.join()
    assert len(errors) == 4 * 20 * len(calls)
    kinds = {type(e) for e in errors}
    assert kinds == {InvalidStateError}, f"other exceptions escaped: {kinds}"
    main = threading.current_thread().name
    assert all("intruder-" in str(e) and repr(main) in str(e) for e in errors)
    assert len(loop.finished) == len(reqs) and m.num_open_caches == 0
    loop.close()
    m.check_invariants()
    m.shutdown()
    assert m.is_shut_down


def test_bind_thread_hands_the_manager_to_the_calling_thread() -> None:
    m = make_manager(full_layers())  # built here, nothing mutated yet
    out: dict[str, Any] = {}

    def scheduler() -> None:
        out["cache"] = m.create_kv_cache(None, tokens(8))  # the first mutation claims it

    t = threading.Thread(target=scheduler, name="scheduler")
    t.start()
    t.join()
    cache = out["cache"]
    with pytest.raises(InvalidStateError, match=r"driven by thread 'scheduler'"):
        cache.resume()
    m.bind_thread()
    assert cache.resume() and cache.resize(8)
    cache.commit(tokens(8))
    cache.close()

    def late() -> None:
        try:
            m.probe_reuse(None, tokens(8))
        except InvalidStateError as exc:
            out["error"] = exc

    t = threading.Thread(target=late, name="late")
    t.start()
    t.join()
    assert "'late'" in str(out["error"]) and "bind_thread" in str(out["error"])
    m.shutdown()


def test_check_thread_false_lets_any_thread_call() -> None:
    m = KVCacheManager(make_config(full_layers(), check_thread=False))
    cache = m.create_kv_cache(None, tokens(8))
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(cache.resume()))
    t.start()
    t.join()
    assert out == [True]
    cache.close()
    m.shutdown()
