"""Moving block data between stores: GPU pools, device-accessible cold pools (pinned
host) and storage pools (disk, remote), through each cold level's page codec and pinned
staging.

Every transfer is one batch per (source store, destination store): GPU pages are encoded
into cold pages (or decoded back) by the page codec in one launch; storage pools are
reached through pinned staging and the tier's asynchronous I/O, waited for before the
transfer returns, so a page is never read before its copy finished and a source slot is
released only after its data has safely arrived. On an I/O failure the transfer raises
:class:`~kvcm_core.errors.TierIOError` and the destination holds nothing valid; the source
is untouched.

Stores of persistent tiers are framed (:mod:`kvcm_core.frame`): their pages are wrapped on
every write here and checked on every read, so a damaged page never reaches a GPU or
another level; the transfer finishes the intact pages and then raises
:class:`~kvcm_core.frame.FrameCheckFailed` naming the damaged ones.

Cold levels may use different page codecs. A move between two cold levels whose codecs
differ transcodes through device scratch, in chunks: the source pages are decoded (by the
source level's codec) into scratch GPU pages of the pool group's layout, which are then
encoded by the destination level's codec. The data that arrives is what a decode of the
source would give, re-encoded: lossy to lossless keeps the lossy values exactly, lossless
to lossy adds one encoding's error, lossy to another lossy codec adds the second one's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcm_core.backend import Buffer, CopyTask, KernelBackend, PageRegion, Stream, copy_pairs
from kvcm_core.codec import PageCodec, PageLayout
from kvcm_core.errors import TierIOError
from kvcm_core.fences import Fences
from kvcm_core.frame import HEADER, FrameBook, FrameCheckFailed
from kvcm_core.tier import BlobPool, DevicePool, StoragePool

if TYPE_CHECKING:
    from kvcm_core.storage import Store

__all__ = ["Mover"]

try:  # NumPy's C count itself (np.count_nonzero adds a dispatch)
    from numpy._core.multiarray import count_nonzero as _count
except ImportError:  # pragma: no cover - NumPy 1.x
    _count = np.count_nonzero

_STAGING_LIMIT = 64 << 20  # bytes of pinned staging per chunk
#: A page written alone from pinned host memory to storage is sliced out rather than
#: gathered (a test turns it off to compare).
_ONE_BY_ONE = True


class Mover:
    """Copies blocks between stores (see module docstring).

    Args:
        backend: the kernel backend (copies, codec work, pinned staging).
        codecs: each level's page codec (None on level 0).
    """

    def __init__(self, backend: KernelBackend, codecs: Sequence[PageCodec | None]) -> None:
        self.backend = backend
        self.codecs = list(codecs)
        self._staging: Buffer | None = None
        self._scratch: Buffer | None = None  # GPU pages of a transcode
        #: Slot fences of asynchronous copies (:mod:`kvcm_core.fences`).
        self.fences = Fences(backend)
        self._plans: dict[tuple[int, int, int], Any] = {}  # see _parts
        self._issuable: dict[tuple[int, int], Any] = {}  # see can_issue
        self._direct: dict[tuple[int, int, int], Any] = {}  # see _direct_parts
        self._host: dict[int, Any] = {}  # see _host_items

    def close(self) -> None:
        self.fences.close()
        self._host.clear()
        for buf in (self._staging, self._scratch):
            if buf is not None:
                buf.free()
        self._staging = self._scratch = None

    def codec_of(self, level: int) -> PageCodec:
        """The page codec of cold ``level``."""
        codec = self.codecs[level] if level < len(self.codecs) else None
        assert codec is not None, f"cold level {level} without a codec"
        return codec

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
        keys: np.ndarray | None = None,
    ) -> None:
        """Copy blocks ``src_slots[i]`` of ``src`` into ``dst_slots[i]`` of ``dst``.

        ``layout`` is the GPU pool group's layout (what the codec needs). Level-0 stores
        hold GPU pages (one pool per slot size); other stores hold cold pages. ``keys``:
        the 32-byte block keys of the pages (``uint8 [n, 32]``), needed when ``dst`` is
        framed and ``src`` is not (a framed source gives the keys it recorded).

        Raises:
            TierIOError: a storage read or write failed (the destination is not valid).
            FrameCheckFailed: frames read from ``src`` failed their check (at
                ``positions``); every other page was copied.
        """
        n = len(src_slots)
        if n == 0:
            return
        if self.fences.enabled and (src.level == 0 or dst.level == 0):
            # A copy the call does not issue (no pinned level takes it, or a codec runs)
            # reads or writes GPU pages the engine's queued work on the call's stream may
            # still write or read: its stream waits for that work first.
            self.fences.join_op(stream or self.backend.default_stream)
        # What _copy_gpu copies between the GPU level and a device-accessible store with
        # an identity codec, without its lookups (neither side framed: no keys).
        direct = self._direct_parts(layout, src, dst) \
            if (src.level == 0) is not (dst.level == 0) else None
        if direct is not None and not self.fences.events:
            self._copy_direct(direct, src_slots, dst_slots, stream)
            return
        # Between cold levels of one codec (_copy_cold) the slots stay int64, the type
        # storage pools check them as and NumPy indexes with (no conversion there, nor
        # at each use); copies that touch GPU pages or scratch take int32 slots.
        same = src.level != 0 and dst.level != 0 and \
            self.codec_of(src.level) is self.codec_of(dst.level)
        s = np.asarray(src_slots, dtype=np.int64 if same else np.int32)
        d = np.asarray(dst_slots, dtype=np.int64 if same else np.int32)
        if keys is None and src.frames is not None and dst.frames is not None:
            # A copy (take: keys[s], whole rows at once), taken before any write to a book;
            # only a framed destination uses them (_put), not an onboard to the GPU.
            keys = src.frames.keys.take(s, axis=0)
        if self.fences.events:  # asynchronous copies may still touch these slots
            self.fences.wait_host(((src, s), (dst, d)))
        if direct is not None:
            self._copy_direct(direct, s, d, stream)
            return
        ok = np.ones(n, dtype=bool)
        if same:
            self._copy_cold(src, s, dst, d, stream, keys, ok)
        elif src.level == 0 or dst.level == 0:
            self._copy_gpu(layout, src, s, dst, d, stream, keys, ok)
        else:
            self._transcode(layout, src, s, dst, d, stream, keys, ok)
        # The source slot may be reused as soon as we return: finish the copy first.
        (stream or self.backend.default_stream).synchronize()
        if _count(ok) != n:
            bad = np.flatnonzero(~ok)
            raise FrameCheckFailed(
                f"{len(bad)} cold pages read from level {src.level} failed their frame "
                f"check (slots {s[bad].tolist()[:8]})", bad)

    def _copy_direct(self, parts: list[tuple[PageRegion, PageRegion, int]],
                     s: Sequence[int] | np.ndarray, d: Sequence[int] | np.ndarray,
                     stream: Stream | None) -> None:
        """Copy blocks ``s[i]`` into ``d[i]`` by :meth:`_direct_parts`, and wait (slots of
        stores: in range, so the backend may skip its checks)."""
        self.backend.copy_pages_checked_by_caller(parts, np.asarray(d), np.asarray(s), stream)
        (stream or self.backend.default_stream).synchronize()

    # -- asynchronous copies (GPU <-> device-accessible pools) ------------------------------

    def can_issue(self, src: Store, dst: Store) -> bool:
        """Whether a move between these stores runs asynchronously (:meth:`issue`): a
        device backend, the GPU level on one side, a device-accessible pool on the other
        (GPU or pinned host memory, not sparse) and an identity codec between them."""
        if not self.fences.enabled or (src.level != 0 and dst.level != 0):
            return False
        key = (id(src), id(dst))
        known = self._issuable.get(key)
        if known is None:
            known = _bounded(self._issuable)[key] = (self._can_issue(src, dst), src, dst)
        return known[0]

    def _can_issue(self, src: Store, dst: Store) -> bool:
        for store in (src, dst):
            if store.frames is not None or not all(
                    type(p).__name__ != "SparseHostPool" and isinstance(p, DevicePool)
                    for p in store.pools):
                return False
        if src.level == 0 and dst.level == 0:
            return True
        return self.codec_of(max(src.level, dst.level)).identity

    def issue(self, layout: PageLayout, src: Store, src_slots: np.ndarray, dst: Store,
              dst_slots: np.ndarray, chunk_pages: int) -> None:
        """Queue the copy of blocks ``src_slots[i]`` into ``dst_slots[i]`` (see
        :meth:`can_issue`) and return: evictions on the evict stream, onboards on the
        onboard stream, in batches of ``chunk_pages`` pages, each waiting for the fences
        of its slots (:mod:`kvcm_core.fences`). Within each batch, ``src_slots`` must
        ascend and ``dst_slots`` too (:func:`order_in_batches`): pages adjacent on both
        sides are then one run, and a batch that is one run is one contiguous copy per
        part. An eviction fences its slots batch by batch: the level-0 slots it frees are
        what an onboard of the same call fills, batch for batch, so both directions
        overlap. An onboard fences all of its slots with one event after its last batch
        (their next users come after the call)."""
        f = self.fences
        evict, onboard = f.streams()
        stream = onboard if dst.level < src.level or (
            dst.level == src.level == 0) else evict
        f.join_op(stream)
        s = np.asarray(src_slots, dtype=np.int32)
        d = np.asarray(dst_slots, dtype=np.int32)
        n = len(s)
        per = max(1, chunk_pages)
        src_fence, dst_fence = f.of(src), f.of(dst)
        # Fences before this move: its batches touch distinct slots, so each batch waits
        # only for earlier moves' batches, read here once.
        before = np.maximum(src_fence[s], dst_fence[d]) if f.events else None
        make = self._parts(layout, src, dst)
        bounds = list(range(0, n, per))
        nb = len(bounds)
        ends = [*bounds[1:], n]
        # First and last slot of each batch on both sides, in one gather each.
        at = np.asarray([*bounds, *[e - 1 for e in ends]], dtype=np.intp)
        sv, dv = s[at].tolist(), d[at].tolist()
        if make[0] and n > 1:
            # Both sides ascend within a batch (distinct slots): it is one run when each
            # side's first and last slot span exactly its length.
            single = all(sv[nb + k] - sv[k] == dv[nb + k] - dv[k] == ends[k] - 1 - bounds[k]
                         for k in range(nb))
        else:
            single = n == 1
        waits = f.batch_waits(before, bounds) if before is not None else None
        be = self.backend
        parts = make[1]
        if single:
            copy_bytes = be.copy_bytes

            def copy(k: int) -> None:  # pages back to back (stride == size): one range
                s0, d0, count = sv[k], dv[k], ends[k] - bounds[k]
                for dr, sr, size in parts:
                    copy_bytes(dr.buffer, dr.offset + d0 * dr.stride, sr.buffer,
                               sr.offset + s0 * sr.stride, count * size, stream)
        else:
            def copy(k: int) -> None:
                lo = bounds[k]
                pairs = copy_pairs(d[lo:lo + per], s[lo:lo + per])
                be.copy_pages_batch([CopyTask(dr, sr, size, pairs) for dr, sr, size in parts],
                                    stream)
        each = stream is evict  # fence batch by batch (see above)
        started = [0]  # batches whose copies were (maybe in part) queued

        def counted(k: int) -> None:
            started[0] = k + 1
            copy(k)

        try:
            numbers = f.run_batches(stream, nb, waits, counted, each)
        except BaseException:  # the caller gives the slots back: fence what was queued
            if started[0]:  # (none queued: the slots keep the fences they had)
                upto = ends[started[0] - 1]
                _fence_queued(f, stream, ((src, s[:upto]), (dst, d[:upto])))
            raise
        seqs: np.ndarray | int = np.repeat(np.asarray(numbers, dtype=np.int64), per)[:n] \
            if each else numbers[-1]
        src_fence[s] = seqs
        dst_fence[d] = seqs

    def forget_plans(self) -> None:
        """Pools were reallocated (a level resized): forget the copies kept per pair of
        stores."""
        self._plans.clear()
        self._issuable.clear()
        self._direct.clear()
        self._host.clear()

    def _direct_parts(self, layout: PageLayout, src: Store, dst: Store
                      ) -> list[tuple[PageRegion, PageRegion, int]] | None:
        """The copies of one page, as ``(dst, src, bytes)`` per part, of a copy that
        :meth:`_copy_gpu` makes with an identity codec between the GPU level and a
        device-accessible store (exactly one of ``src`` and ``dst`` on level 0); None for
        any other copy. Kept per pair of stores and layout, and used while every pool
        of both stores still has the buffer it had (a resize may move a pool)."""
        key = (id(layout), id(src), id(dst))
        plan = self._direct.get(key)
        if plan is not None:
            pools, buffers, parts = plan[0], plan[1], plan[2]
            if parts is None:
                return None
            for pool, buffer in zip(pools, buffers, strict=True):
                if pool.buffer is not buffer:
                    break
            else:
                return parts
        gpu, cold = (src, dst) if src.level == 0 else (dst, src)
        pool = cold.pools[0]
        if not isinstance(pool, DevicePool) or not self.codec_of(cold.level).identity:
            _bounded(self._direct)[key] = ((), (), None, (layout, src, dst))
            return None
        parts = _identity_parts(layout, self._gpu_regions(gpu), pool.region, gpu is src)
        pools = [*gpu.pools, pool]
        _bounded(self._direct)[key] = (pools, [p.buffer for p in pools], parts,
                                       (layout, src, dst))
        return parts

    def _parts(self, layout: PageLayout, src: Store, dst: Store
               ) -> tuple[bool, list[tuple[PageRegion, PageRegion, int]]]:
        """The copies of one page between two stores, as ``(dst, src, bytes)`` per part,
        and whether every part's pages lie back to back on both sides (kept per pair of
        stores and layout: pools and codecs do not change)."""
        key = (id(layout), id(src), id(dst))
        plan = self._plans.get(key)
        if plan is None:
            if src.level == 0 and dst.level == 0:
                make = [(r, r2, pool.slot_bytes) for r, r2, pool in zip(
                    self._gpu_regions(dst), self._gpu_regions(src), src.pools, strict=True)]
            elif src.level == 0:
                pool = dst.pools[0]
                assert isinstance(pool, DevicePool)
                make = _identity_parts(layout, self._gpu_regions(src), pool.region, True)
            else:
                pool = src.pools[0]
                assert isinstance(pool, DevicePool)
                make = _identity_parts(layout, self._gpu_regions(dst), pool.region, False)
            packed = all(dr.stride == size and sr.stride == size for dr, sr, size in make)
            plan = _bounded(self._plans)[key] = (packed, make, (layout, src, dst))
        return plan[0], plan[1]

    # -- storage pools: frames applied here ------------------------------------------------

    @staticmethod
    def _put(store: Store, slots: np.ndarray, rows: np.ndarray, keys: np.ndarray | None
             ) -> None:
        """Write cold pages ``rows[i]`` into ``slots[i]`` of a storage store, framed when
        the store is."""
        pool = store.pools[0]
        assert isinstance(pool, StoragePool)
        book = store.frames
        if book is not None:
            if keys is None:
                raise ValueError(f"level {store.level} is framed: block keys are needed")
            if isinstance(pool, BlobPool):
                try:
                    payloads = [book.blob.encode(row) for row in rows] \
                        if book.blob is not None else [row.tobytes() for row in rows]
                except Exception as exc:  # a codec that breaks its contract: a failed write
                    raise TierIOError(f"level {store.level}: the blob codec failed to encode "
                                      f"({type(exc).__name__}: {exc})") from exc
                blobs = book.wrap_blobs(slots, payloads, keys)
                big = max(len(b) for b in blobs)
                if big > pool.slot_bytes:  # a codec past its bound: a failed write
                    raise TierIOError(f"level {store.level}: a {big}-byte blob exceeds "
                                      f"the {pool.slot_bytes}-byte slot")
                pool.write_blobs(slots, blobs).wait()
                return
            # Framed where the pool keeps them (a storage level's held rows): no copy.
            pool.write_into(slots, lambda out: book.wrap(slots, rows, keys, out)).wait()
            return
        pool.write(slots, rows).wait()

    @staticmethod
    def _get(store: Store, slots: np.ndarray, out: np.ndarray, ok: np.ndarray) -> None:
        """Read cold pages of ``slots`` into ``out`` (unframing them); ``ok[i]`` becomes
        False for a frame that fails its check (its row in ``out`` is zeroed)."""
        pool = store.pools[0]
        assert isinstance(pool, StoragePool)
        book = store.frames
        if book is None:
            pool.read(slots, out).wait()
            return
        if isinstance(pool, BlobPool):
            blobs: list[bytes] = [b""] * len(slots)
            pool.read_blobs(slots, blobs).wait()
            for i, (slot, blob) in enumerate(zip(slots.tolist(), blobs, strict=True)):
                page = _unframe_blob(book, slot, blob, out.shape[1])
                ok[i] &= page is not None
                out[i] = 0 if page is None else np.frombuffer(page, dtype=np.uint8)
            return
        frames = np.empty((len(slots), pool.slot_bytes), dtype=np.uint8)
        pool.read(slots, frames).wait()
        good = book.check(slots, frames)
        head = HEADER.itemsize
        out[...] = frames[:, head : head + out.shape[1]]
        if _count(good) != len(good):
            out[~good] = 0  # never hand damaged bytes on, even to a slot given back
            ok &= good

    @staticmethod
    def _page_bytes(store: Store) -> int:
        """Bytes of one cold page of a cold store (its slots hold a frame around it)."""
        return store.pools[0].slot_bytes if store.frames is None else store.frames.page_bytes

    # -- GPU <-> anything ------------------------------------------------------------------

    def _copy_gpu(self, layout: PageLayout, src: Store, s: np.ndarray, dst: Store,
                  d: np.ndarray, stream: Stream | None, keys: np.ndarray | None,
                  ok: np.ndarray) -> None:
        be = self.backend
        if src.level == 0 and dst.level == 0:
            pairs = copy_pairs(d, s)
            be.copy_pages_batch(
                [CopyTask(r, r, pool.slot_bytes, pairs)
                 for r, pool in zip(self._gpu_regions(src), src.pools, strict=True)], stream)
            return
        codec = self.codec_of(max(src.level, dst.level))
        if src.level == 0:
            pool = dst.pools[0]
            if isinstance(pool, DevicePool):
                if codec.identity:
                    be.copy_pages_batch(_identity_tasks(layout, self._gpu_regions(src),
                                                        pool.region, copy_pairs(d, s), True),
                                        stream)
                    return
                codec.encode(be, layout, self._gpu_regions(src), s, pool.region, d, stream)
                return
            cold = self._page_bytes(dst)
            for lo, hi in self._chunks(len(s), cold):
                staging = self._stage((hi - lo) * cold)
                codec.encode(be, layout, self._gpu_regions(src), s[lo:hi],
                             PageRegion(staging, 0, cold), np.arange(hi - lo, dtype=np.int32),
                             stream)
                (stream or be.default_stream).synchronize()
                view = staging.host_view()[: (hi - lo) * cold].reshape(hi - lo, cold)
                self._put(dst, d[lo:hi], view, None if keys is None else keys[lo:hi])
            return
        pool = src.pools[0]
        if isinstance(pool, DevicePool):
            if codec.identity:
                be.copy_pages_batch(_identity_tasks(layout, self._gpu_regions(dst),
                                                    pool.region, copy_pairs(d, s), False),
                                    stream)
                return
            codec.decode(be, layout, pool.region, s, self._gpu_regions(dst), d, stream)
            return
        cold = self._page_bytes(src)
        for lo, hi in self._chunks(len(s), cold):
            staging = self._stage((hi - lo) * cold)
            view = staging.host_view()[: (hi - lo) * cold].reshape(hi - lo, cold)
            self._get(src, s[lo:hi], view, ok[lo:hi])
            rows = np.arange(hi - lo, dtype=np.int32)
            if codec.identity:  # pinned staging: the copies decode makes (PageCodec.identity)
                be.copy_pages_batch(_identity_tasks(layout, self._gpu_regions(dst),
                                                    PageRegion(staging, 0, cold),
                                                    copy_pairs(d[lo:hi], rows), False), stream)
            else:
                codec.decode(be, layout, PageRegion(staging, 0, cold), rows,
                             self._gpu_regions(dst), d[lo:hi], stream)
            (stream or be.default_stream).synchronize()

    # -- cold <-> cold ---------------------------------------------------------------------

    def _transcode(self, layout: PageLayout, src: Store, s: np.ndarray, dst: Store,
                   d: np.ndarray, stream: Stream | None, keys: np.ndarray | None,
                   ok: np.ndarray) -> None:
        """Decode with the source level's codec into scratch GPU pages, encode those with
        the destination level's codec (chunks of at most the staging limit)."""
        page = layout.page_bytes
        for lo, hi in self._chunks(len(s), page):
            k = hi - lo
            scratch = _ScratchStore(self._scratch_buffer(k * page), layout, k)
            slots = np.arange(k, dtype=np.int32)
            self._copy_gpu(layout, src, s[lo:hi], scratch, slots, stream,  # type: ignore[arg-type]
                           None, ok[lo:hi])
            self._copy_gpu(layout, scratch, slots, dst, d[lo:hi], stream,  # type: ignore[arg-type]
                           None if keys is None else keys[lo:hi], ok[lo:hi])

    def _scratch_buffer(self, nbytes: int) -> Buffer:
        if self._scratch is None or self._scratch.nbytes < nbytes:
            if self._scratch is not None:
                self.backend.synchronize()
                self._scratch.free()
            self._scratch = self.backend.alloc_device(max(nbytes, 1 << 20))
        return self._scratch

    def _copy_cold(self, src: Store, s: np.ndarray, dst: Store, d: np.ndarray,
                   stream: Stream | None, keys: np.ndarray | None, ok: np.ndarray) -> None:
        be = self.backend
        sp, dp = src.pools[0], dst.pools[0]
        cold = self._page_bytes(src)
        if self._page_bytes(dst) != cold:
            raise ValueError(f"cold page sizes differ ({cold} vs {self._page_bytes(dst)})")
        if isinstance(sp, DevicePool) and isinstance(dp, DevicePool):
            be.copy_pages(dp.region, sp.region, cold, copy_pairs(d, s), stream)
            return
        region = sp.region if isinstance(sp, DevicePool) else None
        if region is not None and region.buffer.host_ptr is not None:
            # Host-visible pages (pinned host) to storage: one gather, in the caller's
            # order (the storage pool puts the write in slot order, see below).
            if len(s) == 1 and _ONE_BY_ONE:  # one page: its bytes, sliced
                at = region.offset + int(s[0]) * region.stride
                if at + cold > region.buffer.nbytes:
                    _host_pages(region, cold, int(s[0]) + 1)  # raises, naming the page
                row = region.buffer.host_view()[at : at + cold].reshape(1, cold).copy()
                self._put(dst, d.copy(), row, keys)
                return
            top = int(s.max())
            items = self._host_items(region, cold)
            # The first top + 1 pages: _host_pages(region, cold, top + 1, whole=True), which
            # refuses (the same way) a count the kept view cannot give.
            items = items[: top + 1] if 0 <= top < len(items) else \
                _host_pages(region, cold, top + 1, whole=True)
            # take: fancy indexing's result (the same index rules and errors), by whole
            # rows; NumPy's fancy indexing copies a narrow row (a key) item by item. In
            # the caller's order: a storage pool orders a write itself (the disk tier
            # writes in slot order, a level's held writes are put in slot order when
            # they are flushed), so a sort here would only be done twice.
            rows = items.take(s).view(np.uint8).reshape(len(s), cold)
            self._put(dst, d, rows, keys)
            return
        if isinstance(dp, DevicePool) and dp.region.buffer.host_ptr is not None:
            rows = np.empty((len(s), cold), dtype=np.uint8)
            self._get(src, s, rows, ok)
            _host_pages(dp.region, cold, int(d.max()) + 1, whole=True)[d] = \
                rows.view(_page_item(cold)).reshape(len(d))
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
                self._get(src, s[lo:hi], view, ok[lo:hi])
            if isinstance(dp, DevicePool):
                be.copy_pages(dp.region, PageRegion(staging, 0, cold), cold,
                              copy_pairs(d[lo:hi], np.arange(k)),
                              stream)
                (stream or be.default_stream).synchronize()
            else:
                self._put(dst, d[lo:hi], view, None if keys is None else keys[lo:hi])

    def _host_items(self, region: PageRegion, page_bytes: int) -> np.ndarray:
        """Every whole page of host-visible ``region``: :func:`_host_pages` (``whole``) of
        as many pages as fit, kept per buffer while its host view and the region's
        layout stay the same (a view costs as much as the gather of a small batch)."""
        buffer = region.buffer
        base = buffer.host_view()  # each time: a freed buffer still refuses here
        layout = (region.offset, region.stride, page_bytes)
        kept = self._host.get(id(buffer))
        if kept is not None and kept[0] is base and kept[1] == layout:
            return kept[2]
        count = max(0, (buffer.nbytes - region.offset - page_bytes) // region.stride + 1) \
            if region.stride > 0 else 0  # (none kept: _host_pages answers for such a region)
        items = _host_pages(region, page_bytes, count, whole=True) if count else \
            np.empty(0, dtype=_page_item(page_bytes))
        if len(self._host) >= 16:
            self._host.clear()
        self._host[id(buffer)] = (base, layout, items, buffer)  # (buffer: its id stays its)
        return items

    @staticmethod
    def _chunks(n: int, page: int) -> list[tuple[int, int]]:
        per = max(1, _STAGING_LIMIT // max(page, 1))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


class _ScratchPool(DevicePool):
    """One pool of a transcode's scratch GPU pages: ``count`` slots in a shared buffer."""

    def __init__(self, buffer: Buffer, offset: int, slot_bytes: int, count: int) -> None:
        self._buffer = buffer
        self._offset = offset
        self.slot_bytes = slot_bytes
        self.num_slots = count

    @property
    def buffer(self) -> Buffer:
        return self._buffer

    @property
    def region(self) -> PageRegion:
        return PageRegion(self._buffer, self._offset, self.slot_bytes)

    def resize(self, num_slots: int) -> None:
        raise NotImplementedError("scratch pages do not resize")

    def close(self) -> None:
        pass  # the buffer belongs to the Mover


class _ScratchStore:
    """Level-0 stand-in for :meth:`Mover._copy_gpu`: ``count`` blocks of ``layout`` in
    ``buffer``, pool after pool."""

    level = 0

    def __init__(self, buffer: Buffer, layout: PageLayout, count: int) -> None:
        self.pools: list[DevicePool] = []
        at = 0
        for size in layout.slot_sizes:
            self.pools.append(_ScratchPool(buffer, at, size, count))
            at += size * count


#: Plans kept per pair of stores at most: the manager's own stores make a few dozen pairs;
#: a caller that copies through a new store object each time (the remote level's staging
#: store) would otherwise grow a plan cache, and the stores it holds, without end.
_PLANS_KEPT = 64


def _bounded(plans: dict[Any, Any]) -> dict[Any, Any]:
    """``plans``, emptied first when it holds :data:`_PLANS_KEPT` entries."""
    if len(plans) >= _PLANS_KEPT:
        plans.clear()
    return plans


def order_in_batches(x: np.ndarray, per: int) -> np.ndarray:
    """The permutation that sorts ``x`` within each batch of ``per`` (stable), batches in
    place: one row sort for the whole batches, one sort for the last partial one (array
    methods: ``np.argsort`` adds a dispatch of about a microsecond)."""
    n = len(x)
    if n <= per:
        return x.argsort(kind="stable")
    full = n - n % per
    out = np.empty(n, dtype=np.intp)
    rows = x[:full].reshape(-1, per).argsort(axis=1, kind="stable")
    rows += np.arange(0, full, per)[:, None]
    out[:full] = rows.ravel()
    if full < n:
        out[full:] = full + x[full:].argsort(kind="stable")
    return out


def sort_in_batches(x: np.ndarray, per: int) -> np.ndarray:
    """``x`` sorted within each batch of ``per`` (batches in place): ``x`` permuted by
    :func:`order_in_batches`, without the permutation."""
    n = len(x)
    out = x.copy()
    if n <= per:
        out.sort()
        return out
    full = n - n % per
    out[:full].reshape(-1, per).sort(axis=1)
    if full < n:
        out[full:].sort()
    return out


def _identity_parts(layout: PageLayout, gpu: Sequence[PageRegion], cold: PageRegion,
                    encode: bool) -> list[tuple[PageRegion, PageRegion, int]]:
    """The copies of an identity codec (:attr:`PageCodec.identity`) between GPU pools
    ``gpu`` and cold pages in ``cold``, as ``(dst, src, bytes)``: pool ``k``'s slot
    is bytes ``[o_k, o_k + s_k)`` of the cold page (``o_k`` the slot sizes before it);
    ``encode``: GPU to cold."""
    parts = []
    start = 0
    for region, size in zip(gpu, layout.slot_sizes, strict=True):
        if size > 0:
            part = cold if start == 0 else PageRegion(cold.buffer, cold.offset + start,
                                                      cold.stride)
            parts.append((part, region, size) if encode else (region, part, size))
        start += size
    return parts


def _identity_tasks(layout: PageLayout, gpu: Sequence[PageRegion], cold: PageRegion,
                    pairs: np.ndarray, encode: bool) -> list[CopyTask]:
    """:func:`_identity_parts` as copy tasks of ``pairs`` (``(dst, src)`` page indices)."""
    return [CopyTask(dst, src, size, pairs)
            for dst, src, size in _identity_parts(layout, gpu, cold, encode)]


def _host_pages(region: PageRegion, page_bytes: int, count: int,
                whole: bool = False) -> np.ndarray:
    """``[count, page_bytes]`` host view of a host-visible region's first pages
    (``whole``: ``[count]`` of ``void`` items of ``page_bytes``, so that a fancy index
    copies whole pages rather than byte by byte)."""
    end = region.offset + (count - 1) * region.stride + page_bytes
    if end > region.buffer.nbytes:
        raise ValueError(f"page {count - 1} ends at byte {end}, past the buffer's "
                         f"{region.buffer.nbytes} bytes")
    base = region.buffer.host_view()
    if whole:
        return np.ndarray((count,), dtype=_page_item(page_bytes), buffer=base,
                          offset=region.offset, strides=(region.stride,))
    return np.ndarray((count, page_bytes), dtype=np.uint8, buffer=base, offset=region.offset,
                      strides=(region.stride, 1))


@functools.lru_cache(maxsize=64)
def _page_item(page_bytes: int) -> np.dtype:
    """The ``void`` dtype of one page (kept: making a dtype costs as much as the view)."""
    return np.dtype((np.void, page_bytes))


def _unframe_blob(book: FrameBook, slot: int, blob: bytes, size: int) -> bytes | None:
    """The cold page in a blob frame read from ``slot`` (decompressed by the level's blob
    codec), or None when the frame or the compressed payload is damaged."""
    payload = book.unwrap_blob(slot, blob)
    if payload is not None and book.blob is not None:
        try:
            payload = book.blob.decode(payload, expected_size=size)
        except Exception:  # CorruptPageError, or a codec breaking its contract: damaged
            return None
    return payload if payload is not None and len(payload) == size else None


def _fence_queued(fences: Fences, stream: Stream, parts: tuple[tuple[Store, np.ndarray], ...]
                  ) -> None:
    """A move failed part way (an interrupt, a device error): copies it queued on
    ``stream`` may still run, into slots its caller is about to give back. Fence the
    slots behind them (a later user of the slots waits, as for any move), or, if no event
    can be recorded, wait for the stream on the host. The caller re-raises the first
    error."""
    try:
        fences.record(stream, parts)
        return
    except BaseException:  # (recording failed too: wait for the copies instead)
        pass
    try:
        stream.synchronize()
    except BaseException:  # nothing more can be done for a stream that cannot be waited for
        pass
