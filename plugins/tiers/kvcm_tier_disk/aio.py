"""Many positioned reads or writes in one system call: Linux native AIO (``io_submit``).

A batch of a disk pool is one call per run of consecutive slots, and a batch of scattered
slots is many runs. With ``pwrite`` per run, a thread pays one system call per run and,
more costly when it is not the scheduler's thread, takes the GIL back after each. Here the
whole batch is submitted with one ``io_submit``, made through ``ctypes``, which releases
the GIL around it. On a file opened without ``O_DIRECT`` the kernel does the copies inside
``io_submit`` (page cache), so this changes how many times Python calls the kernel, not
what the kernel does; the requests are then complete, and one ``io_getevents`` with a
zero timeout (it never waits) reaps them without releasing the GIL. Requests still
running are waited for by ``io_getevents`` with the GIL released.

Used on Linux x86-64 and AArch64 (little-endian ``struct iocb``), for batches of at least
:data:`MIN_CALLS` runs. Anywhere else, or when the kernel refuses ``io_setup`` (a seccomp
filter, ``fs.aio-max-nr`` reached), :func:`run` (and :func:`run_runs`, which takes runs
of one buffer as arrays) returns None and the caller makes one call per run as before.
Contexts are kept in a free list and reused: one per thread doing I/O at the same moment;
a context whose wait failed is destroyed (the kernel then finishes or cancels its
requests before the buffers are released), and a forked child starts with none (contexts
are not inherited).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["MIN_CALLS", "NativeWrite", "available", "data_address", "native_available",
           "read_nowait", "run", "run_runs"]

#: Batches of fewer runs use one ``pwrite``/``preadv`` per run (as cheap for one or two).
MIN_CALLS = 3
_NR_EVENTS = 256  # requests one context takes at once; larger batches go in slices

# struct iocb (linux/aio_abi.h, 64 bytes, little-endian), struct io_event (32 bytes) and
# struct iovec (16 bytes) are written as rows of u64 / i64 words.
_PREAD, _PWRITE, _PREADV, _PWRITEV = 0, 1, 7, 8  # IOCB_CMD_*
# (io_setup, io_destroy, io_submit, io_getevents, preadv2) by machine
_SYSCALLS = {"x86_64": (206, 207, 209, 208, 327), "aarch64": (0, 1, 2, 4, 286)}
_RWF_NOWAIT = 0x8  # linux/fs.h: fail with EAGAIN rather than wait for the device


class _Kernel:
    def __init__(self) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        self.ok = sys.platform == "linux" and sys.byteorder == "little" and numbers is not None
        #: preadv2 may be called (a refused AIO context clears ``ok`` only).
        self.nowait_ok = self.ok
        if not self.ok:
            return
        assert numbers is not None
        self.setup, self.destroy, self.submit, self.getevents, self.preadv2 = numbers
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.syscall = self.libc.syscall
        self.syscall.restype = ctypes.c_long
        # The same call without releasing the GIL: only for calls that never wait.
        self.syscall_held = ctypes.PyDLL(None, use_errno=True).syscall
        self.syscall_held.restype = ctypes.c_long
        # preadv2 as its own function object with declared argument types: plain ints
        # convert in C, about a third of the cost of ctypes.c_long objects made in Python
        # for each call (syscall() is variadic, but its arguments are all longs, passed
        # as a non-variadic call passes them on x86-64 and AArch64 Linux).
        self.preadv2_held = ctypes.PyDLL(None, use_errno=True).syscall
        self.preadv2_held.restype = ctypes.c_long
        self.preadv2_held.argtypes = [ctypes.c_long] * 7
        self.no_wait = (ctypes.c_long * 2)()  # struct timespec {0, 0}
        self.free: list[int] = []
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            if self.free:
                return self.free.pop()
        ctx = ctypes.c_ulong(0)
        if self.syscall(ctypes.c_long(self.setup), ctypes.c_long(_NR_EVENTS),
                        ctypes.byref(ctx)) != 0:
            self.ok = False  # refused (seccomp, aio-max-nr): per-run calls from now on
            return None
        return ctx.value

    def give(self, ctx: int) -> None:
        with self.lock:
            self.free.append(ctx)

    def drop(self, ctx: int) -> None:
        """Destroy ``ctx``: the kernel waits for (or cancels) what it still has in flight,
        so no request outlives the buffers it was given."""
        self.syscall(ctypes.c_long(self.destroy), ctypes.c_ulong(ctx))

    def forget(self) -> None:
        """In a forked child: the parent's contexts are not the child's."""
        self.free = []
        self.lock = threading.Lock()


_kernel = _Kernel()
if _kernel.ok and hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_kernel.forget)


def available() -> bool:
    """Whether :func:`run` may still batch (False once the kernel refused a context)."""
    return _kernel.ok


def run(fd: int, calls: Sequence[tuple[int, list[memoryview], int]], write: bool
        ) -> list[tuple[int, int, int]] | None:
    """Submit ``calls`` (``(offset, buffers, nbytes)``, as the pool's per-run calls) on
    ``fd`` and wait for all of them. Returns None when batching is not possible here (the
    caller then makes the calls itself; nothing was done), else the calls that failed or
    came up short: ``(index, result, nbytes)`` with ``result`` the byte count or
    ``-errno``. An empty list: everything was read or written."""
    if not _kernel.ok or len(calls) < MIN_CALLS:
        return None
    keep: list[object] = []  # what the kernel reads or writes: exported until reaped
    offsets = [c[0] for c in calls]
    sizes = [c[2] for c in calls]
    if all(len(c[1]) == 1 for c in calls):  # one buffer per run: plain PREAD / PWRITE
        return _submit(_plain_blocks(fd, offsets, [_address(c[1][0], keep) for c in calls],
                                     sizes, write))
    # Runs of several buffers: PREADV / PWRITEV over an iovec array.
    counts = [len(c[1]) for c in calls]
    vecs = np.empty((sum(counts), 2), dtype=np.uint64)
    vecs[:, 0] = [_address(b, keep) for c in calls for b in c[1]]
    vecs[:, 1] = [b.nbytes for c in calls for b in c[1]]
    cbs = _blocks(fd, offsets, sizes, _PWRITEV if write else _PREADV)
    cbs[:, 3] = np.uint64(vecs.ctypes.data) + np.cumsum(
        [0, *counts[:-1]], dtype=np.uint64) * np.uint64(16)
    cbs[:, 4] = counts
    return _submit(cbs)


def run_runs(fd: int, offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray,
             write: bool) -> list[tuple[int, int, int]] | None:
    """:func:`run` of calls of one buffer each, given as arrays: ``sizes[i]`` bytes at
    memory address ``addresses[i]`` (memory the caller keeps alive until this returns) to
    or from file offset ``offsets[i]``; no Python code runs per call."""
    if not _kernel.ok or len(offsets) < MIN_CALLS:
        return None
    return _submit(_plain_blocks(fd, offsets, addresses, sizes, write))


def read_nowait(fd: int, offsets: Sequence[int], addresses: Sequence[int],
                sizes: Sequence[int]) -> int | None:
    """Read ``sizes[i]`` bytes at file offset ``offsets[i]`` into memory at
    ``addresses[i]`` (kept alive by the caller) with ``preadv2(RWF_NOWAIT)``: only from
    the page cache, so the call never waits for the device and is made without
    releasing the GIL (a hand-over of the GIL to another thread and back costs more than
    such a read). Returns 0 when every byte was read, ``EAGAIN`` when some would need the
    device (or came up short), another errno when the call failed (``EOPNOTSUPP``: the
    file system cannot do it); None when the platform has no such call."""
    k = _kernel
    if not k.nowait_ok:
        return None
    iov = (ctypes.c_uint64 * 2)()  # this call's own (threads may switch between runs)
    vec, call, nr = ctypes.addressof(iov), k.preadv2_held, k.preadv2
    for offset, address, size in zip(offsets, addresses, sizes, strict=True):
        iov[0], iov[1] = address, size
        got = call(nr, fd, vec, 1, offset, 0, _RWF_NOWAIT)
        if got != size:
            return (ctypes.get_errno() or errno.EIO) if got < 0 else errno.EAGAIN
    return 0


# glibc's struct aiocb on x86-64 (168 bytes) as 21 little-endian u64 words; the fields kvcm
# sets or reads: [0] aio_fildes (i32) | aio_lio_opcode (i32) << 32, [2] aio_buf,
# [3] aio_nbytes, [5] sigev_signo (i32) | sigev_notify (i32) << 32, [14] __error_code (i32,
# the low half), [15] __return_value (i64), [16] aio_offset (i64).
_AIOCB_WORDS = 21
_FILDES_OPCODE, _BUF, _NBYTES, _SIGEVENT, _ERROR, _RETURN, _OFFSET = 0, 2, 3, 5, 14, 15, 16
_LIO_WRITE, _LIO_NOWAIT, _SIGEV_NONE = 1, 1, 1
#: Byte offsets of control blocks 0, 1, ... from the first (the list lio_listio takes is
#: these plus the first one's address; larger batches compute their own).
_CB_OFFSETS = np.arange(256, dtype=np.uint64) * np.uint64(8 * _AIOCB_WORDS)


class _Posix:
    """glibc's POSIX AIO (``lio_listio``), where kvcm knows its ``struct aiocb``."""

    def __init__(self) -> None:
        self.lio = None
        if sys.platform != "linux" or platform.machine() != "x86_64":
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl lays aiocb out otherwise)
            self.lio = libc.lio_listio
            self.suspend = libc.aio_suspend
        except AttributeError:
            self.lio = None
            return
        # Declared argument types: plain ints convert in C, cheaper than ctypes objects
        # made in Python for each call.
        self.lio.restype = ctypes.c_int
        self.lio.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self.suspend.restype = ctypes.c_int
        self.suspend.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self.no_wait = (ctypes.c_long * 2)()  # struct timespec {0, 0}
        self.no_wait_at = ctypes.addressof(self.no_wait)


