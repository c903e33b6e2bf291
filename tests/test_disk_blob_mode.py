"""The disk tier's blob mode: append-only segments, an index rebuilt on reopen, compaction
of mostly dead segments, and a quota that counts stored bytes (the tier conformance suite
runs on it too: tests/test_conformance_tiers.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcm_tier_disk import DiskTier

from kvcm_core.errors import ConfigError

SLOT = 600
SEGMENT = 4096


def _tier(path, **options) -> DiskTier:
    return DiskTier(None, {"path": str(path), "mode": "blob", "segment_bytes": SEGMENT,
                           **options})


def _segments(path) -> list[str]:
    return sorted(p for p in os.listdir(path) if ".seg" in p)


def _read(pool, slots) -> list[bytes]:
    out = [b""] * len(slots)
    pool.read_blobs(np.asarray(slots), out).wait()
    return out


@pytest.mark.parametrize("options, field", [
    ({"mode": "blobs"}, "mode"),
    ({"segment_bytes": 100}, "segment_bytes"),
    ({"segment_bytes": True}, "segment_bytes"),
])
def test_bad_blob_mode_options_raise_config_error(tmp_path, options, field):
    with pytest.raises(ConfigError, match=f"disk.options.{field}"):
        DiskTier(None, {"path": str(tmp_path / "d"), **options})


def test_blob_mode_declares_blobs_and_slot_mode_does_not(tmp_path):
    assert _tier(tmp_path / "a").capabilities.blobs
    assert not DiskTier(None, {"path": str(tmp_path / "b")}).capabilities.blobs


def test_a_blob_larger_than_a_slot_is_refused_and_nothing_is_written(tmp_path):
    pool = _tier(tmp_path / "d").create_pool(SLOT, 4)
    with pytest.raises(ValueError, match="at most slot_bytes"):
        pool.write_blobs(np.array([0, 1]), [b"a", b"x" * (SLOT + 1)])
    assert _read(pool, [0, 1]) == [b"", b""]
    assert pool.stored_bytes == 0


def test_rewrites_leave_dead_bytes_until_a_mostly_dead_segment_is_compacted(tmp_path):
    tier = _tier(tmp_path / "d")
    pool = tier.create_pool(SLOT, 8)  # anonymous: its segments live in the owner directory
    first = [bytes([i]) * 500 for i in range(8)]
    pool.write_blobs(np.arange(8), first).wait()   # fills segment 1 past 4 KiB
    before = _segments(tier.owner_directory)
    assert len(before) == 1  # full, closed for writing: the next write starts segment 2
    pool.write_blobs(np.arange(6), [b"new" * 100] * 6).wait()  # 6 of 8 blobs now dead
    assert before[0] not in _segments(tier.owner_directory)    # segment 1 compacted
    assert _read(pool, range(8)) == [b"new" * 100] * 6 + first[6:]
    assert pool.stored_bytes == pool.live_bytes == 6 * 300 + 2 * 500


def test_stored_bytes_never_pass_the_quota_and_compaction_makes_room(tmp_path):
    pool = _tier(tmp_path / "d").create_pool(SLOT, 4)
    for round_ in range(20):
        blobs = [bytes([round_]) * SLOT] * 4
        pool.write_blobs(np.arange(4), blobs).wait()
        assert pool.stored_bytes <= 4 * SLOT
        assert _read(pool, range(4)) == blobs


def test_reopen_rebuilds_the_index_and_shrunk_slots_stay_empty(tmp_path):
    tier = _tier(tmp_path / "d")
    pool = tier.create_pool(SLOT, 6, name="kept")
    blobs = [bytes([i + 1]) * (50 * i + 1) for i in range(6)]
    pool.write_blobs(np.arange(6), blobs).wait()
    pool.write_blobs(np.array([2]), [b"later"]).wait()
    pool.resize(4)
    pool.resize(6)
    assert _read(pool, range(6)) == [blobs[0], blobs[1], b"later", blobs[3], b"", b""]
    tier.close()
    again = _tier(tmp_path / "d").create_pool(SLOT, 6, name="kept")
    assert _read(again, range(6)) == [blobs[0], blobs[1], b"later", blobs[3], b"", b""]


def test_reopen_with_another_slot_size_is_refused(tmp_path):
    tier = _tier(tmp_path / "d")
    tier.create_pool(SLOT, 2, name="p").write_blobs(np.array([0]), [b"x"]).wait()
    tier.close()
    with pytest.raises(ValueError, match="slot_bytes"):
        _tier(tmp_path / "d").create_pool(SLOT + 1, 2, name="p")


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(
    st.sampled_from(["write", "write", "write", "resize", "reopen"]),
    st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
    st.integers(0, SLOT), st.integers(1, 8)), min_size=1, max_size=25))
def test_blob_pool_matches_a_dict_model_and_keeps_its_quota(tmp_path_factory, ops):
    """Random writes, resizes and reopens: every slot reads back its last blob (or
    nothing), and stored bytes never pass ``num_slots * slot_bytes``."""
    path = tmp_path_factory.mktemp("model")
    tier = _tier(path)
    pool = tier.create_pool(SLOT, 8, name="m")
    model: dict[int, bytes] = {}
    try:
        for k, (op, slots, length, size) in enumerate(ops):
            slots = [s for s in slots if s < pool.num_slots]
            if op == "write" and slots:
                blobs = [bytes([(k + s) % 256]) * length for s in slots]
                pool.write_blobs(np.asarray(slots), blobs).wait()
                model.update(zip(slots, blobs, strict=True))
            elif op == "resize":
                pool.resize(size)
                model = {s: b for s, b in model.items() if s < size}
            elif op == "reopen":
                n = pool.num_slots
                tier.close()
                tier = _tier(path)
                pool = tier.create_pool(SLOT, n, name="m")
            assert pool.stored_bytes <= pool.num_slots * SLOT
            got = _read(pool, range(pool.num_slots))
            assert got == [model.get(s, b"") for s in range(pool.num_slots)]
    finally:
        tier.close()
