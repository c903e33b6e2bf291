"""The ``host`` tier: pools in pinned, device-mapped host memory of the active backend.

Pools are single allocations made through
:meth:`~kvcm_core.backend.KernelBackend.alloc_host`, so kernels of a GPU backend read and
write them directly (zero-copy over the bus) and ``copy_pages`` moves pages between the
``gpu`` and ``host`` tiers in one launch. On the ``numpy`` backend this is plain memory.
Resizing moves the pool, exactly as for the ``gpu`` tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvcm_tier_gpu import MemoryTier

from kvcm_core import hookimpl
from kvcm_core.backend import Buffer
from kvcm_core.records import Medium, TierCapabilities, TierSpec

__all__ = ["CAPABILITIES", "HostTier"]

CAPABILITIES = TierCapabilities(device_accessible=True, medium=Medium.HOST)


class HostTier(MemoryTier):
    """Pools in pinned, device-mapped host memory (see module docstring)."""

    tier_name = "host"
    capabilities = CAPABILITIES

    def _allocator(self) -> Callable[[int], Buffer]:
        return self.backend.alloc_host


@hookimpl
def kvcm_tiers() -> Iterator[TierSpec]:
    yield TierSpec(
        name="host",
        factory=HostTier,
        description="Pinned, device-mapped host memory of the active kernel backend",
        capabilities=CAPABILITIES,
    )
