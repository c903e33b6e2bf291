"""The ``gpu`` tier: pools in device memory of the active kernel backend.

Level 0 of every manager lives here. Pools are single allocations made through
:meth:`~kvcm_core.backend.KernelBackend.alloc_device`; kernels read and write them directly
through :attr:`~kvcm_core.tier.DevicePool.region`. On the ``numpy`` backend "device memory"
is host memory, so the tier works (and is tested) on machines without a GPU.

This module also provides :class:`MemoryTier` and :class:`MemoryPool`, the shared
implementation of tiers whose pools are one backend allocation each (the ``host`` tier
builds on them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from kvcm_core import hookimpl
from kvcm_core.backend import Buffer, CopyTask, KernelBackend, PageRegion
from kvcm_core.errors import ConfigError, InvalidStateError
from kvcm_core.records import Medium, TierCapabilities, TierSpec
from kvcm_core.tier import DevicePool, Tier

__all__ = ["CAPABILITIES", "GpuTier", "MemoryPool", "MemoryTier", "check_pool_size"]

CAPABILITIES = TierCapabilities(device_accessible=True, medium=Medium.DEVICE)

#: Page size of the contiguous copy that carries kept slots over on resize: large enough
#: that the copy runs at bandwidth, small enough that a gather kernel spreads it over SMs.
_RESIZE_CHUNK = 1 << 20


def check_pool_size(slot_bytes: object, num_slots: object) -> tuple[int, int]:
    """Validate the sizes of a new or resized pool.

    Returns:
        ``(slot_bytes, num_slots)`` as ints.

    Raises:
        ValueError: ``slot_bytes`` is not an int >= 1 or ``num_slots`` not an int >= 0.
    """
    for field, value, minimum in (("slot_bytes", slot_bytes, 1), ("num_slots", num_slots, 0)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{field}={value!r}: must be an int >= {minimum}")
        if value < minimum:
            raise ValueError(f"{field}={value!r}: must be >= {minimum}")
    return int(slot_bytes), int(num_slots)  # type: ignore[call-overload]


class MemoryPool(DevicePool):
    """A pool that is one backend allocation; slot ``s`` is bytes ``[s*B, (s+1)*B)``.

    Args:
        backend: the kernel backend that owns the memory.
        allocate: ``backend.alloc_device`` or ``backend.alloc_host``.
        slot_bytes: bytes per slot (>= 1).
        num_slots: initial slot count (>= 0).
        label: names the pool in error messages.
    """

    def __init__(
        self,
        backend: KernelBackend,
        allocate: Callable[[int], Buffer],
        slot_bytes: int,
        num_slots: int,
        label: str,
    ) -> None:
        self.slot_bytes, self.num_slots = check_pool_size(slot_bytes, num_slots)
        self._backend = backend
        self._allocate = allocate
        self._label = label
        self._buffer: Buffer | None = allocate(self.slot_bytes * self.num_slots)

    @property
    def buffer(self) -> Buffer:
        """The allocation backing the pool; a new one after every :meth:`resize`.

        Raises:
            InvalidStateError: the pool was closed.
        """
        if self._buffer is None:
            raise InvalidStateError(f"{self._label} was closed; its memory is released")
        return self._buffer

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to ``num_slots``, keeping the data of slots below the smaller count.

        Allocates the new memory first (so a failed allocation leaves the pool as it was),
        waits for all queued device work, copies the kept bytes with one batched
        ``copy_pages`` on the default stream, waits for it and frees the old memory. The
        pool therefore **moves**: :attr:`buffer`, :attr:`base_address` and :attr:`region`
        change, and page tables or views taken before must be rebuilt. Slots beyond the old
        count start with undefined contents.

        Raises:
            ValueError: ``num_slots`` is not an int >= 0.
            InvalidStateError: the pool was closed.
        """
        _, num_slots = check_pool_size(self.slot_bytes, num_slots)
        old = self.buffer
        new = self._allocate(self.slot_bytes * num_slots)
        kept = self.slot_bytes * min(self.num_slots, num_slots)
        queued = False  # a copy into ``new`` may be queued
        try:
            if kept:
                self._backend.synchronize()  # writers on any stream finish before the copy
                queued = True
                self._backend.copy_pages_batch(list(_contiguous_copy(new, old, kept)))
                self._backend.default_stream.synchronize()
        except BaseException:
            # Freed only once no copy into it can still run: memory a queued copy would
            # write into is never handed out again (it is leaked instead).
            if not queued or _drained(self._backend):
                new.free()
            raise
        old.free()
        self._buffer = new
        self.num_slots = num_slots

    def close(self) -> None:
        """Free the memory (idempotent); later use of :attr:`buffer` raises."""
        if self._buffer is not None:
            self._buffer.free()
            self._buffer = None


def _drained(backend: KernelBackend) -> bool:
    """Whether the default stream's queued work has run (False: waiting for it failed)."""
    try:
        backend.default_stream.synchronize()
    except BaseException:  # (the caller re-raises the first error)
        return False
    return True


def _contiguous_copy(dst: Buffer, src: Buffer, nbytes: int) -> Iterator[CopyTask]:
    """``copy_pages`` tasks that copy the first ``nbytes`` of ``src`` to ``dst``."""
    chunk = min(nbytes, _RESIZE_CHUNK)
    whole, rest = divmod(nbytes, chunk)
    pages = np.arange(whole, dtype=np.int32)
    yield CopyTask(
        PageRegion(dst, 0, chunk), PageRegion(src, 0, chunk), chunk, np.stack([pages, pages], 1)
    )
    if rest:
        tail = whole * chunk
        pair = np.zeros((1, 2), dtype=np.int32)
        yield CopyTask(PageRegion(dst, tail, rest), PageRegion(src, tail, rest), rest, pair)


class MemoryTier(Tier):
    """A tier whose pools are backend allocations (subclasses choose which allocator).

    Takes no options: an unknown option raises :class:`~kvcm_core.errors.ConfigError`.
    """

    tier_name = "memory"

    def __init__(self, backend: KernelBackend, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, options or {})
        for key, value in self.options.items():
            raise ConfigError(
                f"{self.tier_name}.options.{key}", value, "unknown option; this tier takes none"
            )
        self._pools: list[MemoryPool] = []

    def _allocator(self) -> Callable[[int], Buffer]:
        raise NotImplementedError

    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> MemoryPool:
        """A new pool of ``num_slots`` slots of ``slot_bytes`` bytes (contents undefined).

        Raises:
            ValueError: bad sizes.
        """
        label = f"{self.tier_name} pool {name!r}" if name else f"unnamed {self.tier_name} pool"
        pool = MemoryPool(self.backend, self._allocator(), slot_bytes, num_slots, label)
        self._pools.append(pool)
        return pool

    def close(self) -> None:
        """Free every pool this tier created (idempotent)."""
        pools, self._pools = self._pools, []
        for pool in pools:
            pool.close()


class GpuTier(MemoryTier):
    """Pools in device memory of the active backend (see module docstring)."""

    tier_name = "gpu"
    capabilities = CAPABILITIES

    def _allocator(self) -> Callable[[int], Buffer]:
        return self.backend.alloc_device


@hookimpl
def kvcm_tiers() -> Iterator[TierSpec]:
    yield TierSpec(
        name="gpu",
        factory=GpuTier,
        description="Device memory of the active kernel backend (level 0)",
        capabilities=CAPABILITIES,
    )
