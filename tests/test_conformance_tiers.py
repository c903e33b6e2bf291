"""Every registered tier through the tier conformance suite, the reference and fault tiers
through it too, and unit tests of :class:`~kvcm_core.testing.faults.FaultyTier`."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcm_tier_disk import BLOB_CAPABILITIES, HEADER_BYTES, DiskTier, file_name
from kvcm_tier_disk import _run_calls as disk_run_calls
from kvcm_tier_disk import aio as disk_aio

from kvcm_core.errors import ConfigError, TierIOError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.records import TierSpec
from kvcm_core.testing.conformance.tier import TierConformance
from kvcm_core.testing.faults import (
    POISON,
    FaultPlan,
    FaultyBlobPool,
    FaultyTier,
    faulty_tier_spec,
)
from kvcm_core.testing.reference import (
    DICT_TIER_CAPABILITIES,
    DICT_TIER_SPEC,
    DictPool,
    DictTier,
)
from kvcm_core.tier import DevicePool, Pool, StoragePool


class _DiskFiles(TierConformance):
    """Checks what a disk tier stored by reading its files (the backdoor): a named disk
    pool is opened by one tier at a time, so the suite's default backdoor (a second tier
    reopening the pool by name) is refused while the pool under test is open."""

    def backdoor_read(self, pool: Pool, slot: int) -> bytes | None:
        where = self._names.get(id(pool))
        if where is None:
            return None
        name, base = where
        directory = Path(self.tier_options(base)["path"])
        if self.spec.capabilities.blobs:  # whole rows stored as blobs; none: zeros
            return _blob_on_disk(directory, file_name(name), slot) or bytes(pool.slot_bytes)
        with open(directory / file_name(name), "rb") as f:
            f.seek(HEADER_BYTES + slot * pool.slot_bytes)
            return f.read(pool.slot_bytes)


def _blob_on_disk(directory: Path, fname: str, slot: int) -> bytes:
    """The blob of ``slot`` in the segments of blob pool ``fname``, read as a reopen reads
    them (kvcm_tier_disk.blob): segments in order, records ``slot u32 | length u32 |
    bytes`` after a 64-byte header, up to a sealed segment's valid end (u64 at byte 24),
    the last record of the slot wins and a tombstone (length 0xFFFFFFFF) empties it."""
    blob = b""
    for seg in sorted(p for p in os.listdir(directory) if p.startswith(fname + ".seg")):
        raw = (directory / seg).read_bytes()
        end = int.from_bytes(raw[24:32], "little") or len(raw)
        at = 64
        while at + 8 <= min(end, len(raw)):
            found, length = (int.from_bytes(raw[i:i + 4], "little") for i in (at, at + 4))
            at += 8
            if length == 0xFFFFFFFF:
                blob = b"" if found == slot else blob
                continue
            if at + length > min(end, len(raw)):
                break
            blob = raw[at:at + length] if found == slot else blob
            at += length
    return blob


class TestTiers(_DiskFiles):
    """Every tier registered through the ``kvcm`` entry points (the disk tier checked
    through its files, the others through the suite's default backdoor)."""

    def backdoor_read(self, pool: Pool, slot: int) -> bytes | None:
        if self.spec.name == "disk":
            return super().backdoor_read(pool, slot)
        return TierConformance.backdoor_read(self, pool, slot)


class TestDictTier(TierConformance):
    """The in-memory reference tier, read through its dict as the backdoor."""

    plugin_name = "dict"

    @pytest.fixture(scope="class")
    @classmethod
    def kvcm_plugin_spec(cls) -> TierSpec:
        return DICT_TIER_SPEC

    def backdoor_read(self, pool: Pool, slot: int) -> bytes | None:
        assert isinstance(pool, DictPool)
        return pool.data.get(slot, bytes(pool.slot_bytes))


class TestDiskOneCallPerRun(_DiskFiles):
    """The disk tier with ``batch_syscalls`` off: its one-call-per-run path passes the
    suite too (the default batches three or more runs into one system call)."""

    plugin_name = "disk"

    def tier_options(self, tmp_path: Path) -> dict[str, Any]:
        return {**super().tier_options(tmp_path), "batch_syscalls": False}


class TestFaultyDiskWithoutFaults(_DiskFiles):
    """A FaultyTier with an empty plan is transparent: it passes the suite of its tier."""

    plugin_name = "faulty-disk"

    @pytest.fixture(scope="class")
    @classmethod
    def kvcm_plugin_spec(cls) -> TierSpec:
        return faulty_tier_spec(get_plugin_manager().tier("disk"), FaultPlan())


# -- FaultyTier ----------------------------------------------------------------------------


def _faulty(plan: FaultPlan | None = None) -> tuple[FaultyTier, StoragePool]:
    tier = FaultyTier(DictTier(), plan)
    pool = tier.create_pool(16, 8, name="p")
    assert isinstance(pool, StoragePool)
    return tier, pool


def _rows(value: int, n: int = 1) -> np.ndarray:
    return np.full((n, 16), value, dtype=np.uint8)


def _stored(pool: StoragePool, slot: int) -> np.ndarray:
    out = np.zeros((1, 16), dtype=np.uint8)
    pool.read(np.array([slot]), out).wait()
    return out[0]


def test_nth_write_fails_through_its_handle_and_poisons_its_slots() -> None:
    tier, pool = _faulty(FaultPlan(fail_writes={2}))
    pool.write(np.array([0]), _rows(1)).wait()
    failed = pool.write(np.array([1, 2]), _rows(2, 2))  # the call itself does not raise
    with pytest.raises(TierIOError, match="write 2"):
        failed.wait()
    pool.write(np.array([3]), _rows(3)).wait()
    assert (_stored(pool, 0) == 1).all()
    assert (_stored(pool, 1) == POISON).all() and (_stored(pool, 2) == POISON).all()
    assert (_stored(pool, 3) == 3).all()
    assert tier.injected == ["write 2 failed (slots [1, 2])"]


def test_every_read_fails_when_planned_and_dest_gets_poison() -> None:
    tier, pool = _faulty()
    pool.write(np.array([5]), _rows(9)).wait()
    tier.plan.fail_all_reads = True  # plans change mid-test
    dest = np.zeros((1, 16), dtype=np.uint8)
    handle = pool.read(np.array([5]), dest)
    with pytest.raises(TierIOError, match="read 1"):
        handle.wait()
    assert (dest == POISON).all()
    tier.plan.fail_all_reads = False
    assert (_stored(pool, 5) == 9).all()


def test_every_write_fails_when_planned() -> None:
    _, pool = _faulty(FaultPlan(fail_all_writes=True))
    for slot in range(3):
        with pytest.raises(TierIOError):
            pool.write(np.array([slot]), _rows(4)).wait()


def test_corrupting_write_reports_success_and_stores_first_byte_inverted() -> None:
    _, pool = _faulty(FaultPlan(corrupt_writes={1}))
    source = _rows(0x0F)
    pool.write(np.array([4]), source).wait()
    got = _stored(pool, 4)
    assert got[0] == 0xF0 and (got[1:] == 0x0F).all()
    assert (source == 0x0F).all(), "the caller's rows are never modified"


def test_corrupt_inverts_one_byte_of_a_stored_slot() -> None:
    tier, pool = _faulty()
    pool.write(np.array([6]), _rows(0x33)).wait()
    tier.corrupt(pool, 6)
    got = _stored(pool, 6)
    assert got[0] == 0x33 ^ 0xFF and (got[1:] == 0x33).all()
    with pytest.raises(ValueError):
        tier.corrupt(pool, 8)
    with pytest.raises(ValueError):
        tier.corrupt(_faulty()[1], 0)  # a pool of another FaultyTier


def test_corrupt_works_on_device_accessible_pools_through_the_backend() -> None:
    pm = get_plugin_manager()
    backend = pm.kernel_backend("numpy").factory({})
    tier = FaultyTier(pm.tier("gpu").factory(backend, {}))
    pool = tier.create_pool(8, 4)
    assert isinstance(pool, DevicePool)
    backend.write(pool.buffer, pool.region.page_start(2), np.full(8, 0x01, dtype=np.uint8))
    tier.corrupt(pool, 2)
    got = backend.read(pool.buffer, pool.region.page_start(2), 8)
    assert got[0] == 0xFE and (got[1:] == 0x01).all()
    tier.close()


def test_held_handles_stay_pending_until_released() -> None:
    tier, pool = _faulty(FaultPlan(hold=True))
    handle = pool.write(np.array([0]), _rows(7))
    assert not handle.done()
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0)
    tier.release()
    assert handle.done()
    handle.wait()
    tier.plan.hold = False
    assert pool.write(np.array([1]), _rows(8)).done()


