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
