"""Reference models for tests: an in-memory tier whose behaviour is obvious by reading it.

:class:`DictTier` keeps each pool's slots in a ``dict`` of ``bytes`` and completes every
operation synchronously. It is the model other tiers are compared against and a stand-in
level for manager tests that need a storage tier without files. It is not registered as a
plugin; :data:`DICT_TIER_SPEC` is its record, for registering by hand
(``get_plugin_manager().register(...)``) or for handing to code that takes a ``TierSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcm_core.backend import KernelBackend
from kvcm_core.errors import ConfigError, InvalidStateError
from kvcm_core.records import Medium, TierCapabilities, TierSpec
from kvcm_core.tier import CompletedIO, IOHandle, StoragePool, Tier, check_slots

__all__ = ["DICT_TIER_CAPABILITIES", "DICT_TIER_SPEC", "DictPool", "DictTier", "check_rows"]

DICT_TIER_CAPABILITIES = TierCapabilities(device_accessible=False, medium=Medium.HOST)


def check_rows(pool: StoragePool, array: object, n: int, what: str) -> np.ndarray:
    """Validate the host array of a ``read``/``write``: ``uint8 [n, slot_bytes]``.

    Raises:
        ValueError: wrong type, dtype or shape (naming ``what`` and the shape expected).
    """
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
        raise ValueError(
            f"{what} of type {type(array).__name__} dtype={getattr(array, 'dtype', None)}: "
            "must be a uint8 numpy array"
        )
    if array.shape != (n, pool.slot_bytes):
        raise ValueError(
            f"{what}.shape={array.shape}: must be ({n}, {pool.slot_bytes}) "
            "(one row of slot_bytes per slot)"
        )
    return array


class DictPool(StoragePool):
    """Slots as ``bytes`` in a dict; a slot never written reads as zeros.

    Attributes:
        data: slot -> its bytes (tests may inspect it: this is the backdoor).
    """

    def __init__(self, slot_bytes: int, num_slots: int, name: str = "") -> None:
        for field, value, minimum in (("slot_bytes", slot_bytes, 1), ("num_slots", num_slots, 0)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"{field}={value!r}: must be an int >= {minimum}")
            if value < minimum:
                raise ValueError(f"{field}={value!r}: must be >= {minimum}")
        self.slot_bytes = int(slot_bytes)
        self.num_slots = int(num_slots)
        self.name = name
        self.data: dict[int, bytes] = {}
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidStateError(f"dict pool {self.name!r} was closed")

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        """Store rows synchronously.

        Raises:
            ValueError: a slot out of range or repeated, or a bad ``source`` (nothing is
                written).
            InvalidStateError: the pool was closed.
        """
        self._check_open()
        arr = check_slots(self, slots)
        rows = check_rows(self, source, len(arr), "source")
        if len(np.unique(arr)) != len(arr):
            raise ValueError(f"slots={arr.tolist()}: a write may name each slot only once")
        for i, slot in enumerate(arr.tolist()):
            self.data[slot] = rows[i].tobytes()
        return CompletedIO()

    def read(self, slots: np.ndarray, dest: np.ndarray) -> IOHandle:
        """Load rows synchronously (zeros for slots never written).

        Raises:
            ValueError: a slot out of range or a bad ``dest``.
            InvalidStateError: the pool was closed.
        """
        self._check_open()
        arr = check_slots(self, slots)
        rows = check_rows(self, dest, len(arr), "dest")
        zeros = bytes(self.slot_bytes)
        for i, slot in enumerate(arr.tolist()):
            rows[i] = np.frombuffer(self.data.get(slot, zeros), dtype=np.uint8)
        return CompletedIO()

    def resize(self, num_slots: int) -> None:
        """Drop slots at or above ``num_slots``; new slots read as zeros."""
        self._check_open()
        if isinstance(num_slots, bool) or not isinstance(num_slots, int | np.integer):
            raise ValueError(f"num_slots={num_slots!r}: must be an int >= 0")
        if num_slots < 0:
            raise ValueError(f"num_slots={num_slots!r}: must be >= 0")
        self.data = {s: b for s, b in self.data.items() if s < num_slots}
        self.num_slots = int(num_slots)

    def close(self) -> None:
        """Forget the data (idempotent)."""
        self.closed = True
        self.data = {}


class DictTier(Tier):
    """The in-memory reference tier (see module docstring). Takes no options."""

    capabilities = DICT_TIER_CAPABILITIES

    def __init__(
        self, backend: KernelBackend | None = None, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(backend, options or {})  # type: ignore[arg-type]
        for key, value in self.options.items():
            raise ConfigError(f"dict.options.{key}", value, "unknown option; this tier takes none")
        self.pools: list[DictPool] = []

    def create_pool(self, slot_bytes: int, num_slots: int, *, name: str = "") -> DictPool:
        """A new, empty pool (all slots read as zeros)."""
        pool = DictPool(slot_bytes, num_slots, name)
        self.pools.append(pool)
        return pool

    def close(self) -> None:
        """Close every pool (idempotent)."""
        for pool in self.pools:
            pool.close()


DICT_TIER_SPEC = TierSpec(
    name="dict",
    factory=DictTier,
    description="In-memory reference tier (tests only; not registered by default)",
    capabilities=DICT_TIER_CAPABILITIES,
)
