"""Blob mode of the disk tier: each slot's bytes stored by size in append-only segments.

A blob pool is a series of segment files ``<pool file>.seg000001``, ... in the tier's
directory. A write appends one record per slot (``slot u32 | length u32 | bytes``) to the
active segment and points the in-memory index (slot -> segment, offset, length) at it; the
record it replaces becomes dead. A segment grows to ``segment_bytes`` and is then closed
for writing; the next append (or the first after a reopen: a pool only read adds no file)
starts a new one. A closed segment whose live bytes fall below half of its bytes is
compacted (its live records are appended to the active segment and the file is deleted),
and one holding nothing still needed (no blob, no tombstone an older segment needs) is
deleted.

Quota: the pool holds at most ``num_slots * slot_bytes`` stored bytes, the bytes of the
blobs it was handed (kvcm's cold frames included), live or dead until compaction; when a
write would pass it, every segment with dead bytes is compacted first. Record and segment
headers (8 and 64 bytes) are the tier's own bookkeeping and are not counted.

A named pool holds the lock file ``<pool file>.lock`` (``flock``-ed by
:meth:`DiskTier.create_pool` before the segments are read, closed last at ``close``), so
no other tier opens the pool meanwhile; see the one-tier rule in :mod:`kvcm_tier_disk`.

Reopening a named pool rebuilds the index by reading its segments in order (the last
record of a slot wins; a shrink, and a reopen with fewer slots, append tombstones, which
compaction carries forward while an older segment might still hold the slot). A record cut
short by a truncated file ends the scan of its segment; a blob whose file was truncated
under it reads back short (kvcm's frame check rejects it). I/O runs on the caller's thread;
errors surface through the returned handle as :class:`~kvcm_core.errors.TierIOError`.

A failed write leaves memory and segments agreeing, so a reopen reads what a read did: an
append cut short is cut off the file again (nothing past a segment's recorded end
survives); each slot of a failed write holds its old blob, nothing (a write that had to
compact for its quota lets an old blob go with its segment), or its new blob when only the
compaction after the write failed.

When the torn bytes cannot be cut off (``ftruncate`` fails: EIO, ENOSPC, EPERM...), the
segment is **sealed**: its valid length is written into its header (``valid end``, a u64 at
byte 24; 0 in a segment never sealed), it is never appended to again, and the next write
starts a new segment; a reopen reads a sealed segment only up to its valid end, so the torn
records are never read back. If the header cannot be written either, the segment stays
*torn* in memory and the pool refuses every write (``TierIOError``, nothing appended) until
a retry of the truncate or of the seal, made at each later write and at ``close``,
succeeds; reads go on meanwhile. Nothing already stored is lost either way.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvcm_core.errors import InvalidStateError, TierIOError
from kvcm_core.tier import BlobPool, CompletedIO, IOHandle, check_slots

if TYPE_CHECKING:
    from kvcm_tier_disk import DiskTier

__all__ = ["SEGMENT_HEADER_BYTES", "BlobDiskPool"]

SEGMENT_HEADER_BYTES = 64
_SEG_MAGIC = b"KVCMSEGS"
_SEG_VERSION = 1
_SEG_HEADER = struct.Struct("<8sIIQ")  # magic, version, header bytes, slot bytes
_SEAL = struct.Struct("<Q")  # at _SEAL_AT: a sealed segment's valid end (0: not sealed)
_SEAL_AT = _SEG_HEADER.size
_RECORD = struct.Struct("<II")  # slot, blob length
_TOMBSTONE = 0xFFFFFFFF  # a record length: the slot holds nothing from here on


class BlobDiskPool(BlobPool):
    """One blob-mode pool (see module docstring). Built by :meth:`DiskTier.create_pool`.

    Attributes:
        name: the pool's name (empty for an anonymous pool).
        path: the path prefix of its segment files.
    """

    def __init__(self, tier: DiskTier, name: str, fname: str, slot_bytes: int,
                 num_slots: int, segment_bytes: int, lock_fd: int | None = None) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.name = name
        self.path = os.path.join(tier.directory, fname)
        self._tier = tier
        self._fname = fname
        self._label = f"disk blob pool {name!r}" if name else "anonymous disk blob pool"
        self._segment_bytes = segment_bytes
        self._fds: dict[int, int] = {}  # segment id -> open file
        self._size: dict[int, int] = {}  # segment id -> file size
        self._stored: dict[int, int] = {}  # segment id -> blob bytes in it (live or dead)
        self._live: dict[int, int] = {}  # segment id -> live blob bytes
        self._seg = np.full(num_slots, -1, dtype=np.int64)
        self._off = np.zeros(num_slots, dtype=np.int64)
        self._len = np.zeros(num_slots, dtype=np.int64)
        self._tombs: dict[int, set[int]] = {}  # segment id -> slots with a tombstone in it
        self._sealed: set[int] = set()  # segments whose header marks a valid end: never
        # appended to again
        self._torn: dict[int, int] = {}  # segments with bytes past this valid end, neither
        # cut off nor sealed yet (the pool takes no writes until they are)
        self._active = 0  # the segment appended to; 0: none yet (made by the next append)
        self._gone = "was closed"  # why the pool is unusable once _closed
        self._last = 0  # the highest segment id seen or made: a new one takes the next
        self._closed = False
        # a named pool's locked lock file (DiskTier._blob_lock): closed at close, not
        # here when this constructor fails (create_pool closes it then)
        self._lock_fd = lock_fd
        beyond: set[int] = set()  # slots past num_slots whose last record holds a blob
        try:
            for seg in self._existing_segments():
                self._scan(seg, beyond)
            if beyond:  # reopened with fewer slots: drop those blobs for good, as a shrink
                self._write_tombstones(sorted(beyond))
            if self.stored_bytes > num_slots * slot_bytes:
                self._compact(list(self._fds), rotate=True)
        except BaseException as exc:
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
            if isinstance(exc, OSError) and not isinstance(exc, TierIOError):
                raise TierIOError(f"{self._label}: cannot open its segments in "
                                  f"{tier.directory}: {exc}") from exc
            raise

    # -- segments ------------------------------------------------------------------------

    def _seg_name(self, seg: int) -> str:
        return f"{self._fname}.seg{seg:06d}"

    def _existing_segments(self) -> list[int]:
        if not self.name:
            return []
        pattern = re.compile(re.escape(self._fname) + r"\.seg(\d{6})$")
        found = (pattern.match(entry) for entry in os.listdir(self._tier._live_dir_fd()))
        return sorted(int(m.group(1)) for m in found if m)

    def _open_segment(self, seg: int) -> tuple[int, bool]:
        fd, created = self._tier._open_file(self._seg_name(seg), self._label)
        if created:
            header = _SEG_HEADER.pack(_SEG_MAGIC, _SEG_VERSION, SEGMENT_HEADER_BYTES,
                                      self.slot_bytes).ljust(SEGMENT_HEADER_BYTES, b"\0")
            try:
                if os.pwrite(fd, header, 0) != SEGMENT_HEADER_BYTES:
                    raise TierIOError(f"{self._label}: short write of a segment header")
            except OSError:  # no half-made segment for a later write or a reopen
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self._seg_name(seg), dir_fd=self._tier._live_dir_fd())
                raise
        self._fds[seg] = fd
        self._size[seg] = max(os.fstat(fd).st_size, SEGMENT_HEADER_BYTES)
        self._stored.setdefault(seg, 0)
        self._live.setdefault(seg, 0)
        return fd, created

    def _new_segment(self) -> None:
        seg = max(self._last, max(self._fds, default=0)) + 1
        self._open_segment(seg)
        self._active = self._last = seg

    def _scan(self, seg: int, beyond: set[int]) -> None:
        """Rebuild the index from one existing segment (reopen); ``beyond`` collects the
        slots past ``num_slots`` whose last record so far holds a blob."""
        fd, _ = self._open_segment(seg)
        self._last = max(self._last, seg)
        raw = os.pread(fd, self._size[seg], 0)
        if len(raw) < SEGMENT_HEADER_BYTES:  # created, header never written: empty
            self._drop_segment(seg)
            return
        magic, version, header_bytes, slot_bytes = _SEG_HEADER.unpack_from(raw)
        (valid_end,) = _SEAL.unpack_from(raw, _SEAL_AT)
        if magic != _SEG_MAGIC or version != _SEG_VERSION or header_bytes != \
                SEGMENT_HEADER_BYTES:
            raise TierIOError(f"{self._label}: {self._seg_name(seg)} is not a kvcm segment")
        if slot_bytes != self.slot_bytes:
            raise ValueError(f"slot_bytes={self.slot_bytes}: {self._label} exists with "
                             f"slots of {slot_bytes} bytes; reopen it with the same slot size")
        end = len(raw)
        if valid_end:  # sealed after a failed append: what lies past its end is torn
            end = min(end, max(valid_end, SEGMENT_HEADER_BYTES))
            self._sealed.add(seg)
        at = SEGMENT_HEADER_BYTES
        while at + _RECORD.size <= end:
            slot, length = _RECORD.unpack_from(raw, at)
            at += _RECORD.size
            dead = length == _TOMBSTONE
            if not dead and at + length > end:
                break  # cut short: the file was truncated
            if dead:
                self._tombs.setdefault(seg, set()).add(slot)
            if slot < self.num_slots:
                self._unlink_slot(slot)
                if not dead:
                    self._point(slot, seg, at, length)
            elif dead:
                beyond.discard(slot)
            else:
                beyond.add(slot)
            if not dead:
                self._stored[seg] += length
                at += length
        self._size[seg] = at

    def _point(self, slot: int, seg: int, offset: int, length: int) -> None:
        self._seg[slot], self._off[slot], self._len[slot] = seg, offset, length
        self._live[seg] += length

    def _unlink_slot(self, slot: int) -> None:
        old = int(self._seg[slot])
        if old >= 0:
            self._live[old] -= int(self._len[slot])
            self._seg[slot] = -1

    def locate(self, slot: int) -> tuple[str, int, int] | None:
        """Where the blob of ``slot`` lies: (file path, byte offset, length); None when
        the slot holds nothing (for tools and tests that inspect or damage files)."""
        seg = int(self._seg[slot])
        if seg < 0:
            return None
        return (os.path.join(self._tier.directory, self._seg_name(seg)), int(self._off[slot]),
                int(self._len[slot]))

    @property
    def stored_bytes(self) -> int:
        """Blob bytes in the segments, live or dead until compaction."""
        return sum(self._stored.values())

    @property
    def live_bytes(self) -> int:
        return sum(self._live.values())

    # -- I/O -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidStateError(f"{self._label} {self._gone}")

    def _disown(self) -> None:
        """In a forked child (:meth:`DiskTier._disown`): close this process's copies of
        the segment files, touching nothing on disk; the pool is then closed here."""
        from kvcm_tier_disk import _FORKED

        self._closed, self._gone = True, _FORKED
        fds, self._fds = self._fds, {}
        self._torn.clear()
        lock, self._lock_fd = self._lock_fd, None
        # closing our copy of the lock file leaves the parent's flock held (it belongs to
        # the open file, which the parent's descriptor still holds)
        for fd in [*fds.values(), *([lock] if lock is not None else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)

    def write_blobs(self, slots: np.ndarray, blobs: Sequence[bytes]) -> IOHandle:
        """Store ``blobs[i]`` (at most ``slot_bytes`` each) as the bytes of ``slots[i]``.

        Raises:
            ValueError: a slot out of range or repeated, a blob too large, or lengths that
                do not match (raised here; nothing is written).
            InvalidStateError: the pool was closed.
        """
        self._check_open()
        arr = check_slots(self, slots)
        if len(blobs) != len(arr):
            raise ValueError(f"{len(blobs)} blobs for {len(arr)} slots: one blob per slot")
        if len(np.unique(arr)) != len(arr):
            raise ValueError(f"slots={arr.tolist()}: a write may name each slot only once")
        big = [len(b) for b in blobs if len(b) > self.slot_bytes]
        if big:
            raise ValueError(f"a blob of {big[0]} bytes: at most slot_bytes="
                             f"{self.slot_bytes} per slot")
        try:
            self._append(arr, blobs)
            self._compact_dead()
        except OSError as exc:
            error = exc if isinstance(exc, TierIOError) else TierIOError(
                f"{self._label}: write of {len(arr)} blobs failed: {exc}")
            return CompletedIO(error)
        return CompletedIO()

    def _append(self, slots: np.ndarray, blobs: Sequence[bytes], quota: bool = True) -> None:
        """Append records; ``quota`` False: compaction moving blobs already counted (the
        pool may pass its quota by them until the old segment is deleted)."""
        total = sum(len(b) for b in blobs)
        if quota and self.stored_bytes + total > self.num_slots * self.slot_bytes:
            # their old blobs are dead once these land: not moved, gone with their segments
            self._compact(list(self._fds), rotate=True, dropping=slots)
        if quota and self.stored_bytes + total > self.num_slots * self.slot_bytes:
            raise TierIOError(f"{self._label}: {total} bytes do not fit its quota of "
                              f"{self.num_slots * self.slot_bytes} stored bytes")
        self._writable()
        seg = self._active
        at = self._size[seg]
        parts, places = [], []
        for slot, blob in zip(slots.tolist(), blobs, strict=True):
            parts += [_RECORD.pack(slot, len(blob)), bytes(blob)]
            places.append((slot, at + _RECORD.size, len(blob)))
            at += _RECORD.size + len(blob)
        self._write_at_end(b"".join(parts))
        self._stored[seg] += total
        for slot, offset, length in places:
            self._unlink_slot(slot)
            self._point(slot, seg, offset, length)
        if at >= self._segment_bytes:  # full: closed for writing, the next append
            self._active = 0  # starts a new segment

    def _write_at_end(self, data: bytes) -> None:
        """Append ``data`` to the active segment (made writable by :meth:`_writable`
        first). A short or failed write is cut off the file again, so no record of it
        survives past the segment's recorded end (the next write lands there); when it
        cannot be cut off, the segment is sealed at that end (:meth:`_mend`)."""
        seg = self._active
        fd, end = self._fds[seg], self._size[seg]
        try:
            done = os.pwrite(fd, data, end)
            if done != len(data):
                raise TierIOError(f"{self._label}: short write: {done} of {len(data)} bytes")
        except OSError:
            self._torn[seg] = end
            self._mend(seg)
            raise
        self._size[seg] = end + len(data)

    def _mend(self, seg: int) -> bool:
        """Make the torn segment ``seg`` consistent on disk: cut its torn bytes off (it
        may then be appended to again), or else seal it, writing its valid end into its
        header (a reopen reads no further, and it is never appended to again). True when
        either worked (it is no longer torn)."""
        end = self._torn[seg]
        fd = self._fds[seg]
        try:
            os.ftruncate(fd, end)
        except OSError:
            try:
                if os.pwrite(fd, _SEAL.pack(end), _SEAL_AT) != _SEAL.size:
                    return False
            except OSError:
                return False
            self._sealed.add(seg)
        del self._torn[seg]
        return True

    def _writable(self) -> None:
        """Make the active segment one that may be appended to: retry sealing torn
        segments (refusing the write while one stays torn), and start a new segment in
        place of a sealed one.

        Raises:
            TierIOError: a torn segment can still be neither cut off nor sealed, or the
                new segment cannot be made.
        """
        for seg in list(self._torn):
            if not self._mend(seg):
                raise TierIOError(
                    f"{self._label}: {self._seg_name(seg)} holds the torn bytes of a failed "
                    f"append past byte {self._torn[seg]} that can be neither cut off nor "
                    "marked in its header; no writes until one of them works")
        if self._active not in self._fds or self._active in self._sealed:
            self._new_segment()  # none yet (or closed for writing), or sealed

    def _write_tombstones(self, slots: list[int]) -> None:
        """Append a tombstone for each of ``slots`` to the active segment."""
        self._writable()
        self._write_at_end(b"".join(_RECORD.pack(s, _TOMBSTONE) for s in slots))
        self._tombs.setdefault(self._active, set()).update(slots)

    def read_blobs(self, slots: np.ndarray, out: list[bytes]) -> IOHandle:
        """Load the blob of ``slots[i]`` into ``out[i]`` (``b""``: never written; a blob
        whose file was truncated reads back short).

        Raises:
            ValueError: a slot out of range, or ``out`` not a list of ``len(slots)``.
            InvalidStateError: the pool was closed.
        """
        self._check_open()
        arr = check_slots(self, slots)
        if not isinstance(out, list) or len(out) != len(arr):
            raise ValueError(f"out: must be a list of {len(arr)} entries, one per slot")
        try:
            for i, slot in enumerate(arr.tolist()):
                out[i] = self._read_one(slot)
        except OSError as exc:
            return CompletedIO(TierIOError(f"{self._label}: read failed: {exc}"))
        return CompletedIO()

    def _read_one(self, slot: int) -> bytes:
        seg = int(self._seg[slot])
        if seg < 0:
            return b""
        return os.pread(self._fds[seg], int(self._len[slot]), int(self._off[slot]))

    # -- compaction --------------------------------------------------------------------

    def _compact_dead(self) -> None:
        """Compact closed segments that are mostly dead, and delete those that hold
        nothing needed (no blob, no tombstone to carry: left by a failed write, or
        emptied)."""
        oldest = min(self._fds, default=0)
        mostly_dead = [seg for seg in self._fds if seg != self._active
                       and (self._live[seg] * 2 < self._stored[seg]
                            or (not self._stored[seg]
                                and (seg == oldest or not self._carry(seg))))]
        if mostly_dead:
            self._compact(mostly_dead, rotate=False)

    def _carry(self, seg: int) -> list[int]:
        """The tombstones of ``seg`` still needed while an older segment remains: those
        of slots past the end or holding nothing now."""
        return [s for s in sorted(self._tombs.get(seg, ()))
                if s >= self.num_slots or self._seg[s] < 0]

    def _compact(self, segments: list[int], *, rotate: bool,
                 dropping: np.ndarray | None = None) -> None:
        """Move the live blobs of ``segments`` to the active segment (a fresh one first
        when ``rotate``) and delete those segment files, oldest first. Their tombstones
        of slots now empty move too while an older segment remains (it may hold such a
        slot's record). The blobs of ``dropping`` (slots about to be rewritten; only when
        compacting every segment, so none older remains) are not moved: each such slot
        empties as its segment goes, so memory and disk agree if this stops part way."""
        if rotate:  # the next append starts a fresh segment (none when nothing moves)
            self._active = 0
        drop = np.zeros(self.num_slots, dtype=bool)
        if dropping is not None:
            drop[dropping] = True
        for seg in sorted(s for s in segments if s != self._active):
            here = self._seg == seg
            carry = self._carry(seg)
            if carry and min(self._fds) < seg:
                self._write_tombstones(carry)
            moving = np.flatnonzero(here & ~drop)
            if len(moving):
                blobs = [self._read_one(int(s)) for s in moving.tolist()]
                self._append(moving, blobs, quota=False)
            for slot in np.flatnonzero(here & drop).tolist():
                self._unlink_slot(slot)
            self._drop_segment(seg)

    def _drop_segment(self, seg: int) -> None:
        fd = self._fds.pop(seg)
        os.close(fd)
        for table in (self._size, self._stored, self._live, self._tombs, self._torn):
            table.pop(seg, None)
        self._sealed.discard(seg)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._seg_name(seg), dir_fd=self._tier._live_dir_fd())

    # -- life cycle --------------------------------------------------------------------

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to ``num_slots``; kept slots keep their blobs, dropped slots'
        blobs become dead (tombstones make that survive a reopen); grown slots are
        empty (read as zeros).

        A shrink writes the dropped slots' tombstones, then compacts when the stored
        bytes pass the smaller quota; the new size is taken only once both worked.

        Raises:
            ValueError: ``num_slots`` is not an int >= 0.
            InvalidStateError: the pool was closed.
            TierIOError: the tombstones or the compaction could not be written: the pool
                keeps its old size, every kept slot its blob; a dropped slot may have
                lost its blob already (kvcm's levels move their pages out of the dropped
                slots first).
        """
        self._check_open()
        if isinstance(num_slots, bool) or not isinstance(num_slots, int | np.integer) or \
                num_slots < 0:
            raise ValueError(f"num_slots={num_slots!r}: must be an int >= 0")
        num_slots = int(num_slots)
        old = self.num_slots
        if num_slots < old:
            dropped = np.flatnonzero(self._seg[num_slots:] >= 0) + num_slots
            try:
                if len(dropped):
                    self._write_tombstones(dropped.tolist())
                    for slot in dropped.tolist():
                        self._unlink_slot(slot)
                if self.stored_bytes > num_slots * self.slot_bytes:
                    self._compact(list(self._fds), rotate=True)
            except OSError as exc:
                raise TierIOError(f"{self._label}: resize from {old} to {num_slots} slots "
                                  f"failed (it keeps {old} slots): {exc}") from exc
            self._seg, self._off, self._len = (a[:num_slots].copy()
                                               for a in (self._seg, self._off, self._len))
        else:
            grow = num_slots - old
            self._seg = np.concatenate([self._seg, np.full(grow, -1, dtype=np.int64)])
            self._off = np.concatenate([self._off, np.zeros(grow, dtype=np.int64)])
            self._len = np.concatenate([self._len, np.zeros(grow, dtype=np.int64)])
        self.num_slots = num_slots
        # Housekeeping only (the next write retries it): a grow never fails, so a level
        # can always undo a shrink of another pool by growing this one back.
        with contextlib.suppress(OSError):
            if self.stored_bytes > num_slots * self.slot_bytes:
                self._compact(list(self._fds), rotate=True)
            else:
                self._compact_dead()

    def close(self) -> None:
        """Close the segment files (idempotent); an anonymous pool's files are deleted,
        then a named pool's lock file is closed (it stays on disk: see
        :mod:`kvcm_tier_disk`). Every descriptor is closed and every deletion tried even
        when one fails.

        Raises:
            TierIOError: a segment file could not be closed or deleted (each failure
                listed); the pool is closed all the same.
        """
        if self._closed:
            return
        self._closed = True
        for seg in list(self._torn):  # a last try, so a reopen reads no torn record
            self._mend(seg)
        failures: list[str] = []
        fds, self._fds = self._fds, {}
        for seg, fd in sorted(fds.items()):
            try:
                os.close(fd)
            except OSError as exc:
                failures.append(f"closing {self._seg_name(seg)}: {exc}")
        if not self.name:
            for seg in sorted(fds):
                try:
                    os.unlink(self._seg_name(seg), dir_fd=self._tier._live_dir_fd())
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failures.append(f"deleting {self._seg_name(seg)}: {exc}")
        lock, self._lock_fd = self._lock_fd, None
        if lock is not None:  # last: another tier may open the pool once this is closed
            try:
                os.close(lock)
            except OSError as exc:
                failures.append(f"closing {self._fname}.lock: {exc}")
        for table in (self._size, self._stored, self._live, self._tombs, self._torn):
            table.clear()
        self._sealed.clear()
        self._tier._pools.pop(self._fname, None)
        if failures:
            raise TierIOError(f"{self._label}: close in {self._tier.directory}: "
                              + "; ".join(failures))
