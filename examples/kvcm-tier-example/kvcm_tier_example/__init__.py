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
from kvcm_core.errors import ConfigError, InvalidStateError, TierIOError
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
        try:
            fd, self.path = tempfile.mkstemp(dir=directory, suffix=".mmap")  # created 0600
        except OSError as exc:
            raise TierIOError(f"mmap pool {name!r}: cannot create its file: {exc}") from exc
        self._fd: int | None = fd
        self._map: mmap.mmap | None = None
        try:
            self._remap(self.num_slots)
        except TierIOError:
            os.close(fd)
            self._fd = None
            os.unlink(self.path)
            raise

    def _remap(self, num_slots: int) -> None:
        """Give the file ``num_slots`` slots and map it again. On failure (TierIOError)
        the old mapping is kept where possible. Nothing may hold a view of the old mapping
        (this class keeps none across calls)."""
        assert self._fd is not None
        old_bytes = self.num_slots * self.slot_bytes
        nbytes = num_slots * self.slot_bytes
        if self._map is not None:
            try:
                self._map.close()
            except BufferError as exc:  # a view still exported: nothing changed
                raise TierIOError(f"mmap pool {self.name!r}: cannot remap: {exc}") from None
            self._map = None
        try:
            os.ftruncate(self._fd, nbytes)
            if nbytes:  # mmap cannot map zero bytes
                self._map = mmap.mmap(self._fd, nbytes)
        except OSError as exc:
            try:  # back to the old size and mapping
                os.ftruncate(self._fd, old_bytes)
                if old_bytes:
                    self._map = mmap.mmap(self._fd, old_bytes)
            except OSError:
                pass
            raise TierIOError(f"mmap pool {self.name!r}: cannot map {nbytes} bytes: "
                              f"{exc}") from exc

    def _slots(self) -> np.ndarray:
        """A ``[num_slots, slot_bytes]`` view of the mapping (drop it before remapping)."""
        if self._fd is None:
            raise InvalidStateError(f"mmap pool {self.name!r} was closed")
        if self._map is None:
            if not self.num_slots:
                return np.empty((0, self.slot_bytes), dtype=np.uint8)
            # A failed resize could not map the old size again either: try once more.
            nbytes = self.num_slots * self.slot_bytes
            try:
                os.ftruncate(self._fd, nbytes)
                self._map = mmap.mmap(self._fd, nbytes)
            except OSError as exc:
                raise TierIOError(f"mmap pool {self.name!r}: not mapped since a failed "
                                  f"resize, and mapping {nbytes} bytes failed: {exc}") from exc
        return np.frombuffer(self._map, dtype=np.uint8).reshape(self.num_slots, self.slot_bytes)

    def _rows(self, array: object, n: int, what: str) -> np.ndarray:
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
            raise ValueError(f"{what}: must be a uint8 numpy array, got {type(array).__name__}")
        if array.shape != (n, self.slot_bytes):
            raise ValueError(f"{what}.shape={array.shape}: must be ({n}, {self.slot_bytes})")
        return array

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Copy ``source[i]`` into ``slots[i]`` now; returns a completed handle."""
        # Arguments checked before a view of the mapping is taken, and the view lives
        # only in the statement that copies: an error (kept by the caller with its
        # frames) must not hold a view, or remapping and closing fail with BufferError.
        self._live()
        arr = check_slots(self, slots)
        rows = self._rows(source, len(arr), "source")
        self._slots()[arr] = rows
        return CompletedIO()

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Copy ``slots[i]`` into ``dest[i]`` now; returns a completed handle."""
        self._live()
        arr = check_slots(self, slots)
        rows = self._rows(dest, len(arr), "dest")
        rows[...] = self._slots()[arr]  # (the view: as in write)
        return CompletedIO()

    def resize(self, num_slots: int) -> None:
        """Change the file's length and map it again; kept slots keep their bytes. On
        failure (TierIOError) the pool keeps its size."""
        self._live()
        new = _check_size("num_slots", num_slots, 0)
        self._remap(new)
        self.num_slots = new

    def close(self) -> None:
        """Unmap, close and delete the file (idempotent). Every step is tried; the first
        failure is raised after them as TierIOError."""
        if self._fd is None:
            return
        errors: list[BaseException] = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError as exc:  # a view still exported: unmapped once it goes
                errors.append(exc)
            self._map = None
        for step in (lambda: os.close(self._fd), lambda: os.unlink(self.path)):
            try:
                step()
            except OSError as exc:
                errors.append(exc)
        self._fd = None
        if errors:
            raise TierIOError(f"mmap pool {self.name!r}: closing failed: {errors[0]}")

    def _live(self) -> None:
        if self._fd is None:
            raise InvalidStateError(f"mmap pool {self.name!r} was closed")


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
        """Close every pool and remove the directory (idempotent); a pool that fails to
        close does not stop the others or the removal (the first failure is raised
        after them)."""
        errors: list[Exception] = []
        for pool in self._pools:
            try:
                pool.close()
            except Exception as exc:  # (raised after the rest is done)
                errors.append(exc)
        self._pools = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if errors:
            raise errors[0]


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