def test_pending_polls_delay_done_by_that_many_polls() -> None:
    _, pool = _faulty(FaultPlan(pending_polls=2))
    handle = pool.write(np.array([0]), _rows(7))
    assert [handle.done(), handle.done(), handle.done()] == [False, False, True]


@pytest.mark.parametrize("bad", [0, -1, True, "1"])
def test_fault_ordinals_must_be_positive_ints(bad: object) -> None:
    with pytest.raises(ValueError, match="ordinal"):
        FaultPlan(fail_writes={bad})  # type: ignore[arg-type]


def test_faulty_tier_spec_shares_one_plan_across_the_tiers_it_builds() -> None:
    plan = FaultPlan()
    spec = faulty_tier_spec(DICT_TIER_SPEC, plan)
    assert spec.name == "faulty-dict" and spec.capabilities == DICT_TIER_SPEC.capabilities
    first, second = spec.factory(None, {}), spec.factory(None, {})
    plan.fail_all_writes = True
    for tier in (first, second):
        pool = tier.create_pool(16, 1)
        with pytest.raises(TierIOError):
            pool.write(np.array([0]), _rows(1)).wait()


# -- the disk tier's own rules -------------------------------------------------------------


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    tier = DiskTier(None, {"path": str(tmp_path / "d"), "io_threads": 2})
    yield tier
    tier.close()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"bogus": 1}, "disk.options.bogus"),
        ({"io_threads": 0}, "disk.options.io_threads"),
        ({"io_threads": "4"}, "disk.options.io_threads"),
        ({"io_threads": True}, "disk.options.io_threads"),
        ({"path": ""}, "disk.options.path"),
        ({"path": 17}, "disk.options.path"),
        ({"batch_syscalls": 1}, "disk.options.batch_syscalls"),
    ],
)
def test_disk_bad_option_is_a_config_error_naming_it(options: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        DiskTier(None, options)
    assert info.value.field == field


def test_disk_refuses_a_shared_sticky_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ConfigError, match="sticky"):
        DiskTier(None, {"path": str(shared)})


