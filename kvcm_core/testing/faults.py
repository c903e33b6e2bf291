"""A fault-injecting tier for reliability tests.

:class:`FaultyTier` wraps any tier and, following a mutable :class:`FaultPlan`, makes
storage reads and writes fail through their handles, stores corrupted bytes, or holds
completion back. Faults are deterministic (chosen by operation ordinal, never by chance or
time), so a failing test replays exactly.

What a fault does, so that code which ignores an error is caught rather than lucky:

- a failed **write** stores poison bytes (``POISON``) in the slots it named, as a torn
  write would, and its handle's ``wait()`` raises :class:`~kvcm_core.errors.TierIOError`;
- a failed **read** fills the destination rows with poison and its handle raises;
- a **corrupting write** stores the rows with one byte inverted (``corrupt_offset``: the
  first by default, which is a cold frame's magic; point it at the payload or the checksum
  to exercise the other checks) and reports success (silent corruption, for frame checks);
- :meth:`FaultyTier.corrupt` inverts that byte of one stored slot now;
- **failing close** (``fail_close``) closes the inner pool or tier, then raises
  ``OSError(EROFS)`` as a read-only file system would (for shutdown paths);
- a **slow** operation (``slow_writes``/``slow_reads``, ``slow_all``) sleeps ``slow_s``
  seconds on the thread that called it, then proceeds normally (a frozen file system, for
  I/O deadlines; with ``LevelConfig.io_deadline_s`` the caller is the level's I/O thread);
- **holding** keeps handles pending (``done()`` False, ``wait(timeout)`` raising
  ``TimeoutError``) until :meth:`FaultyTier.release`; ``pending_polls`` makes each handle
  answer ``done() == False`` that many times first.

A wrapped pool that has its own background writes and memory reads (the disk tier's
``write_behind`` / ``read_nowait``) keeps them, so that a storage level uses the same I/O
paths as with the bare tier: a failed or corrupting write is injected on ``write_behind``
too (the same ordinals; a failed one's ``error()`` says so), while a write planned slow, a
read planned to fail or be slow, and ``hold`` / ``pending_polls`` make those paths decline
(the caller then goes through ``write`` / ``read``, where the fault happens).

Blob pools (tiers storing blobs by size, such as the disk tier in blob mode) are wrapped
as :class:`FaultyBlobPool`, whose ``write_blobs``/``read_blobs`` follow the same plan.
Device-accessible pools are passed through (kernels reach their memory directly, so there
is no operation to fail); :meth:`FaultyTier.corrupt` works on them through the backend.
Neither class is registered as a plugin; :func:`faulty_tier_spec` builds a record for
tests that need one.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.backend import Buffer
from kvcm_core.errors import TierIOError
from kvcm_core.level_io import IODeadlineError
from kvcm_core.records import TierSpec
from kvcm_core.tier import (
    BlobPool,
    DevicePool,
    IOHandle,
    Pool,
    StoragePool,
    Tier,
    WriteBehind,
    check_slots,
)

__all__ = [
    "POISON",
    "FaultPlan",
    "FaultyBlobPool",
    "FaultyDevicePool",
    "FaultyStoragePool",
    "FaultyTier",
    "faulty_tier_spec",
]

#: Byte stored by a failed write and returned by a failed read.
POISON = 0xEE


def _ordinals(value: Iterable[int]) -> set[int]:
    out = set()
    for n in value:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"operation ordinal {n!r}: must be an int >= 1 (the first is 1)")
        out.add(n)
    return out


@attrs.define(kw_only=True)
class FaultPlan:
    """Which operations of a :class:`FaultyTier` misbehave. Mutable: change it mid-test.

    Ordinals count ``write`` (or ``read``) calls over all storage pools of the tier,
    starting at 1. A level's held writes (``LevelConfig.write_combine_bytes``) reach the
    tier only when they go out, and a read of held rows never reaches it: a test of read
    faults either waits for the write-back (``wait_idle``) or turns holding off.

    Attributes:
        fail_writes: ordinals of writes that fail.
        fail_reads: ordinals of reads that fail.
        fail_all_writes: every write fails.
        fail_all_reads: every read fails.
        corrupt_writes: ordinals of writes that store corrupted bytes and report success.
        corrupt_offset: the byte of each row or blob that corruption inverts (negative:
            from the end; 0, the default, is a cold frame's magic).
        hold: new handles stay pending until :meth:`FaultyTier.release`.
        pending_polls: each new handle answers ``done() == False`` this many times first.
        fail_close: closing a storage pool or the tier raises ``OSError(EROFS)`` (after
            closing the inner one).
        slow_writes: ordinals of writes that sleep ``slow_s`` first.
        slow_reads: ordinals of reads that sleep ``slow_s`` first.
        slow_all: every storage read and write sleeps ``slow_s`` first.
        slow_resizes: every storage pool resize sleeps ``slow_s`` first (then resizes).
        slow_s: seconds a slow operation sleeps (default 1.0).
    """

    fail_writes: set[int] = attrs.field(factory=set, converter=_ordinals)
    fail_reads: set[int] = attrs.field(factory=set, converter=_ordinals)
    fail_all_writes: bool = False
    fail_all_reads: bool = False
    corrupt_writes: set[int] = attrs.field(factory=set, converter=_ordinals)
    corrupt_offset: int = 0
    hold: bool = False
    pending_polls: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    fail_close: bool = False
    slow_writes: set[int] = attrs.field(factory=set, converter=_ordinals)
    slow_reads: set[int] = attrs.field(factory=set, converter=_ordinals)
    slow_all: bool = False
    slow_resizes: bool = False
    slow_s: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))


class _FaultyHandle(IOHandle):
    def __init__(
        self,
        inner: IOHandle,
        error: TierIOError | None,
        gate: threading.Event | None,
        polls: int,
        keep: np.ndarray | None,
    ) -> None:
        self._inner = inner
        self._keep = keep  # staging rows of an injected write must outlive the inner I/O
        self._error = error
        self._gate = gate
        self._polls = polls

    def done(self) -> bool:
        if self._gate is not None and not self._gate.is_set():
            return False
        if self._polls > 0:
            self._polls -= 1
            return False
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> None:
        if self._gate is not None and not self._gate.wait(timeout):
            raise TimeoutError(f"held by FaultyTier: not released within {timeout} s")
        self._polls = 0
        if self._error is not None:
            try:
                self._inner.wait(timeout)
            except TierIOError:
                pass
            raise self._error
        self._inner.wait(timeout)


class FaultyStoragePool(StoragePool):
    """A storage pool whose ``read``/``write`` follow the tier's :class:`FaultPlan`."""

    def __init__(self, tier: FaultyTier, inner: StoragePool) -> None:
        self.tier = tier
        self.inner = inner
        self.slot_bytes = inner.slot_bytes
        self.num_slots = inner.num_slots

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Write through the inner pool, failing or corrupting as planned."""
        arr = check_slots(self, slots)
        tier, plan = self.tier, self.tier.plan
        tier.writes += 1
        n = tier.writes
        tier.maybe_slow("write", n, arr)
        if plan.fail_all_writes or n in plan.fail_writes:
            poison = np.full((len(arr), self.slot_bytes), POISON, dtype=np.uint8)
            inner = self.inner.write(arr, poison)
            tier.injected.append(f"write {n} failed (slots {arr.tolist()})")
            tier.mark(self, arr, "failed write")
            error = TierIOError(f"injected fault: write {n} of slots {arr.tolist()} failed")
            return tier.handle(inner, error, keep=poison)
        if n in plan.corrupt_writes:
            bad = np.array(source, dtype=np.uint8, copy=True)
            bad[:, plan.corrupt_offset % self.slot_bytes] ^= 0xFF
            tier.injected.append(f"write {n} corrupted (slots {arr.tolist()})")
            tier.mark(self, arr, "corrupt")
            return tier.handle(self.inner.write(arr, bad), None, keep=bad)
        tier.mark(self, arr, None)
        return tier.handle(self.inner.write(arr, source), None)

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Read through the inner pool, failing as planned (poison in ``dest``)."""
        arr = check_slots(self, slots)
        tier, plan = self.tier, self.tier.plan
        tier.reads += 1
        n = tier.reads
        tier.maybe_slow("read", n, arr)
        if plan.fail_all_reads or n in plan.fail_reads:
            if (
                isinstance(dest, np.ndarray)
                and dest.shape == (len(arr), self.slot_bytes)
                and dest.flags.writeable
            ):
                dest[...] = POISON
            else:  # let the inner pool report the bad argument
                self.inner.read(arr, dest)
            tier.injected.append(f"read {n} failed (slots {arr.tolist()})")
            error = TierIOError(f"injected fault: read {n} of slots {arr.tolist()} failed")
            return tier.handle(_Done(), error)
        return tier.handle(self.inner.read(arr, dest), None)

    # -- the inner pool's own background writes and memory reads, when it has them ----------

    def write_behind(self, slots: np.ndarray, source: np.ndarray) -> WriteBehind | None:
        """The inner pool's ``write_behind``, following the plan as :meth:`write` does
        (same ordinals): a failed write stores poison and its handle's ``error()`` says
        so, a corrupting write stores the inverted byte and reports success. None
        (declined: the caller writes through :meth:`write`, no ordinal spent) when the
        inner pool declines or has no ``write_behind``, when the next write is planned
        slow (it sleeps in :meth:`write`, on the level's thread, never on the caller's),
        or while ``hold`` or ``pending_polls`` is set."""
        return self._behind(slots, source, None, False)

    def _write_behind_checked(self, slots: np.ndarray, source: np.ndarray, bound: int,
                              owned: bool = False) -> WriteBehind | None:
        """:meth:`write_behind` for a level that has checked ``slots`` (see
        ``StoragePool`` implementations such as the disk tier's): passed on to the inner
        pool's own ``_write_behind_checked`` when it has one."""
        return self._behind(slots, source, bound, owned)

    def _behind(self, slots: np.ndarray, source: np.ndarray, bound: int | None,
                owned: bool) -> WriteBehind | None:
        inner = self.inner
        if type(inner).write_behind is StoragePool.write_behind:
            return None
        tier, plan = self.tier, self.tier.plan
        n = tier.writes + 1
        if plan.hold or plan.pending_polls or plan.slow_all or n in plan.slow_writes:
            return None
        arr = check_slots(self, slots) if bound is None else slots
        ok_rows = isinstance(source, np.ndarray) and source.shape == (len(arr),
                                                                    self.slot_bytes)
        failing = ok_rows and (plan.fail_all_writes or n in plan.fail_writes)
        corrupting = ok_rows and not failing and n in plan.corrupt_writes
        rows = source
        if failing:
            rows = np.full((len(arr), self.slot_bytes), POISON, dtype=np.uint8)
        elif corrupting:
            rows = np.array(source, dtype=np.uint8, copy=True)
            rows[:, plan.corrupt_offset % self.slot_bytes] ^= 0xFF
        checked = getattr(type(inner), "_write_behind_checked", None)
        if checked is not None and bound is not None:
            handle = checked(inner, arr, rows, bound, owned and not (failing or corrupting))
        else:
            handle = inner.write_behind(arr, rows)
        if handle is None:
            return None
        tier.writes = n
        if failing:
            tier.injected.append(f"write {n} failed (slots {arr.tolist()}, behind)")
            tier.mark(self, arr, "failed write")
        elif corrupting:
            tier.injected.append(f"write {n} corrupted (slots {arr.tolist()}, behind)")
            tier.mark(self, arr, "corrupt")
        else:
            tier.mark(self, arr, None)
        if not failing:
            return handle
        return _FailedBehind(handle, f"injected fault: write {n} of slots {arr.tolist()} "
                                     "failed")

    def read_nowait(self, slots: np.ndarray, dest: np.ndarray) -> bool:
        """The inner pool's ``read_nowait`` (a read, by ordinal, when it reads): declined
        (False, no ordinal spent; the caller reads through :meth:`read`, where the fault
        happens) when the next read is planned to fail or be slow, while ``hold`` or
        ``pending_polls`` is set, or when the inner pool declines."""
        inner = self.inner
        if type(inner).read_nowait is StoragePool.read_nowait:
            return False
        tier, plan = self.tier, self.tier.plan
        n = tier.reads + 1
        if plan.fail_all_reads or n in plan.fail_reads or plan.slow_all or \
                n in plan.slow_reads or plan.hold or plan.pending_polls:
            return False
        if not inner.read_nowait(slots, dest):
            return False
        tier.reads = n
        return True

    def resize(self, num_slots: int) -> None:
        tier = self.tier
        if tier.plan.slow_resizes:
            tier.injected.append(f"resize to {num_slots} slow")
            time.sleep(tier.plan.slow_s)
        self.inner.resize(num_slots)
        self.num_slots = self.inner.num_slots

    def close(self) -> None:
        self.inner.close()
        self.tier.closing_fault("storage pool")


def _inverted(blob: bytes, offset: int) -> bytes:
    """``blob`` with byte ``offset`` (negative: from the end) inverted."""
    if not blob:
        return blob
    out = bytearray(blob)
    out[offset % len(out)] ^= 0xFF
    return bytes(out)


class FaultyBlobPool(FaultyStoragePool, BlobPool):
    """A blob pool whose ``write_blobs``/``read_blobs`` follow the tier's plan too (the
    fixed-row ``write``/``read`` go through them)."""

    inner: BlobPool

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        return BlobPool.write(self, slots, source)

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        return BlobPool.read(self, slots, dest)

    @property
    def stored_bytes(self) -> int:
        return self.inner.stored_bytes

    def write_blobs(self, slots: np.ndarray, blobs: Sequence[bytes]) -> IOHandle:
        """Write through the inner pool, failing or corrupting as planned."""
        arr = check_slots(self, slots)
        tier, plan = self.tier, self.tier.plan
        tier.writes += 1
        n = tier.writes
        tier.maybe_slow("write", n, arr)
        if plan.fail_all_writes or n in plan.fail_writes:
            inner = self.inner.write_blobs(arr, [bytes([POISON]) * len(b) for b in blobs])
            tier.injected.append(f"write {n} failed (slots {arr.tolist()})")
            tier.mark(self, arr, "failed write")
            error = TierIOError(f"injected fault: write {n} of slots {arr.tolist()} failed")
            return tier.handle(inner, error)
        if n in plan.corrupt_writes:
            blobs = [_inverted(bytes(b), plan.corrupt_offset) for b in blobs]
            tier.injected.append(f"write {n} corrupted (slots {arr.tolist()})")
            tier.mark(self, arr, "corrupt")
        else:
            tier.mark(self, arr, None)
        return tier.handle(self.inner.write_blobs(arr, blobs), None)

    def read_blobs(self, slots: np.ndarray, out: list[bytes]) -> IOHandle:
        """Read through the inner pool, failing as planned (poison in ``out``)."""
        arr = check_slots(self, slots)
        tier, plan = self.tier, self.tier.plan
        tier.reads += 1
        n = tier.reads
        tier.maybe_slow("read", n, arr)
        if plan.fail_all_reads or n in plan.fail_reads:
            out[:] = [bytes([POISON]) * self.slot_bytes] * len(arr)
            tier.injected.append(f"read {n} failed (slots {arr.tolist()})")
            error = TierIOError(f"injected fault: read {n} of slots {arr.tolist()} failed")
            return tier.handle(_Done(), error)
        return tier.handle(self.inner.read_blobs(arr, out), None)


class _FailedBehind(WriteBehind):
    """An inner background write (of poison) reported failed with ``error``."""

    def __init__(self, inner: WriteBehind, error: str) -> None:
        self._inner = inner
        self._error = error

    def done(self) -> bool:
        return self._inner.done()

    def error(self) -> str | None:
        return self._error


class FaultyDevicePool(DevicePool):
    """A device-accessible pool passed through unchanged (see module docstring)."""

    def __init__(self, tier: FaultyTier, inner: DevicePool) -> None:
        self.tier = tier
        self.inner = inner
        self.slot_bytes = inner.slot_bytes
        self.num_slots = inner.num_slots

    @property
    def buffer(self) -> Buffer:
        return self.inner.buffer

    def resize(self, num_slots: int) -> None:
        self.inner.resize(num_slots)
        self.num_slots = self.inner.num_slots

    def close(self) -> None:
        self.inner.close()


class _Done(IOHandle):
    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass


class FaultyTier(Tier):
    """Wraps ``inner`` and injects the faults of ``plan`` (see module docstring).

    Attributes:
        inner: the wrapped tier.
        plan: the faults to inject; mutable.
        writes: storage writes so far (the ordinal of the last one).
        reads: storage reads so far.
        injected: one line per fault injected, in order.
        damaged: what injected faults left in storage slots, by ``(id(pool), slot)``
            (``pool`` a storage or device pool of this tier): ``"failed write"`` (poison
            of a failed write: a correct caller never reads it as data) or ``"corrupt"``
            (a corrupting write or :meth:`corrupt`: the frame check should catch it). A
            later write of the slot that is not a fault clears it. See :meth:`damage`.
    """

    def __init__(self, inner: Tier, plan: FaultPlan | None = None) -> None:
        super().__init__(inner.backend, inner.options)
        self.inner = inner
        self.capabilities = inner.capabilities
        self.plan = plan if plan is not None else FaultPlan()
        self.writes = 0
        self.reads = 0
        self.injected: list[str] = []
        self.damaged: dict[tuple[int, int], str] = {}
        self._gate = threading.Event()

    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> Pool:
        """A pool of the inner tier, wrapped."""
        inner = self.inner.create_pool(slot_bytes, num_slots, name=name)
        if isinstance(inner, BlobPool):
            return FaultyBlobPool(self, inner)
        if isinstance(inner, StoragePool):
            return FaultyStoragePool(self, inner)
        if isinstance(inner, DevicePool):
            return FaultyDevicePool(self, inner)
        raise TypeError(f"{type(inner).__name__} is neither a StoragePool nor a DevicePool")

    def handle(
        self, inner: IOHandle, error: TierIOError | None, keep: np.ndarray | None = None
    ) -> IOHandle:
        gate = self._gate if self.plan.hold else None
        return _FaultyHandle(inner, error, gate, self.plan.pending_polls, keep)

    def maybe_slow(self, op: str, n: int, slots: np.ndarray) -> None:
        """Sleep ``plan.slow_s`` if the plan makes ``op`` number ``n`` slow."""
        plan = self.plan
        if plan.slow_all or n in (plan.slow_writes if op == "write" else plan.slow_reads):
            self.injected.append(f"{op} {n} slow (slots {slots.tolist()})")
            time.sleep(plan.slow_s)

    def mark(self, pool: Pool, slots: np.ndarray, kind: str | None) -> None:
        """Record what a write left in ``slots`` of ``pool``: ``kind`` (see
        ``damaged``), or None for good data (the slots' marks are cleared)."""
        key = id(pool)
        if kind is not None:
            for s in slots.tolist():
                self.damaged[(key, s)] = kind
        elif self.damaged:
            for s in slots.tolist():
                self.damaged.pop((key, s), None)

    def damage(self, pool: Pool, slot: int) -> str | None:
        """What injected faults left in ``slot`` of ``pool`` (a pool of this tier, or a
        level's I/O thread wrapper of one): ``"failed write"``, ``"corrupt"``, or None
        (the last write there stored what it was given)."""
        inner = getattr(pool, "inner_pool", pool)
        return self.damaged.get((id(inner), int(slot)))

    def release(self) -> None:
        """Let every held handle complete; handles made later are held again if
        ``plan.hold`` is still set."""
        gate, self._gate = self._gate, threading.Event()
        gate.set()

    def corrupt(self, pool: Pool, slot: int) -> None:
        """Invert byte ``plan.corrupt_offset`` of ``slot`` of ``pool`` (a pool of this
        tier) now. Given a level's pool (its I/O thread wrapper), the damage is done on the
        level's I/O thread, after the writes queued before it (background writes
        included): it hits what the level wrote, as damage on the medium would (behind an
        operation past the deadline it lands when that returns).

        Raises:
            ValueError: ``slot`` out of range, or ``pool`` not made by this tier.
        """
        io = getattr(pool, "io", None)
        inner = getattr(pool, "inner_pool", pool)  # through a level's I/O thread wrapper
        if not isinstance(inner, FaultyStoragePool | FaultyDevicePool) or \
                inner.tier is not self:
            raise ValueError(f"pool {inner!r}: not a pool of this FaultyTier")
        check_slots(inner, np.array([slot]))
        self.injected.append(f"slot {slot} corrupted")
        if io is not None:
            try:
                io.call(lambda: self._corrupt(inner, slot), f"corrupt slot {slot}", "admin")
            except IODeadlineError:  # behind a slow operation: it lands when that returns
                self.injected[-1] += " (late)"
        else:
            self._corrupt(inner, slot)

    def _corrupt(self, pool: Any, slot: int) -> None:
        offset = self.plan.corrupt_offset
        key = (id(pool), int(slot))
        if self.damaged.get(key) != "failed write":  # (poison stays poison)
            self.damaged[key] = "corrupt"
        if isinstance(pool, FaultyBlobPool):
            blobs = [b""]
            pool.inner.read_blobs(np.array([slot]), blobs).wait()
            pool.inner.write_blobs(np.array([slot]), [_inverted(blobs[0], offset)]).wait()
            return
        if isinstance(pool, FaultyStoragePool):
            row = np.empty((1, pool.slot_bytes), dtype=np.uint8)
            pool.inner.read(np.array([slot]), row).wait()
            row[0, offset % pool.slot_bytes] ^= 0xFF
            pool.inner.write(np.array([slot]), row).wait()
            return
        start = pool.inner.region.page_start(slot) + offset % pool.slot_bytes
        byte = self.backend.read(pool.inner.buffer, start, 1)
        self.backend.write(pool.inner.buffer, start, byte ^ 0xFF)

    def close(self) -> None:
        """Release held handles and close the inner tier."""
        self.release()
        self.inner.close()
        self.closing_fault("tier")

    def closing_fault(self, what: str) -> None:
        """Raise ``OSError(EROFS)`` if the plan fails closes (the inner one is closed)."""
        if self.plan.fail_close:
            self.injected.append(f"{what} close failed")
            raise OSError(errno.EROFS, f"injected fault: closing the {what} failed",
                          "read-only file system")


def faulty_tier_spec(inner: TierSpec, plan: FaultPlan, *, name: str | None = None) -> TierSpec:
    """A record whose factory wraps ``inner``'s tiers in :class:`FaultyTier` with ``plan``.

    Every tier the record builds shares ``plan``, so a test changes faults in one place.
    """

    def factory(backend: object, options: object) -> FaultyTier:
        return FaultyTier(inner.factory(backend, options), plan)

    return TierSpec(
        name=name or f"faulty-{inner.name}"[:64],
        factory=factory,
        description=f"{inner.name} with injected faults (tests)",
        capabilities=inner.capabilities,
        options_type=inner.options_type,
        availability=inner.availability,
    )
