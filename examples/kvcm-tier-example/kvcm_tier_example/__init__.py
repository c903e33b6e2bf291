"""An example third-party kvcm tier, ``mmap``: pools in memory-mapped files.

Each pool is one file in a private temporary directory (mode 0700, files 0600), mapped
into memory; ``write`` and ``read`` copy between the caller's rows and the mapping at
once and return completed handles. The tier is not persistent: the directory is removed
when the tier is closed. It shows everything a tier plugin needs:

- a :class:`~kvcm_core.tier.Tier` subclass whose ``create_pool`` returns pools,
- a :class:`~kvcm_core.tier.StoragePool` with ``write``, ``read``, ``resize``, ``close``,
- honest :class:`~kvcm_core.records.TierCapabilities`,
- a ``kvcm_tiers`` hook yielding a :class:`~kvcm_core.records.TierSpec`, registered
  through the ``kvcm`` entry-point group in ``pyproject.toml``,
- a declared known gap: a memory-mapped file fails by ``SIGBUS``, not by an error the tier
  could turn into :class:`~kvcm_core.errors.TierIOError`, so the conformance test that
  injects I/O errors runs as a strict expected failure.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from kvcm_core import hookimpl
from kvcm_core.backend import KernelBackend
from kvcm_core.errors import ConfigError, InvalidStateError
from kvcm_core.records import Medium, TierCapabilities, TierSpec
from kvcm_core.tier import CompletedIO, IOHandle, StoragePool, Tier, check_slots

__all__ = ["CAPABILITIES", "MmapPool", "MmapTier"]

CAPABILITIES = TierCapabilities(device_accessible=False, medium=Medium.FILE, persistent=False)


def _check_size(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{field}={value!r}: must be an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{field}={value!r}: must be >= {minimum}")
    return int(value)


class MmapPool(StoragePool):
    """Slots in one memory-mapped file; slot ``s`` is bytes ``[s*B, (s+1)*B)``."""

    def __init__(self, directory: str, slot_bytes: int, num_slots: int, name: str) -> None:
        self.slot_bytes = _check_size("slot_bytes", slot_bytes, 1)
        self.num_slots = _check_size("num_slots", num_slots, 0)
        self.name = name
        fd, self.path = tempfile.mkstemp(dir=directory, suffix=".mmap")  # created 0600
        self._fd: int | None = fd
        self._map: mmap.mmap | None = None
        self._remap()

    def _remap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        assert self._fd is not None
        os.ftruncate(self._fd, self.nbytes)
        if self.nbytes:  # mmap cannot map zero bytes
            self._map = mmap.mmap(self._fd, self.nbytes)

    def _slots(self) -> np.ndarray:
        """A ``[num_slots, slot_bytes]`` view of the mapping (drop it before remapping)."""
        if self._fd is None:
            raise InvalidStateError(f"mmap pool {self.name!r} was closed")
        if self._map is None:
            return np.empty((0, self.slot_bytes), dtype=np.uint8)
        return np.frombuffer(self._map, dtype=np.uint8).reshape(self.num_slots, self.slot_bytes)

    def _rows(self, array: object, n: int, what: str) -> np.ndarray:
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
            raise ValueError(f"{what}: must be a uint8 numpy array, got {type(array).__name__}")
        if array.shape != (n, self.slot_bytes):
            raise ValueError(f"{what}.shape={array.shape}: must be ({n}, {self.slot_bytes})")
        return array

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Copy ``source[i]`` into ``slots[i]`` now; returns a completed handle."""
        view = self._slots()
        arr = check_slots(self, slots)
        view[arr] = self._rows(source, len(arr), "source")
        return CompletedIO()

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Copy ``slots[i]`` into ``dest[i]`` now; returns a completed handle."""
        view = self._slots()
        arr = check_slots(self, slots)
        self._rows(dest, len(arr), "dest")[...] = view[arr]
        return CompletedIO()

    def resize(self, num_slots: int) -> None:
        """Change the file's length and map it again; kept slots keep their bytes."""
        self._slots()  # refuses a closed pool
        self.num_slots = _check_size("num_slots", num_slots, 0)
        self._remap()

    def close(self) -> None:
        """Unmap, close and delete the file (idempotent)."""
        if self._fd is None:
            return
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self._fd)
        self._fd = None
        os.unlink(self.path)


class MmapTier(Tier):
    """Pools in memory-mapped files of a private temporary directory. Takes no options."""

    capabilities = CAPABILITIES

    def __init__(self, backend: KernelBackend, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, options or {})
        for key, value in self.options.items():
            raise ConfigError(f"mmap.options.{key}", value, "unknown option; this tier takes none")
        self.directory: str | None = tempfile.mkdtemp(prefix="kvcm-mmap-")  # created 0700
        self._pools: list[MmapPool] = []

    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> MmapPool:
        """A new pool (its file name is random; ``name`` only labels it)."""
        if self.directory is None:
            raise InvalidStateError("mmap tier was closed")
        pool = MmapPool(self.directory, slot_bytes, num_slots, name)
        self._pools.append(pool)
        return pool

    def close(self) -> None:
        """Close every pool and remove the directory (idempotent)."""
        for pool in self._pools:
            pool.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


@hookimpl
def kvcm_tiers() -> Iterator[TierSpec]:
    yield TierSpec(
        name="mmap",
        factory=MmapTier,
        description="Example plugin: memory-mapped files in a private temporary directory",
        capabilities=CAPABILITIES,
        known_gaps={
            "test_io_failure_surfaces_as_tier_io_error": (
                "a memory-mapped file fails by SIGBUS, not by an OSError the tier can "
                "report through its handle"
            ),
        },
    )