def test_disk_short_read_of_a_truncated_file_is_a_tier_io_error(disk: DiskTier) -> None:
    pool = disk.create_pool(4096, 4, name="short")
    pool.write(np.arange(4), np.ones((4, 4096), dtype=np.uint8)).wait()
    os.truncate(pool.path, HEADER_BYTES + 4096 + 100)  # cut inside slot 1
    with pytest.raises(TierIOError, match="short"):
        pool.read(np.array([1]), np.zeros((1, 4096), dtype=np.uint8)).wait()
    out = np.zeros((1, 4096), dtype=np.uint8)
    pool.read(np.array([0]), out).wait()
    assert (out == 1).all()


def test_disk_reopen_with_another_slot_size_is_refused(disk: DiskTier) -> None:
    disk.create_pool(64, 2, name="sized").close()
    with pytest.raises(ValueError, match="slots of 64 bytes"):
        disk.create_pool(128, 2, name="sized")


def test_disk_refuses_a_foreign_file_under_a_pool_name(disk: DiskTier) -> None:
    foreign = Path(disk.directory) / file_name("mine")
    foreign.write_bytes(b"not a pool" * 1000)
    with pytest.raises(TierIOError, match="not a kvcm pool file"):
        disk.create_pool(64, 2, name="mine")
    assert foreign.read_bytes() == b"not a pool" * 1000


def test_disk_refuses_a_hard_linked_pool_file(disk: DiskTier, tmp_path: Path) -> None:
    pool = disk.create_pool(64, 2, name="linked")
    pool.close()
    os.link(pool.path, tmp_path / "second-name")
    with pytest.raises(TierIOError, match="hard links"):
        disk.create_pool(64, 2, name="linked")


def test_disk_refuses_a_second_open_pool_of_the_same_name(disk: DiskTier) -> None:
    disk.create_pool(64, 2, name="twice")
    with pytest.raises(ValueError, match="already open"):
        disk.create_pool(64, 2, name="twice")


def test_disk_anonymous_pool_file_is_deleted_on_close(disk: DiskTier) -> None:
    pool = disk.create_pool(64, 2)
    assert os.path.exists(pool.path)
    pool.close()
    assert not os.path.exists(pool.path)


def test_disk_private_directory_is_removed_on_close() -> None:
    tier = DiskTier(None, {})
    directory = tier.directory
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    tier.create_pool(64, 2, name="x")
    tier.close()
    assert not os.path.exists(directory)


