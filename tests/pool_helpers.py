"""A storage pool that passes every call to another one: tests subclass it to change one
operation (a write that fails or blocks, a write behind that is held back) while the rest
stays the real pool's."""

from __future__ import annotations

import numpy as np

from kvcm_core.tier import IOHandle, StoragePool


class PassThroughPool(StoragePool):
    """Every operation is ``inner``'s (``write_behind`` declines, as the base class)."""

    def __init__(self, inner: StoragePool) -> None:
        self.inner = inner
        self.slot_bytes, self.num_slots = inner.slot_bytes, inner.num_slots

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        return self.inner.write(slots, source)

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        return self.inner.read(slots, dest)

    def read_nowait(self, slots: np.ndarray, dest: np.ndarray) -> bool:
        return self.inner.read_nowait(slots, dest)

    def resize(self, num_slots: int) -> None:
        self.inner.resize(num_slots)
        self.num_slots = self.inner.num_slots

    def close(self) -> None:
        self.inner.close()
