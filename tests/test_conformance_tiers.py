"""Every registered tier through the tier conformance suite, the reference and fault tiers
through it too, and unit tests of :class:`~kvcm_core.testing.faults.FaultyTier`."""

from __future__ import annotations

import numpy as np
import pytest

from kvcm_core.errors import TierIOError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.records import TierSpec
from kvcm_core.testing.conformance.tier import TierConformance
from kvcm_core.testing.faults import POISON, FaultPlan, FaultyTier, faulty_tier_spec
from kvcm_core.testing.reference import DICT_TIER_SPEC, DictPool, DictTier
from kvcm_core.tier import DevicePool, Pool, StoragePool


class TestTiers(TierConformance):
    """Every tier registered through the ``kvcm`` entry points."""


class TestDictTier(TierConformance):
    """The in-memory reference tier, read through its dict as the backdoor."""

    plugin_name = "dict"

    @pytest.fixture(scope="class")
    def kvcm_plugin_spec(self) -> TierSpec:
        return DICT_TIER_SPEC

    def backdoor_read(self, pool: Pool, slot: int) -> bytes | None:
        assert isinstance(pool, DictPool)
        return pool.data.get(slot, bytes(pool.slot_bytes))


class TestFaultyDiskWithoutFaults(TierConformance):
    """A FaultyTier with an empty plan is transparent: it passes the suite of its tier."""

    plugin_name = "faulty-disk"

    @pytest.fixture(scope="class")
    def kvcm_plugin_spec(self) -> TierSpec:
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
