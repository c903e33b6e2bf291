"""What the ``cupy`` and ``cuda`` backends share: buffers, streams, events, the staging ring,
argument packing and every kernel's host side.

A subclass supplies a handful of runtime primitives (allocate, copy, launch, stream and event
operations, compile); everything that decides *what* to launch lives here once, so both
backends run the same kernels with the same arguments and must give the same bytes.
"""

from __future__ import annotations

import abc
import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import (
    Buffer,
    CopyTask,
    Event,
    FingerprintPages,
    KernelBackend,
    MemoryKind,
    PageRegion,
    SparseCopy,
    SparseResolve,
    Stream,
    TableConversion,
    check_copy_args,
)
from kvcm_core.scratch import ScratchDesc, scratch_kernel_args
from kvcm_core.sparse.reference import keys_width
from kvcm_kernels_cuda_common.source import (
    CONV_JOB_WORDS,
    COPY_CHUNK_BYTES_PER_THREAD,
    COPY_DESC_WORDS,
    FP_DESC_WORDS,
    KERNEL_NAMES,
    SOURCE,
)
from kvcm_kernels_cuda_common.source_sparse import (
    SPARSE_COPY_DESC_WORDS,
    SPARSE_KERNEL_NAMES,
    SPARSE_RESOLVE_THREADS,
    SPARSE_SHARED_LIMIT,
    SPARSE_SOURCE,
)
from kvcm_kernels_cuda_common.source_sparse_v2 import (
    SPARSE_V2_KERNEL,
    SPARSE_V2_MAX_SHARED,
    SPARSE_V2_SOURCE,
    sparse_v2_shared_bytes,
    sparse_v2_window_bits,
)
from kvcm_kernels_cuda_common.source_sparse_v3 import (
    SPARSE_V3_KERNELS,
    SPARSE_V3_MAX_SHARED,
    SPARSE_V3_SOURCE,
    sparse_v3_kernel,
    sparse_v3_shared_bytes,
)

__all__ = [
    "AUTO_CE_MIN_PAGE_BYTES",
    "COPY_PATHS",
    "CompiledModule",
    "CudaBuffer",
    "CudaEvent",
    "CudaKernelBackend",
    "CudaStream",
    "parse_options",
]

COPY_PATHS = ("auto", "sm", "ce")

#: ``copy_path="auto"``: smallest page size, per (source kind, destination kind), from which
#: the copy engine is used instead of the SM gather kernel (``None``: never). This default
#: (gather everywhere) is the ``cupy`` backend's: its copy-engine path is one
#: ``cudaMemcpyAsync`` per page, which the gather kernel beat at every batch of more than one
#: page on an H200 (benchmarks/README.md). A backend overrides it with
#: :attr:`CudaKernelBackend.auto_ce_min_page_bytes`.
AUTO_CE_MIN_PAGE_BYTES: dict[tuple[str, str], int | None] = {
    (MemoryKind.HOST, MemoryKind.DEVICE): None,
    (MemoryKind.DEVICE, MemoryKind.HOST): None,
    (MemoryKind.DEVICE, MemoryKind.DEVICE): None,
    (MemoryKind.HOST, MemoryKind.HOST): None,
}

_DEFAULTS: dict[str, Any] = {"device": 0, "copy_path": "auto", "block_threads": 128}
_MASK64 = (1 << 64) - 1
_ALIGN = 256
#: Staging slots of the launch ring. A slot is reused only after its launch completed (the
#: host waits otherwise): an asynchronous migration queues a launch per batch on two
#: streams (kvcm_core.fences), so 8 slots made the host wait for the first batches.
_RING_SLOTS = 32
_MAX_GRID_Y = 65535
_MAX_GRID_X = (1 << 31) - 1


