"""The ``cuda`` kernel backend: kvcm's kernels on cuda-python's driver API and NVRTC.

Runs in the device's primary context (shared with the CUDA runtime, so CuPy or PyTorch in
the same process see the same memory), retained for the life of the process: streams and
events may outlive :meth:`close` in Python's garbage, and a released context would leave
them dangling. Memory: ``cuMemAlloc``; ``cuMemHostAlloc`` with
``CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`` and ``cuMemHostGetDevicePointer``.
Kernels: the shared CUDA C source of :mod:`kvcm_kernels_cuda_common`, compiled by NVRTC for
the device's architecture (``-arch=sm_XY``) and cached on disk per architecture (see
:func:`cache_dir`). ``copy_pages`` uses the SM gather kernel or, with ``copy_path="ce"``,
one ``cuMemcpyBatchAsync`` over runs of adjacent pages. The batch is passed as three NumPy
arrays through the driver's entry point (``cuGetProcAddress``, ABI of CUDA 12.8), which costs
no Python object per page; option ``memcpy_batch="bindings"`` uses cuda-python's own
wrapper (lists of ``CUdeviceptr``) instead.

cuda-python is imported only when the backend is checked or built: without it or without a
GPU the plugin still registers and reports why it is unavailable.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
from kvcm_kernels_cuda_common import CudaEvent, CudaKernelBackend, CudaStream, MemoryView
from kvcm_kernels_cuda_common.dlpack import DLDEVICE_CUDA, DLDEVICE_CUDA_HOST

from kvcm_core import hookimpl
from kvcm_core.backend import Buffer, MemoryKind
from kvcm_core.plugins import cached_availability
from kvcm_core.records import Availability, KernelBackendCapabilities, KernelBackendSpec

__all__ = ["CAPABILITIES", "CudaDriverBackend", "CudaError", "availability", "cache_dir"]

CAPABILITIES = KernelBackendCapabilities(
    has_device=True, host_mapped=True, copy_engine=True, compiles_sources=True
)
CACHE_ENV = "KVCM_KERNEL_CACHE"

_MEMHOSTALLOC_PORTABLE = 0x01
_MEMHOSTALLOC_DEVICEMAP = 0x02
_EVENT_DISABLE_TIMING = 0x02
_BATCH_ABI_VERSION = 12080  # cuMemcpyBatchAsync as introduced in CUDA 12.8 (with failIdx)
_SRC_ACCESS_ORDER_STREAM = 1


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed."""


def _ok(result: Any, what: str) -> Any:
    """Unpack a cuda-python result tuple ``(status, *values)``, raising on failure."""
    if not isinstance(result, tuple):
        result = (result,)
    status, values = result[0], result[1:]
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise CudaError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$KVCM_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/kvcm/kernels``, else ``~/.cache/kvcm/kernels``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcm" / "kernels"


@cached_availability
def availability() -> Availability:
    """Available when cuda-python's driver bindings import, a device answers and NVRTC
    loads (checked once)."""
    try:
        from cuda.bindings import driver, nvrtc
    except Exception as exc:
        return Availability(
            False,
            f"cuda-python (cuda.bindings) is not importable ({type(exc).__name__}: "
            f"{exc}); install kvcm[cuda] on a machine with a CUDA GPU",
        )
    try:
        _ok(driver.cuInit(0), "cuInit")
        count = _ok(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    except Exception as exc:
        return Availability(False, f"no usable CUDA driver or device ({type(exc).__name__}: {exc})")
    if count < 1:
        return Availability(False, "no CUDA device")
    try:
        _ok(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except Exception as exc:
        return Availability(False, f"NVRTC is not loadable ({type(exc).__name__}: {exc})")
    return Availability(True)


_BatchFn = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)

# The calls a migration makes per copy batch, through the driver's entry points as plain
# C calls (cuda-python's wrappers cost a few microseconds more each: argument objects, a
# result tuple and an enum per call). Handles are passed as integers.
_FAST_CALLS = {
    "cuMemcpyAsync": (4000, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                             ctypes.c_size_t, ctypes.c_void_p)),
    "cuEventRecord": (2000, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)),
    "cuStreamWaitEvent": (3020, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p,
                                                 ctypes.c_void_p, ctypes.c_uint)),
    "cuEventQuery": (2000, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)),
}
_NOT_READY = 600  # CUDA_ERROR_NOT_READY


