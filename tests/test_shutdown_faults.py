"""``shutdown()`` on a failing (read-only) file system: it closes everything it can, then
raises ``TierIOError`` (never a bare ``OSError``) listing each failure; the manager is shut
down all the same and a second ``shutdown()`` is a no-op."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import pytest
from conftest import open_fds
from levels_helpers import Driver, faulty_disk, faulty_tier, make_manager, tokens

from kvcm_core import InvalidStateError, TierIOError
from kvcm_core.testing.faults import FaultPlan


def _open_fds() -> int:
    """The open file descriptors, once the managers earlier tests dropped without
    shutdown() are released: they are collected with a cycle, and their levels close on
    a thread of their own, so a collection that falls inside a test would otherwise
    change the count it compares."""
    return len(open_fds())


def test_shutdown_on_a_read_only_file_system_raises_tier_io_error_and_is_never_half_shut(
        tmp_path) -> None:
    plan = FaultPlan()
    fds = _open_fds()
    m = make_manager([("gpu", 8), ("host", 8), ("faulty-disk", 16)], tmp_path,
                     pm=faulty_disk(plan))
    tier = faulty_tier(m, 2)
    assert tier.plan is plan
    d = Driver(m)
    for i in range(4):
        d.write(tokens(32, i), chunk=32).close()
    plan.fail_close = True
    with pytest.raises(TierIOError, match=r"EROFS|read-only") as info:
        m.shutdown()
    message = str(info.value)
    assert "level 2 tier" in message and "pool" in message, message
    assert type(info.value) is TierIOError
    assert m.is_shut_down
    assert len(os.listdir("/proc/self/fd")) == fds, "a file or the directory stayed open"
    m.shutdown()  # a no-op
    with pytest.raises(InvalidStateError, match="shut down"):
        m.create_kv_cache(None, tokens(8))


def test_a_real_disk_level_on_a_read_only_file_system_shuts_down_with_tier_io_error(
        tmp_path, monkeypatch) -> None:
    fds = _open_fds()
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 16)], tmp_path)
    d = Driver(m)
    for i in range(4):
        d.write(tokens(32, 20 + i), chunk=32).close()
    owner = m.storage_levels.tiers[2].owner_directory

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "unlink", read_only)
    monkeypatch.setattr(shutil, "rmtree", read_only)
    with pytest.raises(TierIOError, match="Read-only file system") as info:
        m.shutdown()
    assert type(info.value) is TierIOError and owner in str(info.value)
    assert m.is_shut_down and len(os.listdir("/proc/self/fd")) == fds
    m.shutdown()  # a no-op
    monkeypatch.undo()
    # What could not be removed is swept by the next start (its lock was released).
    again = make_manager([("gpu", 8), ("host", 8), ("disk", 16)], tmp_path)
    assert again.storage_levels.tiers[2].swept.directories == (owner,)
    again.shutdown()


class _Interrupting:
    """An event sink that raises ``KeyboardInterrupt`` once armed (a Ctrl-C that lands
    while it runs)."""

    def __init__(self) -> None:
        self.armed = False
        self.batches = 0

    def on_events(self, events) -> None:
        if self.armed:
            raise KeyboardInterrupt("sink")
        self.batches += 1


def test_shutdown_releases_every_resource_even_when_an_event_sink_raises_keyboard_interrupt(
        tmp_path) -> None:
    from levels_helpers import Recorder, SinkPlugin

    from kvcm_core import KvcmPluginManager

    threads = {t.ident for t in threading.enumerate()}
    fds = _open_fds()
    sink, after = _Interrupting(), Recorder()
    pm = KvcmPluginManager()
    pm.register(SinkPlugin(sink), name="sink")
    pm.register(SinkPlugin(after), name="after")
    m = make_manager([("gpu", 8), ("host", 2), ("disk", 64)], tmp_path, pm=pm)
    d = Driver(m)
    for i in range(6):
        d.write(tokens(32, i), chunk=8).close()
    seen = len(after.events)
    sink.armed = True
    with pytest.raises(KeyboardInterrupt, match="sink"):
        m.shutdown()  # the interrupt goes on, after everything is released
    assert m.is_shut_down
    assert len(os.listdir("/proc/self/fd")) == fds, "a file or the directory stayed open"
    assert not list(tmp_path.rglob("kvcm-owner-*")), "the owner directory stayed"
    assert len(after.events) > seen, "a later sink missed the last events"
    for t in threading.enumerate():
        if t.ident not in threads and t.name.startswith("kvcm-io"):
            t.join(5)
            assert not t.is_alive(), t.name
    m.shutdown()  # a no-op


def test_shutdown_announces_every_block_removed_even_when_a_sink_interrupts(
        tmp_path) -> None:
    # More cached blocks than one event batch: shutdown queues every REMOVED event and
    # delivers them at the end, so a sink that raises cannot stop the announcement (the
    # other sinks) or the rest of the shutdown.
    from levels_helpers import Recorder, SinkPlugin

    from kvcm_core import KvcmPluginManager

    sink, after = _Interrupting(), Recorder()
    pm = KvcmPluginManager()
    pm.register(SinkPlugin(sink), name="sink")
    pm.register(SinkPlugin(after), name="after")
    m = make_manager([("gpu", 400)], tmp_path, pm=pm)
    d = Driver(m)
    for i in range(10):
        d.write(tokens(128, i), chunk=64, suspend=False).close()
    live: set = set()
    sink.armed = True
    with pytest.raises(KeyboardInterrupt, match="sink"):
        m.shutdown()
    for e in after.events:
        if e.kind.name == "STORED":
            live.add((e.block_key, e.group))
        elif e.kind.name == "REMOVED":
            live.discard((e.block_key, e.group))
    assert len([e for e in after.events if e.kind.name == "REMOVED"]) >= 300
    assert not live, f"{len(live)} blocks never announced removed"
    assert m.is_shut_down
    assert not list(tmp_path.rglob("kvcm-owner-*"))


def test_a_sink_raising_keyboard_interrupt_lets_the_other_sinks_have_the_batch(
        tmp_path) -> None:
    from levels_helpers import Recorder, SinkPlugin

    from kvcm_core import KvcmPluginManager

    sink, after = _Interrupting(), Recorder()
    pm = KvcmPluginManager()
    pm.register(SinkPlugin(sink), name="sink")
    pm.register(SinkPlugin(after), name="after")
    m = make_manager([("gpu", 8), ("host", 8)], tmp_path, pm=pm)
    d = Driver(m)
    d.write(tokens(32, 1), chunk=8).close()
    sink.armed = True
    with pytest.raises(KeyboardInterrupt):
        m.flush_events()
    assert after.events
    sink.armed = False
    m.check_invariants()
    m.shutdown()


def test_every_mutating_call_after_shutdown_raises_invalid_state_error(tmp_path) -> None:
    """docs/semantics.md: after ``shutdown()`` the mutating calls raise
    ``InvalidStateError`` (``get_and_reset_iteration_stats`` and ``flush_events``
    included); reads still answer; ``shutdown()`` again is a no-op."""
    m = make_manager([("gpu", 8), ("host", 8)], tmp_path)
    d = Driver(m)
    d.write(tokens(32, 1), chunk=8).close()
    m.shutdown()
    calls = {
        "create_kv_cache": lambda: m.create_kv_cache(None, tokens(8)),
        "probe_reuse": lambda: m.probe_reuse(None, tokens(8)),
        "make_room": lambda: m.make_room({0: 1}),
        "clear_reusable_blocks": m.clear_reusable_blocks,
        "get_and_reset_iteration_stats": m.get_and_reset_iteration_stats,
        "flush_events": m.flush_events,
    }
    for name, call in calls.items():
        with pytest.raises(InvalidStateError, match="shut down"):
            call()
            pytest.fail(f"{name}() returned after shutdown()")
    m.get_storage_statistics(1)  # a read
    m.shutdown()
