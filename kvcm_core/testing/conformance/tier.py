r"""Conformance tests for storage tiers.

Every registered tier runs through :class:`TierConformance` on the ``numpy`` backend. Data
goes in through the tier's own path and is checked through a *backdoor* so that ``read`` is
never tested only by trusting ``write``:

- device-accessible pools are written and read by kernels (``copy_pages`` between the pool's
  region and a staging buffer) and checked with the backend's ``read`` at
  ``region.page_start(slot)``;
- storage pools are written and read through their handles and checked through
  :meth:`TierConformance.backdoor_read`, by default (for persistent tiers) a second tier
  instance that reopens the pool by name.

Tests gate on declared capabilities (``device_accessible``, ``medium``, ``persistent``,
``file_mode``, ``dir_mode``, ``blobs``), never on names. Rules a tier must follow beyond the
signatures in :mod:`kvcm_core.tier`:

- an unknown option raises :class:`~kvcm_core.errors.ConfigError`;
- bad pool sizes, out-of-range slots and misshapen host arrays raise ``ValueError`` at the
  call, before anything is written;
- I/O on a closed pool raises :class:`~kvcm_core.errors.InvalidStateError`; ``close`` is
  idempotent;
- file tiers keep every file under the directory their options name, created with the
  declared ``file_mode``/``dir_mode``, and refuse (with a ``KvcmError``) a symbolic link in
  place of a pool file or of their directory;
- persistent tiers reopen a named pool: written, closed, reopened with the same name and
  slot size, it reads back;
- tiers declaring ``blobs`` make :class:`~kvcm_core.tier.BlobPool`\ s: blobs of 0 to
  ``slot_bytes`` bytes round-trip (``b""`` for a slot never written), a larger blob or a
  repeated slot is refused before anything is written, ``stored_bytes`` never passes
  ``num_slots * slot_bytes`` however often slots are rewritten, ``resize`` keeps the kept
  slots' blobs, and a persistent blob pool reads back after a reopen;
- ``StoragePool.read_nowait`` either fills every row exactly as ``read`` would and returns
  True, or returns False; it never raises (bad arguments and closed pools decline);
- ``StoragePool.write(slots, source)`` reads ``source`` only until its handle is done: the
  caller may then overwrite or free it, and what reads back is what it held at the write
  (the tier keeps no reference or view of it);
- ``StoragePool.write_behind`` returns None, or a handle that finishes with no error and
  after which every row reads back (the caller may reuse its rows at once); it refuses a
  slot out of range with ``ValueError``.

Subclass to run it for one tier::

    from kvcm_core.testing.conformance.tier import TierConformance

    class TestMyTier(TierConformance):
        plugin_name = "mytier"

Override :meth:`TierConformance.tier_options` when the tier needs options (keep every
file it creates under the directory given), and :meth:`TierConformance.backdoor_read` to
check stored bytes through a path of your own (reading the file directly, for instance).
"""

from __future__ import annotations

import errno
import gc
import itertools
import mmap
import os
import stat
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core.backend import KernelBackend, PageRegion
from kvcm_core.errors import ConfigError, InvalidStateError, KvcmError, TierIOError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.records import Medium, TierSpec
from kvcm_core.testing.conformance import ConformanceBase
from kvcm_core.tier import BlobPool, DevicePool, IOHandle, Pool, StoragePool, Tier

__all__ = ["TierConformance"]

_SETTINGS = settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # the tier is shared by examples on purpose
        HealthCheck.differing_executors,  # one base class, one subclass per plugin
    ],
)

# Slot sizes from 1 byte to 1 MiB, mostly not powers of two, weighted to the small end.
_slot_sizes = st.one_of(
    st.integers(1, 100),
    st.integers(101, 64 << 10),
    st.integers((64 << 10) + 1, 1 << 20),
    st.sampled_from([1, 4096, 1 << 20]),
)
_seeds = st.integers(0, 2**32 - 1)
#: Bytes of one pool in a random example, at most (keeps an example well under a second).
_BUDGET = 6 << 20
_IO_FUNCTIONS = ("pread", "pwrite", "preadv", "pwritev")


