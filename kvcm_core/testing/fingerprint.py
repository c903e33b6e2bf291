"""The fingerprint engine: a stand-in model that makes every wrong KV byte visible.

Every step it writes into each page a 16-byte record per token slot encoding
``(token id, position, layer, buffer ordinal << 16 | beam)``, repeated to fill the slot
(see :class:`~kvcm_core.backend.FingerprintPages`), and before writing it checks every
page the request's history needs: needed pages must be valid and hold exactly the records
of the tokens they claim; stale pages must be ``BAD_PAGE_INDEX``. An SSM state page holds
one record ``(crc32 of all tokens so far, history length, layer, buffer)``.

Buffers that a lossy page codec may encode (``bf16``, ``fp16`` or ``fp32``, not ``exact``)
hold KV-like values instead of records: each element is a value in ``[-1, 1)`` hashed from
its token slot's record and its index in the page, rounded to the buffer's dtype, and the
first element of every token slot is an outlier of exactly ``+-8``; token slots past those
written hold zeros. A scale group that holds the start of a written token slot thus always
has the largest magnitude 8, so encoding a page again after more tokens were written to it
gives back the same codes and errors do not add up. Typed pages are written and checked on
the host, within ``8 * error_bound`` of the lossiest codec of the manager's cold levels and
of its shared remote level (exactly without one), while every other buffer (``exact`` ones
included) is checked bit for bit. Another block's or stale values differ by about 1 in most
elements, far beyond that tolerance. Managers with SWA scratch write records into every buffer.

The expected layout (which blocks are stale, where the SSM state lives) is computed here
from the model configuration, independently of the manager's own code. Checks and writes
of many requests are batched into one call of the backend's fingerprint kernels, so a
CUDA backend runs them as kernels.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.backend import BAD_PAGE_INDEX, FingerprintPages
from kvcm_core.config import AttentionLayerConfig, SsmLayerConfig
from kvcm_core.errors import KvcmError
from kvcm_core.radix import token_id32
from kvcm_core.testing.values import ITEMSIZE, from_bytes, round_to, to_bytes

__all__ = ["FingerprintEngine", "FingerprintMismatch", "StepWork", "token_ids"]


class FingerprintMismatch(KvcmError):
    """A page did not hold what the request's history says it must."""


@attrs.frozen
class _Buffer:
    layer_id: int
    role: str
    ordinal: int
    group: int
    size: int
    is_ssm: bool
    window: int | None
    sink_blocks: int
    typed: str | None = None  # dtype of KV-like contents (lossy-encodable buffers)


_OUTLIER = 8.0  # magnitude of the outlier elements of typed contents


def _typed_values(record: np.ndarray, index: np.ndarray, first: np.ndarray) -> np.ndarray:
    """KV-like fp32 values of elements ``index`` of token slots with ``record`` (uint32
    ``[n, 4]``, one row per element): a hash mapped to ``[-1, 1)``; ``+-8`` where
    ``first`` (the first element of a token slot)."""
    with np.errstate(over="ignore"):
        x = (record[:, 0] * np.uint32(0x9E3779B1)) ^ (record[:, 1] * np.uint32(0x85EBCA77))
        x ^= (record[:, 2] * np.uint32(0xC2B2AE3D)) ^ (record[:, 3] * np.uint32(0x27D4EB2F))
        x ^= index.astype(np.uint32) * np.uint32(0x165667B1)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
    u = (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-23) - np.float32(1.0)
    outlier = np.where(u < 0, np.float32(-_OUTLIER), np.float32(_OUTLIER))
    return np.where(first, outlier, u).astype(np.float32)


