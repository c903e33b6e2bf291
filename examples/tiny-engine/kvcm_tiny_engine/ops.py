"""The few array operations the model needs, on NumPy (CPU) or PyTorch (any device).

The model in :mod:`kvcm_tiny_engine.model` is written once against this interface, so the
CPU run and the CUDA run compute the same arithmetic; only the array library changes.
:meth:`Ops.page_view` is where kvcm's memory enters the model: a zero-copy view of one
buffer's pages (``[slots, tokens_per_block, kv_heads, head_dim]`` float32) over the pool
kvcm allocated, through the kernel backend's ``as_array`` (a NumPy array on the ``numpy``
backend; a CUDA array exported through DLPack on ``cupy`` and ``cuda``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_core import ConfigError, PageRegion

__all__ = ["NumpyOps", "Ops", "TorchOps"]

F32 = 4  # bytes of a float32


def _check_region(region: PageRegion, page_shape: tuple[int, ...]) -> int:
    """Slots in ``region`` for pages of ``page_shape`` float32; refuses misaligned pages."""
    page_bytes = int(np.prod(page_shape)) * F32
    for field, value in (("offset", region.offset), ("stride", region.stride)):
        if value % F32:
            raise ConfigError(f"page_region.{field}", value,
                              "must be a multiple of 4 bytes to view float32 pages")
    if region.stride < page_bytes:
        raise ConfigError("page_region.stride", region.stride,
                          f"must be >= the page's {page_bytes} bytes")
    return (region.buffer.nbytes - region.offset - page_bytes) // region.stride + 1


class Ops:
    """Array operations; subclasses bind them to one library and device."""

    name = "abstract"

    def asarray(self, a: np.ndarray) -> Any:
        """A float32 NumPy array on this library's device."""
        raise NotImplementedError

    def index(self, a: np.ndarray) -> Any:
        """An integer index array on this library's device."""
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def cat(self, xs: Sequence[Any], axis: int) -> Any:
        raise NotImplementedError

    def where(self, cond: Any, x: Any, y: float) -> Any:
        raise NotImplementedError

    def einsum(self, spec: str, *xs: Any) -> Any:
        raise NotImplementedError

    def rsqrt_mean_square(self, x: Any, eps: float) -> Any:
        """``1 / sqrt(mean(x**2, last axis) + eps)``, keeping the axis."""
        raise NotImplementedError

    def softmax(self, x: Any) -> Any:
        """Softmax over the last axis (rows fully masked with -inf are not expected)."""
        raise NotImplementedError

    def silu(self, x: Any) -> Any:
        raise NotImplementedError

    def page_view(self, backend: Any, region: PageRegion, page_shape: tuple[int, ...]) -> Any:
        """A zero-copy float32 view ``[slots, *page_shape]`` of the pages of ``region``
        (slot ``s``'s page starts at ``region.offset + s * region.stride``)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait until work queued by this library has finished (before kvcm moves pages
        the model wrote)."""


class NumpyOps(Ops):
    """NumPy on the CPU: runs wherever kvcm's ``numpy`` backend runs (CI)."""

    name = "numpy"

    def asarray(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def index(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a, dtype=np.int64)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def cat(self, xs: Sequence[Any], axis: int) -> np.ndarray:
        return np.concatenate(xs, axis=axis)

    def where(self, cond: Any, x: Any, y: float) -> np.ndarray:
        return np.where(cond, x, np.float32(y))

    def einsum(self, spec: str, *xs: Any) -> np.ndarray:
        return np.einsum(spec, *xs)

    def rsqrt_mean_square(self, x: Any, eps: float) -> np.ndarray:
        return 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))

    def softmax(self, x: Any) -> np.ndarray:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def silu(self, x: Any) -> np.ndarray:
        return x / (1.0 + np.exp(-x))

    def page_view(self, backend: Any, region: PageRegion, page_shape: tuple[int, ...]) -> Any:
        slots = _check_region(region, page_shape)
        memory = backend.as_array(region.buffer)  # the pool itself (uint8), no copy
        if not isinstance(memory, np.ndarray):
            raise TypeError(f"kernel backend {backend.name!r} hands out "
                            f"{type(memory).__name__} arrays; NumpyOps needs host memory "
                            "(use TorchOps for device memory)")
        strides = [F32] * len(page_shape)
        for i in range(len(page_shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * page_shape[i + 1]
        return np.ndarray((slots, *page_shape), dtype=np.float32, buffer=memory,
                          offset=region.offset, strides=(region.stride, *strides))


class TorchOps(Ops):
    """PyTorch on ``device`` (``"cuda"``, or ``"cpu"`` over the ``numpy`` backend's
    memory). Pages come through DLPack: ``torch.from_dlpack(backend.as_array(buffer))``
    shares kvcm's pool, so the model writes and reads K/V in place.

    Args:
        device: the torch device; must be where the kernel backend's level-0 memory is.
    """

    name = "torch"

    def __init__(self, device: str = "cuda") -> None:
        import torch  # optional: only this class needs it

        self.torch = torch
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ConfigError("TorchOps.device", device, f"not a torch device ({exc})") \
                from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            # Checked here: torch.cuda.current_device() would fail with an AssertionError
            # (a CPU build of torch) or a RuntimeError (no GPU or driver).
            raise ConfigError("TorchOps.device", device, "CUDA is not available to torch")
        if self.device.type == "cuda" and self.device.index is None:
            # DLPack tensors carry an index ("cuda:0"): compare like with like.
            self.device = torch.device("cuda", torch.cuda.current_device())

    def asarray(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)

    def index(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(np.asarray(a, dtype=np.int64)).to(self.device)

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()

    def cat(self, xs: Sequence[Any], axis: int) -> Any:
        return self.torch.cat(list(xs), dim=axis)

    def where(self, cond: Any, x: Any, y: float) -> Any:
        if isinstance(cond, np.ndarray):
            cond = self.torch.from_numpy(cond).to(self.device)
        return self.torch.where(cond, x, self.torch.tensor(y, dtype=x.dtype,
                                                            device=self.device))

    def einsum(self, spec: str, *xs: Any) -> Any:
        return self.torch.einsum(spec, *xs)

    def rsqrt_mean_square(self, x: Any, eps: float) -> Any:
        return self.torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)

    def softmax(self, x: Any) -> Any:
        return self.torch.softmax(x, dim=-1)

    def silu(self, x: Any) -> Any:
        return self.torch.nn.functional.silu(x)

    def page_view(self, backend: Any, region: PageRegion, page_shape: tuple[int, ...]) -> Any:
        torch = self.torch
        slots = _check_region(region, page_shape)
        memory = torch.from_dlpack(backend.as_array(region.buffer))  # uint8, zero-copy
        if memory.device != self.device:
            raise ConfigError("TorchOps.device", str(self.device),
                              f"kvcm's pages are on {memory.device}: give TorchOps the "
                              f"device of the kernel backend {backend.name!r}")
        floats = memory.view(torch.float32)
        strides = [1] * len(page_shape)
        for i in range(len(page_shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * page_shape[i + 1]
        return torch.as_strided(floats, (slots, *page_shape),
                                (region.stride // F32, *strides), region.offset // F32)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
