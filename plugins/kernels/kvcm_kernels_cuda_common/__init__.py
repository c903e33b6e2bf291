"""Shared parts of kvcm's CUDA kernel backends (``cupy`` and ``cuda``).

Not a plugin itself (it registers nothing): the CUDA C source of the kernels
(:mod:`.source`), the host side of every kernel over a small set of runtime primitives
(:mod:`.base`), and zero-copy DLPack export (:mod:`.dlpack`). Importing it imports neither
CuPy nor cuda-python.
"""

from __future__ import annotations

from kvcm_kernels_cuda_common.base import (
    AUTO_CE_MIN_PAGE_BYTES,
    COPY_PATHS,
    CompiledModule,
    CudaBuffer,
    CudaEvent,
    CudaKernelBackend,
    CudaStream,
    parse_options,
)
from kvcm_kernels_cuda_common.dlpack import MemoryView

__all__ = [
    "AUTO_CE_MIN_PAGE_BYTES",
    "COPY_PATHS",
    "CompiledModule",
    "CudaBuffer",
    "CudaEvent",
    "CudaKernelBackend",
    "CudaStream",
    "MemoryView",
    "parse_options",
]