def _stale(buf: _Buffer, history: int, tpb: int) -> tuple[int, int]:
    """The spec's stale range, computed from the layer config (not the manager)."""
    if buf.is_ssm:
        return 0, history // tpb
    if buf.window is None:
        return 0, 0
    start = min(-(-history // tpb), buf.sink_blocks)
    return start, max(start, (history + 1 - buf.window) // tpb)


@attrs.define
class StepWork:
    """One request's step: check ``[0, history)``, then write ``[history, capacity)``."""

    cache: Any
    tokens: Sequence[Any]  # the request's tokens, at least up to capacity
    beam: int = 0


def token_ids(tokens: Sequence[Any], n: int) -> np.ndarray:
    """The uint32 record ids of the first ``n`` tokens."""
    return _ids(tokens, n)


def _ids(tokens: Sequence[Any], n: int) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        out = tokens[:n].astype(np.int64).astype(np.uint32)
    else:
        out = np.fromiter((_record_id(t) for t in tokens[:n]), dtype=np.uint32, count=n)
    return out


def _record_id(item: Any) -> int:
    """A token's id in records; a digest's from all its bytes (the core's 32-bit id of a
    digest is its first 4 bytes, which an int token or another digest may share: records
    by that id could not tell KV shared across them)."""
    if isinstance(item, bytes | bytearray):
        return zlib.crc32(item) ^ 0x6D6D0000
    return token_id32(item)


def prefix_crc(tokens: Sequence[Any], n: int) -> int:
    """The SSM record's state id: crc32 of the first ``n`` token ids."""
    return zlib.crc32(_ids(tokens, n).astype("<u4").tobytes())


class FingerprintEngine:
    """Drives checks and writes for a :class:`~kvcm_core.KVCacheManager`.

    Args:
        manager: the manager whose pages are checked.
    """

    def __init__(self, manager: Any, batch: Any = None) -> None:
        self.manager = manager
        self._owners = np.zeros(0, dtype=np.int64)  # the last _rows: each row's request
        #: The stream the engine's kernels run on (None: the backend's default stream);
        #: pages are written and checked only after what the manager made it wait for.
        self.stream: Any = None
        #: When set, the page tables of caches seated in this Batch are read from its
        #: published device tables instead of from the caches.
        self.batch = batch
        self.backend = manager.backend
        self.tpb = manager.tokens_per_block
        tpb = self.tpb
        buffers = []
        records_only = manager.config.swa_scratch is not None
        for layer in manager.config.layers:
            for ordinal, buf in enumerate(layer.buffers):
                if buf.size == 0:
                    continue
                group = manager.get_buffer_group_id(layer.layer_id, buf.role)
                typed = None if (records_only or layer.effective_exact(buf)
                                 or buf.dtype not in ITEMSIZE) else buf.dtype
                if isinstance(layer, SsmLayerConfig):
                    buffers.append(_Buffer(layer.layer_id, buf.role, ordinal, group, buf.size,
                                           True, None, 0, typed))
                else:
                    assert isinstance(layer, AttentionLayerConfig)
                    buffers.append(_Buffer(
                        layer.layer_id, buf.role, ordinal, group, buf.size, False,
                        layer.sliding_window_size, -(-layer.num_sink_tokens // tpb), typed))
        self.buffers: tuple[_Buffer, ...] = tuple(buffers)
        self._by_tag = {(b.layer_id, b.ordinal): b for b in buffers}
        self._typed_any = any(b.typed for b in buffers)
        remote = getattr(manager, "remote", None)  # a shared level's pages are pulled in
        codecs = [*getattr(manager, "codecs", ()), remote.codec if remote is not None else None]
        bounds = [c.error_bound for c in codecs
                  if c is not None and not c.lossless and c.error_bound is not None]
        #: Largest error allowed per element of a typed buffer (0: exact).
        self.typed_tolerance = _OUTLIER * max(bounds, default=0.0)
        # SWA scratch: the layers in the order a model runs them, and every attention
        # buffer's converter (its pool base is read at each use: page index i is at
        # pool_base + i * size, and a resize of level 0 moves the pools).
        self._layer_order = sorted({b.layer_id for b in buffers if not b.is_ssm})
        self._conv = {(b.layer_id, b.role): manager.get_page_index_converter(b.layer_id, b.role)
                      for b in buffers if not b.is_ssm}
        self.checked_pages = 0
        self.written_pages = 0
        #: Writes a step's sparse tokens into GPU entries (``SparseSteps``); when set, the
        #: sparse buffers' host pages are written by flushes only.
        self.entry_writer: Any = None
        self._sparse = {(layer.layer_id, buf.role) for layer in manager.config.layers
                        for buf in layer.buffers if getattr(buf, "is_sparse", False)}
        self._ssm_pending: dict[int, StepWork] = {}  # id(cache) -> state to reconstruct

    # -- building page batches ------------------------------------------------------------

    def _rows(self, work: Iterable[StepWork], writing: bool, *,
              only_blocks: dict[int, list[int]] | None = None,
              ssm_only: bool = False, typed: bool = False) -> FingerprintPages | None:
        """Pages to check (``writing=False``: ``[0, history)``) or write (``[history,
        capacity)``). ``only_blocks`` restricts attention rows to those blocks of
        ``[0, history)`` (recompute); ``ssm_only`` keeps SSM rows only; ``typed`` selects
        the buffers with KV-like contents, else those with records."""
        tpb = self.tpb
        m = self.manager
        addr: list[np.ndarray] = []
        nbytes: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        tok: list[np.ndarray] = []
        begin: list[np.ndarray] = []
        end: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        tags: list[np.ndarray] = []
        owners: list[np.ndarray] = []  # the index in ``work`` of each row's request
        bases = {(b.layer_id, b.role): (m.get_mem_pool_base_address(b.layer_id, b.role),
                                        m.get_page_stride(b.layer_id, b.role))
                 for b in self.buffers}
        for wi, w in enumerate(work):
            cache = w.cache
            hist = cache.history_length
            cap = cache.capacity
            nb = -(-cap // tpb)
            if writing and only_blocks is None:
                lo, hi = hist, cap
            else:
                lo, hi = 0, hist
            ntok = -(-max(cap, hist) // tpb) * tpb
            ids = np.zeros(ntok, dtype=np.uint32)
            known = min(len(w.tokens), max(cap, hist))
            ids[:known] = _ids(w.tokens, known)
            block_ids = ids.reshape(-1, tpb) if ntok else ids.reshape(0, tpb)
            tables: dict[int, np.ndarray] = {}
            fork = cache.beam_fork(w.beam) if w.beam else 0
            for buf in self.buffers:
                if bool(buf.typed) != typed:
                    continue
                table = tables.get(buf.group)
                if table is None:
                    table = self._table(cache, buf.group, w.beam)
                    tables[buf.group] = table
                    # A pass that writes no new token reads or rewrites history only:
                    # an SWA scratch group's block after it may lack a page (the scratch
                    # blocks of a step a suspend interrupted, until the next resize).
                    upto = None if (writing and only_blocks is None) or \
                        buf.group not in m.scratch_groups else -(-hist // tpb)
                    self._check_table(cache, buf, table, nb, upto)
                base, stride = bases[(buf.layer_id, buf.role)]
                if buf.is_ssm:
                    if only_blocks is not None:
                        continue
                    if writing:
                        state_at = cap
                    elif hist == 0:
                        continue  # a fresh state holds nothing to check
                    else:
                        state_at = hist
                    slot = int(table[hist // tpb]) if hist // tpb < nb else None
                    if slot is None:
                        if writing and cap > hist:
                            raise FingerprintMismatch(
                                f"cache {cache.id!r}: no SSM state page at block "
                                f"{hist // tpb} for layer {buf.layer_id}/{buf.role}")
                        continue
                    addr.append(np.array([base + slot * stride], dtype=np.int64))
                    owners.append(np.array([wi], dtype=np.int64))
                    nbytes.append(np.array([buf.size], dtype=np.int64))
                    slots.append(np.array([1], dtype=np.int32))
                    row = np.zeros((1, tpb), dtype=np.uint32)
                    row[0, 0] = prefix_crc(w.tokens, state_at)
                    tok.append(row)
                    begin.append(np.array([0], dtype=np.int32))
                    end.append(np.array([1], dtype=np.int32))
                    pos.append(np.array([state_at], dtype=np.int64))
                    # A forked beam's state is beam 0's until the beam writes its own.
                    writer = w.beam if state_at > fork else 0
                    tags.append(np.array([[buf.layer_id, (buf.ordinal << 16) | writer]],
                                         dtype=np.uint32))
                    continue
                if hi <= lo or ssm_only:
                    continue
                if writing and only_blocks is None and self.entry_writer is not None and \
                        (buf.layer_id, buf.role) in self._sparse:
                    continue  # written into entries, reaching the host by flushes
                s0, s1 = _stale(buf, hist, tpb)
                # Positions below a beam's fork were written by beam 0 (shared or copied).
                segments = [(lo, min(hi, fork), 0), (max(lo, fork), hi, w.beam)] \
                    if w.beam else [(lo, hi, 0)]
                for seg_lo, seg_hi, writer in segments:
                    if seg_hi <= seg_lo:
                        continue
                    blocks = np.arange(seg_lo // tpb, -(-seg_hi // tpb))
                    blocks = blocks[(blocks < s0) | (blocks >= s1)]
                    if only_blocks is not None:
                        blocks = blocks[np.isin(blocks, only_blocks.get(buf.group, []))]
                    if blocks.size == 0:
                        continue
                    sl = table[blocks].astype(np.int64)
                    addr.append(base + sl * stride)
                    owners.append(np.full(blocks.size, wi, dtype=np.int64))
                    nbytes.append(np.full(blocks.size, buf.size, dtype=np.int64))
                    slots.append(np.full(blocks.size, tpb, dtype=np.int32))
                    tok.append(block_ids[blocks])
                    first = blocks * tpb
                    begin.append(np.clip(seg_lo - first, 0, tpb).astype(np.int32))
                    end.append(np.clip(seg_hi - first, 0, tpb).astype(np.int32))
                    pos.append(first.astype(np.int64))
                    seg_tag = np.array([buf.layer_id, (buf.ordinal << 16) | writer],
                                       dtype=np.uint32)
                    tags.append(np.broadcast_to(seg_tag, (blocks.size, 2)))
        if not addr:
            return None
        self._owners = np.concatenate(owners)
        return FingerprintPages(
            addresses=np.concatenate(addr), page_bytes=np.concatenate(nbytes),
            record_slots=np.concatenate(slots), token_ids=np.concatenate(tok),
            begin=np.concatenate(begin), end=np.concatenate(end),
            positions=np.concatenate(pos), tags=np.concatenate(tags).astype(np.uint32),
        )

    def _table(self, cache: Any, group: int, beam: int) -> np.ndarray:
        """A cache's base page table, through the batch when it is seated there."""
        row = None if self.batch is None else self.batch.row_of(cache)
        if row is None:
            return np.asarray(cache.get_base_page_indices(group, beam))
        nb = int(self.batch.read_num_blocks(group)[row])
        return self.batch.read_page_table(group)[row, beam, :nb]

    def check_batch(self) -> None:
        """Check the batch's published tables against its members' own page tables: for
        every row and cache group, the block count and every beam's row of the device
        table (what a kernel reads) equal the seated cache's ``get_base_page_indices``,
        entries past them are ``BAD_PAGE_INDEX``; an empty row has 0 blocks and ``BAD``
        everywhere. Every registered index table's row equals the cache's page table
        converted here (the buffer's page-index converter, SWA scratch included), ``BAD``
        past it and in empty rows. Call it right after a publish (the tables are read back
        from the device).

        Raises:
            FingerprintMismatch: naming the row, the cache and the group.
        """
        batch = self.batch
        if batch is None:
            return
        members = batch.members
        for g in range(self.manager.num_cache_groups):
            table = batch.read_page_table(g)
            counts = np.asarray(batch.read_num_blocks(g)).reshape(-1)
            for row, cache in enumerate(members):
                got = table[row]
                if cache is None:
                    if counts[row] != 0 or np.any(got != BAD_PAGE_INDEX):
                        raise FingerprintMismatch(
                            f"batch row {row} is empty but group {g} shows {counts[row]} "
                            f"blocks / pages {got[got != BAD_PAGE_INDEX][:8].tolist()}")
                    continue
                width = cache.beam_width
                for beam in range(got.shape[0]):
                    want = np.asarray(cache.get_base_page_indices(g, beam)) \
                        if beam < width else np.zeros(0, dtype=np.int64)
                    n = want.size
                    if beam == 0 and counts[row] != n:
                        raise FingerprintMismatch(
                            f"batch row {row} (cache {cache.id!r}) group {g}: block count "
                            f"{counts[row]}, the cache's page table has {n} blocks")
                    if not (np.array_equal(got[beam, :n], want)
                            and np.all(got[beam, n:] == BAD_PAGE_INDEX)):
                        bad = np.flatnonzero(got[beam, :n] != want)
                        at = int(bad[0]) if bad.size else n
                        raise FingerprintMismatch(
                            f"batch row {row} (cache {cache.id!r}) group {g} beam {beam}: "
                            f"the device table differs from the cache's page table at "
                            f"block {at} (device {got[beam, at:at + 4].tolist()}, cache "
                            f"{want[at:at + 4].tolist()})")
        for buf in self.buffers:  # the registered index tables: converted here, compared
            key = (buf.layer_id, buf.role)
            if buf.is_ssm or not batch.has_index_table(*key):
                continue
            index = batch.read_index_table(*key)
            for row, cache in enumerate(members):
                got = index[row]
                width = 0 if cache is None else cache.beam_width
                for beam in range(got.shape[0]):
                    want = np.zeros(0, dtype=np.int64) if beam >= width else \
                        np.asarray(self._conv[key].convert(
                            np.asarray(cache.get_base_page_indices(buf.group, beam)),
                            self._scratch_desc(cache, buf.group)))
                    n = want.size
                    if not (np.array_equal(got[beam, :n], want)
                            and np.all(got[beam, n:] == BAD_PAGE_INDEX)):
                        bad = np.flatnonzero(got[beam, :n] != want)
                        at = int(bad[0]) if bad.size else n
                        who = "empty" if cache is None else f"cache {cache.id!r}"
                        raise FingerprintMismatch(
                            f"batch row {row} ({who}) index table of layer {buf.layer_id}/"
                            f"{buf.role} beam {beam}: the device table differs from the "
                            f"cache's converted page table at entry {at} (device "
                            f"{got[beam, at:at + 4].tolist()}, expected "
                            f"{want[at:at + 4].tolist()})")

    def _index(self, cache: Any, buf: _Buffer, beam: int, nb: int) -> np.ndarray:
        """A buffer's page indices for a cache: the batch's registered index table when
        the cache is seated and the table registered, else converted here."""
        key = (buf.layer_id, buf.role)
        row = None if self.batch is None else self.batch.row_of(cache)
        if row is not None and self.batch.has_index_table(*key):
            exp = self._conv[key].expansion
            return self.batch.read_index_table(*key)[row, beam, : nb * exp]
        table = self._table(cache, buf.group, beam)
        return self._conv[key].convert(table, self._scratch_desc(cache, buf.group))

    def _check_table(self, cache: Any, buf: _Buffer, table: np.ndarray, nb: int,
                     upto: int | None = None) -> None:
        """Stale and unused entries are BAD; needed entries are valid slot ids (``upto``:
        only blocks below it are needed)."""
        tpb = self.tpb
        hist = cache.history_length
        where = f"cache {cache.id!r} group {buf.group} (layer {buf.layer_id}/{buf.role})"
        if table.shape != (nb,):
            raise FingerprintMismatch(f"{where}: page table has shape {table.shape}, "
                                      f"expected ({nb},)")
        num_slots = self.manager.stores[0][
            self.manager.layout.group_to_pool_group[buf.group]].num_slots
        if buf.is_ssm:
            live = hist // tpb
            for b in range(nb):
                v = int(table[b])
                if b == live:
                    if not 0 <= v < num_slots:
                        raise FingerprintMismatch(f"{where}: SSM state page {v} invalid")
                elif v != BAD_PAGE_INDEX:
                    raise FingerprintMismatch(
                        f"{where}: SSM block {b} is {v}, expected BAD_PAGE_INDEX (state "
                        f"lives at block {live})")
            return
        s0, s1 = _stale(buf, hist, tpb)
        stale = table[s0:s1]
        if np.any(stale != BAD_PAGE_INDEX):
            raise FingerprintMismatch(f"{where}: stale blocks [{s0}, {s1}) hold {stale}, "
                                      "expected BAD_PAGE_INDEX")
        desc = self._scratch_desc(cache, buf.group)
        if desc is None and upto is None:
            needed = np.concatenate([table[:s0], table[s1:]])
        else:
            keep = np.ones(nb, dtype=bool)
            keep[s0:s1] = False
            if desc is not None:
                self._check_scratch(cache, buf, table, nb, desc, num_slots, where)
                keep[desc.begin : desc.end] = False
            if upto is not None:
                keep[upto:] = False
            needed = table[keep]
        if needed.size and (needed.min() < 0 or needed.max() >= num_slots):
            raise FingerprintMismatch(f"{where}: needed blocks have invalid pages {table}")
        if len(np.unique(needed)) != needed.size:
            raise FingerprintMismatch(f"{where}: two blocks share one page: {table}")

    # -- SWA scratch: layer by layer ------------------------------------------------------------

    @staticmethod
    def _scratch_desc(cache: Any, group: int) -> Any:
        get = getattr(cache, "scratch", None)
        return None if get is None else get(group)

    def _has_scratch(self, cache: Any) -> bool:
        return any(self._scratch_desc(cache, g) is not None
                   for g in {b.group for b in self.buffers if not b.is_ssm})

    def _check_scratch(self, cache: Any, buf: _Buffer, table: np.ndarray, nb: int, desc: Any,
                       num_slots: int, where: str) -> None:
        """The scratch rule, from the layer config: scratch blocks start at or after
        history, end within capacity, and are stale once history reaches ``max(0,
        capacity - max_rewind_len)`` (never sinks); they show BAD; their slot ids are
        valid, distinct, enough for the range, and no page of the cache in that pool group.
        """
        tpb = self.tpb
        m = self.manager
        hist, cap = cache.history_length, cache.capacity
        keep = max(0, cap - m.config.max_rewind_len)
        k0, k1 = _stale(buf, keep, tpb)
        b0, b1 = desc.begin, desc.end
        if not (-(-hist // tpb) <= b0 < b1 <= nb and k0 <= b0 and b1 <= k1):
            raise FingerprintMismatch(
                f"{where}: scratch blocks [{b0}, {b1}) break the rule: they must start at or "
                f"after history ({hist} tokens) and be stale at {keep} tokens (stale "
                f"[{k0}, {k1}), {nb} blocks)")
        if np.any(table[b0:b1] != BAD_PAGE_INDEX):
            raise FingerprintMismatch(f"{where}: scratch blocks [{b0}, {b1}) hold pages "
                                      f"{table[b0:b1]}, expected BAD_PAGE_INDEX")
        ids = np.asarray(desc.slot_ids, dtype=np.int64)
        conv = self._conv[(buf.layer_id, buf.role)]
        spb = desc.scratch_pages_per_block
        want = -(-(b1 - b0) * spb // conv.scale)
        if (ids.size < want or len(np.unique(ids)) != ids.size
                or (ids.size and (ids.min() < 0 or ids.max() >= num_slots))):
            raise FingerprintMismatch(f"{where}: scratch slots {desc.slot_ids} invalid for "
                                      f"{b1 - b0} blocks of {spb} sub-pages ({want} needed)")
        pool_group = m.layout.group_to_pool_group[buf.group]
        for g, pgid in m.layout.group_to_pool_group.items():
            if pgid == pool_group:
                used = np.asarray(cache.get_base_page_indices(g))
                if np.isin(ids, used).any():
                    raise FingerprintMismatch(f"{where}: a scratch slot of {desc.slot_ids} "
                                              f"is also a page of group {g}: {used}")

    def _layer_pages(self, work: list[StepWork], layer_id: int,
                     writing: bool) -> FingerprintPages | None:
        """One layer's attention pages: ``writing``: the records of ``[history,
        capacity)``; else every page the chunk's queries read (blocks not stale at history
        and below ``ceil(capacity / tpb)``, with their tokens below capacity). Pages are
        addressed through the page-index converter (scratch blocks included)."""
        tpb = self.tpb
        m = self.manager
        addr, nbytes, tok, begin, end, pos, tags = [], [], [], [], [], [], []
        pool_base = {(b.layer_id, b.role): m.get_mem_pool_base_address(b.layer_id, b.role)
                     - m.buffer_attr(b.layer_id, b.role).offset
                     for b in self.buffers if b.layer_id == layer_id and not b.is_ssm}
        for w in work:
            cache = w.cache
            hist, cap = cache.history_length, cache.capacity
            nb = -(-cap // tpb)
            if cap <= hist:
                continue
            ids = np.zeros(nb * tpb, dtype=np.uint32)
            known = min(len(w.tokens), cap)
            ids[:known] = _ids(w.tokens, known)
            block_ids = ids.reshape(nb, tpb)
            for buf in self.buffers:
                if buf.layer_id != layer_id or buf.is_ssm:
                    continue
                key = (buf.layer_id, buf.role)
                index = self._index(cache, buf, w.beam, nb)
                s0, s1 = _stale(buf, hist, tpb)
                blocks = np.arange(hist // tpb if writing else 0, nb)
                blocks = blocks[(blocks < s0) | (blocks >= s1)]
                if blocks.size == 0:
                    continue
                idx = index[blocks].astype(np.int64)
                if np.any(idx == BAD_PAGE_INDEX):
                    raise FingerprintMismatch(
                        f"cache {cache.id!r} layer {buf.layer_id}/{buf.role}: blocks "
                        f"{blocks[idx == BAD_PAGE_INDEX].tolist()} have no page index")
                first = blocks * tpb
                addr.append(pool_base[key] + idx * buf.size)
                nbytes.append(np.full(blocks.size, buf.size, dtype=np.int64))
                tok.append(block_ids[blocks])
                lo = hist if writing else 0
                begin.append(np.clip(lo - first, 0, tpb).astype(np.int32))
                end.append(np.clip(cap - first, 0, tpb).astype(np.int32))
                pos.append(first.astype(np.int64))
                tag = np.array([buf.layer_id, (buf.ordinal << 16) | w.beam], dtype=np.uint32)
                tags.append(np.broadcast_to(tag, (blocks.size, 2)))
        if not addr:
            return None
        n = sum(len(a) for a in addr)
        return FingerprintPages(
            addresses=np.concatenate(addr), page_bytes=np.concatenate(nbytes),
            record_slots=np.full(n, tpb, dtype=np.int32), token_ids=np.concatenate(tok),
            begin=np.concatenate(begin), end=np.concatenate(end),
            positions=np.concatenate(pos), tags=np.concatenate(tags).astype(np.uint32),
        )

    def _write_by_layer(self, work: list[StepWork]) -> None:
        """The write step of caches with scratch blocks, the way a model runs: SSM state
        first, then for each layer (by layer id) write its records of ``[history,
        capacity)`` and at once check every page its attention reads this step, before the
        next layer overwrites the scratch sub-pages."""
        pages = self._rows(work, writing=True, ssm_only=True)
        if pages is not None:
            self.backend.fingerprint_write(pages, self.stream)
            self.written_pages += len(pages)
        for layer_id in self._layer_order:
            pages = self._layer_pages(work, layer_id, writing=True)
            if pages is None:
                continue
            self.backend.fingerprint_write(pages, self.stream)
            self.written_pages += len(pages)
            pages = self._layer_pages(work, layer_id, writing=False)
            assert pages is not None
            ok = self.backend.fingerprint_check(pages, self.stream)
            self.checked_pages += len(pages)
            if not ok.all():
                bad = int(np.nonzero(~ok)[0][0])
                raise FingerprintMismatch(
                    f"layer {layer_id}, right after writing it: page at address "
                    f"{int(pages.addresses[bad]):#x} (positions "
                    f"{int(pages.positions[bad]) + int(pages.begin[bad])}.."
                    f"{int(pages.positions[bad]) + int(pages.end[bad]) - 1}, buffer "
                    f"{int(pages.tags[bad, 1]) >> 16}) does not hold its tokens' records; "
                    f"{int((~ok).sum())} bad pages of {len(ok)} "
                    f"({', '.join(repr(w.cache.id) for w in work[:8])})")

    # -- writing and checking pages --------------------------------------------------------

    def _put(self, work: list[StepWork], writing: bool, **select: Any) -> None:
        """Write the rows :meth:`_rows` selects: records by the backend's kernel, KV-like
        contents of typed buffers on the host."""
        for typed in (False, True) if self._typed_any else (False,):
            pages = self._rows(work, writing, typed=typed, **select)
            if pages is None:
                continue
            if typed:
                self._typed_write(pages)
            else:
                self.backend.fingerprint_write(pages, self.stream)
            self.written_pages += len(pages)

    def _typed_batches(self, pages: FingerprintPages) -> Any:
        """Rows of typed pages grouped by buffer: ``(buffer record, its memory, row
        numbers, byte offsets of the pages in that memory)``."""
        keys = pages.tags[:, 0].astype(np.int64) << 32 | (pages.tags[:, 1] >> 16)
        for key in np.unique(keys).tolist():
            rows = np.flatnonzero(keys == key)
            buf = self._by_tag[(key >> 32, key & 0xFFFF)]
            memory = self.manager.get_page_region(buf.layer_id, buf.role).buffer
            yield buf, memory, rows, pages.addresses[rows].astype(np.int64) - memory.ptr

    @staticmethod
    def _typed_expected(pages: FingerprintPages, rows: np.ndarray, buf: _Buffer
                        ) -> tuple[np.ndarray, np.ndarray]:
        """The token slot of every element of the rows' pages (``[n, E]``) and the
        elements' values as fp32 in the buffer's dtype (what slots in ``[begin, end)``
        must hold)."""
        assert buf.typed is not None
        item = ITEMSIZE[buf.typed]
        p, r = buf.size, int(pages.record_slots[rows[0]])
        index = np.arange(p // item, dtype=np.int64)
        slots = ((index * item + 1) * r - 1) // p
        first = np.diff(slots, prepend=-1) != 0
        slot = np.broadcast_to(slots, (len(rows), len(index)))
        record = np.empty((len(rows), len(index), 4), dtype=np.uint32)
        record[..., 0] = np.take_along_axis(pages.token_ids[rows], slot, axis=1)
        record[..., 1] = (pages.positions[rows, None] + slot).astype(np.uint32)
        record[..., 2:] = pages.tags[rows, None, :]
        values = _typed_values(record.reshape(-1, 4), np.tile(index, len(rows)),
                               np.tile(first, len(rows)))
        return slot, round_to(values, buf.typed).reshape(slot.shape)

    def _read_pages(self, memory: Any, offsets: np.ndarray, nbytes: int) -> np.ndarray:
        if memory.host_ptr is not None:
            return memory.host_view()[offsets[:, None] + np.arange(nbytes)]
        return np.stack([self.backend.read(memory, int(o), nbytes) for o in offsets.tolist()])

    def _write_pages(self, memory: Any, offsets: np.ndarray, data: np.ndarray) -> None:
        if memory.host_ptr is not None:
            memory.host_view()[offsets[:, None] + np.arange(data.shape[1])] = data
            return
        for o, row in zip(offsets.tolist(), data, strict=True):
            self.backend.write(memory, int(o), row)

    def _typed_write(self, pages: FingerprintPages) -> None:
        self.backend.synchronize()
        for buf, memory, rows, offsets in self._typed_batches(pages):
            assert buf.typed is not None
            item = ITEMSIZE[buf.typed]
            slot, want = self._typed_expected(pages, rows, buf)
            n, e = slot.shape
            elems = self._read_pages(memory, offsets, e * item).reshape(n, e, item)
            keep = np.where(slot < pages.end[rows, None], want, np.float32(0.0))
            new = to_bytes(keep.reshape(n, e, 1), buf.typed)
            write = slot >= pages.begin[rows, None]
            elems[write] = new[write]
            self._write_pages(memory, offsets, elems.reshape(n, -1))

    def _typed_check(self, pages: FingerprintPages) -> None:
        tol = self.typed_tolerance
        self.backend.synchronize()
        for buf, memory, rows, offsets in self._typed_batches(pages):
            assert buf.typed is not None
            slot, want = self._typed_expected(pages, rows, buf)
            raw = self._read_pages(memory, offsets, slot.shape[1] * ITEMSIZE[buf.typed])
            got = from_bytes(raw.reshape(-1), buf.typed).reshape(slot.shape)
            sel = (slot >= pages.begin[rows, None]) & (slot < pages.end[rows, None])
            error = np.where(sel, np.abs(got.astype(np.float64) - want), 0.0)
            self.checked_pages += len(rows)
            bad = ~np.all(error <= tol, axis=1)  # NaN fails too
            if bad.any():
                i = int(rows[np.flatnonzero(bad)[0]])
                raise FingerprintMismatch(
                    f"typed page of layer {buf.layer_id}/{buf.role} at address "
                    f"{int(pages.addresses[i]):#x} (positions {int(pages.positions[i])}+"
                    f"[{int(pages.begin[i])}, {int(pages.end[i])})): error beyond {tol} "
                    f"({buf.typed} values of its tokens expected); {int(bad.sum())} bad "
                    f"pages of {len(rows)}")

    # -- the two steps --------------------------------------------------------------------------

    def recompute(self, work: Iterable[StepWork]) -> None:
        """After a first resume: write the records of blocks the cache got fresh although
        its history covers them (``cache.recompute_blocks``), as a model recomputing them
        would. SSM state is reconstructed at the next check, once its page is in the table.
        """
        for w in work:
            cache = w.cache
            groups = {buf.group for buf in self.buffers}
            blocks = {g: cache.recompute_blocks(g) for g in groups}
            if any(-1 in b for b in blocks.values()):
                self._ssm_pending[id(cache)] = w
            attn = {g: [b for b in bl if b >= 0] for g, bl in blocks.items()}
            if any(attn.values()):
                self._put([w], writing=True, only_blocks=attn)

    def _reconstruct_ssm(self, work: list[StepWork]) -> None:
        todo = [w for w in work if id(w.cache) in self._ssm_pending]
        if not todo:
            return
        ready = []
        for w in todo:
            cache = w.cache
            if cache.history_length // self.tpb < -(-cache.capacity // self.tpb):
                ready.append(w)
                del self._ssm_pending[id(cache)]
        if ready:
            self._put(ready, writing=False, ssm_only=True)

    def check(self, work: Iterable[StepWork]) -> None:
        """Check every page the requests' histories need.

        Raises:
            FingerprintMismatch: naming the request, layer, buffer and block.
        """
        work = list(work)
        if self._ssm_pending:
            self._reconstruct_ssm(work)
        if self._typed_any:
            typed = self._rows(work, writing=False, typed=True)
            if typed is not None:
                self._typed_check(typed)
        pages = self._rows(work, writing=False)
        if pages is None:
            return
        ok = self.backend.fingerprint_check(pages, self.stream)
        self.checked_pages += len(pages)
        if not ok.all():
            bad = int(np.nonzero(~ok)[0][0])
            owner = work[int(self._owners[bad])].cache.id
            raise FingerprintMismatch(
                f"request {owner!r}: page at address {int(pages.addresses[bad]):#x} "
                f"(block {int(pages.positions[bad]) // self.tpb}, positions "
                f"{int(pages.positions[bad]) + int(pages.begin[bad])}.."
                f"{int(pages.positions[bad]) + int(pages.end[bad]) - 1}, layer "
                f"{int(pages.tags[bad, 0])}, buffer {int(pages.tags[bad, 1]) >> 16}) does "
                f"not hold its tokens' records; {int((~ok).sum())} bad pages of "
                f"{len(ok)} in this check ({', '.join(repr(w.cache.id) for w in work[:8])})"
            )

    def write(self, work: Iterable[StepWork]) -> None:
        """Write the records of ``[history, capacity)`` (and the SSM state at capacity).

        Caches with SWA scratch blocks this step are written layer by layer, each layer
        checked right after it is written (see :meth:`_write_by_layer`)."""
        work = list(work)
        layered = ([w for w in work if self._has_scratch(w.cache)]
                   if self.manager.config.swa_scratch is not None else [])
        if layered:
            self._write_by_layer(layered)
            work = [w for w in work if not any(w is x for x in layered)]
        if self.entry_writer is not None:
            self.written_pages += self.entry_writer.write_entries(work)
        self._put(work, writing=True)

    def step(self, work: Sequence[StepWork]) -> None:
        """Check, then write: what the model would read and write this step."""
        self.check(work)
        self.write(work)
