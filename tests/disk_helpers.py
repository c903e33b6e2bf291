"""Shared pieces of the disk tier's write-behind tests: the slot size, the skip mark for
glibc's AIO, seeded rows and waiting for a write on the tier's threads."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvcm_tier_disk import aio

from kvcm_core.tier import WriteBehind

SB = 64  # slot bytes

native = pytest.mark.skipif(not aio.native_available(),
                            reason="glibc's AIO on x86-64 Linux only")


def seeded_rows(n: int, seed: int, width: int = SB) -> np.ndarray:
    """``n`` seeded random rows of ``width`` bytes."""
    return np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)


def wait_written(handle: WriteBehind, timeout: float = 5.0) -> None:
    """Wait until a write on the tier's threads is done (fails after ``timeout``)."""
    end = time.monotonic() + timeout
    while not handle.done():
        assert time.monotonic() < end, "a write on the tier's threads never finished"
        time.sleep(0.0005)

