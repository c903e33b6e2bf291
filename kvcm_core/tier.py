"""The storage-tier contract: pools of fixed-size slots on one backing medium.

A tier creates and resizes pools; the core owns all accounting and slot allocation. Pools
of device-accessible tiers (gpu, pinned host) expose a :class:`~kvcm_core.backend.PageRegion`
that kernels read and write directly. Pools of the other tiers (disk, remote) expose
batched asynchronous ``write``/``read`` between their slots and host-visible staging
arrays, returning :class:`IOHandle` completion handles.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import Buffer, KernelBackend, PageRegion
from kvcm_core.errors import InvalidArgumentError, InvalidStateError, TierIOError
from kvcm_core.records import TierCapabilities

__all__ = [
    "BlobPool",
    "CompletedIO",
    "DevicePool",
    "IOHandle",
    "KeyedTier",
    "Pool",
    "StoragePool",
    "Tier",
    "WriteBehind",
    "check_slots",
    "checked_rows",
]


def check_slots(pool: Pool, slots: np.ndarray) -> np.ndarray:
    """Validate slot ids against ``pool.num_slots``; returns them as int64.

    Raises:
        IndexError is never raised to users: a ``ValueError`` names the slot and the range.
    """
    arr = np.asarray(slots, dtype=np.int64).reshape(-1)
    # One reduction for both bounds: read as uint64, a negative slot is larger than any
    # pool (num_slots < 2**63).
    if arr.size and int(arr.view(np.uint64).max()) >= pool.num_slots:
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise InvalidArgumentError(
            f"slot {bad} out of range: pool has slots 0..{pool.num_slots - 1}")
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


class WriteBehind(abc.ABC):
    """A write started by :meth:`StoragePool.write_behind`, polled without blocking."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the write finished (successfully or not); never blocks."""

    @abc.abstractmethod
    def error(self) -> str | None:
        """Once :meth:`done`: None when every byte was written, else what failed."""


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

    def write_into(self, slots: np.ndarray, fill: Callable[[np.ndarray], None]) -> IOHandle:
        """:meth:`write` of rows that ``fill(rows)`` writes into ``rows`` (``uint8 [n,
        slot_bytes]``, ``n = len(slots)``), lent by the pool: the core frames cold pages
        this way, so that a pool that keeps rows for later (a storage level's held
        writes) lends its own and saves a copy. The default fills a new array and hands
        it to :meth:`write`; tiers need not override it."""
        rows = np.empty((len(np.asarray(slots).reshape(-1)), self.slot_bytes), dtype=np.uint8)
        fill(rows)
        return self.write(slots, rows)

    def write_behind(self, slots: np.ndarray, source: np.ndarray) -> WriteBehind | None:
        """Start writing ``source[i]`` into ``slots[i]`` on threads that never take
        Python's interpreter lock, and return at once; None when the pool cannot (the
        caller then writes through :meth:`write`). ``source`` may be reused as soon as
        this returns. A storage level with an I/O thread hands its background writes
        here first, so that they do not compete with the scheduler for the interpreter
        lock. Raises as :meth:`write` does for bad arguments; the default declines."""
        return None

    def read_nowait(self, slots: np.ndarray, dest: np.ndarray) -> bool:
        """Load ``slots[i]`` into ``dest[i]`` now, only if that cannot block (the data
        is in memory, e.g. the page cache); True when every row was read. False: nothing
        may be assumed of ``dest``, and the caller reads through :meth:`read`. A storage
        level with an I/O thread tries this on the caller's thread first, which saves
        the hand-over to the thread. Never raises for I/O; the default declines."""
        return False


