"""Storage I/O that cannot stall everyone: one I/O thread per storage level, with a deadline.

A cold level whose tier is reached through I/O (disk, remote: pools that are not device
memory) gets a :class:`LevelIO`: one thread of its own that runs every read, write, resize
and close of that level's pools, in submission order. The scheduler thread hands it a
batch and waits at most ``LevelConfig.io_deadline_s`` (default 5 s):

- a **write** past its deadline is dropped: the caller sees
  :class:`~kvcm_core.errors.TierIOError`, as for a failed write, so the block is simply
  not cached on that level (droppable victims are dropped instead of offloaded);
- a **read** past its deadline loses the blocks: the caller sees ``TierIOError``, so they
  leave the prefix tree and a ``resume`` that needed them raises ``TierIOError`` (the
  engine recomputes them);
- while an operation that missed its deadline is still running (the level is *stuck*: a
  frozen file system), every new operation of that level fails at once, without waiting,
  so a level that hangs costs at most one deadline, once; requests that never touch it
  are not delayed at all. The level recovers by itself when the stuck operation returns.
  (A read of held rows, below, needs no I/O and is still served.)

Ordering makes late completions harmless: one thread per level runs operations in order,
and nothing queues behind a stuck one, so a late write lands before any later operation
of its slots. The one exception keeps that rule: a read goes ahead of the background
writes at the end of the queue that write none of its slots (a resume waits for the
blocks it reads, not for write-back of others). A late read lands in a private buffer
that nobody reads; writes copy their rows first (the caller's staging is reused as soon
as the call returns).

Background writes (``LevelConfig.write_queue_depth``, 8 batches unless told otherwise)
are for *droppable* pages, victims that are only cached copies (announced by
:meth:`LevelIO.dropping`): such a write returns once its rows are copied into the queue.
The thread is woken once half the queue has filled (or by any other operation of the level,
which runs after them), and runs the queued writes of one pool as one write, each slot
written once, in slot order: a thread hand-over costs far more than a small write, so
fewer, larger writes keep the level's thread from taking the scheduler's time (the
scheduler and the I/O thread share one interpreter lock).
When ``N`` batches are already in flight it fails at once (``stats.queue_full_drops``) and
the caller drops those victims instead of offloading them, so a level that cannot keep up
never holds up the scheduler. A background write that fails marks its slots bad: a later
read of them fails (the blocks are lost, never wrong KV; they were droppable) until they
are written again. Writes of held pages (a suspended request's, which must not be lost)
stay synchronous within the deadline: a failure leaves them where they were.

Held writes (``LevelConfig.write_combine_bytes``, 1 MiB unless told otherwise): a
background write smaller than that is held back (its rows copied) and started with the
next ones of its pool once that many bytes are held, as one write, so that the hand-over
is paid once for many small writes. A read of held slots only is served from the held
rows; whatever else must run after a held write writes it first: a read of held and other
slots, any write that is not held, a resize, a close, :meth:`LevelIO.wait_idle` (see
:meth:`LevelIO.flush_held`).

Shutdown (:meth:`LevelIO.close_pools`): every pool and the tier are closed on the level's
thread, all within one deadline; operations still unfinished then are abandoned (their
thread closes the files once they return) and listed in the ``TierIOError`` that
``KVCacheManager.shutdown()`` raises.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcm_core.errors import TierIOError
from kvcm_core.tier import (
    BlobPool,
    CompletedIO,
    IOHandle,
    Pool,
    StoragePool,
    WriteBehind,
    check_slots,
)

__all__ = ["DeadlineBlobPool", "DeadlinePool", "IODeadlineError", "IOStats", "LevelIO",
           "WriteQueueFull"]


class IODeadlineError(TierIOError):
    """A storage operation missed its level's ``io_deadline_s`` (or was not attempted
    because an earlier one is still stuck past it).

    Attributes:
        attempted: False when the operation was refused at once (never queued).
    """

    def __init__(self, message: str, *, attempted: bool = True) -> None:
        super().__init__(message)
        self.attempted = attempted


class WriteQueueFull(IODeadlineError):
    """A write of droppable pages found the level's background write queue full: it was
    not attempted (the pages are dropped instead of offloaded)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, attempted=False)