def _max_slots(slot_bytes: int, cap: int = 12) -> int:
    return max(1, min(cap, _BUDGET // slot_bytes))


def _draw_slots(data: st.DataObject, slot_bytes: int) -> tuple[int, list[int]]:
    """A pool size for ``slot_bytes`` and distinct slots of it (at least one)."""
    num_slots = data.draw(st.integers(1, _max_slots(slot_bytes)), label="num_slots")
    chosen = data.draw(
        st.lists(st.integers(0, num_slots - 1), min_size=1, unique=True), label="slots"
    )
    return num_slots, chosen


def _random_rows(seed: int, n: int, slot_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, slot_bytes), dtype=np.uint8)


class TierConformance(ConformanceBase):
    """The conformance suite of storage tiers (see module docstring)."""

    kvcm_kind: ClassVar[str] = "tier"

    @classmethod
    def applies_to(cls, spec: Any) -> bool:
        """Slot tiers only: keyed tiers have :class:`~.keyed.KeyedTierConformance`."""
        return not spec.capabilities.keyed

    spec: TierSpec
    backend: KernelBackend
    tmp_path: Path

    # -- hooks for subclasses ------------------------------------------------------------

    def tier_options(self, tmp_path: Path) -> dict[str, Any]:
        """Options for the tier under test, keeping all its files under ``tmp_path``.

        The default gives persistent file tiers ``{"path": tmp_path / "tier"}`` and every
        other tier no options.
        """
        caps = self.spec.capabilities
        if caps.persistent and caps.medium is Medium.FILE:
            return {"path": str(tmp_path / "tier")}
        return {}

    def backdoor_read(self, pool: Pool, slot: int) -> bytes | None:
        """The bytes stored in ``slot``, through a path independent of ``pool``'s own I/O.

        The default reads device-accessible pools with the backend's ``read`` at
        ``region.page_start(slot)``; for persistent storage tiers it reopens the pool by name
        in a second tier instance built from the same options; otherwise ``None`` (no
        backdoor: the test then relies on ``read`` alone). A tier that lets one instance
        at a time open a named pool (the disk tier) refuses that second instance while
        the pool is open: override this to read its files instead.
        """
        if isinstance(pool, DevicePool):
            start = pool.region.page_start(slot)
            return bytes(self.backend.read(pool.buffer, start, pool.slot_bytes))
        where = self._names.get(id(pool))
        if not self.spec.capabilities.persistent or where is None:
            return None
        name, base = where
        second = self._second.get(base)
        if second is None:
            second = self._second[base] = self.spec.factory(self.backend, self.tier_options(base))
        other = second.create_pool(pool.slot_bytes, pool.num_slots, name=name)
        assert isinstance(other, StoragePool)
        try:
            row = np.zeros((1, pool.slot_bytes), dtype=np.uint8)
            other.read(np.array([slot]), row).wait()
        finally:
            other.close()
        return row.tobytes()

    # -- fixtures ------------------------------------------------------------------------

    @pytest.fixture
    def tier(self, kvcm_plugin_spec: TierSpec, tmp_path: Path) -> Iterator[Tier]:
        """A tier from the plugin's factory on a fresh numpy backend."""
        self.spec = kvcm_plugin_spec
        self.backend = get_plugin_manager().kernel_backend("numpy").factory({})
        self.tmp_path = tmp_path
        self._opened: list[Tier] = []
        self._names: dict[int, tuple[str, Path]] = {}
        self._bases: dict[int, Path] = {}
        self._counter = itertools.count()
        self._second: dict[Path, Tier] = {}
        tier = self.open_tier()
        yield tier
        for second in self._second.values():
            second.close()
        for opened in reversed(self._opened):
            opened.close()
        self.backend.close()

    def open_tier(self, base: Path | None = None) -> Tier:
        """Another tier instance (closed after the test), with options for ``base``."""
        base = base or self.tmp_path
        tier = self.spec.factory(self.backend, self.tier_options(base))
        self._opened.append(tier)
        self._bases[id(tier)] = base
        return tier

    def new_pool(self, tier: Tier, slot_bytes: int, num_slots: int, name: str = "") -> Pool:
        """A pool with a fresh name (remembered for the backdoor)."""
        name = name or f"pool{next(self._counter)}"
        pool = tier.create_pool(slot_bytes, num_slots, name=name)
        self._names[id(pool)] = (name, self._bases.get(id(tier), self.tmp_path))
        return pool

    # -- data paths ----------------------------------------------------------------------

    def put(self, pool: Pool, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store ``rows[i]`` in ``slots[i]`` through the pool's own path."""
        if isinstance(pool, StoragePool):
            pool.write(slots, rows).wait()
            return
        assert isinstance(pool, DevicePool)
        if not len(slots):
            return
        staging = self.backend.alloc_host(rows.size)
        try:
            self.backend.write(staging, 0, rows)
            pairs = np.stack([slots, np.arange(len(slots))], axis=1).astype(np.int32)
            region = PageRegion(staging, 0, pool.slot_bytes)
            self.backend.copy_pages(pool.region, region, pool.slot_bytes, pairs)
            self.backend.synchronize()
        finally:
            staging.free()

    def get(self, pool: Pool, slots: np.ndarray) -> np.ndarray:
        """The rows stored in ``slots`` through the pool's own path."""
        out = np.zeros((len(slots), pool.slot_bytes), dtype=np.uint8)
        if isinstance(pool, StoragePool):
            pool.read(slots, out).wait()
            return out
        assert isinstance(pool, DevicePool)
        if not len(slots):
            return out
        staging = self.backend.alloc_host(out.size)
        try:
            pairs = np.stack([np.arange(len(slots)), slots], axis=1).astype(np.int32)
            region = PageRegion(staging, 0, pool.slot_bytes)
            self.backend.copy_pages(region, pool.region, pool.slot_bytes, pairs)
            self.backend.synchronize()
            out[...] = self.backend.read(staging, 0, out.size).reshape(out.shape)
        finally:
            staging.free()
        return out

    def check_stored(self, pool: Pool, slots: np.ndarray, rows: np.ndarray) -> None:
        """Assert ``rows`` are in ``slots``: through the pool's path and the backdoor."""
        order = np.random.default_rng(len(slots)).permutation(len(slots))
        got = self.get(pool, slots[order])
        for k, i in enumerate(order):
            assert np.array_equal(got[k], rows[i]), f"slot {int(slots[i])} read back wrong"
        for i in range(min(len(slots), 3)):
            back = self.backdoor_read(pool, int(slots[i]))
            if back is not None:
                assert back == rows[i].tobytes(), f"slot {int(slots[i])} stored wrong bytes"

    # -- the record and the pools ----------------------------------------------------------

    def test_tier_declares_the_capabilities_of_its_record(self, tier: Tier) -> None:
        assert tier.capabilities == self.spec.capabilities
        pool = self.new_pool(tier, 64, 2)
        if tier.capabilities.device_accessible:
            assert isinstance(pool, DevicePool)
        else:
            assert isinstance(pool, StoragePool)
            assert not isinstance(pool, DevicePool)

    def test_pool_reports_its_size(self, tier: Tier) -> None:
        pool = self.new_pool(tier, 1000, 7)
        assert (pool.slot_bytes, pool.num_slots, pool.nbytes) == (1000, 7, 7000)
        if isinstance(pool, DevicePool):
            assert pool.buffer.nbytes >= pool.nbytes
            assert pool.base_address == pool.buffer.ptr
            assert pool.region.page_start(3) - pool.region.page_start(2) == 1000

    @pytest.mark.parametrize(
        ("slot_bytes", "num_slots"), [(0, 4), (-8, 4), (64, -1), (1.5, 4), (True, 4)]
    )
    def test_bad_pool_sizes_are_refused(self, tier: Tier, slot_bytes: Any, num_slots: Any) -> None:
        with pytest.raises(ValueError):
            tier.create_pool(slot_bytes, num_slots, name="bad")

    def test_unknown_option_is_refused_with_config_error(self, tier: Tier) -> None:
        options = {**self.tier_options(self.tmp_path / "other"), "no_such_option": 1}
        with pytest.raises(ConfigError) as info:
            self.spec.factory(self.backend, options)
        assert "no_such_option" in str(info.value)

    def test_empty_pool_can_be_created_and_grown(self, tier: Tier) -> None:
        pool = self.new_pool(tier, 48, 0)
        assert pool.nbytes == 0
        pool.resize(3)
        rows = _random_rows(1, 3, 48)
        self.put(pool, np.arange(3), rows)
        self.check_stored(pool, np.arange(3), rows)

    # -- data ------------------------------------------------------------------------------

    def _drawn(self, tier: Tier, data: st.DataObject, slot_bytes: int, seed: int
               ) -> tuple[Pool, np.ndarray, np.ndarray]:
        """A new pool of a drawn size, drawn distinct slots of it (int64) and random rows
        for them."""
        num_slots, chosen = _draw_slots(data, slot_bytes)
        slots = np.array(chosen, dtype=np.int64)
        rows = _random_rows(seed, len(slots), slot_bytes)
        return self.new_pool(tier, slot_bytes, num_slots), slots, rows

    @_SETTINGS
    @given(data=st.data(), slot_bytes=_slot_sizes, seed=_seeds)
    def test_bytes_round_trip_through_every_slot(
        self, tier: Tier, data: st.DataObject, slot_bytes: int, seed: int
    ) -> None:
        pool, slots, rows = self._drawn(tier, data, slot_bytes, seed)
        try:
            self.put(pool, slots, rows)
            self.check_stored(pool, slots, rows)
        finally:
            pool.close()

    @_SETTINGS
    @given(data=st.data(), slot_bytes=_slot_sizes, seed=_seeds)
    def test_a_read_nowait_fills_every_row_as_read_would_or_declines(
        self, tier: Tier, data: st.DataObject, slot_bytes: int, seed: int
    ) -> None:
        pool, slots, rows = self._drawn(tier, data, slot_bytes, seed)
        try:
            if not isinstance(pool, StoragePool):
                return
            self.put(pool, slots, rows)
            out = np.zeros_like(rows)
            if pool.read_nowait(slots, out):
                np.testing.assert_array_equal(out, rows)
            num_slots = pool.num_slots
            for bad in (slots + num_slots, slots.astype(np.float64), -1 - slots, None,
                        3, np.array(3), slots.tolist()):  # never raises
                assert pool.read_nowait(bad, np.zeros_like(rows)) is False  # type: ignore[arg-type]
            if pool.read_nowait(slots.astype(np.uint32), out):  # any integer type
                np.testing.assert_array_equal(out, rows)
            assert pool.read_nowait(slots, np.zeros((len(slots), slot_bytes + 1),
                                                    dtype=np.uint8)) is False
        finally:
            pool.close()
        assert pool.read_nowait(slots, np.zeros_like(rows)) is False  # closed: declines

    @_SETTINGS
    @given(data=st.data(), slot_bytes=_slot_sizes, seed=_seeds)
    def test_a_write_behind_declines_or_lands_every_row(
        self, tier: Tier, data: st.DataObject, slot_bytes: int, seed: int
    ) -> None:
        pool, slots, rows = self._drawn(tier, data, slot_bytes, seed)
        try:
            if not isinstance(pool, StoragePool):
                return
            source = rows.copy()
            handle = pool.write_behind(slots, source)
            if handle is None:
                return
            source[:] = 0  # the caller may reuse its rows at once
            end = time.monotonic() + 10.0
            while not handle.done():
                assert time.monotonic() < end, "write_behind never finished"
                time.sleep(0.0005)
            assert handle.error() is None
            self.check_stored(pool, slots, rows)
            with pytest.raises(ValueError):  # as write: out of range, nothing written
                pool.write_behind(np.array([pool.num_slots]), rows[:1])
        finally:
            pool.close()

    # -- the source rows of a write ---------------------------------------------------------

    def test_write_reads_its_source_only_until_its_handle_is_done(self, tier: Tier) -> None:
        """Once a write's handle is done the caller may overwrite ``source``: what reads
        back is what ``source`` held at the write, never what it holds later."""
        pool = self.new_pool(tier, 257, 6)
        if not isinstance(pool, StoragePool):
            pytest.skip("device-accessible pools are written by kernels, not from host rows")
        rows = _random_rows(14, 4, 257)
        slots = np.array([4, 0, 5, 2])
        source = rows.copy()
        pool.write(slots, source).wait()
        source[:] = 0xA5  # the caller reuses its rows at once
        source[1:3] = _random_rows(15, 2, 257)
        self.check_stored(pool, slots, rows)
        # once more after a rewrite of one slot from a source reused the same way
        again = _random_rows(16, 1, 257)
        source = again.copy()
        pool.write(np.array([0]), source).wait()
        source[:] = 0x5A
        expected = rows.copy()
        expected[1] = again[0]
        self.check_stored(pool, slots, expected)

    def test_write_keeps_no_hold_on_its_source_after_its_handle_is_done(
        self, tier: Tier
    ) -> None:
        """After a write's handle is done the tier neither needs nor holds ``source``: its
        memory can be freed (here an anonymous mapping that cannot be unmapped while any
        view of it lives) and the rows still read back."""
        pool = self.new_pool(tier, 300, 5)
        if not isinstance(pool, StoragePool):
            pytest.skip("device-accessible pools are written by kernels, not from host rows")
        rows = _random_rows(17, 3, 300)
        slots = np.array([1, 4, 3])
        memory = mmap.mmap(-1, rows.size)
        source = np.frombuffer(memory, dtype=np.uint8).reshape(rows.shape)
        source[...] = rows
        watch = weakref.ref(source)
        pool.write(slots, source).wait()
        del source
        gc.collect()
        assert watch() is None, "the tier still holds the source array after its write is done"
        try:
            memory.close()  # BufferError while the tier keeps any view of these rows
        except BufferError:
            pytest.fail("the tier still holds a view of the source rows after its write "
                        "is done (the caller may free them)")
        self.check_stored(pool, slots, rows)

    def test_rewriting_a_slot_replaces_its_bytes_only(self, tier: Tier) -> None:
        pool = self.new_pool(tier, 333, 4)
        first = _random_rows(2, 4, 333)
        self.put(pool, np.arange(4), first)
        second = _random_rows(3, 1, 333)
        self.put(pool, np.array([2]), second)
        expected = first.copy()
        expected[2] = second[0]
        self.check_stored(pool, np.arange(4), expected)

    @_SETTINGS
    @given(data=st.data(), slot_bytes=_slot_sizes, seed=_seeds)
    def test_resize_keeps_the_data_of_kept_slots(
        self, tier: Tier, data: st.DataObject, slot_bytes: int, seed: int
    ) -> None:
        cap = _max_slots(slot_bytes)
        before = data.draw(st.integers(1, cap), label="before")
        sizes = data.draw(st.lists(st.integers(0, cap), min_size=1, max_size=3), label="sizes")
        pool = self.new_pool(tier, slot_bytes, before)
        try:
            rows = _random_rows(seed, before, slot_bytes)
            self.put(pool, np.arange(before), rows)
            kept = before
            for size in sizes:
                pool.resize(size)
                assert (pool.num_slots, pool.nbytes) == (size, size * slot_bytes)
                kept = min(kept, size)
                self.check_stored(pool, np.arange(kept), rows[:kept])
            # slots gained by growing are usable
            if pool.num_slots > kept:
                fresh = np.arange(kept, pool.num_slots)
                new_rows = _random_rows(seed + 1, len(fresh), slot_bytes)
                self.put(pool, fresh, new_rows)
                self.check_stored(pool, fresh, new_rows)
                self.check_stored(pool, np.arange(kept), rows[:kept])
        finally:
            pool.close()

    def test_out_of_range_slots_are_refused_and_nothing_is_written(self, tier: Tier) -> None:
        pool = self.new_pool(tier, 100, 4)
        rows = _random_rows(4, 4, 100)
        self.put(pool, np.arange(4), rows)
        junk = np.full((2, 100), 0xAB, dtype=np.uint8)
        if isinstance(pool, StoragePool):
            for slots in ([0, 4], [-1, 1], [1, 1 << 40]):
                with pytest.raises(ValueError):
                    pool.write(np.array(slots), junk)
                with pytest.raises(ValueError):
                    pool.read(np.array(slots), np.zeros((2, 100), dtype=np.uint8))
        else:
            assert isinstance(pool, DevicePool)
            # the allocation holds the pool's slots and no further whole slot
            assert pool.buffer.nbytes < pool.region.page_start(5)
            staging = self.backend.alloc_host(junk.size)
            try:
                self.backend.write(staging, 0, junk)
                src = PageRegion(staging, 0, 100)
                with pytest.raises(ValueError):
                    self.backend.copy_pages(
                        pool.region, src, 100, np.array([[0, 0], [4, 1]], dtype=np.int32)
                    )
            finally:
                staging.free()
        self.check_stored(pool, np.arange(4), rows)

    def test_misshapen_host_arrays_are_refused(self, tier: Tier) -> None:
        pool = self.new_pool(tier, 64, 4)
        if not isinstance(pool, StoragePool):
            pytest.skip("device-accessible pools take no host arrays")
        rows = _random_rows(5, 2, 64)
        self.put(pool, np.array([0, 1]), rows)
        for bad in (
            np.zeros((2, 63), dtype=np.uint8),
            np.zeros((3, 64), dtype=np.uint8),
            np.zeros((2, 16), dtype=np.uint32),
            np.zeros(128, dtype=np.uint8),
        ):
            with pytest.raises(ValueError):
                pool.write(np.array([0, 1]), bad)
            with pytest.raises(ValueError):
                pool.read(np.array([0, 1]), bad)
        self.check_stored(pool, np.array([0, 1]), rows)

    def test_hundreds_of_operations_in_flight_all_complete_correctly(self, tier: Tier) -> None:
        if tier.capabilities.device_accessible:
            pytest.skip("device-accessible pools are reached by kernels, not by I/O handles")
        n, slot_bytes = 400, 1500
        pool = self.new_pool(tier, slot_bytes, n)
        assert isinstance(pool, StoragePool)
        rows = _random_rows(6, n, slot_bytes)
        order = np.random.default_rng(7).permutation(n)
        # single slots and small scattered batches, all submitted before any wait
        batches = [order[i : i + 1] for i in range(0, 200)]
        batches += [order[i : i + 5] for i in range(200, n, 5)]
        handles: list[IOHandle] = [pool.write(b, rows[b]) for b in batches]
        for handle in handles:
            handle.wait()
            assert handle.done()
        dests = [np.zeros((len(b), slot_bytes), dtype=np.uint8) for b in batches]
        handles = [pool.read(b[::-1].copy(), d) for b, d in zip(batches, dests, strict=True)]
        for handle in handles:
            handle.wait()
        for b, d in zip(batches, dests, strict=True):
            assert np.array_equal(d, rows[b[::-1]])
        self.check_stored(pool, np.arange(n), rows)

    def test_large_consecutive_batch_round_trips(self, tier: Tier) -> None:
        slot_bytes, n = (64 << 10) + 7, 300  # about 19 MiB in one call
        pool = self.new_pool(tier, slot_bytes, n)
        rows = _random_rows(8, n, slot_bytes)
        self.put(pool, np.arange(n), rows)
        self.check_stored(pool, np.arange(n), rows)

    # -- life cycle ------------------------------------------------------------------------

    def test_close_is_idempotent_and_a_closed_pool_refuses_use(self, tier: Tier) -> None:
        pool = self.new_pool(tier, 64, 2)
        pool.close()
        pool.close()
        with pytest.raises(InvalidStateError):
            if isinstance(pool, StoragePool):
                pool.write(np.array([0]), np.zeros((1, 64), dtype=np.uint8))
            else:
                assert isinstance(pool, DevicePool)
                _ = pool.buffer
        if isinstance(pool, StoragePool):
            with pytest.raises(InvalidStateError):
                pool.read(np.array([0]), np.zeros((1, 64), dtype=np.uint8))
        tier.close()
        tier.close()

    # -- blob pools (capabilities.blobs) ---------------------------------------------------

    def _blob_pool(self, tier: Tier, slot_bytes: int, num_slots: int, name: str = "") -> BlobPool:
        if not tier.capabilities.blobs:
            pytest.skip("tier does not store blobs by size")
        pool = self.new_pool(tier, slot_bytes, num_slots, name)
        assert isinstance(pool, BlobPool), "a tier declaring blobs must make BlobPools"
        return pool

    @staticmethod
    def read_blobs(pool: BlobPool, slots: Any) -> list[bytes]:
        out: list[bytes] = [b""] * len(slots)
        pool.read_blobs(np.asarray(slots, dtype=np.int64), out).wait()
        return out

    @_SETTINGS
    @given(data=st.data(), seed=_seeds)
    def test_blobs_of_every_size_up_to_a_slot_round_trip(
        self, tier: Tier, data: st.DataObject, seed: int
    ) -> None:
        slot_bytes = data.draw(st.integers(1, 5000), label="slot_bytes")
        pool = self._blob_pool(tier, slot_bytes, 8)
        try:
            slots = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
                              label="slots")
            sizes = data.draw(st.lists(st.integers(0, slot_bytes), min_size=len(slots),
                                       max_size=len(slots)), label="sizes")
            rng = np.random.default_rng(seed)
            blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
            pool.write_blobs(np.asarray(slots), blobs).wait()
            assert self.read_blobs(pool, slots) == blobs
            assert pool.stored_bytes <= pool.num_slots * slot_bytes
            untouched = [s for s in range(8) if s not in slots]
            assert self.read_blobs(pool, untouched) == [b""] * len(untouched)
        finally:
            pool.close()

    def test_a_blob_larger_than_a_slot_is_refused_and_nothing_is_written(
        self, tier: Tier
    ) -> None:
        pool = self._blob_pool(tier, 64, 4)
        pool.write_blobs(np.array([0]), [b"kept"]).wait()
        with pytest.raises(ValueError):
            pool.write_blobs(np.array([0, 1]), [b"x", bytes(65)])
        with pytest.raises(ValueError):
            pool.write_blobs(np.array([2, 2]), [b"x", b"y"])
        assert self.read_blobs(pool, [0, 1, 2]) == [b"kept", b"", b""]

    def test_rewritten_blobs_never_push_stored_bytes_past_the_quota(self, tier: Tier) -> None:
        pool = self._blob_pool(tier, 1000, 4)
        for round_ in range(40):
            blobs = [bytes([round_, s]) * (50 + 100 * ((round_ + s) % 5)) for s in range(4)]
            pool.write_blobs(np.arange(4), blobs).wait()
            assert pool.stored_bytes <= 4 * 1000
            assert self.read_blobs(pool, range(4)) == blobs

    def test_blob_pool_resize_keeps_the_blobs_of_kept_slots(self, tier: Tier) -> None:
        pool = self._blob_pool(tier, 300, 6)
        blobs = [bytes([s + 1]) * (40 * s) for s in range(6)]
        pool.write_blobs(np.arange(6), blobs).wait()
        pool.resize(3)
        assert self.read_blobs(pool, range(3)) == blobs[:3]
        pool.resize(6)
        assert self.read_blobs(pool, range(6)) == blobs[:3] + [b""] * 3
        assert pool.stored_bytes <= 6 * 300

    def test_persistent_blob_pool_reads_back_after_reopen(self, tier: Tier) -> None:
        if not tier.capabilities.persistent:
            pytest.skip("tier does not declare persistence")
        pool = self._blob_pool(tier, 500, 5, name="kept-blobs")
        blobs = [bytes([s]) * (97 * s) for s in range(5)]
        pool.write_blobs(np.arange(5), blobs).wait()
        pool.write_blobs(np.array([1]), [b"rewritten"]).wait()
        pool.close()
        tier.close()
        again = self.open_tier()
        reopened = self.new_pool(again, 500, 5, name="kept-blobs")
        assert isinstance(reopened, BlobPool)
        assert self.read_blobs(reopened, range(5)) == [blobs[0], b"rewritten", *blobs[2:]]

    # -- faults ----------------------------------------------------------------------------

    def test_io_failure_surfaces_as_tier_io_error(
        self, tier: Tier, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        caps = tier.capabilities
        if caps.device_accessible or caps.medium is not Medium.FILE:
            pytest.skip("needs a file tier reached through I/O handles")
        pool = self.new_pool(tier, 4096, 8)
        assert isinstance(pool, StoragePool)
        rows = _random_rows(9, 8, 4096)
        pool.write(np.arange(8), rows).wait()

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.EIO, "injected I/O error")

        for fn in _IO_FUNCTIONS:
            if hasattr(os, fn):
                monkeypatch.setattr(os, fn, fail)
        write = pool.write(np.array([1, 2]), rows[:2])
        with pytest.raises(TierIOError):
            write.wait()
        assert write.done()
        read = pool.read(np.array([5]), np.zeros((1, 4096), dtype=np.uint8))
        with pytest.raises(TierIOError):
            read.wait()
        assert read.done()
        monkeypatch.undo()
        # the pool carries on: untouched slots are intact, failed slots can be rewritten
        self.check_stored(pool, np.array([0, 5, 7]), rows[[0, 5, 7]])
        self.put(pool, np.array([1, 2]), rows[3:5])
        self.check_stored(pool, np.array([1, 2]), rows[3:5])

    # -- persistence and files -------------------------------------------------------------

    def _files_under(self, root: Path) -> dict[Path, os.stat_result]:
        out = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for entry in (*dirnames, *filenames):
                p = Path(dirpath) / entry
                out[p] = p.lstat()
        return out

    def test_persistent_pool_reads_back_after_reopen(self, tier: Tier) -> None:
        if not tier.capabilities.persistent:
            pytest.skip("tier does not declare persistence")
        rows = _random_rows(10, 6, 777)
        pool = self.new_pool(tier, 777, 6, name="kept")
        self.put(pool, np.arange(6), rows)
        pool.close()
        tier.close()
        again = self.open_tier()
        reopened = self.new_pool(again, 777, 6, name="kept")
        self.check_stored(reopened, np.arange(6), rows)

    def test_files_and_directories_get_the_declared_modes(self, tier: Tier) -> None:
        caps = tier.capabilities
        if caps.file_mode is None and caps.dir_mode is None:
            pytest.skip("tier declares no file or directory modes")
        pools = [self.new_pool(tier, 512, 4, name=n) for n in ("a", "b")]
        pools.append(tier.create_pool(512, 4))  # unnamed too
        self.put(pools[0], np.arange(4), _random_rows(11, 4, 512))
        entries = self._files_under(self.tmp_path)
        assert entries, "the tier created nothing under the directory its options name"
        for path, info in entries.items():
            mode = info.st_mode
            if stat.S_ISDIR(mode) and caps.dir_mode is not None:
                assert stat.S_IMODE(mode) == caps.dir_mode, f"{path}: mode {mode:o}"
            elif stat.S_ISREG(mode) and caps.file_mode is not None:
                assert stat.S_IMODE(mode) == caps.file_mode, f"{path}: mode {mode:o}"

    def test_existing_directory_is_tightened_to_dir_mode(self, tier: Tier) -> None:
        if tier.capabilities.dir_mode is None:
            pytest.skip("tier declares no directory mode")
        base = self.tmp_path / "loose"
        first = self.open_tier(base)
        self.new_pool(first, 64, 1, name="probe")
        first.close()
        dirs = [p for p, i in self._files_under(base).items() if stat.S_ISDIR(i.st_mode)]
        for d in dirs:
            d.chmod(0o777)
        second = self.open_tier(base)
        self.new_pool(second, 64, 1, name="probe2")
        for d in dirs:
            if d.exists():
                assert stat.S_IMODE(d.stat().st_mode) == tier.capabilities.dir_mode, str(d)

    def _pool_files(self, tier: Tier, base: Path, name: str) -> list[Path]:
        before = set(self._files_under(base))
        pool = self.new_pool(tier, 256, 2, name=name)
        self.put(pool, np.arange(2), _random_rows(12, 2, 256))
        pool.close()
        return [p for p in self._files_under(base) if p not in before and p.is_file()]

    def test_symlink_planted_in_place_of_a_pool_file_is_refused(self, tier: Tier) -> None:
        caps = tier.capabilities
        if caps.file_mode is None or not caps.persistent:
            pytest.skip("needs a persistent file tier that declares its file mode")
        base = self.tmp_path / "planted"
        first = self.open_tier(base)
        files = self._pool_files(first, base, "victim")
        first.close()
        assert files, "creating a named pool created no file under the tier's directory"
        outside = self.tmp_path / "outside"
        outside.mkdir()
        # the targets are genuine pool files, so only refusing the link itself protects them
        targets = []
        for i, f in enumerate(files):
            target = outside / f"precious{i}"
            f.rename(target)
            target.chmod(0o640)
            f.symlink_to(target)
            targets.append((target, target.read_bytes()))
        second = self.open_tier(base)
        with pytest.raises(KvcmError):
            pool = second.create_pool(256, 2, name="victim")
            if isinstance(pool, StoragePool):  # a lazy tier must refuse at first I/O
                pool.write(np.arange(2), np.zeros((2, 256), dtype=np.uint8)).wait()
        for target, content in targets:
            assert target.read_bytes() == content
            assert stat.S_IMODE(target.stat().st_mode) == 0o640

    def test_symlinked_directory_is_refused(self, tier: Tier) -> None:
        if tier.capabilities.dir_mode is None:
            pytest.skip("tier declares no directory mode")
        base = self.tmp_path / "moved"
        first = self.open_tier(base)
        files = self._pool_files(first, base, "probe")
        first.close()
        assert files
        tier_dir = files[0].parent
        elsewhere = self.tmp_path / "elsewhere"
        tier_dir.rename(elsewhere)
        tier_dir.symlink_to(elsewhere, target_is_directory=True)
        before = set(self._files_under(elsewhere))
        with pytest.raises(KvcmError):
            second = self.open_tier(base)
            self.new_pool(second, 256, 2, name="other")
        assert set(self._files_under(elsewhere)) == before

    def test_pool_names_cannot_escape_the_directory(self, tier: Tier) -> None:
        if tier.capabilities.medium is not Medium.FILE or not self.tier_options(self.tmp_path):
            pytest.skip("needs a file tier whose directory the options name")
        base = self.tmp_path / "names"
        around = {p.name for p in self.tmp_path.iterdir()}
        named = self.open_tier(base)
        hostile = ["../escape", "../../escape2", "/abs/escape3", "..", ".", "a/b", "a_b", "\x00"]
        rows = _random_rows(13, len(hostile), 128)
        pools = [self.new_pool(named, 128, 1, name=n) for n in hostile]
        for i, pool in enumerate(pools):
            self.put(pool, np.array([0]), rows[i : i + 1])
        for i, pool in enumerate(pools):  # distinct names never share storage
            self.check_stored(pool, np.array([0]), rows[i : i + 1])
        assert {p.name for p in self.tmp_path.iterdir()} == around | {"names"}
        assert not Path("/abs").exists()
        for path in self._files_under(base):
            assert path.resolve().is_relative_to(base.resolve()), path
