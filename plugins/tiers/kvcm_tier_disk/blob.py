"""Blob mode of the disk tier: each slot's bytes stored by size in append-only segments.

A blob pool is a series of segment files ``<pool file>.seg000001``, ... in the tier's
directory. A write appends one record per slot (``slot u32 | length u32 | bytes``) to the
active segment and points the in-memory index (slot -> segment, offset, length) at it; the
record it replaces becomes dead. A segment grows to ``segment_bytes`` and is then closed
for writing; a closed segment whose live bytes fall below half of its bytes is compacted
(its live records are appended to the active segment and the file is deleted).

Quota: the pool holds at most ``num_slots * slot_bytes`` stored bytes, the bytes of the
blobs it was handed (kvcm's cold frames included), live or dead until compaction; when a
write would pass it, every segment with dead bytes is compacted first. Record and segment
headers (8 and 64 bytes) are the tier's own bookkeeping and are not counted.

Reopening a named pool rebuilds the index by reading its segments in order (the last
record of a slot wins; a shrink appends tombstones). A record cut short by a truncated file
ends the scan of its segment; a blob whose file was truncated under it reads back short
(kvcm's frame check rejects it). I/O runs on the caller's thread; errors surface through
the returned handle as :class:`~kvcm_core.errors.TierIOError`.
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
_RECORD = struct.Struct("<II")  # slot, blob length
_TOMBSTONE = 0xFFFFFFFF  # a record length: the slot holds nothing from here on


class BlobDiskPool(BlobPool):
    """One blob-mode pool (see module docstring). Built by :meth:`DiskTier.create_pool`.

    Attributes:
        name: the pool's name (empty for an anonymous pool).
        path: the path prefix of its segment files.
    """

    def __init__(self, tier: DiskTier, name: str, fname: str, slot_bytes: int,
                 num_slots: int, segment_bytes: int) -> None:
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
        self._active = 0
        self._closed = False
        for seg in self._existing_segments():
            self._scan(seg)
        self._new_segment()

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
        self._fds[seg] = fd
        if created:
            header = _SEG_HEADER.pack(_SEG_MAGIC, _SEG_VERSION, SEGMENT_HEADER_BYTES,
                                      self.slot_bytes).ljust(SEGMENT_HEADER_BYTES, b"\0")
            if os.pwrite(fd, header, 0) != SEGMENT_HEADER_BYTES:
                raise TierIOError(f"{self._label}: short write of a segment header")
        self._size[seg] = max(os.fstat(fd).st_size, SEGMENT_HEADER_BYTES)
        self._stored.setdefault(seg, 0)
        self._live.setdefault(seg, 0)
        return fd, created

    def _new_segment(self) -> None:
        self._active = max(self._fds, default=0) + 1
        self._open_segment(self._active)

    def _scan(self, seg: int) -> None:
        """Rebuild the index from one existing segment (reopen)."""
        fd, _ = self._open_segment(seg)
        raw = os.pread(fd, self._size[seg], 0)
        if len(raw) < SEGMENT_HEADER_BYTES:  # created, header never written: empty
            self._drop_segment(seg)
            return
        magic, version, header_bytes, slot_bytes = _SEG_HEADER.unpack_from(raw)
        if magic != _SEG_MAGIC or version != _SEG_VERSION or header_bytes != \
                SEGMENT_HEADER_BYTES:
            raise TierIOError(f"{self._label}: {self._seg_name(seg)} is not a kvcm segment")
        if slot_bytes != self.slot_bytes:
            raise ValueError(f"slot_bytes={self.slot_bytes}: {self._label} exists with "
                             f"slots of {slot_bytes} bytes; reopen it with the same slot size")
        at = SEGMENT_HEADER_BYTES
        while at + _RECORD.size <= len(raw):
            slot, length = _RECORD.unpack_from(raw, at)
            at += _RECORD.size
            dead = length == _TOMBSTONE
            if not dead and at + length > len(raw):
                break  # cut short: the file was truncated
            if slot < self.num_slots:
                self._unlink_slot(slot)
                if not dead:
                    self._point(slot, seg, at, length)
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
            raise InvalidStateError(f"{self._label} was closed")

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
            for slot in slots.tolist():  # their old blobs are dead once these land
                self._unlink_slot(slot)
            self._compact(list(self._fds), rotate=True)
        if quota and self.stored_bytes + total > self.num_slots * self.slot_bytes:
            raise TierIOError(f"{self._label}: {total} bytes do not fit its quota of "
                              f"{self.num_slots * self.slot_bytes} stored bytes")
        seg = self._active
        at = self._size[seg]
        parts, places = [], []
        for slot, blob in zip(slots.tolist(), blobs, strict=True):
            parts += [_RECORD.pack(slot, len(blob)), bytes(blob)]
            places.append((slot, at + _RECORD.size, len(blob)))
            at += _RECORD.size + len(blob)
        data = b"".join(parts)
        done = os.pwrite(self._fds[seg], data, self._size[seg])
        if done != len(data):
            raise TierIOError(f"{self._label}: short write: {done} of {len(data)} bytes")
        self._size[seg] = at
        self._stored[seg] += total
        for slot, offset, length in places:
            self._unlink_slot(slot)
            self._point(slot, seg, offset, length)
        if at >= self._segment_bytes:
            self._new_segment()

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
        """Compact closed segments that are mostly dead."""
        mostly_dead = [seg for seg in self._fds if seg != self._active
                       and self._live[seg] * 2 < self._stored[seg]]
        if mostly_dead:
            self._compact(mostly_dead, rotate=False)

    def _compact(self, segments: list[int], *, rotate: bool) -> None:
        """Move the live blobs of ``segments`` to the active segment (a fresh one first
        when ``rotate``) and delete those segment files."""
        if rotate:
            self._new_segment()
        segments = [s for s in segments if s != self._active]
        for seg in segments:
            moving = np.flatnonzero(self._seg == seg)
            if len(moving):
                blobs = [self._read_one(int(s)) for s in moving.tolist()]
                self._append(moving, blobs, quota=False)
            self._drop_segment(seg)

    def _drop_segment(self, seg: int) -> None:
        fd = self._fds.pop(seg)
        os.close(fd)
        for table in (self._size, self._stored, self._live):
            table.pop(seg, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._seg_name(seg), dir_fd=self._tier._live_dir_fd())

    # -- life cycle --------------------------------------------------------------------

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to ``num_slots``; kept slots keep their blobs, dropped slots'
        blobs become dead (tombstones make that survive a reopen); grown slots are
        empty (read as zeros)."""
        self._check_open()
        if isinstance(num_slots, bool) or not isinstance(num_slots, int | np.integer) or \
                num_slots < 0:
            raise ValueError(f"num_slots={num_slots!r}: must be an int >= 0")
        num_slots = int(num_slots)
        old = self.num_slots
        if num_slots < old:
            dropped = np.flatnonzero(self._seg[num_slots:] >= 0) + num_slots
            if len(dropped):
                data = b"".join(_RECORD.pack(int(s), _TOMBSTONE) for s in dropped.tolist())
                try:
                    os.pwrite(self._fds[self._active], data, self._size[self._active])
                except OSError as exc:
                    raise TierIOError(f"{self._label}: resize failed: {exc}") from exc
                self._size[self._active] += len(data)
                for slot in dropped.tolist():
                    self._unlink_slot(slot)
            self._seg, self._off, self._len = (a[:num_slots].copy()
                                               for a in (self._seg, self._off, self._len))
        else:
            grow = num_slots - old
            self._seg = np.concatenate([self._seg, np.full(grow, -1, dtype=np.int64)])
            self._off = np.concatenate([self._off, np.zeros(grow, dtype=np.int64)])
            self._len = np.concatenate([self._len, np.zeros(grow, dtype=np.int64)])
        self.num_slots = num_slots
        if self.stored_bytes > num_slots * self.slot_bytes:
            self._compact(list(self._fds), rotate=True)
        else:
            self._compact_dead()

    def close(self) -> None:
        """Close the segment files (idempotent); an anonymous pool's files are deleted."""
        if self._closed:
            return
        self._closed = True
        for seg in list(self._fds):
            if self.name:
                os.close(self._fds.pop(seg))
            else:
                self._drop_segment(seg)
        self._tier._pools.pop(self._fname, None)
