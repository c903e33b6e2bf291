"""Corrupt cold pages met while a move runs (a prefetch, room made for a resize), with an
event sink that interrupts (it propagates) on the first removal: the move's reserved
destination slots come back, the manager stays consistent, every slot is free once the
caches are closed, and the owner's resume names the corrupt block (session 27's review of
prefetch and onboarding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from levels_helpers import Driver, SinkPlugin, assert_invariants, cache_pages, make_manager, tokens
from test_cold_frames import _flip_a_byte_of

import kvcm_core.levels as levels_mod
from kvcm_core import CorruptPageError, EventKind, EventSink, KvcmPluginManager


class _Injected(BaseException):
    """An interrupt a sink raises (a BaseException: it is not swallowed as an error)."""


class _Sink(EventSink):
    armed = False
    fired = 0

    def on_events(self, events: Any) -> None:
        if self.armed and any(e.kind is EventKind.REMOVED for e in events):
            self.armed = False
            self.fired += 1
            raise _Injected("interrupt delivered to the event sink")


def _manager(tmp_path: Path, levels: list[tuple[str, int]]) -> tuple[Any, _Sink]:
    pm = KvcmPluginManager()
    sink = _Sink()
    pm.register(SinkPlugin(sink), name="sink")
    return make_manager(levels, tmp_path, pm=pm), sink


def _close_everything_and_count_free(m: Any) -> None:
    for cache in m.open_caches:
        if cache.status.name == "ACTIVE":
            cache.suspend()
        cache.close()
    m.clear_reusable_blocks()
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free == st.total, f"level {level}: {st.total - st.free} slots leaked"


def test_a_sink_interrupt_while_a_prefetch_discards_a_corrupt_page_leaks_no_slot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(levels_mod, "_EVENT_BATCH", 1)  # every event a delivery point
    m, sink = _manager(tmp_path, [("gpu", 8), ("host", 8), ("disk", 40)])
    d = Driver(m)
    a = d.write(tokens(30, 11), end=25)  # A (7 blocks) suspended, pushed to the disk
    b = d.write(tokens(32, 12), chunk=32)
    d.write(tokens(32, 13), chunk=32)
    pages = cache_pages(a)
    L = m.storage_levels
    assert {int(L.arena.level[p]) for p in pages} == {2}
    _flip_a_byte_of(m, pages[4])
    b.close()  # room on the host
    sink.armed = True
    with pytest.raises(_Injected):
        a.prefetch(1)
    assert sink.fired == 1
    assert_invariants(m)
    with pytest.raises(CorruptPageError, match="block 4"):
        a.resume()
    _close_everything_and_count_free(m)
    m.shutdown()


def test_a_sink_interrupt_while_room_is_made_past_corrupt_held_pages_leaks_no_slot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Levels GPU, disk, host: a resize pushes held pages from the disk to the host, and
    two of them fail their frame check."""
    monkeypatch.setattr(levels_mod, "_EVENT_BATCH", 1)
    m, sink = _manager(tmp_path, [("gpu", 8), ("disk", 8), ("host", 40)])
    d = Driver(m)
    L = m.storage_levels
    a = d.write(tokens(32, 1), chunk=32)
    d.write(tokens(32, 2), chunk=32)  # A -> disk
    pa = cache_pages(a)
    assert all(int(L.arena.level[p]) == 1 for p in pa)
    for p in pa[:2]:
        _flip_a_byte_of(m, p)
    c = d.create(tokens(32, 3))
    sink.armed = True
    with pytest.raises(_Injected):
        c.resume()
        d.run_to(c)  # B -> disk, which pushes A's held pages from disk to host
    assert sink.fired == 1
    assert_invariants(m)
    _close_everything_and_count_free(m)
    m.shutdown()
