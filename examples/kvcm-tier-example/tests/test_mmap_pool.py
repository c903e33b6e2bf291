"""MmapPool and MmapTier beyond the conformance suite: errors kept by the caller."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvcm_tier_example import MmapTier


def test_resize_and_close_work_while_the_caller_keeps_an_error_of_a_bad_write() -> None:
    """A misshapen write raises ValueError (the contract); the caller may keep the error
    (a level's last error, pytest.raises). Its frames must hold no view of the mapping:
    resize then keeps the bytes and changes the size, and both closes remove everything
    (they raised a raw BufferError, left num_slots changed and the directory behind)."""
    tier = MmapTier(None, {})
    pool = tier.create_pool(16, 4, name="p")
    pool.write(np.arange(2), np.full((2, 16), 7, np.uint8)).wait()
    with pytest.raises(ValueError) as kept_write:
        pool.write(np.arange(2), np.ones((2, 15), np.uint8))
    with pytest.raises(ValueError) as kept_read:
        pool.read(np.arange(2), np.empty((3, 16), np.uint8))
    pool.resize(8)
    assert pool.num_slots == 8 and os.path.getsize(pool.path) == 8 * 16
    out = np.zeros((2, 16), np.uint8)
    pool.read(np.arange(2), out).wait()
    assert (out == 7).all()
    directory = tier.directory
    assert directory is not None
    pool.close()
    tier.close()
    assert not os.path.exists(directory)
    assert kept_write.value is not None and kept_read.value is not None


def test_a_resize_that_cannot_remap_keeps_the_pool_as_it_was() -> None:
    """With a view of the mapping held elsewhere, resize raises TierIOError, not a raw
    BufferError, and the pool keeps its size and bytes; Tier.close still removes the
    directory and reports the pool it could not close as TierIOError."""
    from kvcm_core.errors import TierIOError

    tier = MmapTier(None, {})
    pool = tier.create_pool(16, 4, name="p")
    pool.write(np.arange(1), np.full((1, 16), 3, np.uint8)).wait()
    view = pool._slots()  # held by someone: the mapping cannot be closed
    with pytest.raises(TierIOError):
        pool.resize(8)
    assert pool.num_slots == 4 and os.path.getsize(pool.path) == 4 * 16
    out = np.zeros((1, 16), np.uint8)
    pool.read(np.arange(1), out).wait()
    assert (out == 3).all()
    directory = tier.directory
    assert directory is not None
    with pytest.raises(TierIOError):
        tier.close()
    assert not os.path.exists(directory) and tier.directory is None
    del view


def test_a_pool_whose_failed_resize_could_not_map_again_maps_on_next_use_keeping_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A resize whose new mapping fails (no memory) and whose old mapping cannot be made
    again either raises TierIOError and keeps its size; the next write or read maps the
    file again (the bytes are still in it), or raises TierIOError if it cannot (it raised
    a raw IndexError: no mapping behind a pool of 8 slots)."""
    import errno

    import kvcm_tier_example as ex

    from kvcm_core.errors import TierIOError

    tier = MmapTier(None, {})
    pool = tier.create_pool(16, 8, name="p")
    pool.write(np.arange(2), np.full((2, 16), 5, np.uint8)).wait()
    real = ex.mmap.mmap

    def no_memory(*a: object, **k: object) -> object:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(ex.mmap, "mmap", no_memory)
    with pytest.raises(TierIOError, match="cannot map"):
        pool.resize(16)
    assert pool.num_slots == 8
    with pytest.raises(TierIOError, match="not mapped since a failed resize"):
        pool.write(np.array([3]), np.zeros((1, 16), np.uint8))
    monkeypatch.setattr(ex.mmap, "mmap", real)
    pool.write(np.array([3]), np.full((1, 16), 9, np.uint8)).wait()
    out = np.zeros((4, 16), np.uint8)
    pool.read(np.arange(4), out).wait()
    assert (out[:2] == 5).all() and (out[3] == 9).all()
    tier.close()