class CudaDriverBackend(CudaKernelBackend):
    """kvcm's kernels on the CUDA driver API (see the module docstring).

    Args:
        options: ``device``, ``copy_path`` (``"auto"``, ``"sm"``, ``"ce"``),
            ``block_threads``, ``memcpy_batch`` (``"auto"``, ``"entry_point"``,
            ``"bindings"``).

    Raises:
        RuntimeError: the backend is unavailable here (the reason is in the message).
    """

    name = "cuda"
    capabilities = CAPABILITIES
    extra_options = {"memcpy_batch": "auto"}
    #: Measured on an H200 (benchmarks/README.md): between host and device, one
    #: ``cuMemcpyBatchAsync`` reached 0.97-1.0 of a contiguous memcpy from 256 KiB pages on,
    #: at every batch size, against 0.92-0.95 for the gather kernel, for about 0.7 us of host
    #: time per page. Below 256 KiB, and device to device, the gather kernel wins.
    auto_ce_min_page_bytes = {
        (MemoryKind.HOST, MemoryKind.DEVICE): 256 << 10,
        (MemoryKind.DEVICE, MemoryKind.HOST): 256 << 10,
        (MemoryKind.DEVICE, MemoryKind.DEVICE): None,
        (MemoryKind.HOST, MemoryKind.HOST): None,
    }

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        avail = availability()
        if not avail:
            raise RuntimeError(f"kernel backend 'cuda' is unavailable: {avail.reason}")
        from cuda.bindings import driver, nvrtc

        self._drv = driver
        self._nvrtc = nvrtc
        self._tls = threading.local()
        self._ctx: Any = None
        super().__init__(options)
        mode = self.options["memcpy_batch"]
        if mode not in ("auto", "entry_point", "bindings"):
            raise ValueError(f"memcpy_batch={mode!r}: must be 'auto', 'entry_point' or 'bindings'")
        self._fast = self._fast_entry_points()
        self._batch_fn = None if mode == "bindings" else self._batch_entry_point()
        if mode == "entry_point" and self._batch_fn is None:
            raise CudaError("cuMemcpyBatchAsync is not offered by this driver")
        self.memcpy_batch = "entry_point" if self._batch_fn is not None else "bindings"
        # The attribute block, index and failure slot of every batch (CUDA 12.8 layout,
        # zero-padded: only the source access order is set).
        self._batch_attrs = np.zeros(8, dtype=np.uint64)
        self._batch_attrs.view(np.int32)[0] = _SRC_ACCESS_ORDER_STREAM
        self._batch_idx = np.zeros(1, dtype=np.uint64)
        self._batch_fail = np.zeros(1, dtype=np.uint64)

    # -- runtime primitives ----------------------------------------------------------------

    def _enter(self) -> None:
        """Make the device's primary context current on the calling thread (once)."""
        if not getattr(self._tls, "entered", False):
            _ok(self._drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._tls.entered = True

    def _init_runtime(self) -> None:
        d = self._drv
        _ok(d.cuInit(0), "cuInit")
        count = _ok(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if self.device_id >= count:
            raise ValueError(f"device={self.device_id}: only {count} CUDA device(s) here")
        self._dev = _ok(d.cuDeviceGet(self.device_id), "cuDeviceGet")
        self._ctx = _ok(d.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._enter()
        attr = d.CUdevice_attribute
        self._cc = (
            _ok(
                d.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev
                ),
                "cuDeviceGetAttribute",
            ),
            _ok(
                d.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev
                ),
                "cuDeviceGetAttribute",
            ),
        )

    def _entry_point(self, name: str, version: int) -> int | None:
        d = self._drv
        try:
            flags = d.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
            result = d.cuGetProcAddress(name.encode(), version, flags)
        except Exception:
            return None
        if int(result[0]) != 0 or not result[1]:
            return None
        return int(result[1])

    def _fast_entry_points(self) -> dict[str, Any]:
        """The per-batch calls of :data:`_FAST_CALLS` as ctypes functions (empty when the
        driver does not offer one of them: cuda-python's wrappers are used instead)."""
        out = {}
        for name, (version, proto) in _FAST_CALLS.items():
            address = self._entry_point(name, version)
            if address is None:
                return {}
            out[name] = proto(address)
        return out

    def _fail(self, status: int, what: str) -> None:
        raise CudaError(f"{what} failed: {self._drv.CUresult(status).name}")

    def _batch_entry_point(self) -> Any:
        address = self._entry_point("cuMemcpyBatchAsync", _BATCH_ABI_VERSION)
        return None if address is None else _BatchFn(address)

    def _malloc(self, nbytes: int) -> tuple[int, Any]:
        self._enter()
        ptr = _ok(self._drv.cuMemAlloc(nbytes), "cuMemAlloc")
        return int(ptr), ptr

    def _malloc_host(self, nbytes: int) -> tuple[int, int, Any]:
        self._enter()
        d = self._drv
        host = _ok(
            d.cuMemHostAlloc(nbytes, _MEMHOSTALLOC_PORTABLE | _MEMHOSTALLOC_DEVICEMAP),
            "cuMemHostAlloc",
        )
        dev = _ok(d.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")
        return int(host), int(dev), host

    def _free(self, kind: str, handle: Any) -> None:
        self._enter()
        if kind == MemoryKind.DEVICE:
            _ok(self._drv.cuMemFree(handle), "cuMemFree")
        else:
            _ok(self._drv.cuMemFreeHost(handle), "cuMemFreeHost")

    def _memcpy_sync(self, dst: int, src: int, nbytes: int, dst_host: bool, src_host: bool) -> None:
        self._enter()
        d = self._drv
        if dst_host:
            _ok(d.cuMemcpyDtoH(dst, src, nbytes), "cuMemcpyDtoH")
        elif src_host:
            _ok(d.cuMemcpyHtoD(dst, src, nbytes), "cuMemcpyHtoD")
        else:
            _ok(d.cuMemcpy(dst, src, nbytes), "cuMemcpy")

    def _memcpy_async(self, dst: int, src: int, nbytes: int, stream_native: Any) -> None:
        fast = self._fast.get("cuMemcpyAsync")
        if fast is None:
            _ok(self._drv.cuMemcpyAsync(dst, src, nbytes, stream_native), "cuMemcpyAsync")
            return
        status = fast(dst, src, nbytes, int(stream_native))
        if status:
            self._fail(status, "cuMemcpyAsync")

    def _memcpy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_native: Any
    ) -> None:
        n = len(dsts)
        if self._batch_fn is not None:
            dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
            srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
            sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
            status = self._batch_fn(
                dsts.ctypes.data,
                srcs.ctypes.data,
                sizes.ctypes.data,
                n,
                self._batch_attrs.ctypes.data,
                self._batch_idx.ctypes.data,
                1,
                self._batch_fail.ctypes.data,
                int(stream_native),
            )
            if status != 0:
                name = self._drv.CUresult(status).name
                raise CudaError(
                    f"cuMemcpyBatchAsync failed: {name} (copy {int(self._batch_fail[0])})"
                )
            return
        d = self._drv
        attrs = d.CUmemcpyAttributes()
        attrs.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        _ok(
            d.cuMemcpyBatchAsync(
                [d.CUdeviceptr(x) for x in dsts.tolist()],
                [d.CUdeviceptr(x) for x in srcs.tolist()],
                sizes.tolist(),
                n,
                [attrs],
                [0],
                1,
                stream_native,
            ),
            "cuMemcpyBatchAsync",
        )

    def _device_synchronize(self) -> None:
        self._enter()
        _ok(self._drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def _new_stream(self) -> CudaStream:
        self._enter()
        native = _ok(self._drv.cuStreamCreate(0), "cuStreamCreate")
        return CudaStream(self, native, int(native), owned=True)

    def _stream_synchronize(self, native: Any) -> None:
        _ok(self._drv.cuStreamSynchronize(native), "cuStreamSynchronize")

    def _stream_wait_event(self, native: Any, event_native: Any) -> None:
        fast = self._fast.get("cuStreamWaitEvent")
        if fast is None:
            _ok(self._drv.cuStreamWaitEvent(native, event_native, 0), "cuStreamWaitEvent")
            return
        status = fast(int(native), int(event_native), 0)
        if status:
            self._fail(status, "cuStreamWaitEvent")

    def _stream_is_capturing(self, native: Any) -> bool:
        status = _ok(self._drv.cuStreamIsCapturing(native), "cuStreamIsCapturing")
        return status != self._drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def _stream_destroy(self, native: Any) -> None:
        self._drv.cuStreamDestroy(native)

    def _new_event(self, timing: bool = True) -> CudaEvent:
        self._enter()
        flags = 0 if timing else _EVENT_DISABLE_TIMING
        return CudaEvent(self, _ok(self._drv.cuEventCreate(flags), "cuEventCreate"))

    def _event_record(self, native: Any, stream_native: Any) -> None:
        fast = self._fast.get("cuEventRecord")
        if fast is None:
            _ok(self._drv.cuEventRecord(native, stream_native), "cuEventRecord")
            return
        status = fast(int(native), int(stream_native))
        if status:
            self._fail(status, "cuEventRecord")

    def _event_query(self, native: Any) -> bool:
        fast = self._fast.get("cuEventQuery")
        if fast is not None:
            status = fast(int(native))
            if status == _NOT_READY:
                return False
            if status:
                self._fail(status, "cuEventQuery")
            return True
        status = self._drv.cuEventQuery(native)[0]
        if status == self._drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _ok((status,), "cuEventQuery")
        return True

    def _event_synchronize(self, native: Any) -> None:
        _ok(self._drv.cuEventSynchronize(native), "cuEventSynchronize")

    def _event_elapsed_ms(self, start_native: Any, end_native: Any) -> float:
        return float(
            _ok(self._drv.cuEventElapsedTime(start_native, end_native), "cuEventElapsedTime")
        )

    def _event_destroy(self, native: Any) -> None:
        self._drv.cuEventDestroy(native)

    # -- compilation -----------------------------------------------------------------------

    def _nvrtc_compile(self, source: str, opts: tuple[str, ...]) -> bytes:
        nv = self._nvrtc
        prog = _ok(
            nv.nvrtcCreateProgram(source.encode(), b"kvcm.cu", 0, [], []), "nvrtcCreateProgram"
        )
        try:
            encoded = [o.encode() for o in opts]
            status = nv.nvrtcCompileProgram(prog, len(encoded), encoded)[0]
            if int(status) != 0:
                size = _ok(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
                log = b" " * size
                nv.nvrtcGetProgramLog(prog, log)
                raise CudaError(
                    f"NVRTC failed ({getattr(status, 'name', status)}) with options "
                    f"{' '.join(opts)}:\n{log.decode(errors='replace').rstrip(chr(0))}"
                )
            size = _ok(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * size
            _ok(nv.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
            return image
        finally:
            nv.nvrtcDestroyProgram(prog)

    def _compile(self, source: str, options: tuple[str, ...]) -> Any:
        self._enter()
        arch = f"sm_{self._cc[0]}{self._cc[1]}"
        opts = ("-std=c++17", f"-arch={arch}", *options)
        version = _ok(self._nvrtc.nvrtcVersion(), "nvrtcVersion")
        key = hashlib.sha256("\0".join([source, *opts, repr(version)]).encode()).hexdigest()[:32]
        path = cache_dir() / f"{key}.{arch}.cubin"
        try:
            image = path.read_bytes()
        except OSError:
            image = self._nvrtc_compile(source, opts)
            _store(path, image)
        data = np.frombuffer(image, dtype=np.uint8).copy()
        return _ok(self._drv.cuModuleLoadData(data.ctypes.data), "cuModuleLoadData")

    def _get_function(self, module_native: Any, name: str) -> Any:
        self._enter()
        return _ok(
            self._drv.cuModuleGetFunction(module_native, name.encode()), "cuModuleGetFunction"
        )

    def _allow_shared(self, function: Any, nbytes: int) -> None:
        self._enter()
        attr = self._drv.CUfunction_attribute
        _ok(self._drv.cuFuncSetAttribute(
            function, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
            "cuFuncSetAttribute")
        _ok(self._drv.cuFuncSetAttribute(
            function, attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
            "cuFuncSetAttribute")

    def _launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[np.generic | np.ndarray],
        stream_native: Any,
        shared_bytes: int,
    ) -> None:
        if all(type(a) is np.uint64 for a in args):
            # 64-bit arguments (all of kvcm's own kernels): a per-thread value array and a
            # constant array of pointers into it, so a launch allocates nothing.
            values, pointers = self._arg_arrays(len(args))
            values[:] = args
            keep: Any = None
        else:
            keep = [np.array(a) for a in args]
            pointers = np.array([h.ctypes.data for h in keep], dtype=np.uint64)
        _ok(
            self._drv.cuLaunchKernel(
                function,
                *grid,
                *block,
                shared_bytes,
                stream_native,
                int(pointers.ctypes.data) if len(args) else 0,
                0,
            ),
            "cuLaunchKernel",
        )
        del keep  # the driver copied the arguments at launch

    def _arg_arrays(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        cache = getattr(self._tls, "args", None)
        if cache is None:
            cache = self._tls.args = {}
        pair = cache.get(count)
        if pair is None:
            values = np.zeros(max(count, 1), dtype=np.uint64)
            pointers = np.arange(max(count, 1), dtype=np.uint64) * 8 + values.ctypes.data
            pair = cache[count] = (values, pointers)
        return pair

    def device_info(self) -> dict[str, Any]:
        self._enter()
        d = self._drv
        raw = _ok(d.cuDeviceGetName(256, self._dev), "cuDeviceGetName")
        sms = _ok(
            d.cuDeviceGetAttribute(
                d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._dev
            ),
            "cuDeviceGetAttribute",
        )
        packages = {}
        for dist in ("cuda-bindings", "cuda-python"):
            try:
                packages[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return {
            "device": raw.split(b"\0", 1)[0].decode(),
            "compute_capability": f"{self._cc[0]}.{self._cc[1]}",
            "multiprocessors": int(sms),
            "driver_version": int(_ok(d.cuDriverGetVersion(), "cuDriverGetVersion")),
            "nvrtc_version": ".".join(str(v) for v in _ok(self._nvrtc.nvrtcVersion(), "nvrtc")),
            "memcpy_batch": self.memcpy_batch,
            "packages": packages,
        }

    # -- views -----------------------------------------------------------------------------

    def as_array(self, buffer: Buffer) -> MemoryView:
        """A zero-copy ``uint8`` view with ``__cuda_array_interface__`` and DLPack (device
        type CUDA for device memory, CUDA-host for pinned memory). Exporting it waits for
        the backend's queued work, so a consumer on another stream sees finished data."""
        device_type = DLDEVICE_CUDA if buffer.kind == MemoryKind.DEVICE else DLDEVICE_CUDA_HOST
        return MemoryView(
            buffer.ptr,
            buffer.nbytes,
            device_type,
            self.device_id if device_type == DLDEVICE_CUDA else 0,
            owner=buffer,
            stream=self._default.handle,
            synchronize=self._device_synchronize,
        )


def _store(path: Path, image: bytes) -> None:
    """Write a compiled module atomically; a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(image)
        os.replace(tmp, path)
    except OSError:
        pass


@hookimpl
def kvcm_kernel_backends():
    yield KernelBackendSpec(
        name="cuda",
        factory=CudaDriverBackend,
        description=(
            "CUDA driver API through cuda-python: SM gather kernel or cuMemcpyBatchAsync for "
            "page copies, NVRTC kernels cached on disk per architecture"
        ),
        capabilities=CAPABILITIES,
        availability=availability,
        priority=20,
    )
