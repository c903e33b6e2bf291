"""A ``False`` from ``resize`` / ``resume`` / ``set_beam_width`` / ``manager.resize`` leaves
its reason in ``last_refusal`` (None after a success); ``KVCacheManager`` and ``KVCache``
are context managers (the manager closes every open cache and shuts down on exit, a cache
closes on exit, an exception inside the block included)."""

from __future__ import annotations

import levels_helpers as lh
import pytest
from conftest import Driver, full_layers, tokens
from test_levels import _fill_every_level_with_held_pages

from kvcm_core import CacheStatus, InvalidStateError, KVCacheManager


def test_refused_resize_says_which_level_and_pool_group_ran_short(managers):
    m = managers(full_layers(), slots=10)
    d = Driver(m)
    a = d.create(tokens(32, seed=1))
    d.run_to(a, 32, chunk=8)  # 8 of 10 slots locked
    b = d.create(tokens(16, seed=2))
    d.run_to(b, 4)  # 9 of 10
    assert b.last_refusal is None
    assert not b.resize(12)  # 2 more blocks, 1 free, nothing evictable
    reason = b.last_refusal
    assert reason is not None and reason.startswith("resize: level 0 pool group 0")
    assert "cannot provide 2 more pages" in reason
    assert "1 free" in reason and "9 locked by active caches" in reason
    a.close()
    assert b.resize(12)
    assert b.last_refusal is None  # a success clears it


def test_refused_resize_on_the_one_group_fast_path_also_gives_a_reason(managers):
    m = managers(full_layers(), slots=10)
    big = Driver(m).create(tokens(60, seed=6))
    assert big.resume()
    assert not big.resize(41)  # 11 blocks > 10 slots: the prefill fast path refuses
    assert "cannot provide 11 more pages" in (big.last_refusal or "")
    assert big.resize(40)
    assert big.last_refusal is None
    big.close()


def test_resume_over_max_util_for_resume_names_the_limit(managers):
    m = managers(full_layers(), slots=10, max_util_for_resume=0.5)
    d = Driver(m)
    a = d.create(tokens(16, seed=1))
    d.run_to(a, 16)  # 4 of 10 locked
    t = tokens(10, seed=2)
    d.run(t)
    b = d.create([*t, 1, 2], match_len=10)  # 3 reused pages: 4 + 3 > 5
    assert not b.resume()
    assert b.last_refusal == (
        "resume: level 0 pool group 0 would have 7 of 10 slots locked, over "
        "max_util_for_resume=0.5 (5 slots)")
    a.close()
    assert b.resume()
    assert b.last_refusal is None
    b.close()


def test_resume_that_cannot_make_room_says_the_held_pages_have_nowhere_to_go(tmp_path):
    m = lh.make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    d = lh.Driver(m)
    r1, _r2, r3 = _fill_every_level_with_held_pages(m, d)
    assert r1.resume() is False
    assert r1.last_refusal is not None
    assert r1.last_refusal.startswith("resume: level 0 pool group 0 cannot provide 8 more")
    assert "8 held by suspended caches" in r1.last_refusal
    assert "no colder level can take the held pages" in r1.last_refusal
    assert r3.resume() and r3.last_refusal is None
    lh.close_all(m)
    m.shutdown()


def test_refused_beam_fork_gives_a_reason(managers):
    m = managers(full_layers(), slots=6, max_beam_width=4)
    d = Driver(m)
    c = d.create(tokens(18, seed=3))
    d.run_to(c, 18)  # 5 blocks; the partial one must be copied per new beam
    assert not c.set_beam_width(4)  # 3 more beams x 1 own block > 1 free slot
    assert (c.last_refusal or "").startswith("set_beam_width: level 0 pool group 0")
    assert c.set_beam_width(2)
    assert c.last_refusal is None
    c.close()


def test_refused_manager_resize_leaves_its_reason_on_the_manager(tmp_path):
    m = lh.make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    d = lh.Driver(m)
    held = _fill_every_level_with_held_pages(m, d)
    assert m.last_refusal is None
    assert m.resize(2, lh.quota("full", 2, 4)) is False
    assert m.last_refusal is not None and "resize(level=2" in m.last_refusal
    assert "cannot be placed" in m.last_refusal
    assert m.resize(2, lh.quota("full", 2, 8))
    assert m.last_refusal is None
    for r in held:
        r.close()
    m.shutdown()


# -- context managers ------------------------------------------------------------------------


def test_cache_used_in_a_with_block_is_closed_on_exit(managers):
    m = managers(full_layers(), slots=10)
    toks = tokens(12, seed=4)
    with m.create_kv_cache(None, toks) as c:
        assert c.resume() and c.resize(12)
        c.commit(toks)
        assert c.status is CacheStatus.ACTIVE
    assert c.status is CacheStatus.CLOSED
    assert m.num_open_caches == 0
    assert m.probe_reuse(None, toks) == 12  # closing published what it committed


def test_cache_with_block_closes_it_when_the_block_raises(managers):
    m = managers(full_layers(), slots=10)
    with pytest.raises(RuntimeError, match="engine failed"), \
            m.create_kv_cache(None, tokens(8, seed=5)) as c:
        assert c.resume() and c.resize(8)
        raise RuntimeError("engine failed")
    assert c.status is CacheStatus.CLOSED
    assert m.num_open_caches == 0


def test_manager_with_block_closes_open_caches_and_shuts_down(managers):
    cfg = managers(full_layers(), slots=10).config
    with KVCacheManager(cfg) as m:
        active = m.create_kv_cache(None, tokens(8, seed=6))
        assert active.resume() and active.resize(8)
        suspended = m.create_kv_cache(None, tokens(8, seed=7))
    assert active.status is CacheStatus.CLOSED
    assert suspended.status is CacheStatus.CLOSED
    assert m.is_shut_down
    with pytest.raises(InvalidStateError):
        m.create_kv_cache(None, [1, 2, 3])


def test_manager_with_block_shuts_down_when_the_block_raises(managers):
    cfg = managers(full_layers(), slots=10).config
    with pytest.raises(ValueError, match="scheduler bug"), KVCacheManager(cfg) as m:
        c = m.create_kv_cache(None, tokens(8, seed=8))
        assert c.resume()
        raise ValueError("scheduler bug")
    assert c.status is CacheStatus.CLOSED
    assert m.is_shut_down
