"""A ``False`` from ``resize`` / ``resume`` / ``set_beam_width`` / ``manager.resize`` leaves
its reason in ``last_refusal`` (None after a success; the plain resize shortage and the
``max_util_for_resume`` refusal are checked in test_manager_lifecycle.py);
``KVCacheManager`` and ``KVCache`` are context managers (the manager closes every open
cache and shuts down on exit, a cache closes on exit, an exception inside the block
included)."""

from __future__ import annotations

import levels_helpers as lh
import pytest
from conftest import Driver, full_layers, tokens
from test_levels import _fill_every_level_with_held_pages

from kvcm_core import CacheStatus, InvalidStateError, KVCacheManager


def test_refused_resize_on_the_one_group_fast_path_also_gives_a_reason(managers):
    m = managers(full_layers(), slots=10)
    big = Driver(m).create(tokens(60, seed=6))
    assert big.resume()
    assert not big.resize(41)  # 11 blocks > 10 slots: the prefill fast path refuses
    assert "cannot provide 11 more pages" in (big.last_refusal or "")
    assert big.resize(40)
    assert big.last_refusal is None
    big.close()


@pytest.fixture
def held_levels(tmp_path):
    """A manager whose three levels (8 slots each) are full of suspended caches' pages."""
    m = lh.make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    held = _fill_every_level_with_held_pages(m, lh.Driver(m))
    yield m, held
    lh.close_all(m)
    m.shutdown()


def test_resume_that_cannot_make_room_says_the_held_pages_have_nowhere_to_go(held_levels):
    _, (r1, _r2, r3) = held_levels
    assert r1.resume() is False
    assert r1.last_refusal is not None
    assert r1.last_refusal.startswith("resume: level 0 pool group 0 cannot provide 8 more")
    assert "8 held by suspended caches" in r1.last_refusal
    assert "no colder level can take the held pages" in r1.last_refusal
    assert r3.resume() and r3.last_refusal is None


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


def test_refused_manager_resize_leaves_its_reason_on_the_manager(held_levels):
    m, _ = held_levels
    assert m.last_refusal is None
    assert m.resize(2, lh.quota("full", 2, 4)) is False
    assert m.last_refusal is not None and "resize(level=2" in m.last_refusal
    assert "cannot be placed" in m.last_refusal
    assert m.resize(2, lh.quota("full", 2, 8))
    assert m.last_refusal is None


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


def test_cache_with_block_removes_a_seated_cache_from_its_batch_before_closing(managers):
    from kvcm_core import Batch

    m = managers(full_layers(), slots=10)
    batch = Batch(m, max_rows=2, max_blocks_per_row=4)
    with m.create_kv_cache(None, tokens(8, seed=9)) as c:
        assert c.resume() and c.resize(8)
        row = batch.add_kv_cache(c)
        assert c.batch_row == row
    assert c.batch_row is None and c.status is CacheStatus.CLOSED
    assert batch.row_of(c) is None and batch.members[row] is None


def test_manager_with_block_unseats_and_closes_batched_caches(managers):
    from kvcm_core import Batch

    cfg = managers(full_layers(), slots=10).config
    with KVCacheManager(cfg) as m:
        batch = Batch(m, max_rows=2, max_blocks_per_row=4)
        c = m.create_kv_cache(None, tokens(8, seed=10))
        assert c.resume() and c.resize(8)
        batch.add_kv_cache(c)
    assert c.batch_row is None and c.status is CacheStatus.CLOSED
    assert m.is_shut_down


def test_a_refusal_short_of_unlocked_pages_blames_the_locked_pages_not_the_colder_levels(
        tmp_path):
    """Level 0 has 8 slots: an active cache locks 5, a suspended one holds 1 (which the host
    level below has room for). A 4-block resize is short by 1 even if every unlocked page
    moved out: the reason names the locked pages, not the colder levels."""
    m = lh.make_manager([("gpu", 8), ("host", 64)], tmp_path)
    d = lh.Driver(m)
    held = d.create(tokens(4, seed=1))
    assert held.resume()
    d.run_to(held, 4)
    held.suspend()
    active = d.create(tokens(20, seed=2))
    assert active.resume()
    d.run_to(active, 20)
    c = d.create(tokens(16, seed=3))
    assert c.resume()
    assert c.resize(16) is False
    reason = c.last_refusal or ""
    assert "1 short even with every unlocked page moved out" in reason, reason
    assert "locked by active caches hold the rest" in reason
    assert "no colder level" not in reason
    lh.close_all(m)
    m.shutdown()