def test_disk_file_is_preallocated_to_its_slots(disk: DiskTier) -> None:
    pool = disk.create_pool(1000, 9, name="sized")
    assert os.path.getsize(pool.path) == HEADER_BYTES + 9000
    pool.resize(3)
    assert os.path.getsize(pool.path) == HEADER_BYTES + 3000


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record the disk tier's system calls as ``(name, buffers)``; a ``pwrite`` of one
    buffer is recorded as a ``pwritev`` of one (the tier uses it as the cheaper form)."""
    calls: list[tuple[str, int]] = []
    for fn in ("preadv", "pwritev"):
        real = getattr(os, fn)

        def counted(fd: int, buffers: list, offset: int, _real=real, _fn=fn) -> int:
            calls.append((_fn, len(buffers)))
            return _real(fd, buffers, offset)

        monkeypatch.setattr(os, fn, counted)
    real_pwrite = os.pwrite

    def counted_pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(("pwritev", 1))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", counted_pwrite)
    return calls


def test_disk_consecutive_slots_move_in_one_call(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = disk.create_pool(4096, 64, name="runs")
    rows = np.random.default_rng(0).integers(0, 256, (64, 4096), dtype=np.uint8)
    calls = _count_calls(monkeypatch)
    # slots 10..19 given out of order: one call gathering the caller's rows
    slots = np.random.default_rng(1).permutation(np.arange(10, 20))
    pool.write(slots, rows[:10]).wait()
    assert len(calls) == 1 and calls[0][0] == "pwritev"
    calls.clear()
    # rows in slot order merge into a single buffer
    out = np.zeros((10, 4096), dtype=np.uint8)
    pool.read(np.arange(10, 20), out).wait()
    assert calls == [("preadv", 1)]
    assert np.array_equal(out[np.argsort(np.argsort(slots))], rows[:10])
    calls.clear()
    # two runs with a gap: two calls
    pool.read(np.array([1, 2, 3, 7, 8]), np.zeros((5, 4096), dtype=np.uint8)).wait()
    assert sorted(calls) == [("preadv", 1), ("preadv", 1)]


def test_disk_large_run_is_shared_by_the_io_threads(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = disk.create_pool(1 << 20, 32, name="big")
    calls = _count_calls(monkeypatch)
    pool.write(np.arange(32), np.zeros((32, 1 << 20), dtype=np.uint8)).wait()
    assert len(calls) == 4  # 32 MiB in 8 MiB calls


def _blob_disk_spec() -> TierSpec:
    def factory(backend: Any, options: Any) -> DiskTier:
        # Small segments, so that the suite's writes roll over and compact.
        return DiskTier(backend, {**options, "mode": "blob", "segment_bytes": 4096})

    return TierSpec(name="disk-blob", factory=factory, capabilities=BLOB_CAPABILITIES,
                    description="disk tier, blob mode")


class TestDiskTierInBlobMode(_DiskFiles):
    """The disk tier with ``mode="blob"``: append-only segments, stored by size."""

    plugin_name = "disk-blob"

    @pytest.fixture(scope="class")
    @classmethod
    def kvcm_plugin_spec(cls) -> TierSpec:
        return _blob_disk_spec()


class TestFaultyBlobDiskWithoutFaults(_DiskFiles):
    """FaultyBlobPool with an empty plan is transparent too."""

    plugin_name = "faulty-disk-blob"

    @pytest.fixture(scope="class")
    @classmethod
    def kvcm_plugin_spec(cls) -> TierSpec:
        return faulty_tier_spec(_blob_disk_spec(), FaultPlan())


def test_faulty_blob_pool_corrupts_the_planned_byte_of_a_blob(tmp_path):
    plan = FaultPlan(corrupt_writes={2}, corrupt_offset=-1)
    tier = FaultyTier(DiskTier(None, {"path": str(tmp_path / "d"), "mode": "blob"}), plan)
    try:
        pool = tier.create_pool(16, 4)
        assert isinstance(pool, FaultyBlobPool)
        pool.write_blobs(np.array([0]), [b"abc"]).wait()
        pool.write_blobs(np.array([1]), [b"abc"]).wait()
        plan.corrupt_offset = 0
        tier.corrupt(pool, 0)
        out = [b"", b""]
        pool.read_blobs(np.array([0, 1]), out).wait()
        assert out == [b"\x9ebc", b"ab\x9c"]
        assert tier.injected == ["write 2 corrupted (slots [1])", "slot 0 corrupted"]
    finally:
        tier.close()


# -- the disk tier's batched system calls (kvcm_tier_disk.aio) -----------------------------

needs_aio = pytest.mark.skipif(not disk_aio.available(),
                               reason="no Linux native AIO here (the tier makes one call per run)")


@needs_aio
@settings(max_examples=40, deadline=None)
@given(slots=st.lists(st.integers(0, 63), min_size=1, max_size=40, unique=True),
       seed=st.integers(0, 2**32 - 1))
def test_disk_batched_writes_and_reads_store_the_same_bytes_as_one_call_per_run(
        tmp_path_factory: pytest.TempPathFactory, slots: list[int], seed: int) -> None:
    base = tmp_path_factory.mktemp("aio")
    rows = np.random.default_rng(seed).integers(0, 256, (len(slots), 48), dtype=np.uint8)
    files = []
    for batch in (True, False):
        tier = DiskTier(None, {"path": str(base / str(batch)), "batch_syscalls": batch})
        try:
            pool = tier.create_pool(48, 64, name="p")
            pool.write(np.array(slots), rows).wait()
            out = np.zeros_like(rows)
            pool.read(np.array(slots[::-1]), out[::-1]).wait()  # reversed: sorted inside
            np.testing.assert_array_equal(out, rows)
            files.append(Path(pool.path).read_bytes())
        finally:
            tier.close()
    assert files[0] == files[1]


def _calls(rows: np.ndarray, offsets: list[int]) -> list[tuple[int, list[memoryview], int]]:
    return [(off, [rows[i].data], rows.shape[1]) for i, off in enumerate(offsets)]


@needs_aio
def test_disk_batched_write_failure_is_a_tier_io_error_naming_the_errno(tmp_path: Path
                                                                        ) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)  # writes fail with EBADF
    try:
        rows = np.ones((4, 64), dtype=np.uint8)
        with pytest.raises(TierIOError, match=r"Errno 9"):
            disk_run_calls(fd, _calls(rows, [0, 256, 512, 1024]), True, "test", True)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(4096)


@needs_aio
def test_disk_batched_read_past_the_end_of_the_file_is_a_short_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 4)  # 1 KiB
    fd = os.open(path, os.O_RDONLY)
    try:
        rows = np.zeros((3, 64), dtype=np.uint8)
        calls = _calls(rows, [0, 512, 1000])  # the last run ends past the end
        with pytest.raises(TierIOError, match="short preadv: 24 of 64 bytes at offset 1000"):
            disk_run_calls(fd, calls, False, "test", True)
        np.testing.assert_array_equal(rows[0], np.arange(64))
    finally:
        os.close(fd)


@needs_aio
def test_disk_write_of_three_or_more_runs_is_one_batched_call_not_a_pwrite_each(
        disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = disk.create_pool(64, 16, name="runs")
    rows = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("one call per run was made")

    for fn in ("pwrite", "pwritev", "preadv"):
        monkeypatch.setattr(os, fn, refuse)
    pool.write(np.array([1, 5, 9, 13]), rows).wait()  # four runs
    out = np.zeros_like(rows)
    pool.read(np.array([1, 5, 9, 13]), out).wait()
    monkeypatch.undo()
    np.testing.assert_array_equal(out, rows)


@needs_aio
def test_disk_batched_read_of_a_pool_truncated_under_it_is_a_short_read(
        disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs handed to the batched call as arrays (DiskPool._run_runs): a failure names
    the run's offset, as the per-run calls do."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the runs went through per-run call tuples")

    monkeypatch.setattr(disk_aio, "run", refuse)
    pool = disk.create_pool(64, 16, name="cut")
    rows = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    slots = np.array([1, 5, 9, 13])  # four runs
    pool.write(slots, rows).wait()
    os.truncate(pool.path, HEADER_BYTES + 9 * 64 + 10)  # slot 9 keeps 10 bytes
    out = np.zeros_like(rows)
    with pytest.raises(TierIOError, match=rf"short preadv: 10 of 64 bytes at offset "
                                          rf"{HEADER_BYTES + 9 * 64}"):
        pool.read(slots, out).wait()
    np.testing.assert_array_equal(out[:2], rows[:2])  # the runs before it were read


@needs_aio
def test_disk_batched_calls_of_several_buffers_write_and_read_them_in_order(
        tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDWR)
    try:
        rows = np.random.default_rng(3).integers(0, 256, (6, 100), dtype=np.uint8)
        calls = [(off, [rows[2 * i].data, rows[2 * i + 1].data], 200)
                 for i, off in enumerate([0, 1000, 5000])]
        assert disk_aio.run(fd, calls, True) == []
        data = path.read_bytes()
        for i, off in enumerate([0, 1000, 5000]):
            assert data[off : off + 200] == rows[2 * i].tobytes() + rows[2 * i + 1].tobytes()
        back = np.zeros_like(rows)
        assert disk_aio.run(fd, [(off, [back[2 * i].data, back[2 * i + 1].data], 200)
                                 for i, off in enumerate([0, 1000, 5000])], False) == []
        np.testing.assert_array_equal(back, rows)
    finally:
        os.close(fd)


@needs_aio
def test_disk_batched_calls_work_in_a_forked_child(tmp_path: Path) -> None:
    """AIO contexts are not inherited: a child gets its own."""
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    rows = np.full((3, 64), 7, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR)
    try:
        assert disk_aio.run(fd, _calls(rows, [0, 1024, 2048]), True) == []  # a context
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if its batched write works
            ok = False
            try:
                ok = disk_aio.run(fd, _calls(rows + 1, [256, 1280, 2304]), True) == []
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    data = path.read_bytes()
    assert data[256:320] == bytes([8]) * 64 and data[0:64] == bytes([7]) * 64


# -- the source-lifetime rule of write, shown failing on tiers that break it ---------------


class _LazyPool(DictPool):
    """Broken on purpose: a write keeps views of the caller's rows and copies them only
    when the slot is read, after the handle was done."""

    def write(self, slots: np.ndarray, source: np.ndarray) -> Any:
        handle = super().write(slots, source)  # the checks, and a correct copy it ignores
        self.views = getattr(self, "views", {})
        for i, slot in enumerate(np.asarray(slots).tolist()):
            self.views[slot] = source[i]
        return handle

    def read(self, slots: np.ndarray, dest: np.ndarray) -> Any:
        for slot in np.asarray(slots).tolist():
            if slot in getattr(self, "views", {}):
                self.data[slot] = self.views[slot].tobytes()
        return super().read(slots, dest)


class _HoldingPool(DictPool):
    """Broken on purpose, less visibly: copies at once (reads back right) but keeps the
    caller's last source array, so the caller cannot free it."""

    def write(self, slots: np.ndarray, source: np.ndarray) -> Any:
        self.last_source = source
        return super().write(slots, source)


