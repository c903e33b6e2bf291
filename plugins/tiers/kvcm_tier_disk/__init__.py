"""The ``disk`` tier: pools in preallocated files, reached by asynchronous ``pread``/``pwrite``.

Each pool is one file in the tier's directory: a 4 KiB header (magic, version, slot size)
followed by the slots, so slot ``s`` starts at byte ``4096 + s * slot_bytes``. Reads and
writes run on a thread pool shared by the tier's pools (``io_threads`` threads), except a
batch of at most 256 KiB that is one task, which runs on the caller's thread (handing it
to a thread and waiting would cost more than the I/O). A batch is
sorted by slot and cut into runs of consecutive slots; each run is one ``preadv``/``pwritev``
straight between the file and the caller's rows (no copy), so large transfers run at the
file system's sequential speed. Any ``OSError``, and any short read or write, makes the
handle's ``wait()`` raise :class:`~kvcm_core.errors.TierIOError`.

Options:
    path: the directory of pool files (a relative one is made absolute at start). Created
        with mode 0700 (an existing one we own is tightened to 0700). Without it the tier
        uses a private temporary directory (``kvcm-disk-*`` in the system temporary
        directory) that :meth:`DiskTier.close` removes.
    io_threads: threads doing I/O (int >= 1, default 4).
    mode: ``"slot"`` (default: fixed-size slots in one preallocated file per pool) or
        ``"blob"``: each slot's bytes stored by size in append-only segment files, so a
        level on this tier may take a blob codec (``zstd``, ``lz4``); its quota counts
        stored bytes (see :mod:`kvcm_tier_disk.blob`). The tier then declares
        ``capabilities.blobs``.
    segment_bytes: size at which a blob-mode segment file is closed for writing and a
        new one started (int >= 4096, default 64 MiB).
    batch_syscalls: submit a batch's runs of consecutive slots (three or more) with one
        Linux native AIO system call instead of one ``pwrite``/``preadv`` each (bool,
        default True; see :mod:`kvcm_tier_disk.aio`). Where the platform has no such call
        or the kernel refuses it, the tier makes one call per run, as with False.
    native_writes: let a storage level's background writes run on glibc's own AIO threads
        (:meth:`DiskPool.write_behind`), which never take Python's interpreter lock
        (bool, default True; Linux x86-64 with glibc only, elsewhere the level's I/O
        thread writes them as with False).

Persistence: a pool created with the ``name`` of an existing pool file in ``path`` reopens
it and keeps its data (resized to the requested slot count); a file written with another
slot size is refused. Unnamed pools (the manager's cold levels) get an anonymous file in
the tier's owner directory, deleted on close.

One tier at a time: a named pool is held by the tier that opened it, through an exclusive
``flock`` taken without waiting when it is created or reopened and dropped when it closes
(or its tier does, or its process dies). Another tier with the same ``path``, in this
process or another, that opens the same name meanwhile gets ``TierIOError`` ("in use by
another disk tier") and changes nothing, so two tiers never write into one pool's files.
A slot pool locks its pool file; a blob pool, whose segment files come and go, locks a
file ``<pool file>.lock`` beside them, taken before its segments are read. That file is
left in place at close: an unlocked one is harmless, and deleting it would let a tier that
opened it just before the deletion lock the removed file while a third tier locks a new
one. An empty slot pool file (its creator lost the race for its lock to a tier that
opened it at once, or died before writing its header) is taken as a new pool by the tier
that locks it.

Crash safety (see :mod:`kvcm_tier_disk.owner`): anonymous files live in an owner directory
(``path/kvcm-owner-*``, or the private directory) holding an ``flock``-ed ``lock`` file;
a tier that starts removes the owner directories whose lock is free (their process died,
``kill -9`` included), logs one warning on logger ``kvcm.disk`` and records what it
removed in :attr:`DiskTier.swept`. :meth:`DiskTier.close` closes every pool and the
directory even when one of them fails, then raises ``TierIOError`` listing the failures.
A child forked without exec closes its copies of every tier's descriptors (lock, directory,
pool files, blob pools' lock files; nothing on disk is touched), so it keeps no dead
parent's directory from being swept; the parent's tiers and pools are closed in the child
(``InvalidStateError``). The parent keeps its named pools' locks: an ``flock`` belongs to
the open file, which the parent's descriptors still hold.

Security: files are created 0600 with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to an open
descriptor of the directory; pool names are reduced to a safe file name; a pool file that is
a symbolic link, not a regular file, hard-linked, or owned by someone else is refused, and so
is a ``path`` that is itself a symbolic link, a shared sticky directory (such as ``/tmp``)
or a directory owned by another user.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import fcntl
import hashlib
import itertools
import os
import re
import shutil
import stat
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core import hookimpl
from kvcm_core.backend import KernelBackend
from kvcm_core.errors import ConfigError, InvalidStateError, TierIOError
from kvcm_core.records import Availability, Medium, TierCapabilities, TierSpec
from kvcm_core.tier import CompletedIO, IOHandle, StoragePool, Tier, check_slots, checked_rows
from kvcm_tier_disk import aio
from kvcm_tier_disk.blob import BlobDiskPool

from .owner import (
    OWNER_PREFIX,
    PRIVATE_PREFIX,
    OwnerLock,
    Swept,
    make_owner_directory,
    make_private_directory,
    sweep,
)

__all__ = ["BLOB_CAPABILITIES", "CAPABILITIES", "HEADER_BYTES", "DiskPool", "DiskTier"]

CAPABILITIES = TierCapabilities(
    device_accessible=False,
    medium=Medium.FILE,
    persistent=True,
    file_mode=0o600,
    dir_mode=0o700,
)
#: What a disk tier in blob mode (``mode="blob"``) declares.
BLOB_CAPABILITIES = attrs.evolve(CAPABILITIES, blobs=True)

#: Bytes before slot 0 in every pool file (keeps slots page-aligned).
HEADER_BYTES = 4096
_MAGIC = b"KVCMPOOL"
_VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, header bytes, slot bytes
_SUFFIX = ".kvcm"
_LOCK_SUFFIX = ".lock"  # a named blob pool's lock file: <pool file>.lock
_DEFAULT_THREADS = 4
_DEFAULT_SEGMENT = 64 << 20
# One preadv/pwritev moves at most this many bytes and buffers (Linux caps one call at
# about 2 GiB and IOV_MAX = 1024): large runs are cut so that several threads share them.
# A task handed to one thread holds at most about _TASK_BYTES.
_MAX_CALL_BYTES = 8 << 20
_MAX_IOV = 1024
_TASK_BYTES = 8 << 20
_INLINE_BYTES = 256 << 10  # batches up to this size run on the caller's thread
_NOWAIT_RUNS = 64  # read_nowait declines a read of more runs than this
_NOWAIT_BYTES = 1 << 20  # ... or of more bytes than this
# read_nowait reads slots not in slot order as one span, lowest to highest, when the span
# holds at most this many times as many slots as the read names (and at most
# _NOWAIT_BYTES): the extra bytes copied cost less than a call per run
_NOWAIT_SPAN = 2
_HASHED = re.compile(r"-[0-9a-f]{16}$")  # how file_name ends a name it had to change
_FORKED = ("belongs to the process that forked this one; a forked child cannot use its "
           "parent's disk tier (make a new one)")


def _availability() -> Availability:
    if not hasattr(os, "preadv") or not hasattr(os, "pwritev"):
        return Availability(False, "os.preadv/os.pwritev are missing on this platform")
    return Availability(True)


def _parse_options(options: Mapping[str, Any]
                   ) -> tuple[str | None, int, str, int, bool, bool]:
    known = ("path", "io_threads", "mode", "segment_bytes", "batch_syscalls", "native_writes")
    for key in options:
        if key not in known:
            raise ConfigError(
                f"disk.options.{key}", options[key], f"unknown option; known: {', '.join(known)}"
            )
    path = options.get("path")
    if path is not None:
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise ConfigError("disk.options.path", path, "must be a non-empty directory path")
        # absolute: a later chdir must not move where close() removes the owner directory
        path = os.path.abspath(os.fspath(path))
    threads = options.get("io_threads", _DEFAULT_THREADS)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
        raise ConfigError("disk.options.io_threads", threads, "must be an int in 1..1024")
    mode = options.get("mode", "slot")
    if mode not in ("slot", "blob"):
        raise ConfigError("disk.options.mode", mode, "must be 'slot' or 'blob'")
    segment = options.get("segment_bytes", _DEFAULT_SEGMENT)
    if isinstance(segment, bool) or not isinstance(segment, int) or segment < 4096:
        raise ConfigError("disk.options.segment_bytes", segment, "must be an int >= 4096")
    batch = options.get("batch_syscalls", True)
    if not isinstance(batch, bool):
        raise ConfigError("disk.options.batch_syscalls", batch, "must be a bool")
    native = options.get("native_writes", True)
    if not isinstance(native, bool):
        raise ConfigError("disk.options.native_writes", native, "must be a bool")
    return path, threads, mode, segment, batch, native


def file_name(name: str) -> str:
    """The file name of pool ``name``: letters, digits, ``_ . -`` only, never hidden.

    A name that had to be changed gets a hash of the original appended, and so does a name
    that already ends the way such a hash does (``-`` and 16 hexadecimal digits), so two
    different names never share a file.
    """
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)[:96].lstrip(".")
    if safe != name or not safe or _HASHED.search(safe):
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        safe = f"{safe or 'pool'}-{digest}"
    return safe + _SUFFIX


class _Batch(IOHandle):
    """Handle of one ``read``/``write``: done when all of its tasks are."""

    def __init__(self, futures: list[cf.Future[None]], keepalive: np.ndarray) -> None:
        self._futures = futures
        self._keepalive = keepalive  # the caller's rows must outlive the I/O

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> None:
        _, pending = cf.wait(self._futures, timeout=timeout)
        if pending:
            raise TimeoutError(f"disk I/O not finished after {timeout} s")
        for future in self._futures:
            exc = future.exception()
            if exc is not None:
                if isinstance(exc, TierIOError):
                    raise exc
                raise TierIOError(f"disk I/O failed: {type(exc).__name__}: {exc}") from exc


# (file offset, buffers, bytes) of one preadv/pwritev
_Call = tuple[int, list[memoryview], int]


class DiskPool(StoragePool):
    """One pool file (see module docstring). Built by :meth:`DiskTier.create_pool`.

    Attributes:
        name: the pool's name (empty for an anonymous pool).
        path: the pool file.
        data_offset: byte of the file where slot 0 starts.
    """

    data_offset = HEADER_BYTES

    def __init__(
        self, tier: DiskTier, fd: int, name: str, fname: str, slot_bytes: int, num_slots: int
    ) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.name = name
        self.path = os.path.join(tier.directory, fname)
        self._tier = tier
        self._fd: int | None = fd
        self._fname = fname
        self._pending: set[cf.Future[None]] = set()
        self._lock = threading.Lock()
        self._nowait = True  # read_nowait is worth trying (until the file system says no)
        self._row_item = np.dtype((np.void, slot_bytes))  # a slot's bytes as one item
        self._natives: list[aio.NativeWrite] = []  # write_behind writes maybe in flight
        self._gone = "was closed"  # why the pool is unusable once _fd is None

    def _label(self) -> str:
        return f"disk pool {self.name!r}" if self.name else "anonymous disk pool"

    def _live_fd(self) -> int:
        if self._fd is None:
            raise InvalidStateError(f"{self._label()} {self._gone}")
        return self._fd

    def _disown(self) -> None:
        """In a forked child: close this process's copy of the file (the parent's stays
        open, its file untouched); the pool is then closed here."""
        fd, self._fd = self._fd, None
        self._gone = _FORKED
        self._pending, self._natives = set(), []  # the parent's threads' work
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- I/O -------------------------------------------------------------------------

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Store ``source[i]`` into ``slots[i]`` asynchronously.

        Raises:
            ValueError: a slot out of range or repeated, or ``source`` not ``uint8
                [len(slots), slot_bytes]`` (raised here; nothing is written).
            InvalidStateError: the pool was closed.
        """
        fd = self._live_fd()
        arr = check_slots(self, slots)
        rows = checked_rows(self, source, len(arr), "source")
        if not _rows_contiguous(rows):
            rows = np.ascontiguousarray(rows)
        order = _order(arr)
        if order is not None:
            ordered = arr[order]
            if np.count_nonzero(ordered[1:] == ordered[:-1]):
                raise ValueError(f"slots={arr.tolist()}: a write may name each slot only once")
        return self._submit(fd, arr, rows, write=True, order=order)

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Load ``slots[i]`` into ``dest[i]`` asynchronously.

        Raises:
            ValueError: a slot out of range, or ``dest`` not a writable ``uint8
                [len(slots), slot_bytes]`` array with contiguous rows.
            InvalidStateError: the pool was closed.
        """
        fd = self._live_fd()
        arr = check_slots(self, slots)
        rows = checked_rows(self, dest, len(arr), "dest")
        if not _rows_contiguous(rows) or not rows.flags.writeable:
            raise ValueError(
                f"dest strides={rows.strides} writeable={rows.flags.writeable}: must be a "
                "writable array whose rows are contiguous"
            )
        return self._submit(fd, arr, rows, write=False, order=_order(arr))

    def write_behind(self, slots: np.ndarray, source: np.ndarray) -> aio.NativeWrite | None:
        """Start writing ``source[i]`` into ``slots[i]`` on glibc's AIO threads and return
        at once (:class:`kvcm_tier_disk.aio.NativeWrite`; the rows are copied in slot
        order, one request per run of consecutive slots); None when the option
        ``native_writes`` is off or the platform cannot.

        Raises:
            ValueError: as :meth:`write` (nothing is written).
            InvalidStateError: the pool was closed.
        """
        if not self._tier.native_writes or not aio.native_available():
            return None
        fd = self._live_fd()
        arr = check_slots(self, slots)
        return self._behind(fd, arr, checked_rows(self, source, len(arr), "source"))

    def _write_behind_checked(self, slots: np.ndarray, source: np.ndarray, bound: int,
                              owned: bool = False) -> aio.NativeWrite | None:
        """:meth:`write_behind` for a storage level (:mod:`kvcm_core.level_io`) whose
        ``DeadlinePool.write`` has already checked ``slots`` as ``check_slots`` does: an
        ``int64 [n]`` array (its result) of slots in ``[0, bound)``. That O(n) check is not
        made again while ``bound <= num_slots`` (every slot is then in range here too,
        exactly what it would test); the O(1) checks (pool open, rows' type and shape) still
        are. Otherwise (a smaller pool, or a subclass's own ``write_behind``) this is
        :meth:`write_behind`, every check included. ``owned``: ``source`` is the level's
        private copy, which nobody writes again (its held rows, flushed): kept as the
        buffer the writes read (when C-contiguous) rather than copied once more."""
        if bound > self.num_slots or type(self).write_behind is not DiskPool.write_behind:
            return self.write_behind(slots, source)
        if not self._tier.native_writes or not aio.native_available():
            return None
        fd = self._live_fd()
        return self._behind(fd, slots, checked_rows(self, source, len(slots), "source"),
                            owned)

    def _behind(self, fd: int, arr: np.ndarray, rows: np.ndarray, owned: bool = False
                ) -> aio.NativeWrite | None:
        """:meth:`write_behind` of checked slots (``int64 [n]``, in range) and rows
        (``owned``: see :meth:`_write_behind_checked`)."""
        n = len(arr)
        if not n:
            return None
        # The rows the writes read: a copy (the caller may reuse its rows) unless owned.
        mine = rows if owned and rows.flags.c_contiguous else None
        if n == 1:
            write = self._write_runs(fd, arr, mine if mine is not None else
                                     np.array(rows, order="C", copy=True), arr[:0])
        else:
            step = arr[1:] - arr[:-1]  # slots in range: their differences cannot overflow
            # A run ends where the next slot is not next (the method: np.flatnonzero is
            # Python code around it).
            ends = (step != 1).nonzero()[0]
            if len(ends) and step[ends].min() <= 0:  # not in slot order (or repeated)
                write = self._write_unordered(fd, arr, rows)
            else:  # in slot order; no step (one run, most writes) or only steps > 1 in ends
                write = self._write_runs(fd, arr, mine if mine is not None else
                                         np.array(rows, order="C", copy=True), ends)
        self._natives = [w for w in self._natives if not w.done()]
        self._natives.append(write)  # close and resize wait for it
        return write

    def _write_unordered(self, fd: int, arr: np.ndarray, rows: np.ndarray
                         ) -> aio.NativeWrite:
        """:meth:`write_behind` of checked slots ``arr`` that are not in slot order: the
        rows copied in slot order, then one request per run of consecutive slots."""
        order = np.argsort(arr, kind="stable")
        arr = arr[order]
        step = arr[1:] - arr[:-1]
        if not step.all():
            raise ValueError(f"slots={arr.tolist()}: a write may name each slot only once")
        rows = np.ascontiguousarray(rows[order])  # a copy (fancy indexing), in slot order
        return self._write_runs(fd, arr, rows, (step != 1).nonzero()[0])

    def _write_runs(self, fd: int, arr: np.ndarray, rows: np.ndarray, ends: np.ndarray
                    ) -> aio.NativeWrite:
        """One request per run of consecutive slots of ``arr`` (increasing; the rows, ours
        and packed, in the same order); ``ends``: the index of each run's last slot but
        the last run's (none: one run, one request)."""
        n, sb = len(arr), self.slot_bytes
        if not len(ends):
            return aio.NativeWrite(fd, [int(arr[0]) * sb + self.data_offset],
                                   [aio.data_address(rows)], [n * sb], rows)
        starts = np.empty(len(ends) + 1, dtype=np.int64)  # each run's first row
        starts[0] = 0
        np.add(ends, 1, out=starts[1:])
        at = starts * sb  # the runs' first bytes in rows
        sizes = np.empty_like(at)
        sizes[:-1] = at[1:]
        sizes[-1] = n * sb
        sizes -= at
        offsets = arr[starts]
        offsets *= sb
        offsets += self.data_offset
        at += aio.data_address(rows)
        return aio.NativeWrite(fd, offsets, at, sizes, rows)

    def read_nowait(self, slots: np.ndarray, dest: np.ndarray) -> bool:
        """Read from the page cache only (:func:`kvcm_tier_disk.aio.read_nowait`, one
        call per run of consecutive slots, in slot order as :meth:`read` does; slots not
        in order are read into a copy in slot order, then moved to their rows, or, when
        they lie close together (:data:`_NOWAIT_SPAN`), as one call from the lowest slot
        to the highest, the rows then taken from it): True when
        every byte came back; False when any of it would need the device, when the file
        system does not support it (this pool then stops trying), for a read of more than
        :data:`_NOWAIT_RUNS` runs or :data:`_NOWAIT_BYTES` bytes (the thread's read
        releases the GIL while it copies), or on any error, bad arguments included (the
        caller's ordinary read reports it)."""
        fd = self._fd
        if fd is None or not self._nowait:
            return False
        if not (isinstance(slots, np.ndarray) and slots.ndim == 1 and slots.dtype.kind in "iu"
                and isinstance(dest, np.ndarray) and dest.dtype == np.uint8
                and dest.flags.c_contiguous and dest.flags.writeable):
            return False
        n, sb = len(slots), self.slot_bytes
        if dest.shape != (n, sb) or n == 0 or n * sb > _NOWAIT_BYTES:
            return False
        arr = slots.astype(np.int64, copy=False)  # file offsets never wrap
        first, last = int(arr[0]), int(arr[-1])
        if n == 1 or (last - first == n - 1 and (n == 2 or bool(
                (np.diff(arr) == 1).all()))):  # one run
            if first < 0 or last >= self.num_slots:
                return False
            status = aio.read_nowait(fd, (self.data_offset + first * sb,),
                                     (dest.ctypes.data,), (n * sb,))
        else:
            # One reduction for both bounds (as check_slots: a negative slot read as
            # uint64 is larger than any pool).
            hi = int(arr.view(np.uint64).max())  # (the largest slot, all in range)
            if hi >= self.num_slots:
                return False
            lo = int(arr.min())
            span = hi - lo + 1
            unordered = bool(np.count_nonzero(arr[1:] <= arr[:-1]))
            if unordered and span <= _NOWAIT_SPAN * n and span * sb <= _NOWAIT_BYTES:
                # Slots not in slot order (a copy is made anyway) close together (a
                # level hands its slots out from the top down, so an onboard usually
                # names a few runs of them downwards): one read of the slots from the
                # lowest to the highest, then their rows taken from it. The slots in
                # between are read too, from the page cache only as the rest: the read
                # is declined where any of it would need the device.
                into = np.empty((span, sb), dtype=np.uint8)
                status = aio.read_nowait(fd, (self.data_offset + lo * sb,),
                                         (aio.data_address(into),), (span * sb,))
                if status == 0:
                    item = self._row_item
                    into.view(item)[:, 0].take(arr - lo, out=dest.view(item)[:, 0])
                return self._nowait_result(status)
            order = None
            if unordered:  # not in slot order: sort them
                order = arr.argsort(kind="stable")
                arr = arr.take(order)
            cuts = (arr[1:] != arr[:-1] + 1).nonzero()[0]
            if len(cuts) >= _NOWAIT_RUNS:
                return False
            into = dest if order is None else np.empty_like(dest)
            # Run k is rows starts[k]:starts[k + 1] of ``into``, from slot arr[starts[k]].
            starts = [0, *(cuts + 1).tolist()]
            ends = [*starts[1:], n]
            at = aio.data_address(into)
            status = aio.read_nowait(fd, (arr.take(starts) * sb + self.data_offset).tolist(),
                                     [at + i * sb for i in starts],
                                     [(j - i) * sb for i, j in zip(starts, ends, strict=True)])
            if status == 0 and order is not None:  # row i of the copy is dest[order[i]]
                item = self._row_item
                dest.view(item)[:, 0].put(order, into.view(item)[:, 0])
        return self._nowait_result(status)

    def _nowait_result(self, status: int | None) -> bool:
        """:meth:`read_nowait`'s result for ``aio.read_nowait``'s ``status``."""
        if status is None or status in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS,
                                        errno.EPERM):  # never here: stop trying
            self._nowait = False
        return status == 0

    def _submit(self, fd: int, slots: np.ndarray, rows: np.ndarray, *, write: bool,
                order: np.ndarray | None) -> IOHandle:
        """``order``: a stable argsort of ``slots``, or None when they are increasing."""
        if not len(slots):
            return CompletedIO()
        if len(slots) * self.slot_bytes <= _INLINE_BYTES:
            return self._inline(fd, slots, rows, write=write, order=order)
        tasks = list(self._tasks(slots, rows, order))
        futures = [
            self._tier._executor.submit(_run_calls, fd, calls, write, self._label(),
                                        self._tier.batch_syscalls)
            for calls in tasks
        ]
        with self._lock:
            self._pending.update(futures)
        for future in futures:
            future.add_done_callback(self._forget)
        return _Batch(futures, rows)

    def _inline(self, fd: int, slots: np.ndarray, rows: np.ndarray, *, write: bool,
                order: np.ndarray | None) -> IOHandle:
        """A small batch on the caller's thread: handing it to a thread and waiting would
        cost more than the I/O. Rows go through a slot-ordered copy (unless the slots are
        in order already), so every run of consecutive slots is one buffer of one call."""
        if order is None and rows.flags.c_contiguous:
            # Slots in order, rows packed: one call per run of consecutive slots, straight
            # from the caller's rows (a batch this small never needs splitting).
            try:
                self._run_runs(fd, slots, rows, write)
            except TierIOError as exc:
                return CompletedIO(exc)
            return CompletedIO()
        if order is None:
            order = np.arange(len(slots))
        ordered = slots[order]
        staged = rows[order] if write else np.empty_like(rows)
        try:
            for task in self._tasks(ordered, staged, None):
                _run_calls(fd, task, write, self._label(), self._tier.batch_syscalls)
        except TierIOError as exc:
            return CompletedIO(exc)
        if not write:
            rows[order] = staged
        return CompletedIO()

    def _run_runs(self, fd: int, slots: np.ndarray, rows: np.ndarray, write: bool) -> None:
        """One call per run of consecutive ``slots`` (increasing), straight between the
        file and the packed ``rows``; the first failure raises. A batched submission
        (three runs or more) takes the runs as arrays: no Python code runs per run."""
        n = len(slots)
        cuts = np.flatnonzero(slots[1:] != slots[:-1] + 1) + 1  # where runs start, but 0
        sb, base = self.slot_bytes, self.data_offset
        batch = self._tier.batch_syscalls
        if batch and len(cuts) + 1 >= aio.MIN_CALLS:
            starts = np.concatenate(([0], cuts))
            offsets = base + slots[starts] * sb
            op = "pwritev" if write else "preadv"
            try:
                failed = aio.run_runs(fd, offsets, rows.ctypes.data + starts * sb,
                                      (np.append(cuts, n) - starts) * sb, write)
            except OSError as exc:  # io_getevents failed: the batch's outcome is unknown
                raise TierIOError(f"{self._label()}: batched {op} of {len(starts)} runs "
                                  f"failed: {exc}") from exc
            if failed is not None:
                _raise_batch_failure(failed, offsets, op, self._label())
                return
        first = [0, *cuts.tolist()]
        calls = [(base + slot * sb, [rows[a:b].data], (b - a) * sb)
                 for a, b, slot in zip(first, [*first[1:], n], slots[first].tolist(),
                                       strict=True)]
        _run_calls(fd, calls, write, self._label(), batch)

    def _forget(self, future: cf.Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _tasks(self, slots: np.ndarray, rows: np.ndarray,
               order: np.ndarray | None) -> Iterator[list[_Call]]:
        """Cut a batch into tasks for the I/O threads; each task is a list of calls.

        A call is one ``preadv``/``pwritev`` over a run of consecutive slots: its buffers are
        the caller's rows (consecutive rows merge into one buffer). Tasks aim at an equal
        share of the batch per thread, between 256 KiB and 8 MiB.
        """
        if not len(slots):
            return
        sb = self.slot_bytes
        packed = rows.flags.c_contiguous
        if order is None:  # slots are sorted and rows follow them
            sorted_slots = slots
            file_next = sorted_slots[1:] == sorted_slots[:-1] + 1
            mem_next = file_next if packed else np.zeros(len(file_next), dtype=bool)
            order = np.arange(len(slots))
        else:
            sorted_slots = slots[order]
            file_next = sorted_slots[1:] == sorted_slots[:-1] + 1
            mem_next = file_next & (order[1:] == order[:-1] + 1) & packed
        # pieces: runs contiguous both in the file and in memory -> one buffer each
        starts = np.concatenate(([0], np.nonzero(~mem_next)[0] + 1)).tolist()
        ends = [*starts[1:], len(slots)]
        share = -(-len(slots) * sb // self._tier._threads)
        target = min(max(share, 256 << 10), _TASK_BYTES)
        task: list[_Call] = []
        task_bytes = 0
        offset, nbytes = 0, 0  # the call being built
        buffers: list[memoryview] = []
        for a, b in zip(starts, ends, strict=True):
            r0 = int(order[a])
            view = rows[r0 : r0 + (b - a)].data.cast("B")
            at = self.data_offset + int(sorted_slots[a]) * sb
            joins = a > 0 and bool(file_next[a - 1])
            for cut in range(0, len(view), _MAX_CALL_BYTES):
                piece = view[cut : cut + _MAX_CALL_BYTES]
                if (
                    buffers
                    and joins
                    and len(buffers) < _MAX_IOV
                    and nbytes + len(piece) <= _MAX_CALL_BYTES
                ):
                    buffers.append(piece)
                    nbytes += len(piece)
                else:
                    if buffers:
                        task.append((offset, buffers, nbytes))
                        task_bytes += nbytes
                        if task_bytes >= target:
                            yield task
                            task, task_bytes = [], 0
                    offset, buffers, nbytes = at + cut, [piece], len(piece)
                joins = True
        task.append((offset, buffers, nbytes))
        yield task

    def _drain(self) -> None:
        """Wait for this pool's I/O in flight (their errors belong to their handles)."""
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending)
        while self._natives:  # writes on glibc's threads: the file must outlive them
            if self._natives[-1].done() and all(w.done() for w in self._natives):
                self._natives.clear()
                break
            time.sleep(0.0005)

    # -- life cycle --------------------------------------------------------------------

    def resize(self, num_slots: int) -> None:
        """Grow or shrink the file to ``num_slots`` slots, keeping the kept slots' data.

        Waits for this pool's I/O in flight first. Grown slots read as zeros.

        Raises:
            ValueError: ``num_slots`` is not an int >= 0.
            InvalidStateError: the pool was closed.
            TierIOError: the file could not be resized (the pool is unchanged).
        """
        num_slots = _check_count(num_slots)
        fd = self._live_fd()
        self._drain()
        try:
            _set_size(fd, self.data_offset + num_slots * self.slot_bytes)
        except OSError as exc:
            raise TierIOError(
                f"{self._label()}: resize to {num_slots} slots failed: {exc}"
            ) from exc
        self.num_slots = num_slots

    def close(self) -> None:
        """Wait for I/O in flight and close the file (idempotent).

        The file stays for a named pool (it is reopened by name); an anonymous pool's file
        is deleted.
        """
        if self._fd is None:
            return
        self._drain()
        fd, self._fd = self._fd, None
        self._tier._pools.pop(self._fname, None)
        try:
            os.close(fd)
            if not self.name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._fname, dir_fd=self._tier._dir_fd)
        except OSError as exc:
            raise TierIOError(f"{self._label()}: closing {self.path} failed: {exc}") from exc


def _rows_contiguous(rows: np.ndarray) -> bool:
    """Each row is one contiguous run of bytes (empty and single-byte rows always are)."""
    return rows.size == 0 or rows.shape[1] <= 1 or rows.strides[1] == 1


def _order(slots: np.ndarray) -> np.ndarray | None:
    """A stable argsort of ``slots``; None when they are strictly increasing already."""
    if len(slots) < 2 or not np.count_nonzero(slots[1:] <= slots[:-1]):
        return None
    return np.argsort(slots, kind="stable")


def _run_calls(fd: int, calls: list[_Call], write: bool, label: str,
               batch: bool = False) -> None:
    """The calls of one batch (or task), in order; the first failure raises. ``batch``:
    submit them in one system call where the platform allows (:mod:`kvcm_tier_disk.aio`)."""
    op = "pwritev" if write else "preadv"
    if batch and len(calls) >= aio.MIN_CALLS:
        try:
            failed = aio.run(fd, calls, write)
        except OSError as exc:  # io_getevents failed: the batch's outcome is unknown
            raise TierIOError(f"{label}: batched {op} of {len(calls)} runs failed: "
                              f"{exc}") from exc
        if failed is not None:
            _raise_batch_failure(failed, [c[0] for c in calls], op, label)
            return
    for offset, buffers, nbytes in calls:
        try:
            if write:  # one buffer: pwrite (half the cost of pwritev from Python)
                done = os.pwrite(fd, buffers[0], offset) if len(buffers) == 1 else \
                    os.pwritev(fd, buffers, offset)
            else:
                done = os.preadv(fd, buffers, offset)
        except OSError as exc:
            raise TierIOError(
                f"{label}: {op} of {nbytes} bytes at offset {offset} failed: {exc}"
            ) from exc
        if done != nbytes:
            raise TierIOError(
                f"{label}: short {op}: {done} of {nbytes} bytes at offset {offset} "
                "(file truncated or disk full)"
            )


def _raise_batch_failure(failed: list[tuple[int, int, int]], offsets: Sequence[int] | np.ndarray,
                         op: str, label: str) -> None:
    """Raise for the first call of a batched submission that failed or came up short
    (:func:`kvcm_tier_disk.aio.run`'s answer; nothing when it is empty)."""
    if not failed:
        return
    i, done, nbytes = failed[0]
    offset = int(offsets[i])
    if done < 0:
        raise TierIOError(f"{label}: {op} of {nbytes} bytes at offset {offset} "
                          f"failed: [Errno {-done}] {os.strerror(-done)}")
    raise TierIOError(f"{label}: short {op}: {done} of {nbytes} bytes at offset {offset} "
                      "(file truncated or disk full)")


def _check_count(num_slots: object) -> int:
    if isinstance(num_slots, bool) or not isinstance(num_slots, int | np.integer):
        raise ValueError(f"num_slots={num_slots!r}: must be an int >= 0")
    if num_slots < 0:
        raise ValueError(f"num_slots={num_slots!r}: must be >= 0")
    return int(num_slots)


def _set_size(fd: int, size: int) -> None:
    """Make the file exactly ``size`` bytes, reserving the blocks where supported."""
    current = os.fstat(fd).st_size
    if size < current:
        os.ftruncate(fd, size)
    elif size > current:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:  # file systems without fallocate: sparse growth
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            os.ftruncate(fd, size)


class DiskTier(Tier):
    """Pools in files of one directory (see module docstring).

    Raises:
        ConfigError: an unknown option, a bad value, or an unsafe ``path``.
    """

    capabilities = CAPABILITIES

    def __init__(self, backend: KernelBackend | None, options: Mapping[str, Any] | None = None):
        super().__init__(backend, options or {})  # type: ignore[arg-type]
        path, threads, self.mode, self._segment_bytes, self.batch_syscalls, \
            self.native_writes = _parse_options(self.options)
        if self.mode == "blob":
            self.capabilities = BLOB_CAPABILITIES
        self._threads = threads
        self._anon_prefix = ""  # the owner directory, relative to the tier's directory
        self._pools: dict[str, DiskPool | BlobDiskPool] = {}
        self._anonymous = itertools.count()
        self._lock: OwnerLock | None = None
        self._dir_fd: int | None = None
        self.directory = path or ""
        #: Where this tier's anonymous pool files live (removed at close, swept after a
        #: crash); the private directory itself without ``path``.
        self.owner_directory: str | None = None
        #: What the sweep at start removed (directories of dead owners, their bytes).
        self.swept = Swept()
        self._gone = "disk tier was closed"  # why it is unusable once _dir_fd is None
        try:  # a failure part way releases what was built (descriptors, directories)
            self._claim_directory(path)
        except BaseException:
            self._release_directory()
            raise
        self._executor = cf.ThreadPoolExecutor(threads, thread_name_prefix="kvcm-disk")
        _TIERS.add(self)

    def _disown(self) -> None:
        """In a forked child (``os.fork`` without exec): close this process's copies of
        the parent's descriptors (the owner lock, the directory, every pool's files), so
        that a child outliving a killed parent holds no lock that keeps the parent's
        owner directory from being swept. Nothing on disk is touched (the files are the
        parent's); the tier and its pools are closed in the child (``InvalidStateError``),
        and its :meth:`close` removes nothing."""
        for pool in list(self._pools.values()):
            pool._disown()
        self._pools.clear()
        lock, self._lock = self._lock, None
        fds = [self._dir_fd, lock.fd if lock is not None else None]
        if lock is not None:
            lock.fd = None  # closing our copy leaves the parent's flock held
        self._dir_fd = None
        self.owner_directory = None
        self._gone = f"disk tier {_FORKED}"
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _claim_directory(self, path: str | None) -> None:
        """Sweep dead owners' directories, then make and lock this tier's own."""
        if path is None:
            self.swept = sweep(tempfile.gettempdir(), PRIVATE_PREFIX)
            try:
                self.directory = self.owner_directory = make_private_directory()
            except OSError as exc:
                raise TierIOError(f"disk tier: cannot create a private directory in "
                                  f"{tempfile.gettempdir()}: {exc}") from exc
            self._dir_fd = _open_directory(self.directory)
        else:
            self._dir_fd = _open_directory(path)
            self.swept = sweep(path, OWNER_PREFIX)
            try:
                name = make_owner_directory(self._dir_fd, path)
            except OSError as exc:
                raise ConfigError("disk.options.path", path,
                                  f"cannot create an owner directory in it: {exc}") from exc
            self.owner_directory = os.path.join(path, name)
            self._anon_prefix = name + "/"
        assert self.owner_directory is not None
        try:
            self._lock = OwnerLock(self.owner_directory)
        except OSError as exc:
            raise ConfigError("disk.options.path", path,
                              f"cannot create the owner lock file: {exc}") from exc

    def _release_directory(self) -> list[str]:
        """Remove the owner directory (the private one without ``path``) and its files,
        then drop the lock and close the directory; returns what failed."""
        failures: list[str] = []
        owner, self.owner_directory = self.owner_directory, None
        if owner is not None:
            try:
                shutil.rmtree(owner)
            except FileNotFoundError:
                pass
            except OSError as exc:  # e.g. read-only now: the next start sweeps it
                failures.append(f"removing {owner}: {exc}")
        lock, self._lock = self._lock, None
        fd, self._dir_fd = self._dir_fd, None
        try:
            if lock is not None:
                lock.release()
            if fd is not None:
                os.close(fd)
        except OSError as exc:
            failures.append(f"closing the owner lock or directory: {exc}")
        return failures

    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = ""
                    ) -> DiskPool | BlobDiskPool:
        """Create (or, for a ``name`` whose file exists, reopen) a pool. A named pool
        is this tier's until it closes (one tier at a time: module docstring).

        Raises:
            ValueError: bad sizes, a name already open in this tier, or an existing file
                whose slot size differs.
            TierIOError: the name is open in another disk tier (this process or another;
                nothing is created or changed), the file is unsafe (symbolic link, not a
                regular file, hard-linked, someone else's), not a kvcm pool file, or could
                not be created.
            InvalidStateError: the tier was closed.
        """
        if self._dir_fd is None:
            raise InvalidStateError(self._gone)
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int | np.integer):
            raise ValueError(f"slot_bytes={slot_bytes!r}: must be an int >= 1")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes={slot_bytes!r}: must be >= 1")
        num_slots = _check_count(num_slots)
        if not isinstance(name, str):
            raise ValueError(f"name={name!r}: must be a str")
        if name:
            fname = file_name(name)
            if fname in self._pools:
                raise ValueError(f"name={name!r}: a pool of that name is already open")
        else:  # in this tier's owner directory: swept if the process dies
            fname = f"{self._anon_prefix}.anon-{next(self._anonymous)}{_SUFFIX}"
        if self.mode == "blob":
            lock = self._blob_lock(fname, f"disk blob pool {name!r}") if name else None
            try:
                pool: BlobDiskPool = BlobDiskPool(self, name, fname, int(slot_bytes),
                                                  num_slots, self._segment_bytes, lock)
            except BaseException:
                if lock is not None:
                    os.close(lock)
                raise
            self._pools[fname] = pool
            return pool
        label = f"disk pool {name!r}" if name else "anonymous disk pool"
        fd, created = self._open_file(fname, label)
        if name:  # held through the pool's descriptor until it closes
            held = self._hold(fd, fname, label)
            created = created or held.st_size == 0  # empty: a new pool (module doc)
        try:
            if created:
                os.fchmod(fd, 0o600)
                header = _HEADER.pack(_MAGIC, _VERSION, HEADER_BYTES, int(slot_bytes))
                if os.pwrite(fd, header.ljust(HEADER_BYTES, b"\0"), 0) != HEADER_BYTES:
                    raise TierIOError(f"{label}: short write of the file header")
            else:
                self._check_header(fd, label, int(slot_bytes))
            _set_size(fd, HEADER_BYTES + int(slot_bytes) * num_slots)
        except OSError as exc:
            self._discard(fd, fname, created)
            if isinstance(exc, TierIOError):
                raise
            raise TierIOError(f"{label}: could not prepare {fname!r}: {exc}") from exc
        except BaseException:
            self._discard(fd, fname, created)
            raise
        slot_pool = DiskPool(self, fd, name, fname, int(slot_bytes), num_slots)
        self._pools[fname] = slot_pool
        return slot_pool

    def _discard(self, fd: int, fname: str, created: bool) -> None:
        """Give up a slot pool file whose preparation failed: delete it when this tier made
        it, then close it. In that order: a named pool's lock lasts until the close, so no
        other tier can lock a file that is about to be deleted."""
        try:
            if created:
                os.unlink(fname, dir_fd=self._dir_fd)
        finally:
            os.close(fd)

    def _hold(self, fd: int, fname: str, label: str) -> os.stat_result:
        """Lock ``fname``, just opened as ``fd``, for this tier: an exclusive ``flock``,
        not waited for, held until ``fd`` is closed; returns its status.

        Raises:
            TierIOError: another tier holds it, or it was deleted before the lock was
                taken, or it cannot be locked. ``fd`` is then closed and nothing else is
                touched: a file this tier has just created is the winner's to use.
        """
        where = os.path.join(self.directory, fname)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TierIOError(
                    f"{label} ({where}) is in use by another disk tier, in this process "
                    "or another; a named pool is opened by one tier at a time (close it "
                    "there first)") from exc
            raise TierIOError(f"{label}: cannot lock {where}: {exc}") from exc
        if st.st_nlink == 0:  # deleted by the tier that held it (a failed create)
            os.close(fd)
            raise TierIOError(f"{label}: {where} was deleted by the disk tier that held "
                              "it while this one opened it; try again")
        return st

    def _blob_lock(self, fname: str, label: str) -> int:
        """Open and lock the lock file of named blob pool ``fname`` (:meth:`_hold`);
        returns its descriptor, which the pool closes last at its close."""
        lock = fname + _LOCK_SUFFIX
        fd, _ = self._open_file(lock, label)
        self._hold(fd, lock, label)
        return fd

    def _open_file(self, fname: str, label: str) -> tuple[int, bool]:
        """Create ``fname`` exclusively, or open the existing regular file safely."""
        flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        where = os.path.join(self.directory, fname)
        try:
            return os.open(fname, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._dir_fd), True
        except FileExistsError:
            pass
        except OSError as exc:
            raise TierIOError(f"{label}: cannot create {where}: {exc}") from exc
        try:
            fd = os.open(fname, flags | getattr(os, "O_NONBLOCK", 0), dir_fd=self._dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise TierIOError(
                    f"{label}: {where} is a symbolic link; refusing to follow it"
                ) from exc
            raise TierIOError(f"{label}: cannot open {where}: {exc}") from exc
        st = os.fstat(fd)
        problem = ""
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"is owned by uid {st.st_uid}, not this process's uid {os.geteuid()}"
        elif st.st_nlink != 1:
            problem = f"has {st.st_nlink} hard links (must have exactly 1)"
        if problem:
            os.close(fd)
            raise TierIOError(f"{label}: {where} {problem}; refusing to use it")
        os.set_blocking(fd, True)
        os.fchmod(fd, 0o600)
        return fd, False

    def _live_dir_fd(self) -> int:
        if self._dir_fd is None:
            raise InvalidStateError(self._gone)
        return self._dir_fd

    def _check_header(self, fd: int, label: str, slot_bytes: int) -> None:
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) < _HEADER.size:
            raise TierIOError(f"{label}: existing file is too short to be a kvcm pool file")
        magic, version, header_bytes, stored = _HEADER.unpack(raw)
        if magic != _MAGIC or version != _VERSION or header_bytes != HEADER_BYTES:
            raise TierIOError(
                f"{label}: existing file is not a kvcm pool file (magic={magic!r}, "
                f"version={version}); remove it or choose another pool name"
            )
        if stored != slot_bytes:
            raise ValueError(
                f"slot_bytes={slot_bytes}: {label} exists with slots of {stored} bytes; "
                "reopen it with the same slot size or choose another name"
            )

    def close(self) -> None:
        """Close every pool, stop the I/O threads, remove the owner directory (the private
        directory without ``path``) and drop its lock; idempotent.

        Raises:
            TierIOError: something could not be closed or removed (each failure is listed);
                everything else is released and the tier is closed all the same.
        """
        if self._dir_fd is None:
            return
        _TIERS.discard(self)
        failures = []
        for pool in list(self._pools.values()):
            try:
                pool.close()
            except OSError as exc:
                failures.append(f"{pool.path}: {exc}")
        self._executor.shutdown(wait=True)
        failures += self._release_directory()
        if failures:
            raise TierIOError(f"disk tier in {self.directory}: {'; '.join(failures)}")