def parse_options(
    options: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Validate backend options: ``device`` (int), ``copy_path`` (``"auto"``, ``"sm"`` or
    ``"ce"``), ``block_threads`` (a multiple of 32 from 64 to 1024), and a backend's own
    ``extra`` keys (given with their defaults; the backend checks their values).

    Raises:
        ValueError: an unknown key or a bad value, naming both.
    """
    defaults = {**_DEFAULTS, **(extra or {})}
    opts = dict(defaults)
    for key, value in (options or {}).items():
        if key not in defaults:
            raise ValueError(
                f"unknown kernel backend option {key!r}; known: {', '.join(sorted(defaults))}"
            )
        opts[key] = value
    if (
        isinstance(opts["device"], bool)
        or not isinstance(opts["device"], int)
        or opts["device"] < 0
    ):
        raise ValueError(f"device={opts['device']!r}: must be an int >= 0")
    if opts["copy_path"] not in COPY_PATHS:
        raise ValueError(f"copy_path={opts['copy_path']!r}: must be one of {COPY_PATHS}")
    threads = opts["block_threads"]
    if (
        isinstance(threads, bool)
        or not isinstance(threads, int)
        or not 64 <= threads <= 1024
        or threads % 32
    ):
        raise ValueError(f"block_threads={threads!r}: must be a multiple of 32 in [64, 1024]")
    return opts


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _host_array(address: int, nbytes: int) -> np.ndarray:
    """A writable ``uint8`` NumPy view of ``nbytes`` of host memory at ``address``."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


# -- memory, streams, events ---------------------------------------------------------------


class CudaBuffer(Buffer):
    """Device memory, or pinned device-mapped host memory, of a CUDA backend.

    ``ptr`` is the address kernels use; for host memory ``host_ptr`` is its host address
    (equal to ``ptr`` under unified addressing).
    """

    def __init__(
        self,
        backend: CudaKernelBackend,
        nbytes: int,
        kind: str,
        ptr: int,
        host_ptr: int | None,
        handle: Any,
    ) -> None:
        self.nbytes = nbytes
        self.kind = kind
        self.ptr = ptr
        self.host_ptr = host_ptr
        self._backend: CudaKernelBackend | None = backend
        self._handle = handle
        self._view: np.ndarray | None = None

    def host_view(self) -> np.ndarray:
        if self.host_ptr is None:
            raise TypeError(f"{self.kind} buffer of {type(self).__name__} has no host view")
        if self._backend is None:
            raise ValueError("buffer was freed")
        if self._view is None:
            self._view = _host_array(self.host_ptr, self.nbytes)
        return self._view

    def free(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            self._view = None
            backend._release(self, self._handle)

    def __repr__(self) -> str:
        return f"CudaBuffer({self.kind}, {self.nbytes} bytes at {self.ptr:#x})"


class CudaStream(Stream):
    """A CUDA stream of one backend (``native`` is the runtime's own stream object)."""

    def __init__(self, backend: CudaKernelBackend, native: Any, handle: int, owned: bool) -> None:
        self._backend = backend
        self.native = native
        self._handle = handle
        self._owned = owned

    @property
    def handle(self) -> int:
        return self._handle

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (version 0, ``cudaStream_t`` as an int): libraries
        that accept it (``cupy.cuda.Stream.from_external``, ``cuda.core``) run work on
        this stream."""
        return (0, self._handle)

    def synchronize(self) -> None:
        self._backend._stream_synchronize(self.native)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"{type(event).__name__} is not an event of this backend")
        self._backend._stream_wait_event(self.native, event.native)

    def __del__(self) -> None:
        if getattr(self, "_owned", False):
            try:
                self._backend._stream_destroy(self.native)
            except Exception:  # interpreter shutdown: the driver may already be gone
                pass


class CudaEvent(Event):
    """A CUDA event; :meth:`elapsed_ms` times device work between two recorded events."""

    def __init__(self, backend: CudaKernelBackend, native: Any) -> None:
        self._backend = backend
        self.native = native

    def record(self, stream: Stream | None = None) -> None:
        self._backend._event_record(self.native, self._backend._stream(stream).native)

    def query(self) -> bool:
        return self._backend._event_query(self.native)

    def synchronize(self) -> None:
        self._backend._event_synchronize(self.native)

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds of device time from ``start`` to this event (both complete)."""
        if not isinstance(start, CudaEvent):
            raise TypeError(f"{type(start).__name__} is not an event of this backend")
        return self._backend._event_elapsed_ms(start.native, self.native)

    def __del__(self) -> None:
        try:
            self._backend._event_destroy(self.native)
        except Exception:  # interpreter shutdown
            pass


class CompiledModule:
    """Kernels compiled from CUDA C source by a backend (:meth:`CudaKernelBackend.compile`)."""

    def __init__(self, backend: CudaKernelBackend, native: Any) -> None:
        self._backend = backend
        self._native = native
        self._functions: dict[str, Any] = {}

    def function(self, name: str) -> Any:
        """The runtime's handle of the ``extern "C"`` kernel ``name`` (looked up once)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._backend._get_function(self._native, name)
        return fn

    def launch(
        self,
        name: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        *,
        stream: Stream | None = None,
        shared_bytes: int = 0,
    ) -> None:
        """Queue kernel ``name`` on ``stream``.

        Args:
            args: NumPy scalars (passed with their exact C type), NumPy arrays of one
                element (its bytes, e.g. a ``void`` element for a struct passed by value),
                :class:`CudaBuffer` (its device address), Python ``int`` (as ``int64``),
                ``float`` (as ``double``) or ``bool``.
        """
        packed = [_scalar(a) for a in args]
        self._backend._launch(
            self.function(name),
            grid,
            block,
            packed,
            self._backend._stream(stream).native,
            shared_bytes,
        )


def _scalar(value: Any) -> np.generic | np.ndarray:
    if isinstance(value, np.generic):
        return value
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise TypeError(f"kernel argument: a NumPy array passed by value must have one "
                            f"element; got shape {value.shape}")
        return value
    if isinstance(value, Buffer):
        return np.uint64(value.ptr)
    if isinstance(value, bool):
        return np.bool_(value)
    if isinstance(value, int):
        return np.int64(value)
    if isinstance(value, float):
        return np.float64(value)
    raise TypeError(f"kernel argument {value!r}: pass a NumPy scalar, a buffer, int or float")


def _u64(values: Sequence[int]) -> list[np.generic]:
    return [np.uint64(v & _MASK64) for v in values]


# -- staging ---------------------------------------------------------------------------------


class _Slot:
    """One slot of the staging arena: pinned ``[input | output]`` (``view``; kernels reach
    it at ``host_ptr``) and a device copy of the input at ``dev_ptr``."""

    def __init__(self, done: CudaEvent) -> None:
        self.view = np.empty(0, dtype=np.uint8)
        self.host_ptr = 0
        self.dev_ptr = 0
        self.in_cap = 0
        self.out_cap = 0
        self.done = done
        self.pending = False


class _StagingRing:
    """Slots carved from one pinned arena and one device arena: tables for a launch are
    written into pinned memory, copied to the device on the launch's stream, and a slot is
    reused only after its event says that launch finished. No allocation and no host
    synchronisation in the steady state; a table larger than a slot regrows the whole arena
    (geometrically, so rarely)."""

    def __init__(
        self,
        backend: CudaKernelBackend,
        slots: int = _RING_SLOTS,
        in_cap: int = 256 << 10,
        out_cap: int = 64 << 10,
    ) -> None:
        self._backend = backend
        self._slots = [_Slot(backend._new_event(timing=False)) for _ in range(slots)]
        self._next = 0
        self._host: CudaBuffer | None = None
        self._device: CudaBuffer | None = None
        self._in_cap, self._out_cap = in_cap, out_cap

    def _layout(self) -> None:
        b = self._backend
        self._drain()
        for buf in (self._host, self._device):
            if buf is not None:
                buf.free()
        k, stride = len(self._slots), self._in_cap + self._out_cap
        self._host = b.alloc_host(k * stride)
        self._device = b.alloc_device(k * self._in_cap)
        view = self._host.host_view()
        for i, slot in enumerate(self._slots):
            slot.view = view[i * stride : (i + 1) * stride]
            slot.host_ptr = self._host.ptr + i * stride
            slot.dev_ptr = self._device.ptr + i * self._in_cap
            slot.in_cap, slot.out_cap = self._in_cap, self._out_cap

    def _drain(self) -> None:
        for slot in self._slots:
            if slot.pending:
                slot.done.synchronize()
                slot.pending = False

    def acquire(self, in_bytes: int, out_bytes: int) -> _Slot:
        if self._host is None or in_bytes > self._in_cap or out_bytes > self._out_cap:
            while in_bytes > self._in_cap:
                self._in_cap *= 2
            while out_bytes > self._out_cap:
                self._out_cap *= 2
            self._layout()
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.pending:
            slot.done.synchronize()
            slot.pending = False
        return slot

    def release(self, slot: _Slot, stream_native: Any) -> None:
        self._backend._event_record(slot.done.native, stream_native)
        slot.pending = True

    def close(self) -> None:
        self._drain()
        for buf in (self._host, self._device):
            if buf is not None:
                buf.free()
        self._host = self._device = None


# -- the backend -----------------------------------------------------------------------------


class CudaKernelBackend(KernelBackend):
    """Host side of every kernel, over runtime primitives that a subclass supplies.

    Args:
        options: see :func:`parse_options`.
    """

    #: The ``copy_path="auto"`` policy (see :data:`AUTO_CE_MIN_PAGE_BYTES`).
    auto_ce_min_page_bytes: dict[tuple[str, str], int | None] = AUTO_CE_MIN_PAGE_BYTES

    #: Options of a subclass beyond the shared ones, with their defaults.
    extra_options: dict[str, Any] = {}

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = parse_options(options, self.extra_options)
        self.device_id: int = self.options["device"]
        self.copy_path: str = self.options["copy_path"]
        env = os.environ.get("KVCM_COPY_PATH", "")
        if env and "copy_path" not in (options or {}):  # experiments (kvcm bench migrate)
            if env not in COPY_PATHS:
                raise ValueError(f"KVCM_COPY_PATH={env!r}: must be one of {COPY_PATHS}")
            self.copy_path = env
        self._threads: int = self.options["block_threads"]
        self._lock = threading.RLock()
        self._live: dict[int, tuple[int, int]] = {}  # id(buffer) -> (ptr, end)
        self._ranges: tuple[np.ndarray, np.ndarray] | None = None
        self._init_runtime()
        self._default = self._new_stream()
        self._ring = _StagingRing(self)
        self._module: CompiledModule | None = None
        self._shared_allowed: dict[str, int] = {}
        self._closed = False

    # -- primitives a subclass supplies --------------------------------------------------

    @abc.abstractmethod
    def _init_runtime(self) -> None:
        """Select the device (and context) for this backend."""

    @abc.abstractmethod
    def _malloc(self, nbytes: int) -> tuple[int, Any]:
        """Device memory: ``(address, handle)``."""

    @abc.abstractmethod
    def _malloc_host(self, nbytes: int) -> tuple[int, int, Any]:
        """Pinned, portable, device-mapped host memory: ``(host address, device address,
        handle)``."""

    @abc.abstractmethod
    def _free(self, kind: str, handle: Any) -> None:
        """Release memory from :meth:`_malloc` or :meth:`_malloc_host`."""

    @abc.abstractmethod
    def _memcpy_sync(self, dst: int, src: int, nbytes: int, dst_host: bool, src_host: bool) -> None:
        """A synchronous copy; ``*_host`` says whether an address is (pageable) host memory."""

    @abc.abstractmethod
    def _memcpy_async(self, dst: int, src: int, nbytes: int, stream_native: Any) -> None:
        """An asynchronous copy between device or pinned memory, on a stream."""

    @abc.abstractmethod
    def _memcpy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_native: Any
    ) -> None:
        """The copy-engine path: copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]``."""

    @abc.abstractmethod
    def _device_synchronize(self) -> None:
        """Wait for all work of this backend's device (context)."""

    @abc.abstractmethod
    def _new_stream(self) -> CudaStream:
        """A new (blocking) stream."""

    @abc.abstractmethod
    def _stream_synchronize(self, native: Any) -> None: ...

    @abc.abstractmethod
    def _stream_wait_event(self, native: Any, event_native: Any) -> None: ...

    @abc.abstractmethod
    def _stream_destroy(self, native: Any) -> None: ...

    @abc.abstractmethod
    def _new_event(self, timing: bool = True) -> CudaEvent: ...

    @abc.abstractmethod
    def _event_record(self, native: Any, stream_native: Any) -> None: ...

    @abc.abstractmethod
    def _event_query(self, native: Any) -> bool: ...

    @abc.abstractmethod
    def _event_synchronize(self, native: Any) -> None: ...

    @abc.abstractmethod
    def _event_elapsed_ms(self, start_native: Any, end_native: Any) -> float: ...

    @abc.abstractmethod
    def _event_destroy(self, native: Any) -> None: ...

    @abc.abstractmethod
    def _compile(self, source: str, options: tuple[str, ...]) -> Any:
        """Compile CUDA C for this device (cached) and load it: a native module."""

    @abc.abstractmethod
    def _get_function(self, module_native: Any, name: str) -> Any: ...

    @abc.abstractmethod
    def _launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[np.generic | np.ndarray],
        stream_native: Any,
        shared_bytes: int,
    ) -> None: ...

    @abc.abstractmethod
    def device_info(self) -> dict[str, Any]:
        """Device name, compute capability, multiprocessor count, driver and runtime
        versions, package versions (for benchmark reports)."""

    # -- runtime -------------------------------------------------------------------------

    def _track(self, buf: CudaBuffer) -> CudaBuffer:
        with self._lock:
            self._live[id(buf)] = (buf.ptr, buf.ptr + buf.nbytes)
            self._ranges = None
        return buf

    def _release(self, buf: CudaBuffer, handle: Any) -> None:
        # Work queued on any stream may still use the memory: wait before giving it back.
        self._device_synchronize()
        with self._lock:
            self._live.pop(id(buf), None)
            self._ranges = None
        self._free(buf.kind, handle)

    @staticmethod
    def _check_size(nbytes: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r}: must be an int >= 0")
        return int(nbytes)

    def alloc_device(self, nbytes: int) -> CudaBuffer:
        n = self._check_size(nbytes)
        ptr, handle = self._malloc(max(n, 1))
        return self._track(CudaBuffer(self, n, MemoryKind.DEVICE, ptr, None, handle))

    def alloc_host(self, nbytes: int) -> CudaBuffer:
        n = self._check_size(nbytes)
        host, dev, handle = self._malloc_host(max(n, 1))
        return self._track(CudaBuffer(self, n, MemoryKind.HOST, dev, host, handle))

    @property
    def default_stream(self) -> Stream:
        return self._default

    def create_stream(self) -> Stream:
        return self._new_stream()

    def create_event(self) -> Event:
        return self._new_event(timing=True)

    def synchronize(self) -> None:
        self._device_synchronize()

    def is_capturing(self, stream: Stream | None = None) -> bool:
        return self._stream_is_capturing(self._stream(stream).native)

    def _stream_is_capturing(self, native: Any) -> bool:
        raise NotImplementedError

    def _stream(self, stream: Stream | None) -> CudaStream:
        if stream is None:
            return self._default
        if not isinstance(stream, CudaStream):
            raise TypeError(f"{type(stream).__name__} is not a stream of this backend")
        return stream

    @staticmethod
    def _check_range(buffer: Buffer, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > buffer.nbytes:
            raise ValueError(f"{what} of {nbytes} bytes at {offset} outside {buffer.nbytes} bytes")

    def read(self, buffer: Buffer, offset: int, nbytes: int) -> np.ndarray:
        self._check_range(buffer, offset, nbytes, "read")
        self._device_synchronize()
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes == 0:
            return out
        if buffer.host_ptr is not None:
            out[:] = buffer.host_view()[offset : offset + nbytes]
        else:
            self._memcpy_sync(out.ctypes.data, buffer.ptr + offset, nbytes, True, False)
        return out

    def write(self, buffer: Buffer, offset: int, data: np.ndarray | bytes) -> None:
        if isinstance(data, bytes | bytearray | memoryview):
            src = np.frombuffer(data, dtype=np.uint8)
        else:
            src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self._check_range(buffer, offset, src.size, "write")
        self._device_synchronize()
        if src.size == 0:
            return
        if buffer.host_ptr is not None:
            buffer.host_view()[offset : offset + src.size] = src
        else:
            self._memcpy_sync(buffer.ptr + offset, src.ctypes.data, src.size, False, True)

    def copy_bytes(
        self,
        dst: Buffer,
        dst_offset: int,
        src: Buffer,
        src_offset: int,
        nbytes: int,
        stream: Stream | None = None,
    ) -> None:
        """One contiguous asynchronous copy (a plain memcpy on ``stream``)."""
        self._check_range(dst, dst_offset, nbytes, "copy destination")
        self._check_range(src, src_offset, nbytes, "copy source")
        if nbytes:
            self._memcpy_async(
                dst.ptr + dst_offset, src.ptr + src_offset, nbytes, self._stream(stream).native
            )

    def compile(self, source: str, options: Sequence[str] = ()) -> CompiledModule:
        """Compile CUDA C ``source`` for this device (cached on disk) and load it."""
        return CompiledModule(self, self._compile(source, tuple(options)))

    def _kernels(self) -> CompiledModule:
        if self._module is None:
            self._module = self.compile(SOURCE + SPARSE_SOURCE + SPARSE_V2_SOURCE
                                        + SPARSE_V3_SOURCE)
        return self._module

    def warm_up(self) -> None:
        """Compile and load the kernels now rather than on first use."""
        module = self._kernels()
        for name in (*KERNEL_NAMES, *SPARSE_KERNEL_NAMES, SPARSE_V2_KERNEL, *SPARSE_V3_KERNELS):
            module.function(name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._device_synchronize()
        self._ring.close()

    # -- copy_pages ----------------------------------------------------------------------

    def choose_copy_path(self, dst_kind: str, src_kind: str, page_bytes: int) -> str:
        """``"sm"`` (gather kernel) or ``"ce"`` (copy engine) for one copy's shape."""
        if self.copy_path != "auto":
            return self.copy_path
        threshold = self.auto_ce_min_page_bytes.get((src_kind, dst_kind))
        return "ce" if threshold is not None and page_bytes >= threshold else "sm"

    def copy_pages(
        self,
        dst: PageRegion,
        src: PageRegion,
        page_bytes: int,
        pairs: np.ndarray,
        stream: Stream | None = None,
    ) -> None:
        check_copy_args(dst, src, page_bytes, pairs)
        if len(pairs) == 0:
            return
        task = CopyTask(dst, src, page_bytes, pairs)
        path = self.choose_copy_path(dst.buffer.kind, src.buffer.kind, page_bytes)
        self._run_copies([task], path, self._stream(stream))

    def copy_pages_batch(self, tasks: Sequence[CopyTask], stream: Stream | None = None) -> None:
        for task in tasks:
            check_copy_args(task.dst, task.src, task.page_bytes, task.pairs)
        live = [t for t in tasks if len(t.pairs)]
        if not live:
            return
        paths = {
            self.choose_copy_path(t.dst.buffer.kind, t.src.buffer.kind, t.page_bytes) for t in live
        }
        self._run_copies(live, "ce" if paths == {"ce"} else "sm", self._stream(stream))

    def _run_copies(self, tasks: list[CopyTask], path: str, stream: CudaStream) -> None:
        if path == "ce":
            dsts, srcs, sizes = _copy_descriptors(tasks)
            with self._lock:
                self._memcpy_batch(dsts, srcs, sizes, stream.native)
            return
        module = self._kernels()
        chunk = self._threads * COPY_CHUNK_BYTES_PER_THREAD
        ntasks = len(tasks)
        npairs = sum(len(t.pairs) for t in tasks)
        table = COPY_DESC_WORDS * 8 * ntasks
        in_bytes = table + 8 * npairs
        max_chunks = 1
        with self._lock:
            slot = self._ring.acquire(in_bytes, 0)
            view = slot.view
            desc = view[:table].view(np.int64).reshape(ntasks, COPY_DESC_WORDS)
            pairs_view = view[table:in_bytes].view(np.int32).reshape(npairs, 2)
            first = 0
            for k, t in enumerate(tasks):
                chunks = -(-t.page_bytes // chunk)
                max_chunks = max(max_chunks, chunks)
                desc[k] = (
                    t.dst.buffer.ptr + t.dst.offset,
                    t.dst.stride,
                    t.src.buffer.ptr + t.src.offset,
                    t.src.stride,
                    t.page_bytes,
                    first,
                    chunks,
                    0,
                )
                pairs_view[first : first + len(t.pairs)] = t.pairs
                first += len(t.pairs)
            dev = slot.dev_ptr
            self._memcpy_async(dev, slot.host_ptr, in_bytes, stream.native)
            grid = (min(max_chunks, _MAX_GRID_X), min(npairs, _MAX_GRID_Y), 1)
            self._launch(
                module.function("kvcm_copy_pages"),
                grid,
                (self._threads, 1, 1),
                _u64([dev, ntasks, dev + table, npairs, chunk]),
                stream.native,
                0,
            )
            self._ring.release(slot, stream.native)

    # -- convert_page_indices --------------------------------------------------------------

    def convert_page_indices(
        self,
        slots: np.ndarray,
        scale: int,
        offset: int,
        expansion: int = 1,
        stream: Stream | None = None,
        *,
        scratch: ScratchDesc | None = None,
    ) -> np.ndarray:
        if expansion < 1:
            raise ValueError(f"expansion={expansion}: must be >= 1")
        s = np.ascontiguousarray(np.asarray(slots, dtype=np.int32))
        if s.ndim == 0:
            raise ValueError("slots must be an array of slot ids (last axis: blocks)")
        lead, width = s.shape[:-1], s.shape[-1]
        for name, value in (("scale", scale), ("offset", offset), ("expansion", expansion)):
            if not -(1 << 63) <= int(value) < (1 << 63):
                raise OverflowError(f"{name}={value}: does not fit int64")
        sa = None if scratch is None else scratch_kernel_args(
            scratch, width, scale, offset, expansion)
        n = s.size
        if n == 0:
            return np.empty((*lead, width * expansion), dtype=np.int32)
        st = self._stream(stream)
        module = self._kernels()
        in_bytes = _align(4 * n)
        ids_bytes = 0 if sa is None else _align(4 * len(sa.slot_ids))
        out_bytes = _align(4 * n * expansion) + _ALIGN
        with self._lock:
            # The output region of a ring slot is pinned and device-mapped: it holds the
            # input, the scratch slot ids, the overflow flag and the output.
            slot = self._ring.acquire(0, in_bytes + ids_bytes + out_bytes)
            view = slot.view
            base = slot.in_cap
            view[base : base + 4 * n].view(np.int32)[:] = s.reshape(-1)
            ids_at = base + in_bytes
            if sa is not None:
                view[ids_at : ids_at + 4 * len(sa.slot_ids)].view(np.int32)[:] = sa.slot_ids
                scratch_args = [sa.begin, sa.stop, sa.spb, sa.unit_scale, sa.unit_offset,
                                slot.host_ptr + ids_at]
            else:
                scratch_args = [0, 0, 0, 1, 0, 0]
            flag_at = ids_at + ids_bytes
            out_at = flag_at + _ALIGN
            view[flag_at : flag_at + 4].view(np.int32)[0] = 0
            threads = self._threads
            blocks = max(1, min(-(-n // threads), 65535))
            self._launch(
                module.function("kvcm_convert_page_indices"),
                (blocks, 1, 1),
                (threads, 1, 1),
                _u64(
                    [
                        slot.host_ptr + base,
                        slot.host_ptr + out_at,
                        n,
                        int(scale),
                        int(offset),
                        int(expansion),
                        slot.host_ptr + flag_at,
                        width,
                        *scratch_args,
                    ]
                ),
                st.native,
                0,
            )
            self._ring.release(slot, st.native)
            slot.done.synchronize()
            slot.pending = False
            overflow = int(view[flag_at : flag_at + 4].view(np.int32)[0])
            out = view[out_at : out_at + 4 * n * expansion].view(np.int32).copy()
        if overflow:
            raise OverflowError("converted page index does not fit int32")
        return out.reshape(*lead, width * expansion)

    # -- convert_page_tables ---------------------------------------------------------------

    def convert_page_tables(self, tables: Sequence[TableConversion], rows: np.ndarray,
                            stream: Stream | None = None) -> None:
        sel = np.asarray(rows, dtype=np.int64)
        if not len(sel) or not tables:
            return
        k = len(sel)
        jobs = np.zeros((k * len(tables), CONV_JOB_WORDS), dtype=np.int64)
        ids: list[np.ndarray] = []
        id_jobs: list[int] = []  # jobs whose ``ids`` word is an offset into ``ids`` (ints)
        nids = 0
        for t_i, t in enumerate(tables):
            block = jobs[t_i * k : (t_i + 1) * k]
            row_in = 4 * t.row_elems
            block[:, 0] = t.src.ptr + sel * row_in
            block[:, 1] = t.dst.ptr + sel * (row_in * t.expansion)
            block[:, 2] = t.row_elems
            block[:, 3] = t.blocks
            block[:, 4] = t.scale
            block[:, 5] = t.offset
            block[:, 6] = t.expansion
            block[:, 10] = 1  # unit_scale of rows without scratch (never read)
            if t.scratch:
                where = {int(r): i for i, r in enumerate(sel.tolist())}
                for r, desc in t.scratch.items():
                    i = where.get(int(r))
                    if i is None:
                        continue
                    sa = scratch_kernel_args(desc, t.blocks, t.scale, t.offset, t.expansion)
                    if sa.stop <= sa.begin:
                        continue
                    block[i, 7:12] = (sa.begin, sa.stop, sa.spb, sa.unit_scale,
                                      sa.unit_offset)
                    block[i, 12] = nids
                    id_jobs.append(t_i * k + i)
                    ids.append(sa.slot_ids)
                    nids += len(sa.slot_ids)
        st = self._stream(stream)
        module = self._kernels()
        table = jobs.nbytes
        ids_at = _align(table)
        flag_at = ids_at + _align(4 * nids)
        in_bytes = flag_at + _ALIGN
        with self._lock:
            slot = self._ring.acquire(in_bytes, 0)
            dev = slot.dev_ptr
            if id_jobs:
                jobs[id_jobs, 12] = dev + ids_at + 4 * jobs[id_jobs, 12]
                slot.view[ids_at : ids_at + 4 * nids].view(np.int32)[:] = np.concatenate(ids)
            slot.view[:table].view(np.int64)[:] = jobs.reshape(-1)
            slot.view[flag_at : flag_at + 4].view(np.int32)[0] = 0
            self._memcpy_async(dev, slot.host_ptr, in_bytes, st.native)
            n_max = max(t.row_elems for t in tables)
            threads = self._threads
            grid = (max(1, min(-(-n_max // threads), 4096)), min(len(jobs), _MAX_GRID_Y), 1)
            self._launch(module.function("kvcm_convert_page_tables"), grid, (threads, 1, 1),
                         _u64([dev, len(jobs), dev + flag_at]), st.native, 0)
            self._ring.release(slot, st.native)

    # -- sparse attention ------------------------------------------------------------------

    #: Working sets up to this many entries keep their stamps (v2) or sort their keys (v1)
    #: in shared memory; larger ones work in global memory.
    sparse_shared_limit = SPARSE_SHARED_LIMIT
    #: The resolve kernel: ``"v4"`` (default: v3 with the duplicates found in a hash table
    #: in shared memory), ``"v3"`` (v2's ranking with fewer barriers, the row's state in
    #: shared memory; past its shared memory v3 and v4 run v2), ``"v2"`` (ranks stamps in
    #: windows) or ``"v1"`` (sorts every eviction key); the environment variable
    #: ``KVCM_SPARSE_RESOLVE`` sets it. v4 is the default by the H200 figures of
    #: benchmarks/results/h200-20261204-resolve3 (256 x 2048: 44.6 us median, v3 55.1).
    sparse_resolve_version = "v4"
    #: v2: stamps a window ranks at once (``None``: the widest, 128 bits per thread) and the
    #: windows a row may take before it falls back to the sort (tests make both small).
    sparse_window: int | None = None
    sparse_max_windows = 16
    #: v2 block size (``None``: 1024 while the rows leave SMs idle, else 512).
    sparse_threads: int | None = None

    def _sparse_version(self) -> str:
        v = os.environ.get("KVCM_SPARSE_RESOLVE", self.sparse_resolve_version)
        if v not in ("v1", "v2", "v3", "v4"):
            raise ValueError(f"KVCM_SPARSE_RESOLVE={v!r}: must be 'v1', 'v2', 'v3' or 'v4'")
        return v

    def _sms(self) -> int:
        sms = getattr(self, "_sm_count", None)
        if sms is None:
            sms = self._sm_count = int(self.device_info().get("multiprocessors", 0)) or 1
        return sms

    def _shared_function(self, name: str, shared: int) -> Any:
        """Kernel ``name``, allowed ``shared`` bytes of dynamic shared memory (past 48 KiB
        a kernel must ask for it) and the largest shared-memory carveout."""
        fn = self._kernels().function(name)
        allowed = self._shared_allowed.setdefault(name, 48 << 10)
        if shared > allowed:
            self._allow_shared(fn, shared)
            self._shared_allowed[name] = shared
        return fn

    def _allow_shared(self, function: Any, nbytes: int) -> None:
        """Let ``function`` launch with ``nbytes`` of dynamic shared memory."""
        raise NotImplementedError

    def sparse_resolve(self, job: SparseResolve, stream: Stream | None = None) -> None:
        if job.rows == 0:
            return
        p = keys_width(job.working_set_units)
        if p >= 1 << 24:
            raise ValueError(f"working_set_units={job.working_set_units}: must be < 2**24")
        st = self._stream(stream)
        sel = 0 if job.selected is None else job.selected.ptr
        args = [job.rows, job.num_selected, job.working_set_units, p, job.max_units,
                job.unit_tokens, job.lease_of_row.ptr, job.marks.ptr, job.resident.ptr,
                job.stamp.ptr, job.tick.ptr, job.entry_of.ptr, job.first.ptr, sel,
                job.entry_map.ptr, job.miss_unit.ptr, job.miss_entry.ptr, job.miss_count.ptr,
                job.counters.ptr, job.keys.ptr]
        version = self._sparse_version()
        # 1024 threads while the rows leave SMs idle, else 512 (two blocks an SM)
        threads = self.sparse_threads or (1024 if job.rows <= self._sms() else 512)
        if version in ("v3", "v4") and job.working_set_units <= self.sparse_shared_limit:
            name = sparse_v3_kernel(threads, version)
            shared = sparse_v3_shared_bytes(threads, job.working_set_units, job.num_selected,
                                            version)
            if shared <= SPARSE_V3_MAX_SHARED:
                widest = sparse_v2_window_bits(threads)
                window = max(1, min(self.sparse_window or widest, widest))
                with self._lock:
                    fn = self._shared_function(name, shared)
                    self._launch(fn, (min(job.rows, _MAX_GRID_X), 1, 1), (threads, 1, 1),
                                 _u64([*args, window, self.sparse_max_windows]),
                                 st.native, shared)
                return
        if version != "v1":  # v3/v4 past their shared memory: v2's global-memory path
            stamps = job.working_set_units <= self.sparse_shared_limit
            shared = sparse_v2_shared_bytes(threads, job.working_set_units, p,
                                            job.num_selected, stamps)
            if shared > SPARSE_V2_MAX_SHARED and stamps:
                stamps = False
                shared = sparse_v2_shared_bytes(threads, job.working_set_units, p,
                                                job.num_selected, stamps)
            if shared <= SPARSE_V2_MAX_SHARED:
                widest = sparse_v2_window_bits(threads)
                window = max(1, min(self.sparse_window or widest, widest))
                with self._lock:
                    fn = self._shared_function(SPARSE_V2_KERNEL, shared)
                    self._launch(fn, (min(job.rows, _MAX_GRID_X), 1, 1), (threads, 1, 1),
                                 _u64([*args, int(stamps), window, self.sparse_max_windows]),
                                 st.native, shared)
                return
        shared = p <= self.sparse_shared_limit
        with self._lock:
            fn = self._shared_function("kvcm_sparse_resolve", 8 * p if shared else 0)
            self._launch(fn, (min(job.rows, _MAX_GRID_X), 1, 1), (SPARSE_RESOLVE_THREADS, 1, 1),
                         _u64([*args, int(shared)]), st.native, 8 * p if shared else 0)

    def sparse_copy(self, job: SparseCopy, stream: Stream | None = None) -> None:
        if job.rows == 0 or not job.buffers:
            return
        desc = np.zeros((len(job.buffers), SPARSE_COPY_DESC_WORDS), dtype=np.int64)
        for i, c in enumerate(job.buffers):
            desc[i] = (c.host.buffer.ptr + c.host.offset, c.host.stride,
                       c.cells.buffer.ptr + c.cells.offset, c.cells.stride, c.unit_bytes,
                       c.units_per_page, c.lease_cells, 0)
        st = self._stream(stream)
        module = self._kernels()
        opt = [(b.ptr if b is not None else 0) for b in
               (job.miss_unit, job.miss_entry, job.miss_count, job.entry_of, job.ranges)]
        with self._lock:
            slot = self._ring.acquire(desc.nbytes, 0)
            slot.view[: desc.nbytes].view(np.int64)[:] = desc.reshape(-1)
            dev = slot.dev_ptr
            self._memcpy_async(dev, slot.host_ptr, desc.nbytes, st.native)
            # About 8192 blocks over rows and their units (a block copies one unit at a
            # time), so that many reads of mapped host memory are in flight.
            per_row = max(1, min(1024, 8192 // (job.rows * len(job.buffers))))
            grid = (per_row, min(job.rows, _MAX_GRID_Y), min(len(job.buffers), _MAX_GRID_Y))
            self._launch(module.function("kvcm_sparse_copy"), grid, (self._threads, 1, 1),
                         _u64([dev, len(job.buffers), job.rows, job.num_selected,
                               job.max_units, job.row_elems, int(job.flush),
                               job.page_table.ptr, job.lease_of_row.ptr, *opt]),
                         st.native, 0)
            self._ring.release(slot, st.native)

    # -- fingerprint engine ----------------------------------------------------------------

    def _live_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if self._ranges is None:
                spans = sorted(self._live.values())
                starts = np.array([a for a, _ in spans], dtype=np.int64)
                ends = np.array([b for _, b in spans], dtype=np.int64)
                self._ranges = (starts, ends)
            return self._ranges

    def _check_addresses(self, addresses: np.ndarray, nbytes: np.ndarray) -> None:
        """Every ``[address, address + nbytes)`` must lie in one live buffer: a bad address
        would fault the device, so it is refused here, like the numpy backend does."""
        starts, ends = self._live_ranges()
        where = np.searchsorted(starts, addresses, side="right") - 1
        inside = where >= 0
        safe = np.where(inside, where, 0)
        if len(starts):
            inside &= addresses + nbytes <= ends[safe]
        else:
            inside[:] = False
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise ValueError(
                f"address {int(addresses[i]):#x} (+{int(nbytes[i])} bytes) is not inside "
                "memory of this backend"
            )

    def _fingerprint_table(self, pages: FingerprintPages) -> tuple[np.ndarray, np.ndarray, int]:
        n = len(pages)
        p = np.asarray(pages.page_bytes, dtype=np.int64)
        r = np.asarray(pages.record_slots, dtype=np.int64)
        tokens = np.ascontiguousarray(pages.token_ids, dtype=np.uint32).reshape(n, -1)
        if (p < 0).any():
            raise ValueError("page_bytes must be >= 0")
        if (r < 1).any():
            raise ValueError("record_slots must be >= 1")
        if n and int(r.max()) > tokens.shape[1]:
            raise ValueError(
                f"token_ids has {tokens.shape[1]} columns; record_slots needs {int(r.max())}"
            )
        addresses = np.asarray(pages.addresses, dtype=np.int64)
        self._check_addresses(addresses, p)
        cb = np.clip(np.asarray(pages.begin, dtype=np.int64), 0, r)
        ce = np.clip(np.asarray(pages.end, dtype=np.int64), 0, r)
        lo = np.where(cb < ce, cb * p // r, 0)
        hi = np.where(cb < ce, ce * p // r, 0)
        tags = np.asarray(pages.tags, dtype=np.uint32).reshape(n, 2).astype(np.uint64)
        table = np.empty((n, FP_DESC_WORDS), dtype=np.int64)
        table[:, 0] = addresses
        table[:, 1] = p
        table[:, 2] = r
        table[:, 3] = lo
        table[:, 4] = hi
        table[:, 5] = np.asarray(pages.positions, dtype=np.int64)
        table[:, 6] = (tags[:, 0] | (tags[:, 1] << np.uint64(32))).view(np.int64)
        table[:, 7] = np.arange(n, dtype=np.int64) * tokens.shape[1]
        units = int(((hi - lo) // 16 + 2).max()) if n else 0
        return table, tokens, units

    def _fingerprint_launch(
        self, pages: FingerprintPages, stream: Stream | None, check: bool
    ) -> np.ndarray | None:
        n = len(pages)
        if n == 0:
            return np.ones(0, dtype=bool) if check else None
        table, tokens, units = self._fingerprint_table(pages)
        st = self._stream(stream)
        module = self._kernels()
        table_bytes = table.nbytes
        in_bytes = _align(table_bytes) + tokens.nbytes
        out_bytes = _align(4 * n) if check else 0
        with self._lock:
            slot = self._ring.acquire(in_bytes, out_bytes)
            view = slot.view
            view[:table_bytes].view(np.int64)[:] = table.reshape(-1)
            tok_at = _align(table_bytes)
            view[tok_at : tok_at + tokens.nbytes].view(np.uint32)[:] = tokens.reshape(-1)
            dev = slot.dev_ptr
            self._memcpy_async(dev, slot.host_ptr, in_bytes, st.native)
            threads = self._threads
            grid = (max(1, min(-(-units // threads), 4096)), min(n, _MAX_GRID_Y), 1)
            if check:
                bad_at = slot.in_cap
                view[bad_at : bad_at + 4 * n].view(np.int32)[:] = 0
                name = "kvcm_fingerprint_check"
                args = [dev, n, dev + tok_at, slot.host_ptr + bad_at]
            else:
                name = "kvcm_fingerprint_write"
                args = [dev, n, dev + tok_at]
            self._launch(module.function(name), grid, (threads, 1, 1), _u64(args), st.native, 0)
            self._ring.release(slot, st.native)
            if not check:
                return None
            slot.done.synchronize()
            slot.pending = False
            return view[bad_at : bad_at + 4 * n].view(np.int32) == 0

    def fingerprint_write(self, pages: FingerprintPages, stream: Stream | None = None) -> None:
        self._fingerprint_launch(pages, stream, check=False)

    def fingerprint_check(
        self, pages: FingerprintPages, stream: Stream | None = None
    ) -> np.ndarray:
        ok = self._fingerprint_launch(pages, stream, check=True)
        assert ok is not None
        return ok


def _copy_descriptors(tasks: Sequence[CopyTask]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Addresses and sizes for the copy-engine path, one per run of adjacent pages.

    Consecutive pairs ``(d, s)``, ``(d + 1, s + 1)`` whose pages are back to back on both
    sides (stride equal to the page size) become one copy, in the order given.
    """
    dsts, srcs, sizes = [], [], []
    for t in tasks:
        p = t.pairs
        if len(p) > 1 and t.dst.stride == t.page_bytes and t.src.stride == t.page_bytes:
            steps = p[1:] - p[:-1]
            if (steps == 1).all():  # one run (the usual batch of a migration)
                length = np.array([len(p)], dtype=np.int64)
                p = p[:1]
            else:
                breaks = np.flatnonzero((steps != 1).any(axis=1)) + 1
                starts = np.concatenate(([0], breaks))
                length = np.diff(np.append(starts, len(p))).astype(np.int64)
                p = p[starts]
        else:
            length = np.ones(len(p), dtype=np.int64)
        d = p[:, 0].astype(np.int64)
        s = p[:, 1].astype(np.int64)
        dsts.append(t.dst.buffer.ptr + t.dst.offset + d * t.dst.stride)
        srcs.append(t.src.buffer.ptr + t.src.offset + s * t.src.stride)
        sizes.append(length * t.page_bytes)
    if len(tasks) == 1:
        return dsts[0].astype(np.uint64), srcs[0].astype(np.uint64), sizes[0].astype(np.uint64)
    return (
        np.concatenate(dsts).astype(np.uint64),
        np.concatenate(srcs).astype(np.uint64),
        np.concatenate(sizes).astype(np.uint64),
    )
