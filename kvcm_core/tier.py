"""The storage-tier contract: pools of fixed-size slots on one backing medium.

A tier creates and resizes pools; the core owns all accounting and slot allocation. Pools
of device-accessible tiers (gpu, pinned host) expose a :class:`~kvcm_core.backend.PageRegion`
that kernels read and write directly. Pools of the other tiers (disk, remote) expose
batched asynchronous ``write``/``read`` between their slots and host-visible staging
arrays, returning :class:`IOHandle` completion handles.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import Buffer, KernelBackend, PageRegion
from kvcm_core.errors import InvalidStateError, TierIOError
from kvcm_core.records import TierCapabilities

__all__ = [
    "CompletedIO", "DevicePool", "IOHandle", "KeyedTier", "Pool", "StoragePool", "Tier",
    "check_slots",
]


def check_slots(pool: Pool, slots: np.ndarray) -> np.ndarray:
    """Validate slot ids against ``pool.num_slots``; returns them as int64.

    Raises:
        IndexError is never raised to users: a ``ValueError`` names the slot and the range.
    """
    arr = np.asarray(slots, dtype=np.int64).reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= pool.num_slots):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise ValueError(f"slot {bad} out of range: pool has slots 0..{pool.num_slots - 1}")
    return arr


class IOHandle(abc.ABC):
    """Completion handle of an asynchronous tier operation."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the operation has finished (successfully or not)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until finished.

        Raises:
            TierIOError: the operation failed (the data it touched is not valid).
            TimeoutError: ``timeout`` seconds passed first.
        """


class CompletedIO(IOHandle):
    """A handle for work that already finished (or failed) synchronously."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            if isinstance(self._error, TierIOError):
                raise self._error
            raise TierIOError(str(self._error)) from self._error


class Pool(abc.ABC):
    """Fixed-size slots ``0..num_slots-1`` of ``slot_bytes`` each."""

    slot_bytes: int
    num_slots: int

    @abc.abstractmethod
    def resize(self, num_slots: int) -> None:
        """Grow or shrink to ``num_slots``, keeping the data of slots below
        ``min(old, new)``. May move the pool in memory (base addresses change)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the pool's memory or files (idempotent)."""

    @property
    def nbytes(self) -> int:
        """Bytes the pool occupies."""
        return self.slot_bytes * self.num_slots


class DevicePool(Pool):
    """A pool that kernels read and write directly (device or pinned host memory)."""

    @property
    @abc.abstractmethod
    def buffer(self) -> Buffer:
        """The memory backing the pool (changes on resize)."""

    @property
    def region(self) -> PageRegion:
        """Slot ``s`` is page ``s`` of this region."""
        return PageRegion(self.buffer, 0, self.slot_bytes)

    @property
    def base_address(self) -> int:
        """Address of slot 0, as kernels see it."""
        return self.buffer.ptr


class StoragePool(Pool):
    """A pool reached through asynchronous I/O (files, remote stores)."""

    @abc.abstractmethod
    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Store ``source[i]`` (``uint8 [n, slot_bytes]``, host memory) into ``slots[i]``.

        ``source`` must stay alive and unchanged until the handle is done.
        """

    @abc.abstractmethod
    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Load ``slots[i]`` into ``dest[i]`` (``uint8 [n, slot_bytes]``, host memory)."""


class Tier(abc.ABC):
    """A storage tier instance, built by its spec's ``factory(backend, options)``."""

    capabilities: TierCapabilities

    def __init__(self, backend: KernelBackend, options: Mapping[str, Any]) -> None:
        self.backend = backend
        self.options = dict(options)

    @abc.abstractmethod
    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> Pool:
        """A new pool; ``name`` is a stable label (used for file names by file tiers)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release tier-wide resources (thread pools, directories of temporary tiers)."""


class KeyedTier(Tier):
    """A store addressed by key instead of slot, shared by any number of managers (a
    remote store such as Redis). Its capacity is the store's own; what it evicts by itself
    is ordinary loss (a later ``get_many`` finds nothing).

    Every call takes ``deadline``, an absolute :func:`time.monotonic` time: the call
    returns by then (give or take a scheduler tick), whatever the store does. Keys are
    opaque bytes chosen by the core (a tier may prefix them with a namespace of its own);
    values are bytes that the tier stores and returns unchanged, never interprets.

    Partial success is per key (a batch may store some values and not others). A call that
    cannot reach the store at all, or that runs past its deadline, raises
    :class:`~kvcm_core.errors.TierIOError`; the tier stays usable and later calls try
    again. Bad arguments raise ``ValueError``/``TypeError`` before anything is sent.
    """

    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> Pool:
        """Keyed tiers have no slot pools.

        Raises:
            InvalidStateError: always.
        """
        raise InvalidStateError(
            f"{type(self).__name__} is a keyed tier: it stores values by key "
            "(put_many/get_many), not in slot pools")

    @abc.abstractmethod
    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview], *,
                 deadline: float) -> np.ndarray:
        """Store ``values[i]`` under ``keys[i]`` (overwriting). Returns a ``bool [n]`` array:
        which were stored."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes], *, deadline: float) -> list[bytes | None]:
        """The value stored under each key, or ``None`` where there is none (never stored,
        deleted, or evicted by the store)."""

    @abc.abstractmethod
    def exists_many(self, keys: Sequence[bytes], *, deadline: float) -> np.ndarray:
        """``bool [n]``: which keys hold a value now (it may vanish right after)."""

    @abc.abstractmethod
    def delete_many(self, keys: Sequence[bytes], *, deadline: float) -> int:
        """Delete the keys; returns how many held a value."""
