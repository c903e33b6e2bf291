"""The ``raw`` page codec: a cold page is the block's slots, concatenated, unchanged.

For a pool group with slot sizes ``(s0, s1, ...)``, cold page bytes ``[0, s0)`` hold the
block's slot in pool 0, ``[s0, s0 + s1)`` its slot in pool 1, and so on, so
``cold_page_size(layout) == layout.page_bytes``. Encoding and decoding are one
``copy_pages_batch`` (one copy task per pool), so the codec runs on every kernel backend and
in one launch where the backend batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core import hookimpl
from kvcm_core.backend import CopyTask, KernelBackend, PageRegion, Stream, copy_pairs
from kvcm_core.codec import PageCodec, PageLayout
from kvcm_core.records import CodecCapabilities, CodecKind, CodecSpec

__all__ = ["CAPABILITIES", "RawCodec"]

CAPABILITIES = CodecCapabilities(kind=CodecKind.PAGE, lossless=True)


_I32_MAX = int(np.iinfo(np.int32).max)


def _slot_array(label: str, slots: np.ndarray) -> np.ndarray:
    arr = np.asarray(slots)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(
            f"{label}: must be a 1-D integer array; got dtype {arr.dtype}, shape {arr.shape}"
        )
    if arr.dtype == np.int32:  # fits by type; negative ids fail the copy's own check
        return arr
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _I32_MAX:
            raise ValueError(f"{label}: slot ids must be in 0..2**31-1; got {lo}..{hi}")
    return arr.astype(np.int32, copy=False)


class RawCodec(PageCodec):
    """Lossless page codec that concatenates a block's slots (see module docstring).

    Args:
        options: must be empty or ``None``; the codec takes no options.

    Raises:
        ValueError: an option was given.
    """

    lossless = True
    error_bound = None
    identity = True  # the core copies device-accessible pages itself (see PageCodec)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        if options:
            raise ValueError(f"raw codec takes no options; got {sorted(options)}")

    def cold_page_size(self, layout: PageLayout) -> int:
        """``layout.page_bytes``: every byte of the block, nothing more.

        Raises:
            ValueError: the layout has no bytes.
        """
        size = layout.page_bytes
        if size <= 0:
            raise ValueError(f"layout.slot_sizes={layout.slot_sizes}: a block needs > 0 bytes")
        return size

    def _tasks(
        self,
        layout: PageLayout,
        pools: Sequence[PageRegion],
        pool_slots: np.ndarray,
        cold: PageRegion,
        cold_slots: np.ndarray,
        encode: bool,
    ) -> list[CopyTask]:
        size = self.cold_page_size(layout)
        if len(pools) != len(layout.slot_sizes):
            raise ValueError(
                f"{len(pools)} pool regions given for a layout of {len(layout.slot_sizes)} pools"
            )
        pool_slots = _slot_array("pool slots", pool_slots)
        cold_slots = _slot_array("cold slots", cold_slots)
        if pool_slots.shape != cold_slots.shape:
            raise ValueError(
                f"{len(pool_slots)} pool slots but {len(cold_slots)} cold slots: one each per block"
            )
        if len(cold_slots) > 1 and cold.stride < size:
            # Cold pages would overlap each other: copies would clobber one another.
            raise ValueError(f"cold region stride {cold.stride} < cold page size {size}")
        pairs = (
            copy_pairs(cold_slots, pool_slots)
            if encode
            else copy_pairs(pool_slots, cold_slots)
        )
        tasks = []
        start = 0
        for region, slot_size in zip(pools, layout.slot_sizes, strict=True):
            if slot_size > 0:
                part = PageRegion(cold.buffer, cold.offset + start, cold.stride)
                dst, src = (part, region) if encode else (region, part)
                tasks.append(CopyTask(dst=dst, src=src, page_bytes=slot_size, pairs=pairs))
            start += slot_size
        return tasks

    def encode(
        self,
        backend: KernelBackend,
        layout: PageLayout,
        src: Sequence[PageRegion],
        src_slots: np.ndarray,
        dst: PageRegion,
        dst_slots: np.ndarray,
        stream: Stream | None = None,
    ) -> None:
        """Copy block ``src_slots[i]`` of the pools ``src`` into cold page ``dst_slots[i]``.

        Raises:
            ValueError: mismatched slot arrays or pool count, overlapping cold pages, or a
                page outside its buffer (nothing is copied then).
        """
        tasks = self._tasks(layout, src, src_slots, dst, dst_slots, encode=True)
        backend.copy_pages_batch(tasks, stream)

    def decode(
        self,
        backend: KernelBackend,
        layout: PageLayout,
        src: PageRegion,
        src_slots: np.ndarray,
        dst: Sequence[PageRegion],
        dst_slots: np.ndarray,
        stream: Stream | None = None,
    ) -> None:
        """Copy cold page ``src_slots[i]`` back into block ``dst_slots[i]`` of the pools
        ``dst``.

        Raises:
            ValueError: as for :meth:`encode`.
        """
        tasks = self._tasks(layout, dst, dst_slots, src, src_slots, encode=False)
        backend.copy_pages_batch(tasks, stream)


@hookimpl
def kvcm_codecs() -> Iterator[CodecSpec]:
    """Register the ``raw`` page codec."""
    yield CodecSpec(
        name="raw",
        factory=RawCodec,
        description="Lossless page codec: the block's slots of every pool, concatenated",
        capabilities=CAPABILITIES,
    )