class IOStats:
    """What a level's I/O thread saw (counters only grow).

    Three counters tell apart what a deadline cost; each operation is in at most one:

    - ``read_misses`` / ``write_misses``: reads and writes a caller waited for and that
      ran past their deadline (a read's blocks lost, a write's blocks not cached there);
    - ``background_misses``: background writes (nobody waits for them) not done within
      the deadline of their being queued (counted from the thread's wake-up);
    - ``fast_fails``: operations not attempted at all, refused at once because the level
      was stuck (reads, writes, background writes and resizes alike).

    Attributes:
        operations: operations run on the thread.
        write_misses: writes a caller waited for past their deadline (the blocks were
            dropped); not those refused at once (``fast_fails``).
        read_misses: reads a caller waited for past their deadline (the blocks were lost);
            not those refused at once (``fast_fails``).
        background_misses: background writes past their deadline, counted once each:
            when the level's thread finishes one late, or when one still unfinished is
            seen past it (a write on the tier's own threads is counted only so: when the
            level looks at it for an operation, or a full queue waits for it).
        fast_fails: operations refused at once because the level was stuck (counted in
            no miss).
        background_failures: background writes that failed (their slots marked bad).
        bad_reads: reads refused because a slot's background write had failed.
        queue_full_drops: writes of droppable pages not attempted because the background
            queue was full (those pages were dropped instead of offloaded).
        direct_reads: reads served on the caller's thread from memory the storage
            already held (:meth:`StoragePool.read_nowait`), with no hand-over.
        direct_writes: background writes that ran on the tier's own threads
            (:meth:`StoragePool.write_behind`) and succeeded, with no hand-over.
        held_writes: background writes held back and written together with the next
            ones of their pool (``LevelConfig.write_combine_bytes``).
        held_reads: reads served from the rows of held writes.
    """

    __slots__ = ("background_failures", "background_misses", "bad_reads", "direct_reads",
                 "direct_writes", "fast_fails", "held_reads", "held_writes", "operations",
                 "queue_full_drops", "read_misses", "write_misses")

    def __init__(self) -> None:
        self.operations = 0
        self.write_misses = 0
        self.read_misses = 0
        self.background_misses = 0
        self.fast_fails = 0
        self.background_failures = 0
        self.bad_reads = 0
        self.queue_full_drops = 0
        self.direct_reads = 0
        self.direct_writes = 0
        self.held_writes = 0
        self.held_reads = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class _Finished:
    """The ``done`` of a write on the tier's threads (:attr:`_Job.handle`), set by the
    first look that sees its handle finished. Nobody blocks on it (waiters poll the
    handle: :meth:`LevelIO._wait`), so it is a flag, without the lock and condition that
    a ``threading.Event`` costs to make and to set for every such write."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True


class _Job:
    __slots__ = ("after", "done", "error", "fn", "handle", "kind", "missed", "rows", "seq",
                 "submitted", "target", "what")

    def __init__(self, fn: Callable[[], None], what: str, kind: str,
                 handle: WriteBehind | None = None) -> None:
        self.fn = fn
        self.what = what
        self.kind = kind  # "read", "write", "bg-write", "admin"
        self.submitted = time.monotonic()
        self.done: threading.Event | _Finished = threading.Event() if handle is None \
            else _Finished()
        self.error: BaseException | None = None
        #: The pool and slots a background write writes or a read reads (None: unknown).
        self.target: tuple[Any, np.ndarray] | None = None
        #: A background write's rows, when it can merge with its neighbours (a storage
        #: pool's ``write(target slots, rows)``).
        self.rows: np.ndarray | None = None
        #: A background write running on the tier's threads (``write_behind``), its
        #: number among them (``seq``); a job for the level's thread waits for the
        #: first ``after`` of those before it runs.
        self.handle = handle
        self.seq = -1
        self.after = 0
        #: A background write counted in ``IOStats.background_misses`` (once).
        self.missed = False


def _no_op() -> None:
    pass


#: Seconds between two looks at writes running on a tier's threads, when waiting for them
#: (doubling up to the second figure: each look takes the interpreter lock).
_POLL_S = 0.0002
_POLL_MAX_S = 0.005


#: Background writes merged into one write at most (the thread's hand-over is paid once).
_MERGE_JOBS = 16

#: Background writes of one pool held back at most (see :meth:`LevelIO.flush_held`).
_HOLD_WRITES = 64


class _Held:
    """Background writes of one pool held back, to be written as one. Their rows are
    copied, in order, into ``buf`` (rows ``[0, n)``), ``slots[i]`` is the slot of row
    ``i``, and ``where[slot]`` the row of the slot's last held write (-1: none), so that a
    read of held slots is served from ``buf`` and a slot held twice is written once, with
    its last rows. Kept per pool from one write to the next."""

    __slots__ = ("buf", "checked", "n", "pool", "row_ids", "slots", "where", "writes")

    def __init__(self, pool: StoragePool, checked: int, rows: int, width: int) -> None:
        self.pool = pool
        self.checked = checked  # the slots are check_slots' result for this many slots
        self.buf = np.empty((rows, width), dtype=np.uint8)
        self.slots = np.empty(rows, dtype=np.int64)
        self.where = np.full(checked, -1, dtype=np.int32)
        self.row_ids = np.arange(rows, dtype=np.int32)  # i at i: slices of it, no arange
        self.n = 0
        self.writes = 0  # held writes in buf


class _Dropping:
    """The context of :meth:`LevelIO.dropping`: sets the level's ``droppable`` on entry,
    puts back the one it found on exit (a class: a generator-based context manager costs
    several times as much, on every move to a storage level)."""

    __slots__ = ("before", "droppable", "io")

    def __init__(self, io: LevelIO, droppable: bool) -> None:
        self.io = io
        self.droppable = droppable
        self.before = False

    def __enter__(self) -> None:
        io = self.io
        self.before, io.droppable = io.droppable, self.droppable

    def __exit__(self, *exc: object) -> None:
        self.io.droppable = self.before


class LevelIO:
    """The I/O thread of storage level ``level`` (see module docstring).

    Args:
        level: the level index (names the thread and messages).
        deadline_s: seconds an operation may take (None: run on the caller's thread).
        write_queue_depth: background write batches in flight at most (0: none).
        combine_bytes: background writes of a pool smaller than this are held back, up
            to this many bytes in all, and written as one (0: each on its own; see
            :meth:`flush_held`).
    """

    def __init__(self, level: int, deadline_s: float | None, write_queue_depth: int = 0,
                 combine_bytes: int = 0) -> None:
        self.level = level
        self.deadline_s = deadline_s
        self.write_queue_depth = write_queue_depth if deadline_s is not None else 0
        self.combine_bytes = combine_bytes if self.write_queue_depth else 0
        self._holders: dict[int, _Held] = {}  # id(pool) -> its _Held, kept
        self._held: dict[int, _Held] = {}  # those holding writes now
        self._held_bytes = 0
        self.stats = IOStats()
        # The condition's own lock: ``with self._lock`` is ``with self._cv`` (waits and
        # notifies still go through the condition) without its Python-level __enter__.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._queue: collections.deque[_Job | None] = collections.deque()
        self._running: _Job | None = None
        self._batch: list[_Job] = []  # the jobs _running runs (merged writes: several)
        #: Background writes on the tier's threads, in submission order (see _Job.handle).
        self._native: collections.deque[_Job] = collections.deque()
        self._native_seq = 0
        self._started = 0.0  # when the thread began ``_running``
        self._late: list[_Job] = []  # jobs past their deadline, not finished
        self._background: collections.deque[_Job] = collections.deque()
        self._bad: set[tuple[int, int]] = set()  # (pool id, slot) of failed bg writes
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._go = False  # the thread was woken: it runs what is queued until none is left
        self._lazy = 0  # background writes queued since the thread was last woken
        #: The writes being issued are of droppable pages (see :meth:`dropping`).
        self.droppable = False

    def dropping(self, droppable: bool) -> _Dropping:
        """Within the block, writes are of droppable pages when ``droppable`` is True:
        only those go to the background queue (a full queue refuses them at once); any
        other write completes, within the deadline, before the call returns."""
        return _Dropping(self, droppable)

    # -- the thread --------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"kvcm-io-L{self.level}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._queue and self._go):
                    self._cv.wait()
                job = self._queue.popleft()
                if job is None:
                    return
                batch = [job]
                if job.rows is not None:  # queued writes of the same pool after it
                    q = self._queue
                    pool = job.target[0]  # type: ignore[index]
                    while q and len(batch) < _MERGE_JOBS:
                        nxt = q[0]
                        if nxt is None or nxt.rows is None or nxt.target[0] is not pool:  # type: ignore[index]
                            break
                        batch.append(q.popleft())
                self._running = job
                self._batch = batch
                self._started = time.monotonic()
            try:
                # Writes already on the tier's threads go first: this job was queued after
                # them.
                self._await_native(max(j.after for j in batch))
                if job.rows is not None:  # one write for the batch (of one or more)
                    self._write_merged(batch)
                else:
                    job.fn()
            except BaseException as exc:  # handed to the waiters, never lost; the thread
                for j in batch:  # goes on with the next job
                    j.error = exc
                    if j.rows is not None:  # not written: its slots read as failed
                        self._mark_bad(j.target[0], j.target[1], 1)  # type: ignore[index]
            with self._lock:
                self._running = None
                self._batch = []
                self.stats.operations += len(batch)
                if job.kind == "bg-write" and self.deadline_s is not None:
                    now = time.monotonic()
                    for done in batch:
                        if now - done.submitted > self.deadline_s:
                            self._background_missed(done)
                for done in batch:
                    if done in self._late:
                        self._late.remove(done)
                    done.done.set()
                if not self._queue:
                    self._go = False  # asleep until the next wake-up
                self._cv.notify_all()

    def _write_merged(self, batch: list[_Job]) -> None:
        """On the thread: the background writes ``batch`` (one pool) as one write, in slot
        order; a slot named twice gets its last write's rows. A failure marks every slot
        of the batch bad."""
        pool = batch[0].target[0]  # type: ignore[index]
        slots = np.concatenate([j.target[1] for j in batch])  # type: ignore[index]
        rows = np.concatenate([j.rows for j in batch])  # type: ignore[misc]
        last, first = np.unique(slots[::-1], return_index=True)
        pick = len(slots) - 1 - first  # the last write of each slot, in slot order
        try:
            _wait(pool.write(last, rows[pick]))
        except BaseException as exc:
            self._mark_bad(pool, slots, len(batch))
            for job in batch:
                job.error = exc
            return
        self._clear_bad(pool, last)

    def _mark_bad(self, pool: Pool, slots: np.ndarray, failures: int) -> None:
        key = id(pool)
        with self._lock:
            self._bad.update((key, int(s)) for s in slots.tolist())
            self.stats.background_failures += failures

    def _clear_bad(self, pool: Pool, slots: np.ndarray) -> None:
        if self._bad:
            key = id(pool)
            with self._lock:
                self._bad.difference_update((key, int(s)) for s in slots.tolist())

    @property
    def thread_alive(self) -> bool:
        """Whether the level's thread is running (started at the first operation, ended
        by :meth:`close` once what is queued has run)."""
        return self._thread is not None and self._thread.is_alive()

    def stuck(self) -> str | None:
        """What the level is stuck on (an operation past its deadline: one somebody waited
        for in vain, or one the thread has been running for longer than the deadline, a
        background write for example), or None."""
        with self._lock:
            if self._late:
                job = self._late[0]
                return f"{job.what} ({time.monotonic() - job.submitted:.1f} s)"
            if self.deadline_s is not None:
                for job in self._native:
                    took = time.monotonic() - job.submitted
                    if took <= self.deadline_s:
                        break
                    if not self._native_done(job):
                        self._background_missed(job)
                        return f"{job.what} (on the tier's threads {took:.1f} s)"
            job = self._running
            if job is None or self.deadline_s is None:
                return None
            took = time.monotonic() - self._started
            if took <= self.deadline_s:
                return None
            if job.kind == "bg-write":  # nobody waits for it: counted here
                for late in self._batch:
                    self._background_missed(late)
            return f"{job.what} (running {took:.1f} s)"

    def _background_missed(self, job: _Job) -> None:
        """(Holding ``_cv``.) The background write ``job`` ran past its deadline: counted
        in ``stats.background_misses``, once."""
        if not job.missed:
            job.missed = True
            self.stats.background_misses += 1

    def _submit(self, job: _Job, wake: bool = True) -> None:
        """Queue ``job``; ``wake`` False leaves an idle thread asleep (a background write
        that the next wake-up runs with the others). A read with a known target goes ahead
        of the background writes at the end of the queue that write none of its slots."""
        with self._lock:
            if self._stopped:
                raise TierIOError(f"level {self.level}: I/O after shutdown ({job.what})")
            if self._thread is None:
                self._start()
            job.after = self._native_seq
            if job.kind == "read" and job.target is not None:
                self._queue.insert(self._read_position(job.target), job)
            else:
                self._queue.append(job)
            if wake or self._go:
                self._wake()
            else:
                self._lazy += 1

    def _read_position(self, target: tuple[object, np.ndarray]) -> int:
        """(Holding ``_cv``.) Where a read of ``target`` joins the queue: before the
        background writes at its end that write none of the slots it reads (the writes
        of other pools, and of other slots of its pool), so that a resume does not wait
        for write-back it does not need; behind everything else, in order."""
        pool, slots = target
        q = self._queue
        at = len(q)
        while at:
            job = q[at - 1]
            if job is None or job.kind != "bg-write" or job.target is None:
                break
            if job.target[0] is pool and _overlap(job.target[1], slots):
                break
            at -= 1
        return at

    def _wake(self) -> None:
        """(Holding ``_cv``.) Wake the thread; background writes that waited for it have
        their deadlines counted from now."""
        if self._lazy:
            now = time.monotonic()
            for job in self._queue:
                if job is not None and job.kind == "bg-write" and not job.done.is_set():
                    job.submitted = max(job.submitted, now)
            self._lazy = 0
        self._go = True
        self._cv.notify_all()

    def _miss(self, job: _Job) -> IODeadlineError | None:
        """``job`` is past its deadline: None if it finished meanwhile, else the error
        (the job is recorded as late: the level is stuck until it returns)."""
        with self._lock:
            if job.done.is_set():
                return None
            self._late.append(job)
            if job.kind == "read":
                self.stats.read_misses += 1
            elif job.kind == "write":
                self.stats.write_misses += 1
        verdict = {"read": "the blocks are lost", "write": "the blocks are not cached here"
                   }.get(job.kind, "abandoned")
        return IODeadlineError(f"level {self.level}: {job.what} missed its "
                               f"{self.deadline_s} s I/O deadline; {verdict}")

    def _fast_fail(self, what: str, kind: str) -> None:
        """Refuse at once while an operation is stuck past its deadline."""
        on = self.stuck()
        if on is None:
            return
        self.stats.fast_fails += 1  # (not attempted: in no miss)
        raise IODeadlineError(f"level {self.level}: {what} not attempted: the level's I/O "
                              f"thread is stuck on {on}", attempted=False)

    def call(self, fn: Callable[[], None], what: str, kind: str,
             until: float | None = None,
             reads: tuple[object, np.ndarray] | None = None) -> None:
        """Run ``fn`` on the level's thread, waiting at most the deadline (or until the
        absolute monotonic time ``until``). ``reads``: the ``(pool, slots)`` a read
        reads, so that it need not wait for queued background writes of other slots.

        Raises:
            TierIOError: ``fn`` failed (any exception, as a TierIOError), it missed its
                deadline, or the level is stuck.
        """
        if self.deadline_s is None:
            _run_inline(fn)
            return
        if self._stopped:
            raise TierIOError(f"level {self.level}: I/O after shutdown ({what})")
        if self._held:
            self._flush_for(reads)
        if kind != "admin":  # closes queue behind a stuck operation; the rest fail now
            self._fast_fail(what, kind)
        job = _Job(fn, what, kind)
        job.target = reads
        self._submit(job)
        end = until if until is not None else job.submitted + self.deadline_s
        if not job.done.wait(max(0.0, end - time.monotonic())):
            missed = self._miss(job)
            if missed is not None:
                raise missed
        _raise(job.error)

    def call_later(self, fn: Callable[[], None], what: str) -> None:
        """Queue ``fn`` on the thread without waiting (its failure is ignored)."""
        self.flush_held()
        self._submit(_Job(fn, what, "admin"))

    # -- background writes -------------------------------------------------------------------

    def background(self, fn: Callable[[], None] | None, what: str, pool: Pool,
                   slots: np.ndarray, rows: np.ndarray | None = None,
                   checked: int | None = None) -> None:
        """Queue a write and return. With ``write_queue_depth`` writes in flight, a
        droppable write (see :meth:`dropping`) raises :class:`WriteQueueFull` at once;
        any other waits for the oldest, within the deadline. ``rows``: the write is
        ``pool.write(slots, rows)`` (it may merge with the writes of the same pool queued
        beside it); ``fn`` None: ``rows`` are the caller's, which this copies before
        queueing them for the thread (a write behind copies them itself). ``checked``:
        the caller checked ``slots`` with ``check_slots`` against a pool of that many
        slots (see :meth:`_write_behind`). A droppable write of such rows, smaller than
        ``combine_bytes``, is held back (:meth:`flush_held`); any other write first
        writes what is held (it must land after it)."""
        hold = self.droppable and fn is None and checked is not None and len(slots) > 0 and \
            isinstance(rows, np.ndarray) and \
            rows.nbytes < self.combine_bytes and rows.dtype == np.uint8 and \
            rows.shape == (len(slots), getattr(pool, "slot_bytes", -1))
        self._admit(what, pool if hold else None)
        if hold:
            assert isinstance(rows, np.ndarray) and checked is not None
            self._hold(pool, slots, rows, checked)  # type: ignore[arg-type]
            return
        self._queue_write(fn, what, pool, slots, rows, checked)

    def _admit(self, what: str, held_pool: Pool | None) -> None:
        """Room in the queue for a background write (``held_pool``: a droppable write of
        that pool to be held back), as :meth:`background` describes: raises at once when
        the level is stopped or stuck, or when a droppable write finds the queue full;
        waits for the oldest write otherwise. A write that is not held first writes what
        is held."""
        if self._stopped:
            raise TierIOError(f"level {self.level}: I/O after shutdown ({what})")
        self._fast_fail(what, "write")
        hold = held_pool is not None
        if self._held and not hold:
            self.flush_held()
        # The batches this write adds: one, or (held) one per pool holding writes once it
        # is held; they count against the queue as if in flight.
        adds = len(self._held) + (id(held_pool) not in self._held) if hold else 1
        depth = self.write_queue_depth
        if not hold or len(self._background) + adds > depth:
            self._reap()  # (a held write needs the count only when it may be full)
        if len(self._background) + adds > depth and self.droppable:
            self.stats.queue_full_drops += 1
            raise WriteQueueFull(f"level {self.level}: {what} not attempted: "
                                 f"{len(self._background) + len(self._held)} background "
                                 "writes in flight or held")
        if len(self._background) + adds > depth:
            oldest = self._background[0]
            with self._lock:
                self._wake()
            left = oldest.submitted + (self.deadline_s or 0) - time.monotonic()
            if not self._wait(oldest, max(0.0, left)):
                with self._lock:
                    if not oldest.done.is_set():
                        self._background_missed(oldest)
                        if oldest not in self._late:
                            self._late.append(oldest)
                self._fast_fail(what, "write")
            self._reap()

    def hold_into(self, pool: StoragePool, slots: np.ndarray, checked: int, what: str
                  ) -> tuple[_Held, np.ndarray] | None:
        """The held rows a droppable background write of ``slots`` (``check_slots``'
        result for a pool of ``checked`` slots) would be copied into, lent so that the
        caller writes its rows there itself (a frame built in place: no copy, no rows of
        its own). The caller fills them, then calls :meth:`held_written` before anything
        else of this level runs; a caller that fails before that leaves nothing held.
        None when such a write would not be held (not droppable, or not under
        ``combine_bytes``): the caller writes as usual. Raises as :meth:`background`
        does (:class:`WriteQueueFull` when the queue is full)."""
        k, width = len(slots), pool.slot_bytes
        if not (self.droppable and k and k * width < self.combine_bytes):
            return None
        self._admit(what, pool)
        held = self._holder(pool, checked, k, width)
        return held, held.buf[held.n : held.n + k]

    def _queue_write(self, fn: Callable[[], None] | None, what: str, pool: Pool,
                     slots: np.ndarray, rows: np.ndarray | None, checked: int | None,
                     owned: bool = False) -> None:
        """:meth:`background` once there is room: on the tier's threads, or queued for
        the level's. ``owned``: ``rows`` are a private copy no one else writes (a flush
        of held rows), kept as they are rather than copied again."""
        if rows is not None and self._write_behind(what, pool, slots, rows, checked, owned):
            return
        if fn is None:
            assert rows is not None and isinstance(pool, StoragePool)
            if not owned:  # the caller reuses its rows
                rows = np.array(rows, dtype=np.uint8, copy=True)
            fn = functools.partial(_write_rows, pool, slots, rows)
        written = self.clearing(fn, pool, slots)

        def run() -> None:
            try:
                written()
            except BaseException:
                self._mark_bad(pool, slots, 1)
                raise

        job = _Job(run, what, "bg-write")
        job.target = (pool, slots)
        if rows is not None and isinstance(pool, StoragePool):
            job.rows = rows
        self._submit(job, wake=len(self._background) + 1 >= max(1, self.write_queue_depth // 2))
        self._background.append(job)

    def _hold(self, pool: StoragePool, slots: np.ndarray, rows: np.ndarray, checked: int
              ) -> None:
        """Hold a background write back (its rows copied); write what is held once
        ``combine_bytes``, or :data:`_HOLD_WRITES` writes of a pool, are."""
        k, width = rows.shape  # (width: the pool's slot_bytes, as background checked)
        held = self._holder(pool, checked, k, width)
        held.buf[held.n : held.n + k] = rows  # the caller reuses its rows
        self.held_written(held, slots)

    def _holder(self, pool: StoragePool, checked: int, k: int, width: int) -> _Held:
        """The held writes of ``pool`` with room for ``k`` more rows (written first when
        they have none left, or when the pool changed size)."""
        held = self._holders.get(id(pool))
        if held is None or held.checked != checked:
            if held is not None and held.n:  # the pool changed size: write the old first
                self._flush_one(held)
            # Room for twice the limit: a write under the limit always fits after a flush.
            cap = max(2 * self.combine_bytes // max(width, 1), k)
            held = self._holders[id(pool)] = _Held(pool, checked, cap, width)
        if held.n + k > len(held.buf):
            self._flush_one(held)
        return held

    def held_written(self, held: _Held, slots: np.ndarray) -> None:
        """The rows after ``held``'s last held ones (as many as ``slots``) now hold a
        write of ``slots`` (see :meth:`hold_into`): held, and all that is held written
        once ``combine_bytes``, or :data:`_HOLD_WRITES` writes of a pool, are."""
        k, n = len(slots), held.n
        held.slots[n : n + k] = slots
        held.where[slots] = held.row_ids[n : n + k]
        held.n = n + k
        held.writes += 1
        self._held[id(held.pool)] = held
        self._held_bytes += k * held.buf.shape[1]
        self.stats.held_writes += 1
        if self._held_bytes >= self.combine_bytes or held.writes >= _HOLD_WRITES:
            self.flush_held()

    def flush_held(self) -> None:
        """Start the writes held back, each pool's as one background write, in slot order
        (a slot held twice gets its last rows). They are background writes of droppable
        pages that passed the queue's check when they were held: holding them turns many
        small writes (a hand-over each, to the tier's threads or the level's) into one.

        Everything else the level does sees held writes as written: a read of held slots
        only is served from the held rows (:meth:`read_direct`); an operation that must run
        after them writes them first (a read of held and other slots, any write that is
        not held, a resize, a close, :meth:`wait_idle`). A held write that cannot be
        started marks its slots bad, as a failed background write does."""
        while self._held:
            self._flush_one(next(iter(self._held.values())))

    def _flush_one(self, held: _Held) -> None:
        n = held.n
        written = held.slots[:n]
        last = held.where[written] == held.row_ids[:n]  # each slot's last rows
        rows_at = np.flatnonzero(last)
        order = np.argsort(written[rows_at], kind="stable")
        rows_at = rows_at[order]
        slots = written[rows_at]
        rows = held.buf.take(rows_at, axis=0)  # a copy (whole rows): buf is reused at once
        held.where[written] = -1
        held.n = held.writes = 0
        del self._held[id(held.pool)]
        self._held_bytes -= n * held.buf.shape[1]
        try:
            self._queue_write(None, f"write of {len(slots)} slots", held.pool, slots, rows,
                              held.checked, owned=True)
        except BaseException as exc:  # the held rows are gone: their blocks are lost,
            self._mark_bad(held.pool, slots, 1)  # never read as the older bytes
            if not isinstance(exc, TierIOError):  # (stopped: as any write now)
                raise

    def _flush_for(self, reads: tuple[object, np.ndarray] | None) -> None:
        """Write what is held before an operation: unless it is a read (``reads``: its
        pool and slots, ``check_slots``' result) of slots that no held write writes."""
        if reads is not None:
            pool, slots = reads
            held = self._held.get(id(pool))
            if held is None or not len(slots):
                return
            if int(slots.max()) < len(held.where) and not (held.where[slots] >= 0).any():
                return
        self.flush_held()

    @property
    def background_in_flight(self) -> int:
        """Background write batches queued or running (at most ``write_queue_depth``). It
        changes nothing, so any thread may read it (the scheduler's own look, ``_reap``,
        pops the finished ones)."""
        return sum(not (job.done.is_set() or (job.handle is not None and job.handle.done()))
                   for job in tuple(self._background))  # (a copy in one C call)

    def _reap(self) -> None:
        bg = self._background
        while bg and (bg[0].done.is_set() or
                      (bg[0].handle is not None and self._native_done(bg[0]))):
            bg.popleft()
        if self._native and self._native[0].done.is_set():
            with self._lock:
                while self._native and self._native[0].done.is_set():
                    self._native.popleft()

    def _write_behind(self, what: str, pool: Pool, slots: np.ndarray, rows: np.ndarray,
                      checked: int | None = None, owned: bool = False) -> bool:
        """Start a background write on the tier's own threads (``write_behind``) when the
        pool can and nothing queued for the level's thread touches its slots (a later
        write must not land before an earlier one); whether it did.

        ``checked``: ``slots`` are ``check_slots``' result for a pool of that many slots
        (:meth:`DeadlinePool.write` checked them). A pool that offers
        ``_write_behind_checked(slots, rows, checked)`` (the disk tier) is then given them
        through it, and skips that O(n) check where it would test the same thing; any
        other pool gets ``write_behind``, which checks everything. ``owned``: ``rows``
        are a private copy (see :meth:`_queue_write`), which such a pool need not copy
        again."""
        if not isinstance(pool, StoragePool) or \
                type(pool).write_behind is StoragePool.write_behind:
            return False
        with self._lock:
            if self._stopped:
                return False
            for job in itertools.chain(self._batch, self._queue):
                if job is None or not _other_slots(job, pool, slots):
                    return False
            # A slot written there again: through the thread, which waits for the first
            # write. (Finished first: a set test of the slots costs more than that look.)
            for job in self._native:
                if not self._native_done(job) and not _other_slots(job, pool, slots):
                    return False
        # Looked up on the class: a wrapper forwarding attributes to an inner pool (as
        # DeadlinePool does) must not lead past its own write_behind.
        trusting = getattr(type(pool), "_write_behind_checked", None) if checked is not None \
            else None
        try:
            handle = pool.write_behind(slots, rows) if trusting is None else \
                trusting(pool, slots, rows, checked, owned)
        except Exception:  # the level's thread writes it, and reports, as before
            return False
        if handle is None:
            return False
        job = _Job(_no_op, what, "bg-write", handle)
        job.target = (pool, slots)
        with self._lock:
            job.seq = self._native_seq
            self._native_seq += 1
            self._native.append(job)
        self._background.append(job)
        return True

    def _native_done(self, job: _Job) -> bool:
        """Whether a write on the tier's threads finished; the first look that sees it
        finish records it (a failure marks its slots bad, as a failed background write
        of the level's thread does)."""
        if job.done.is_set():
            return True
        assert job.handle is not None and job.target is not None
        if not job.handle.done():
            return False
        err = job.handle.error()
        pool, slots = job.target
        with self._lock:
            if job.done.is_set():
                return True
            if job in self._late:  # waited for in vain, finished now: no longer stuck
                self._late.remove(job)
            if err is None:
                self._clear_bad(pool, slots)
                self.stats.direct_writes += 1
            else:
                job.error = TierIOError(f"level {self.level}: {job.what} failed: {err}")
                self._mark_bad(pool, slots, 1)
            job.done.set()  # (no notify: nobody waits on the condition for it, see _wait)
        return True

    def _await_native(self, after: int) -> None:
        """(On the level's thread.) Wait until the writes on the tier's threads numbered
        below ``after`` have finished."""
        pause = _POLL_S
        while True:
            with self._lock:
                pending = [j for j in self._native if j.seq < after and not j.done.is_set()]
            if all(self._native_done(j) for j in pending):
                return
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)  # each look takes the GIL

    def _wait(self, job: _Job, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``job``; whether it finished."""
        if job.handle is None:
            return job.done.wait(timeout)
        end = time.monotonic() + timeout
        pause = _POLL_S
        while not self._native_done(job):
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, _POLL_MAX_S)
        return True

    def clearing(self, fn: Callable[[], None], pool: Pool, slots: np.ndarray
                 ) -> Callable[[], None]:
        """``fn`` (a write of ``slots``), then, once it succeeded, the slots' marks of
        an earlier failed background write are dropped (they hold good data again)."""
        def run() -> None:
            fn()
            self._clear_bad(pool, slots)

        return run

    def read_direct(self, pool: StoragePool, slots: np.ndarray, dest: np.ndarray) -> bool:
        """A read of ``slots`` (``check_slots``' result) of ``pool`` served on the caller's
        thread (True: ``dest`` holds the rows): from the held rows when every slot is
        held (their last held rows), else by :meth:`read_now`. One look at the slots'
        places in the held rows tells both whether every slot is held and whether any is
        (what is held is then written first); False: the level's thread must read."""
        held = self._held.get(id(pool))
        some = False
        if held is not None and len(slots):
            if int(slots.max()) < len(held.where):
                at = held.where[slots]
                if int(at.min()) >= 0:
                    dest[...] = held.buf[at]
                    self.stats.held_reads += 1
                    return True
                some = int(at.max()) >= 0
            else:  # (as _flush_for: a slot past the table, everything written first)
                some = True
        return self.read_now(pool, slots, dest, held=some)

    def read_now(self, pool: StoragePool, slots: np.ndarray, dest: np.ndarray,
                 held: bool) -> bool:
        """Try a read on the caller's thread (:meth:`StoragePool.read_nowait`: only what
        cannot block): True when ``dest`` holds the rows. Declined (False) while the level
        is stuck, while anything but background writes of other slots is queued or
        running (so the read sees every write it must), or for a slot whose background
        write failed (the thread's read refuses it). ``held``: whether a held write
        writes one of ``slots`` (then what is held is written first), as
        :meth:`read_direct` found it."""
        if type(pool).read_nowait is StoragePool.read_nowait:
            return False
        if held:
            self.flush_held()
        key = id(pool)
        with self._lock:
            if self._stopped or self.stuck() is not None:
                return False
            for job in itertools.chain(self._batch, self._queue):
                if job is None or not _other_slots(job, pool, slots):
                    return False
            for job in self._native:  # (finished first: cheaper than the set test)
                if not self._native_done(job) and not _other_slots(job, pool, slots):
                    return False
            if self._bad and any((key, s) in self._bad for s in slots.tolist()):
                return False
        if not pool.read_nowait(slots, dest):
            return False
        self.stats.direct_reads += 1
        return True

    def check_readable(self, pool: Pool, slots: np.ndarray) -> None:
        """On the I/O thread, before a read: refuse slots whose background write failed."""
        if not self._bad:
            return
        key = id(pool)
        with self._lock:
            bad = [int(s) for s in slots.tolist() if (key, int(s)) in self._bad]
            if bad:
                self.stats.bad_reads += 1
        if bad:
            raise TierIOError(f"level {self.level}: slots {bad[:8]} were not written "
                              "(their background write failed)")

    def forget_slots(self, pool: Pool) -> None:
        """Drop the bad marks and the held writes of ``pool`` (it is being closed). (Held
        writes are the scheduler thread's: a pool closed by :meth:`close`, on the level's
        thread, has none left.)"""
        key = id(pool)
        self._holders.pop(key, None)
        held = self._held.pop(key, None)
        if held is not None:
            self._held_bytes -= held.n * held.buf.shape[1]
        with self._lock:
            self._bad = {b for b in self._bad if b[0] != key}

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, closers: Sequence[tuple[str, Callable[[], None]]], until: float
              ) -> tuple[list[str], list[str]]:
        """Run ``closers`` (what, close) on the thread, all by ``until``, then stop it.

        Returns ``(failures, abandoned)``: closers that raised, and what was still
        unfinished at ``until`` (operations in flight or queued, and the closers behind
        them; the thread runs them when it can, then ends).
        """
        failures: list[str] = []
        while self._held:  # each pool's held writes, whatever another pool's raised
            try:
                self._flush_one(next(iter(self._held.values())))
            except Exception as exc:  # its slots are marked bad; the closers still run
                failures.append(f"level {self.level}: held writes: "
                                f"{type(exc).__name__}: {exc}")
        if self.deadline_s is None or (self._thread is None and not self._native):
            for what, fn in closers:
                try:
                    fn()
                except Exception as exc:  # one failure must not leave the rest open
                    failures.append(f"{what}: {type(exc).__name__}: {exc}")
            with self._lock:
                self._stopped = True
            return failures, []
        jobs = []
        with self._lock:
            if self._thread is None:  # writes on the tier's threads only: the closers
                self._start()         # wait for them on the level's thread
            for what, fn in closers:
                job = _Job(fn, what, "admin")
                job.after = self._native_seq
                self._queue.append(job)
                jobs.append(job)
            self._queue.append(None)  # the thread ends after the closers
            self._stopped = True
            self._wake()
        for job in jobs:
            job.done.wait(max(0.0, until - time.monotonic()))
        abandoned = []
        with self._lock:
            now = time.monotonic()
            running = self._running
            if running is not None and not running.done.is_set():
                abandoned.append(f"{self._name(running)} (running "
                                 f"{now - running.submitted:.1f} s)")
            abandoned += [f"{self._name(j)} (queued)" for j in self._queue
                          if j is not None and not j.done.is_set()]
            abandoned += [f"{self._name(j)} (on the tier's threads)" for j in self._native
                          if not self._native_done(j)]
        for job in jobs:
            if job.done.is_set() and job.error is not None:
                failures.append(f"{job.what}: {type(job.error).__name__}: {job.error}")
        return failures, abandoned

    def _name(self, job: _Job) -> str:
        return job.what if job.what.startswith("level ") else f"level {self.level}: {job.what}"

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is queued or running; whether it
        is idle."""
        end = time.monotonic() + timeout
        self.flush_held()
        with self._lock:
            self._wake()
            while self._queue or self._running is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            native = list(self._native)
        for job in native:
            if not self._wait(job, max(0.0, end - time.monotonic())):
                return False
        self._reap()
        return True

    def wrap(self, pool: Pool) -> Pool:
        """``pool`` with its I/O on this level's thread (storage pools only)."""
        if self.deadline_s is None or not isinstance(pool, StoragePool):
            return pool
        if isinstance(pool, BlobPool):
            return DeadlineBlobPool(self, pool)
        return DeadlinePool(self, pool)


def _other_slots(job: _Job, pool: object, slots: np.ndarray) -> bool:
    """Whether ``job`` is a background write that writes none of ``slots`` of ``pool``
    (so a read of them need not wait for it)."""
    if job.kind != "bg-write" or job.target is None:
        return False
    return job.target[0] is not pool or not _overlap(job.target[1], slots)


#: Slot arrays of this many slots together and more are compared through a table of the
#: larger one's range, where that range is small enough (:func:`_overlap`).
_TABLE_OVERLAP = 512
_TABLE_SPAN = 8  # the range may span this many times the slots of both


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether slot arrays ``a`` and ``b`` share a slot. A set test at the sizes a resume
    reads (NumPy's per-call costs are larger there). Larger arrays (a held write's flush:
    thousands of slots, compared with each write still running on the tier's threads)
    whose slots lie close together are compared through a table of the larger one's
    range, in a few NumPy calls instead of a Python object and a set entry per slot."""
    if len(a) > len(b):
        a, b = b, a
    n = len(a) + len(b)
    if n >= _TABLE_OVERLAP and len(a) and a.dtype == b.dtype:  # (differences fit it)
        lo, hi = int(b.min()), int(b.max())
        if hi - lo < _TABLE_SPAN * n:
            table = np.zeros(hi - lo + 1, dtype=bool)
            table[b - lo] = True
            inside = a[(a >= lo) & (a <= hi)]
            return bool(table[inside - lo].any())
    return not set(a.tolist()).isdisjoint(b.tolist())


def _write_rows(pool: StoragePool, slots: np.ndarray, rows: np.ndarray) -> None:
    _wait(pool.write(slots, rows))


def _run_inline(fn: Callable[[], None]) -> None:
    try:
        fn()
    except TierIOError:
        raise
    except OSError as exc:
        raise TierIOError(f"{type(exc).__name__}: {exc}") from exc


def _raise(error: BaseException | None) -> None:
    if error is None:
        return
    if isinstance(error, TierIOError):
        raise error
    if isinstance(error, OSError):
        raise TierIOError(f"{type(error).__name__}: {error}") from error
    raise error


def _wait(handle: IOHandle) -> None:
    handle.wait()


class DeadlinePool(StoragePool):
    """A storage pool whose every operation runs on its level's :class:`LevelIO`
    thread within the deadline (see module docstring). Other attributes are the inner
    pool's (``inner_pool``)."""

    def __init__(self, io: LevelIO, inner: StoragePool) -> None:
        self.io = io
        self.inner_pool = inner
        self.slot_bytes = inner.slot_bytes
        self.num_slots = inner.num_slots

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner_pool")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _what(self, op: str, slots: np.ndarray) -> str:
        return f"{op} of {len(slots)} slots"

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        arr = check_slots(self, slots)
        if self.io.write_queue_depth and self.io.droppable:
            # The background path copies the rows only if its thread writes them (a
            # write behind copies them itself). ``arr`` is check_slots' result for
            # num_slots slots: the inner pool need not check it again.
            return self._write(arr, None, source, self.num_slots)
        rows = np.array(source, dtype=np.uint8, copy=True)  # the caller reuses its rows
        inner = self.inner_pool
        return self._write(arr, lambda: _wait(inner.write(arr, rows)), rows)

    def write_into(self, slots: np.ndarray, fill: Callable[[np.ndarray], None]) -> IOHandle:
        """:meth:`StoragePool.write_into`: a droppable background write that would be
        held back is filled straight into the level's held rows (:meth:`LevelIO.hold_into`),
        any other as :meth:`write`."""
        arr = check_slots(self, slots)
        io = self.io
        if io.write_queue_depth and io.droppable:
            try:
                lent = io.hold_into(self.inner_pool, arr, self.num_slots,
                                    self._what("write", arr))
            except TierIOError as exc:
                return CompletedIO(exc)
            if lent is not None:
                held, rows = lent
                fill(rows)
                io.held_written(held, arr)
                return CompletedIO()
        return super().write_into(arr, fill)

    def _write(self, arr: np.ndarray, fn: Callable[[], None] | None,
               rows: np.ndarray | None = None, checked: int | None = None) -> IOHandle:
        """``fn`` None: a background write of ``rows``, the caller's (see
        :meth:`LevelIO.background`, and there ``checked``)."""
        io = self.io
        what = self._what("write", arr)
        try:
            if io.write_queue_depth and io.droppable:
                io.background(fn, what, self.inner_pool, arr, rows, checked)
            else:
                assert fn is not None
                io.call(io.clearing(fn, self.inner_pool, arr), what, "write")
        except TierIOError as exc:
            return CompletedIO(exc)
        return CompletedIO()

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        arr = check_slots(self, slots)
        if not isinstance(dest, np.ndarray) or dest.dtype != np.uint8 or \
                dest.shape != (len(arr), self.slot_bytes):
            return self.inner_pool.read(arr, dest)  # let the inner pool refuse it
        inner, io = self.inner_pool, self.io
        if io.read_direct(inner, arr, dest):
            return CompletedIO()
        private = np.empty_like(dest)  # a late read must not land in the caller's rows

        def run() -> None:
            io.check_readable(inner, arr)
            inner.read(arr, private).wait()

        try:
            io.call(run, self._what("read", arr), "read", reads=(inner, arr))
        except TierIOError as exc:
            return CompletedIO(exc)
        dest[...] = private
        return CompletedIO()

    def resize(self, num_slots: int) -> None:
        """Resize on the level's thread within the deadline; on a miss the pool is
        resized back to its old size behind the stuck call and ``TierIOError`` raised."""
        inner, old = self.inner_pool, self.num_slots
        try:
            self.io.call(lambda: inner.resize(num_slots), f"resize to {num_slots} slots",
                         "resize")
        except IODeadlineError as exc:
            if exc.attempted:  # it may still happen: size the file back behind it
                self.io.call_later(lambda: inner.resize(old), f"resize back to {old} slots")
            raise
        self.num_slots = inner.num_slots

    def close(self) -> None:
        self.io.forget_slots(self.inner_pool)
        self.inner_pool.close()


class DeadlineBlobPool(DeadlinePool, BlobPool):
    """:class:`DeadlinePool` for blob pools (``write_blobs``/``read_blobs`` too)."""

    inner_pool: BlobPool
    # Rows filled in place are written as write writes them (as blobs), never held.
    write_into = StoragePool.write_into

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        return BlobPool.write(self, slots, source)

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        return BlobPool.read(self, slots, dest)

    @property
    def stored_bytes(self) -> int:
        return self.inner_pool.stored_bytes

    def write_blobs(self, slots: np.ndarray, blobs: Sequence[bytes]) -> IOHandle:
        arr = check_slots(self, slots)
        copies = [bytes(b) for b in blobs]
        inner = self.inner_pool
        return self._write(arr, lambda: _wait(inner.write_blobs(arr, copies)))

    def read_blobs(self, slots: np.ndarray, out: list[bytes]) -> IOHandle:
        arr = check_slots(self, slots)
        private: list[bytes] = [b""] * len(arr)
        inner, io = self.inner_pool, self.io

        def run() -> None:
            io.check_readable(inner, arr)
            inner.read_blobs(arr, private).wait()

        try:
            io.call(run, self._what("read", arr), "read", reads=(inner, arr))
        except TierIOError as exc:
            return CompletedIO(exc)
        out[:] = private
        return CompletedIO()