#: Every disk tier of this process that is open (closed in a forked child: _after_fork).
_TIERS: weakref.WeakSet[DiskTier] = weakref.WeakSet()


def _after_fork() -> None:
    for tier in list(_TIERS):
        tier._disown()
    _TIERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _open_directory(path: str) -> int:
    """Create or tighten ``path`` to 0700 and open it without following a final link."""
    field = "disk.options.path"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(field, path, f"cannot create the directory: {exc}") from exc
    if os.path.islink(path):
        raise ConfigError(field, path, "is a symbolic link; name the real directory")
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        rule = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened: {exc}"
        raise ConfigError(field, path, f"{rule}; name a real directory") from exc
    st = os.fstat(fd)
    rule = ""
    if not stat.S_ISDIR(st.st_mode):
        rule = "is not a directory"
    elif st.st_uid != os.geteuid():
        rule = f"is owned by uid {st.st_uid}, not this process's uid {os.geteuid()}"
    elif st.st_mode & stat.S_ISVTX:
        rule = "is a shared sticky directory (like /tmp); name a private subdirectory"
    if rule:
        os.close(fd)
        raise ConfigError(field, path, rule)
    os.fchmod(fd, 0o700)
    return fd


@hookimpl
def kvcm_tiers() -> Iterator[TierSpec]:
    yield TierSpec(
        name="disk",
        factory=DiskTier,
        description="Preallocated files, asynchronous pread/pwrite on a thread pool",
        capabilities=CAPABILITIES,
        availability=_availability,
    )
