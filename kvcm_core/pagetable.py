"""Page-table vocabulary shared by the kernels and the core: the index of an absent block
and the SWA scratch descriptor (a leaf module: it imports nothing of kvcm)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

__all__ = ["BAD_PAGE_INDEX", "ScratchDesc"]

#: Page index of an absent or stale block, in every page table. Never folded to 0.
BAD_PAGE_INDEX = -1


def _slot_ids(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value)


@attrs.frozen
class ScratchDesc:
    """The scratch blocks of one cache group of one cache for the current step.

    Attributes:
        begin: first scratch block.
        end: one past the last scratch block (``end > begin``).
        slot_ids: the cache's scratch slots of the group (slot ids of its pool group), in
            the order the index arithmetic uses them.
        scratch_pages_per_block: ``spb``, sub-pages per block in a scratch slot.
    """

    begin: int
    end: int
    slot_ids: tuple[int, ...] = attrs.field(converter=_slot_ids)
    scratch_pages_per_block: int

    @property
    def num_blocks(self) -> int:
        return self.end - self.begin

    @property
    def slot_id_array(self) -> np.ndarray:
        """The slot ids as an int32 array (what a kernel reads)."""
        return np.asarray(self.slot_ids, dtype=np.int32)

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int | np.integer) and self.begin <= int(block) < self.end