def _tier_spec_of(pool_type: type[DictPool], name: str) -> TierSpec:
    class _Tier(DictTier):
        def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> DictPool:
            pool = pool_type(slot_bytes, num_slots, name)
            self.pools.append(pool)
            return pool

    return TierSpec(name=name, factory=_Tier, description="broken on purpose (tests)",
                    capabilities=DICT_TIER_CAPABILITIES)


def _run_conformance_case(spec: TierSpec, test: str, tmp_path: Path) -> None:
    """Run one case of the tier suite on ``spec`` (what its ``tier`` fixture sets up)."""
    suite = TierConformance()
    suite.spec = spec
    suite.backend = get_plugin_manager().kernel_backend("numpy").factory({})
    suite.tmp_path = tmp_path
    suite._opened, suite._names, suite._bases, suite._second = [], {}, {}, {}
    suite._counter = itertools.count()
    try:
        getattr(suite, test)(suite.open_tier())
    finally:
        for opened in suite._opened:
            opened.close()
        suite.backend.close()


_SOURCE_CASES = ("test_write_reads_its_source_only_until_its_handle_is_done",
                 "test_write_keeps_no_hold_on_its_source_after_its_handle_is_done")


@pytest.mark.parametrize("test", _SOURCE_CASES)
def test_the_suite_fails_a_tier_that_reads_its_write_source_after_the_handle_is_done(
        test: str, tmp_path: Path) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        _run_conformance_case(_tier_spec_of(_LazyPool, "lazy"), test, tmp_path)


def test_the_suite_fails_a_tier_that_holds_its_write_source_after_the_handle_is_done(
        tmp_path: Path) -> None:
    spec = _tier_spec_of(_HoldingPool, "holding")
    _run_conformance_case(spec, _SOURCE_CASES[0], tmp_path)  # reads back right
    with pytest.raises((AssertionError, pytest.fail.Exception), match="still holds"):
        _run_conformance_case(spec, _SOURCE_CASES[1], tmp_path)


@pytest.mark.parametrize("test", _SOURCE_CASES)
def test_the_source_cases_pass_the_reference_tier(test: str, tmp_path: Path) -> None:
    _run_conformance_case(DICT_TIER_SPEC, test, tmp_path)