class BlobPool(StoragePool):
    """A storage pool that stores each slot's bytes as a blob of its own size (at most
    ``slot_bytes``), for tiers that declare ``capabilities.blobs``. Its quota counts the
    bytes stored, so blobs compressed by a level's blob codec take less of it.

    The fixed-size ``write``/``read`` of :class:`StoragePool` store and load whole rows
    as blobs; the core uses ``write_blobs``/``read_blobs``.
    """

    @abc.abstractmethod
    def write_blobs(self, slots: np.ndarray, blobs: Sequence[bytes]) -> IOHandle:
        """Store ``blobs[i]`` (``len <= slot_bytes``) as the bytes of ``slots[i]``."""

    @abc.abstractmethod
    def read_blobs(self, slots: np.ndarray, out: list[bytes]) -> IOHandle:
        """Load the blob of ``slots[i]`` into ``out[i]``: ``b""`` for a slot never
        written; a blob whose storage was damaged may come back with another length."""

    @property
    @abc.abstractmethod
    def stored_bytes(self) -> int:
        """Bytes stored, as counted against the pool's ``num_slots * slot_bytes``."""

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Store each row of ``source`` (``uint8 [n, slot_bytes]``) as a blob."""
        rows = checked_rows(self, source, len(np.asarray(slots).reshape(-1)), "source")
        return self.write_blobs(slots, [row.tobytes() for row in rows])

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Load whole-row blobs into ``dest`` (a slot never written reads as zeros).

        A blob of another length fails the returned handle with :class:`TierIOError`.
        """
        arr = check_slots(self, slots)
        rows = checked_rows(self, dest, len(arr), "dest")
        blobs: list[bytes] = [b""] * len(arr)
        try:
            self.read_blobs(arr, blobs).wait()
        except TierIOError as exc:
            return CompletedIO(exc)
        for i, blob in enumerate(blobs):
            if blob and len(blob) != self.slot_bytes:
                return CompletedIO(TierIOError(
                    f"slot {int(arr[i])} holds {len(blob)} bytes, not {self.slot_bytes}"))
            rows[i] = np.frombuffer(blob, dtype=np.uint8) if blob else 0
        return CompletedIO()


def checked_rows(pool: Pool, array: np.ndarray, n: int, what: str) -> np.ndarray:
    """``array`` after checking it is ``uint8 [n, pool.slot_bytes]`` (host rows).

    Raises:
        ValueError: it is not (naming ``what``, its type or shape, and the rule).
    """
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
        raise ValueError(
            f"{what} of type {type(array).__name__} "
            f"dtype={getattr(array, 'dtype', None)}: must be a uint8 numpy array"
        )
    if array.shape != (n, pool.slot_bytes):
        raise ValueError(
            f"{what}.shape={array.shape}: must be ({n}, {pool.slot_bytes}) "
            "(one row of slot_bytes per slot)"
        )
    return array


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

    def store_instances(self) -> Mapping[str, str]:
        """For each server of the store this tier has reached (by address), an identity of
        the server process it last found there (Redis: its ``run_id``), recorded when a
        connection was opened; no I/O. A new identity at an address seen before means that
        server restarted or was replaced, and may have lost what it held: the core then
        checks the keys it counts as its own. The default, ``{}``: the tier cannot tell."""
        return {}

    @abc.abstractmethod
    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview], *,
                 deadline: float) -> np.ndarray:
        """Store ``values[i]`` under ``keys[i]`` (overwriting). Returns a ``bool [n]`` array:
        which were stored. The values are read only until the call returns (or raises):
        the caller may then overwrite or free them."""

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

    def renew_many(self, keys: Sequence[bytes], *, ttl_s: float, deadline: float
                   ) -> np.ndarray:
        """``bool [n]``: which keys hold a value; each that does now expires ``ttl_s``
        seconds from now (a later renewal pushes it back) and counts as just used for the
        store's own eviction (LRU). The core keeps its small sentinel key alive this way
        (docs/remote.md, "Lost keys"). The default is :meth:`exists_many`: for a store
        that cannot expire keys, nothing expires and nothing is touched."""
        return self.exists_many(keys, deadline=deadline)

    @property
    def expires(self) -> bool:
        """Whether :meth:`put_expiring_many` and :meth:`renew_many` give keys an expiry.
        A tier that finds it cannot (its store refuses the expiry command) turns False:
        a key written with an expiry before then would expire for want of renewals, so
        the core writes its sentinel again (:meth:`put_expiring_many`, now without one)."""
        return True

    def put_expiring_many(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview],
                          *, ttl_s: float, deadline: float) -> np.ndarray:
        """As :meth:`put_many`, each value stored to expire ``ttl_s`` seconds from now (a
        later :meth:`renew_many` pushes it back). A store that can expire keys writes the
        value with its expiry in one command, so that a call that fails or runs late never
        leaves a value without one (the core writes its sentinel key this way). The default
        (for stores that cannot) is :meth:`put_many`, then :meth:`renew_many` of the
        values stored: ``bool [n]``, which were stored and renewed."""
        ok = np.asarray(self.put_many(keys, values, deadline=deadline), dtype=bool)
        if ok.any():
            stored = [k for k, s in zip(keys, ok.tolist(), strict=True) if s]
            ok[ok] = self.renew_many(stored, ttl_s=ttl_s, deadline=deadline)
        return ok
