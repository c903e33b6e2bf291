"""Where sparse pools live: pinned, device-mapped host memory on level 0, under their own
quota (``sparse_host_quota``), separate from level 0's device quota."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcm_core.errors import ConfigError, InvalidStateError
from kvcm_core.tier import DevicePool

if TYPE_CHECKING:
    from kvcm_core.backend import Buffer, KernelBackend
    from kvcm_core.config import KVCacheManagerConfig
    from kvcm_core.layout import StorageLayout

__all__ = ["SparseHostPool", "check_sparse_backend", "level0_slots"]


class SparseHostPool(DevicePool):
    """A level-0 pool of sparse buffers: one pinned, device-mapped host allocation; slot
    ``s`` is bytes ``[s * slot_bytes, (s + 1) * slot_bytes)``."""

    def __init__(self, backend: KernelBackend, slot_bytes: int, num_slots: int,
                 label: str) -> None:
        self.slot_bytes, self.num_slots = int(slot_bytes), int(num_slots)
        self._backend = backend
        self._label = label
        self._buffer: Buffer | None = backend.alloc_host(self.slot_bytes * self.num_slots)

    @property
    def buffer(self) -> Buffer:
        if self._buffer is None:
            raise InvalidStateError(f"{self._label} was closed; its memory is released")
        return self._buffer

    def resize(self, num_slots: int) -> None:
        """Reallocate, keeping the bytes of the slots both sizes have (the pool moves); the
        same size keeps the pool where it is."""
        if int(num_slots) == self.num_slots:
            return
        old = self.buffer
        new = self._backend.alloc_host(self.slot_bytes * int(num_slots))
        kept = self.slot_bytes * min(self.num_slots, int(num_slots))
        self._backend.synchronize()  # device readers and writers of the old memory finish
        new.host_view()[:kept] = old.host_view()[:kept]
        old.free()
        self._buffer = new
        self.num_slots = int(num_slots)

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.free()
            self._buffer = None


def check_sparse_backend(config: KVCacheManagerConfig, backend: KernelBackend,
                         backend_name: str) -> None:
    """Sparse buffers need a backend whose kernels read and write pinned host memory.

    Raises:
        ConfigError: the model has sparse buffers and the backend is not host-capable.
    """
    if config.sparse_host_quota is not None and any(
            getattr(layer, "sparse", None) is not None for layer in config.layers):
        if not backend.capabilities.host_mapped:
            raise ConfigError("kernel_backend", backend_name,
                              "sparse buffers need a host-capable kernel backend (one that "
                              "declares host_mapped: its kernels read pinned host memory)")


def level0_slots(layout: StorageLayout, config: KVCacheManagerConfig,
                 quota: int | None = None) -> list[int]:
    """Slots of each level-0 pool group: dense groups share level 0's quota (``quota``
    overrides it), sparse groups share ``sparse_host_quota``; ``pool_group_ratios`` weigh
    the groups within each share."""
    out: list[int] = [0] * len(layout.pool_groups)
    ratios = config.pool_group_ratios
    if ratios is not None and len(ratios) != len(out):
        raise ConfigError("pool_group_ratios", tuple(ratios),
                          f"needs one ratio per pool group ({len(out)}: see pool_group_descs)")
    for sparse, total in ((False, config.levels[0].quota if quota is None else quota),
                          (True, config.sparse_host_quota)):
        ids = [pg.id for pg in layout.pool_groups if pg.sparse is sparse]
        if not ids:
            continue
        if total is None:
            raise ConfigError("sparse_host_quota", None, "sparse buffers need a host quota")
        sub: Any = None if ratios is None else [ratios[i] for i in ids]
        field = "sparse_host_quota" if sparse else None
        for pg, n in zip(ids, layout.split_quota(total, sub, groups=ids, field=field),
                         strict=True):
            out[pg] = n
    return out
