"""Moving block data between stores: GPU pools, device-accessible cold pools (pinned
host) and storage pools (disk, remote), through the level codec and pinned staging.

Every transfer is one batch per (source store, destination store): GPU pages are encoded
into cold pages (or decoded back) by the page codec in one launch; storage pools are
reached through pinned staging and the tier's asynchronous I/O, waited for before the
transfer returns, so a page is never read before its copy finished and a source slot is
released only after its data has safely arrived. On an I/O failure the transfer raises
:class:`~kvcm_core.errors.TierIOError` and the destination holds nothing valid; the source
is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvcm_core.backend import Buffer, CopyTask, KernelBackend, PageRegion, Stream, copy_pairs
from kvcm_core.codec import PageCodec, PageLayout
from kvcm_core.tier import DevicePool, StoragePool

if TYPE_CHECKING:
    from kvcm_core.storage import Store

__all__ = ["Mover"]

_STAGING_LIMIT = 64 << 20  # bytes of pinned staging per chunk


class Mover:
    """Copies blocks between stores (see module docstring).

    Args:
        backend: the kernel backend (copies, codec work, pinned staging).
        codec: the cold levels' page codec, or None when there is no cold level.
    """

    def __init__(self, backend: KernelBackend, codec: PageCodec | None) -> None:
        self.backend = backend
        self.codec = codec
        self._staging: Buffer | None = None

    def close(self) -> None:
        if self._staging is not None:
            self._staging.free()
            self._staging = None

    def _stage(self, nbytes: int) -> Buffer:
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                self._staging.free()
            self._staging = self.backend.alloc_host(max(nbytes, 1 << 20))
        return self._staging

    @staticmethod
    def _gpu_regions(store: Store) -> list[PageRegion]:
        out = []
        for pool in store.pools:
            assert isinstance(pool, DevicePool)
            out.append(pool.region)
        return out

    def copy(
        self,
        layout: PageLayout,
        src: Store,
        src_slots: Sequence[int] | np.ndarray,
        dst: Store,
        dst_slots: Sequence[int] | np.ndarray,
        stream: Stream | None = None,
    ) -> None:
        """Copy blocks ``src_slots[i]`` of ``src`` into ``dst_slots[i]`` of ``dst``.

        ``layout`` is the GPU pool group's layout (what the codec needs). Level-0 stores
        hold GPU pages (one pool per slot size); other stores hold cold pages.

        Raises:
            TierIOError: a storage read or write failed (the destination is not valid).
        """
        n = len(src_slots)
        if n == 0:
            return
        s = np.asarray(src_slots, dtype=np.int32)
        d = np.asarray(dst_slots, dtype=np.int32)
        if src.level == 0 or dst.level == 0:
            self._copy_gpu(layout, src, s, dst, d, stream)
        else:
            self._copy_cold(src, s, dst, d, stream)
        # The source slot may be reused as soon as we return: finish the copy first.
        (stream or self.backend.default_stream).synchronize()

    # -- GPU <-> anything ------------------------------------------------------------------

    def _copy_gpu(self, layout: PageLayout, src: Store, s: np.ndarray,
                  dst: Store, d: np.ndarray, stream: Stream | None) -> None:
        be = self.backend
        if src.level == 0 and dst.level == 0:
            pairs = copy_pairs(d, s)
            be.copy_pages_batch(
                [CopyTask(r, r, pool.slot_bytes, pairs)
                 for r, pool in zip(self._gpu_regions(src), src.pools, strict=True)], stream)
            return
        codec = self.codec
        assert codec is not None, "cold level without a codec"
        if src.level == 0:
            pool = dst.pools[0]
            if isinstance(pool, DevicePool):
                codec.encode(be, layout, self._gpu_regions(src), s, pool.region, d, stream)
                return
            assert isinstance(pool, StoragePool)
            cold = pool.slot_bytes
            for lo, hi in self._chunks(len(s), cold):
                staging = self._stage((hi - lo) * cold)
                codec.encode(be, layout, self._gpu_regions(src), s[lo:hi],
                             PageRegion(staging, 0, cold), np.arange(hi - lo, dtype=np.int32),
                             stream)
                (stream or be.default_stream).synchronize()
                view = staging.host_view()[: (hi - lo) * cold].reshape(hi - lo, cold)
                pool.write(d[lo:hi], view).wait()
            return
        pool = src.pools[0]
        if isinstance(pool, DevicePool):
            codec.decode(be, layout, pool.region, s, self._gpu_regions(dst), d, stream)
            return
        assert isinstance(pool, StoragePool)
        cold = pool.slot_bytes
        for lo, hi in self._chunks(len(s), cold):
            staging = self._stage((hi - lo) * cold)
            view = staging.host_view()[: (hi - lo) * cold].reshape(hi - lo, cold)
            pool.read(s[lo:hi], view).wait()
            codec.decode(be, layout, PageRegion(staging, 0, cold),
                         np.arange(hi - lo, dtype=np.int32), self._gpu_regions(dst), d[lo:hi],
                         stream)
            (stream or be.default_stream).synchronize()

    # -- cold <-> cold ---------------------------------------------------------------------

    def _copy_cold(self, src: Store, s: np.ndarray, dst: Store,
                   d: np.ndarray, stream: Stream | None) -> None:
        be = self.backend
        sp, dp = src.pools[0], dst.pools[0]
        cold = sp.slot_bytes
        if dp.slot_bytes != cold:
            raise ValueError(f"cold page sizes differ ({cold} vs {dp.slot_bytes})")
        if isinstance(sp, DevicePool) and isinstance(dp, DevicePool):
            be.copy_pages(dp.region, sp.region, cold, copy_pairs(d, s), stream)
            return
        if isinstance(sp, DevicePool) and sp.region.buffer.host_ptr is not None:
            # Host-visible pages (pinned host) to storage: one gather, in storage order.
            assert isinstance(dp, StoragePool)
            order = np.argsort(d, kind="stable")
            rows = _host_pages(sp.region, cold, int(s.max()) + 1)[s[order]]
            dp.write(d[order], rows).wait()
            return
        if isinstance(dp, DevicePool) and dp.region.buffer.host_ptr is not None:
            assert isinstance(sp, StoragePool)
            rows = np.empty((len(s), cold), dtype=np.uint8)
            sp.read(s, rows).wait()
            _host_pages(dp.region, cold, int(d.max()) + 1)[d] = rows
            return
        for lo, hi in self._chunks(len(s), cold):
            k = hi - lo
            staging = self._stage(k * cold)
            view = staging.host_view()[: k * cold].reshape(k, cold)
            if isinstance(sp, DevicePool):
                be.copy_pages(PageRegion(staging, 0, cold), sp.region, cold,
                              copy_pairs(np.arange(k), s[lo:hi]),
                              stream)
                (stream or be.default_stream).synchronize()
            else:
                assert isinstance(sp, StoragePool)
                sp.read(s[lo:hi], view).wait()
            if isinstance(dp, DevicePool):
                be.copy_pages(dp.region, PageRegion(staging, 0, cold), cold,
                              copy_pairs(d[lo:hi], np.arange(k)),
                              stream)
                (stream or be.default_stream).synchronize()
            else:
                assert isinstance(dp, StoragePool)
                dp.write(d[lo:hi], view).wait()

    @staticmethod
    def _chunks(n: int, page: int) -> list[tuple[int, int]]:
        per = max(1, _STAGING_LIMIT // max(page, 1))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def _host_pages(region: PageRegion, page_bytes: int, count: int) -> np.ndarray:
    """``[count, page_bytes]`` host view of a host-visible region's first pages."""
    end = region.offset + (count - 1) * region.stride + page_bytes
    if end > region.buffer.nbytes:
        raise ValueError(f"page {count - 1} ends at byte {end}, past the buffer's "
                         f"{region.buffer.nbytes} bytes")
    base = region.buffer.host_view()
    return np.ndarray((count, page_bytes), dtype=np.uint8, buffer=base, offset=region.offset,
                      strides=(region.stride, 1))
