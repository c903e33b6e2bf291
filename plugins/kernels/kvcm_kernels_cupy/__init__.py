"""The ``cupy`` kernel backend: kvcm's kernels on a CUDA device through CuPy.

Memory comes from the CUDA runtime directly (``cudaMalloc``; ``cudaHostAlloc`` pinned,
portable and mapped), not from CuPy's pools, so buffers are returned to the device when
freed. Kernels are the shared CUDA C source of :mod:`kvcm_kernels_cuda_common`, compiled by
CuPy's ``RawModule`` (NVRTC, for the device's architecture) and cached by CuPy on disk.
``copy_pages`` uses the SM gather kernel, or with ``copy_path="ce"`` the copy engines: one
``cudaMemcpyAsync`` per run of adjacent pages (CuPy exposes no batched memcpy).

CuPy is imported only when the backend is checked or built: without CuPy or without a GPU
the plugin still registers and reports why it is unavailable.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from kvcm_kernels_cuda_common import CudaEvent, CudaKernelBackend, CudaStream

from kvcm_core import hookimpl
from kvcm_core.backend import Buffer, MemoryKind
from kvcm_core.plugins import cached_availability
from kvcm_core.records import Availability, KernelBackendCapabilities, KernelBackendSpec

__all__ = ["CAPABILITIES", "CupyBackend", "availability"]

CAPABILITIES = KernelBackendCapabilities(
    has_device=True, host_mapped=True, copy_engine=True, compiles_sources=True
)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addresses


@cached_availability
def availability() -> Availability:
    """Available when CuPy imports, sees a CUDA device and loads NVRTC (checked once)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA installation under CuPy
        return Availability(
            False,
            f"cupy is not importable ({type(exc).__name__}: {exc}); "
            "install kvcm[cupy] on a machine with a CUDA GPU",
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return Availability(False, f"no usable CUDA device ({type(exc).__name__}: {exc})")
    if count < 1:
        return Availability(False, "no CUDA device")
    try:
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        return Availability(False, f"NVRTC is not loadable ({type(exc).__name__}: {exc})")
    return Availability(True)


class CupyBackend(CudaKernelBackend):
    """kvcm's kernels through CuPy (see the module docstring).

    Args:
        options: ``device``, ``copy_path`` (``"auto"``, ``"sm"``, ``"ce"``),
            ``block_threads``; see :func:`kvcm_kernels_cuda_common.parse_options`.

    Raises:
        RuntimeError: the backend is unavailable here (the reason is in the message).
    """

    name = "cupy"
    capabilities = CAPABILITIES
    #: Measured on an H200 with kvcm bench migrate (issue 16, 2 MiB pages): the gather
    #: kernel moves one direction at 0.92-0.94 of the link, as the copy engine does, but
    #: two gather kernels (an eviction and an onboard at once) take turns on the SMs: a
    #: swap reached 0.51x of the duplex limit, against 0.80-0.82x on the copy engines.
    #: Between host and device, pages from 256 KiB go to the copy engine (one
    #: cudaMemcpyAsync per run of adjacent pages: a few microseconds of host time each).
    auto_ce_min_page_bytes = {
        (MemoryKind.HOST, MemoryKind.DEVICE): 256 << 10,
        (MemoryKind.DEVICE, MemoryKind.HOST): 256 << 10,
        (MemoryKind.DEVICE, MemoryKind.DEVICE): None,
        (MemoryKind.HOST, MemoryKind.HOST): None,
    }

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        avail = availability()
        if not avail:
            raise RuntimeError(f"kernel backend 'cupy' is unavailable: {avail.reason}")
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self._tls = threading.local()
        self._stream_kwarg: bool | None = None
        super().__init__(options)

    # -- runtime primitives ----------------------------------------------------------------

    def _enter(self) -> None:
        """Make this backend's device current on the calling thread (once per thread)."""
        if not getattr(self._tls, "entered", False):
            self._rt.setDevice(self.device_id)
            self._tls.entered = True

    def _init_runtime(self) -> None:
        count = self._rt.getDeviceCount()
        if self.device_id >= count:
            raise ValueError(f"device={self.device_id}: only {count} CUDA device(s) here")
        self._enter()

    def _malloc(self, nbytes: int) -> tuple[int, Any]:
        self._enter()
        ptr = int(self._rt.malloc(nbytes))
        return ptr, ptr

    def _malloc_host(self, nbytes: int) -> tuple[int, int, Any]:
        self._enter()
        rt = self._rt
        host = int(rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped))
        dev = int(rt.pointerGetAttributes(host).devicePointer)
        return host, dev, host

    def _free(self, kind: str, handle: Any) -> None:
        if kind == MemoryKind.DEVICE:
            self._rt.free(handle)
        else:
            self._rt.freeHost(handle)

    def _memcpy_sync(self, dst: int, src: int, nbytes: int, dst_host: bool, src_host: bool) -> None:
        self._enter()
        self._rt.memcpy(dst, src, nbytes, _MEMCPY_DEFAULT)

    def _memcpy_async(self, dst: int, src: int, nbytes: int, stream_native: Any) -> None:
        self._rt.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream_native.ptr)

    def _memcpy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_native: Any
    ) -> None:
        memcpy, handle = self._rt.memcpyAsync, stream_native.ptr
        for d, s, z in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            memcpy(d, s, z, _MEMCPY_DEFAULT, handle)

    def _device_synchronize(self) -> None:
        self._enter()
        self._rt.deviceSynchronize()

    def _new_stream(self) -> CudaStream:
        self._enter()
        native = self._cp.cuda.Stream(non_blocking=False)
        return CudaStream(self, native, int(native.ptr), owned=False)

    def _stream_synchronize(self, native: Any) -> None:
        native.synchronize()

    def _stream_is_capturing(self, native: Any) -> bool:
        return bool(native.is_capturing())

    def _stream_wait_event(self, native: Any, event_native: Any) -> None:
        native.wait_event(event_native)

    def _stream_destroy(self, native: Any) -> None:
        pass  # CuPy's Stream destroys itself

    def _new_event(self, timing: bool = True) -> CudaEvent:
        self._enter()
        return CudaEvent(self, self._cp.cuda.Event(block=False, disable_timing=not timing))

    def _event_record(self, native: Any, stream_native: Any) -> None:
        native.record(stream_native)

    def _event_query(self, native: Any) -> bool:
        return bool(native.done)

    def _event_synchronize(self, native: Any) -> None:
        native.synchronize()

    def _event_elapsed_ms(self, start_native: Any, end_native: Any) -> float:
        return float(self._cp.cuda.get_elapsed_time(start_native, end_native))

    def _event_destroy(self, native: Any) -> None:
        pass  # CuPy's Event destroys itself

    def _compile(self, source: str, options: tuple[str, ...]) -> Any:
        self._enter()
        # CuPy picks -arch for the current device and caches the cubin on disk.
        return self._cp.RawModule(code=source, options=("-std=c++17", *options))

    def _get_function(self, module_native: Any, name: str) -> Any:
        self._enter()
        return module_native.get_function(name)

    def _launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[np.generic | np.ndarray],
        stream_native: Any,
        shared_bytes: int,
    ) -> None:
        args_t = tuple(args)
        if self._stream_kwarg is not False:
            # CuPy's low-level Function takes the stream directly: no current-stream switch.
            try:
                function.kernel(grid, block, args_t, shared_mem=shared_bytes, stream=stream_native)
                self._stream_kwarg = True
                return
            except TypeError:
                if self._stream_kwarg:
                    raise
                self._stream_kwarg = False
        with stream_native:
            function(grid, block, args_t, shared_mem=shared_bytes)

    def _allow_shared(self, function: Any, nbytes: int) -> None:
        self._enter()
        function.max_dynamic_shared_size_bytes = nbytes  # a RawKernel's attributes
        function.preferred_shared_memory_carveout = 100

    def device_info(self) -> dict[str, Any]:
        self._enter()
        rt = self._rt
        props = rt.getDeviceProperties(self.device_id)
        name = props["name"]
        return {
            "device": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "multiprocessors": int(props["multiProcessorCount"]),
            "driver_version": int(rt.driverGetVersion()),
            "runtime_version": int(rt.runtimeGetVersion()),
            "nvrtc_version": ".".join(str(v) for v in self._cp.cuda.nvrtc.getVersion()),
            "packages": {"cupy": self._cp.__version__},
        }

    # -- views -----------------------------------------------------------------------------

    def as_array(self, buffer: Buffer) -> Any:
        """A CuPy ``uint8`` array over the buffer's memory (zero-copy; DLPack and
        ``__cuda_array_interface__`` come with it). Host buffers are viewed through their
        device-mapped address."""
        cp = self._cp
        mem = cp.cuda.UnownedMemory(buffer.ptr, max(buffer.nbytes, 1), buffer, self.device_id)
        return cp.ndarray((buffer.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))


@hookimpl
def kvcm_kernel_backends():
    yield KernelBackendSpec(
        name="cupy",
        factory=CupyBackend,
        description=(
            "CUDA through CuPy: SM gather kernel or copy engine for page copies, NVRTC-compiled "
            "kernels cached on disk"
        ),
        capabilities=CAPABILITIES,
        availability=availability,
        priority=10,
    )