_posix = _Posix()
if _posix.lio is not None and hasattr(os, "register_at_fork"):
    # A forked child has none of the parent's AIO threads: it writes through its levels'
    # I/O threads instead.
    os.register_at_fork(after_in_child=lambda: setattr(_posix, "lio", None))


def native_available() -> bool:
    """Whether :class:`NativeWrite` can be used here (Linux x86-64 with glibc)."""
    return _posix.lio is not None


def data_address(array: np.ndarray) -> int:
    """The address of a writable array's first byte (``array.ctypes.data`` builds a
    Python object each time and costs about five times as much)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(array))


#: Every NativeWrite glibc may still be using: its control blocks and rows must outlive
#: the owner that drops it unfinished (a manager collected without ``shutdown()``), or
#: glibc would write a status into, and read rows from, freed memory. A handle leaves the
#: set when :meth:`NativeWrite.done` first sees it finished; handles nobody looks at
#: again are looked at here once the set has doubled.
_LIVE: set[NativeWrite] = set()
_prune_at = 64


def _keep_alive(handle: NativeWrite) -> None:
    global _prune_at
    if len(_LIVE) >= _prune_at:
        for h in tuple(_LIVE):  # (a copy: another thread's done() may discard meanwhile)
            h.done()
        _prune_at = max(64, 2 * len(_LIVE))
    _LIVE.add(handle)


class NativeWrite:
    """Writes handed to glibc's own AIO threads (``lio_listio`` with ``LIO_NOWAIT``):
    ``sizes[i]`` bytes at ``addresses[i]`` to file offset ``offsets[i]``, one request per
    run. The call returns at once, and the writes run on threads that never take Python's
    interpreter lock. ``keep`` (the rows) is held until the writes are done, also when
    the handle is dropped unfinished (see ``_LIVE``).

    :meth:`done` reads each request's status from memory (no system call). A request
    that glibc could not queue counts as failed."""

    __slots__ = ("_errors", "_keep", "_list", "_n", "_refused", "_settled", "_words")

    def __init__(self, fd: int, offsets: Sequence[int] | np.ndarray,
                 addresses: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
                 keep: object) -> None:
        n = len(offsets)
        # One zeroed allocation: the n control blocks (status 0, result 0: "failed" until
        # glibc says), then the n pointers to them that lio_listio and aio_suspend take.
        end = n * _AIOCB_WORDS
        words = np.zeros(end + n, dtype=np.uint64)
        base = data_address(words)
        if n == 1:  # one request (a run of slots, about half the writes): word by word
            words[_FILDES_OPCODE] = fd | _LIO_WRITE << 32
            words[_BUF] = addresses[0]
            words[_NBYTES] = sizes[0]
            words[_SIGEVENT] = _SIGEV_NONE << 32
            words[_OFFSET] = offsets[0]
            words[end] = base
        else:  # a field of every block is one strided slice of it
            words[_FILDES_OPCODE:end:_AIOCB_WORDS] = fd | _LIO_WRITE << 32
            words[_BUF:end:_AIOCB_WORDS] = addresses
            words[_NBYTES:end:_AIOCB_WORDS] = sizes
            words[_SIGEVENT:end:_AIOCB_WORDS] = _SIGEV_NONE << 32
            words[_OFFSET:end:_AIOCB_WORDS] = offsets
            np.add(_CB_OFFSETS[:n] if n <= len(_CB_OFFSETS) else
                   np.arange(n, dtype=np.uint64) * np.uint64(8 * _AIOCB_WORDS),
                   base, out=words[end:])
        self._words, self._keep, self._n = words, keep, n
        self._errors = words.view(np.int32)[2 * _ERROR:2 * end:2 * _AIOCB_WORDS]
        self._list = base + 8 * end
        self._refused = 0
        self._settled = False
        assert _posix.lio is not None
        _keep_alive(self)  # (before glibc has the control blocks)
        if _posix.lio(_LIO_NOWAIT, self._list, n, None) != 0:
            self._refused = ctypes.get_errno() or errno.EAGAIN  # some may still run

    def done(self) -> bool:
        """Whether every request finished (successfully or not). The first time it is,
        one ``aio_suspend`` with a zero timeout takes glibc's request lock, under which
        its thread still reads the control block after setting its status: once that
        returns, glibc is done with our memory and the handle may be dropped."""
        if self._settled:
            return True
        if errno.EINPROGRESS in self._errors.tolist():  # a few requests: a list is cheaper
            return False
        _posix.suspend(self._list, self._n, _posix.no_wait_at)
        self._settled = True
        _LIVE.discard(self)
        return True

    def error(self) -> str | None:
        """Once :meth:`done`: None when every byte was written, else what failed."""
        words, end = self._words, self._n * _AIOCB_WORDS
        errors = self._errors.tolist()
        sizes = words[_NBYTES:end:_AIOCB_WORDS].tolist()
        # Success (every status 0, every result its size) is tested on the unsigned
        # words: a negative result never equals a size there either.
        if not self._refused and not any(errors) and \
                words[_RETURN:end:_AIOCB_WORDS].tolist() == sizes:
            return None
        results = words[_RETURN:end:_AIOCB_WORDS].view(np.int64).tolist()
        bad = [i for i in range(self._n) if errors[i] or results[i] != sizes[i]]
        i = bad[0] if bad else 0
        err = errors[i] or self._refused
        return (f"pwrite at offset {int(words[i * _AIOCB_WORDS + _OFFSET])}: "
                + (os.strerror(err) if err else f"{results[i]} of {sizes[i]} bytes"))


def _blocks(fd: int, offsets: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
            opcode: int) -> np.ndarray:
    """The control blocks of calls at file ``offsets`` moving ``sizes`` bytes each, their
    buffers (words 3 and 4) left for the caller to fill."""
    # struct iocb as eight little-endian u64 words: [0] data (the bytes the call must
    # move), [1] key and rw_flags (0), [2] opcode | reqprio << 16 | fildes << 32, [3] buf,
    # [4] nbytes, [5] offset, [6] reserved (0), [7] flags and resfd (0).
    cbs = np.zeros((len(offsets), 8), dtype=np.uint64)
    cbs[:, 0] = sizes
    cbs[:, 2] = opcode | (fd << 32)
    cbs[:, 5] = offsets
    return cbs


def _plain_blocks(fd: int, offsets: Sequence[int] | np.ndarray,
                  addresses: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
                  write: bool) -> np.ndarray:
    """The control blocks of one-buffer calls: plain ``PREAD`` / ``PWRITE``."""
    cbs = _blocks(fd, offsets, sizes, _PWRITE if write else _PREAD)
    cbs[:, 3] = addresses
    cbs[:, 4] = cbs[:, 0]
    return cbs


def _submit(cbs: np.ndarray) -> list[tuple[int, int, int]] | None:
    """Run the control blocks ``cbs`` on a context of the free list; None when the kernel
    refuses one (nothing was done)."""
    ctx = _kernel.take()
    if ctx is None:
        return None
    try:
        out = _run(ctx, cbs)
    except BaseException:
        _kernel.drop(ctx)  # requests may be in flight: wait for them, never reuse ctx
        raise
    _kernel.give(ctx)
    return out


def _run(ctx: int, cbs: np.ndarray) -> list[tuple[int, int, int]]:
    k = _kernel
    n = len(cbs)
    base = cbs.ctypes.data
    ptrs = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(64)
    events = np.zeros((min(n, _NR_EVENTS), 4), dtype=np.int64)  # data, obj, res, res2
    results = np.empty(n, dtype=np.int64)
    done = 0
    while done < n:
        m = min(n - done, _NR_EVENTS)
        got = k.syscall(ctypes.c_long(k.submit), ctypes.c_ulong(ctx), ctypes.c_long(m),
                        ctypes.c_void_p(ptrs.ctypes.data + done * 8))
        if got <= 0:  # nothing accepted: the rest fail with errno
            results[done:] = -(ctypes.get_errno() or errno.EIO)
            break
        reaped = 0
        while reaped < got:
            # On a file in the page cache the kernel finished the requests inside
            # io_submit: reap them first with a zero timeout, which never waits, without
            # handing the GIL over (taking it back from the scheduler's thread costs more
            # than the call); wait, the GIL released, only for requests still running.
            r = k.syscall_held(ctypes.c_long(k.getevents), ctypes.c_ulong(ctx),
                               ctypes.c_long(0), ctypes.c_long(got - reaped),
                               ctypes.c_void_p(events.ctypes.data), ctypes.byref(k.no_wait))
            if r == 0:
                r = k.syscall(ctypes.c_long(k.getevents), ctypes.c_ulong(ctx),
                              ctypes.c_long(got - reaped), ctypes.c_long(got - reaped),
                              ctypes.c_void_p(events.ctypes.data), None)
            if r < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, os.strerror(err))
            ev = events[:r]
            results[(ev[:, 1] - base) // 64] = ev[:, 2]
            reaped += r
        done += got
    want = cbs[:, 0].astype(np.int64)
    bad = np.nonzero(results != want)[0]
    return [(int(i), int(results[i]), int(want[i])) for i in bad.tolist()]


def _address(buffer: memoryview, keep: list[object]) -> int:
    """The address of ``buffer``'s first byte; what exports it is appended to ``keep``."""
    try:
        c = ctypes.c_char.from_buffer(buffer)
        keep.append(c)
        return ctypes.addressof(c)
    except TypeError:  # a read-only buffer (a write's source)
        arr = np.frombuffer(buffer, dtype=np.uint8)
        keep.append(arr)
        return int(arr.ctypes.data)
