"""``Batch``: the device-side page tables of the running requests.

A batch owns, per cache group, a device page table ``[max_rows, max_beam_width,
max_blocks_per_row]`` of int32 slot ids (``BAD_PAGE_INDEX`` padding) and a device array of
per-row block counts, plus the converted page-index tables the engine registers. Every
table is allocated once: its address never changes for the batch's life, so CUDA graphs
can capture kernels that read it.

Rows are stable seats of ACTIVE caches. A member's page table changes only through calls
the engine makes (resize, commit with rebasing, scratch and stale-range changes, beam
width); each such change moves the cache's ``page_table_version`` and marks its row dirty
(``mark_dirty``), and ``publish`` uploads exactly the dirty rows (with rows seated, moved
or emptied since the last publish) in one batched copy from pinned host staging.

Design choices (see docs/batch.md):

- The host staging mirrors the device tables row for row; ``publish`` rebuilds a dirty
  row from the member's own tables, so the device never holds a row the host cannot
  explain.
- Registered index tables are converted on the device from the uploaded base rows, the
  dirty rows only, in one ``convert_page_tables`` call (``BAD_PAGE_INDEX`` stays as it
  is).
- ``record_read(stream)`` records a reader fence; removing a member, and any release of a
  seated member's pages, waits for the last fence first, so a kernel still reading the
  old table never sees a page reused under it.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.backend import BAD_PAGE_INDEX, Buffer, CopyTask, PageRegion, TableConversion
from kvcm_core.cache_base import CacheStatus
from kvcm_core.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidStateError,
    KvcmError,
    OutOfPagesError,
)
from kvcm_core.manager import KVCacheManager
from kvcm_core.pagetable import ScratchDesc
from kvcm_core.sparse.arena import SparseArena

if TYPE_CHECKING:
    from kvcm_core.backend import Event, KernelBackend, Stream

__all__ = ["Batch", "IndexMode"]


class IndexMode(enum.Enum):
    """Index space of a converted table.

    SHARED: one index space per pool (``slot * scale + offset``: a buffer's pages counted
    from the pool's base in units of the buffer's page size). PER_LAYER: the layer's own
    pages (``slot``; the kernel adds ``get_mem_pool_base_address`` of the buffer and
    strides by ``get_page_stride``).
    """

    SHARED = "shared"
    PER_LAYER = "per_layer"


#: Entries of one page table at most (kernels index a table with int32).
_MAX_TABLE_ENTRIES = (1 << 31) - 1


def _count(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentTypeError(f"{name}={value!r}: must be an int")
    if value < low:
        raise InvalidArgumentError(f"{name}={value!r}: must be >= {low}")
    return int(value)


@attrs.define
class _Table:
    """One int32 device table (row-major ``shape``), with pinned host staging of the same
    shape when the host writes its rows (base tables and block counts); index tables are
    written on the device only."""

    device: Buffer
    shape: tuple[int, ...]
    row_bytes: int
    host: Buffer | None = None
    staging: Any = None  # int32 view of ``host``

    @classmethod
    def make(cls, backend: KernelBackend, shape: tuple[int, ...], fill: int,
             staged: bool = True) -> _Table:
        nbytes = math.prod(shape) * 4  # (Python ints: never wraps)
        device = backend.alloc_device(nbytes)
        init = np.full(shape, fill, dtype=np.int32)
        backend.write(device, 0, init.reshape(-1).view(np.uint8))
        table = cls(device, shape, nbytes // shape[0])
        if staged:
            table.host = backend.alloc_host(nbytes)
            table.staging = table.host.host_view()[:nbytes].view(np.int32).reshape(shape)
            table.staging[...] = init
        return table

    def task(self, pairs: np.ndarray) -> CopyTask:
        assert self.host is not None
        return CopyTask(PageRegion(self.device, 0, self.row_bytes),
                        PageRegion(self.host, 0, self.row_bytes), self.row_bytes, pairs)

    def free(self) -> None:
        self.device.free()
        if self.host is not None:
            self.host.free()


@attrs.define
class _IndexTable:
    layer_id: int
    role: str
    group: int
    scale: int
    offset: int
    expansion: int
    table: _Table


class Batch:
    """Device page tables for up to ``max_rows`` running requests (see module docstring).

    Args:
        manager: the :class:`~kvcm_core.manager.KVCacheManager` whose caches are seated.
        max_rows: seats.
        max_blocks_per_row: blocks a row's table holds (a member may not grow past it).
        max_beam_width: beams per row.
        max_total_input_tokens: the most new tokens (``capacity - history``) one
            :meth:`resize` may give all rows together (``None``: no bound).

    Raises:
        ArgumentTypeError, InvalidArgumentError: a bad argument.
    """

    def __init__(self, manager: Any, max_rows: int, max_blocks_per_row: int,
                 max_beam_width: int = 1, max_total_input_tokens: int | None = None) -> None:
        if not isinstance(manager, KVCacheManager):
            raise ArgumentTypeError(f"manager={type(manager).__name__}: must be a "
                                    "KVCacheManager")
        if manager.is_shut_down:
            raise InvalidStateError("the manager is shut down")
        self.max_rows = _count("max_rows", max_rows)
        self.max_blocks_per_row = _count("max_blocks_per_row", max_blocks_per_row)
        self.max_beam_width = _count("max_beam_width", max_beam_width)
        self.max_total_input_tokens = None if max_total_input_tokens is None else _count(
            "max_total_input_tokens", max_total_input_tokens)
        entries = self.max_rows * self.max_beam_width * self.max_blocks_per_row
        if entries > _MAX_TABLE_ENTRIES:
            raise InvalidArgumentError(
                f"max_rows={self.max_rows} x max_beam_width={self.max_beam_width} x "
                f"max_blocks_per_row={self.max_blocks_per_row} = {entries} page table "
                f"entries: at most {_MAX_TABLE_ENTRIES} (kernels index them with int32)")
        self.manager = manager
        self._thread = manager.thread_guard
        self.backend: KernelBackend = manager.backend
        self.num_groups = manager.num_cache_groups
        shape = (self.max_rows, self.max_beam_width, self.max_blocks_per_row)
        self._tables = [_Table.make(self.backend, shape, BAD_PAGE_INDEX)
                        for _ in range(self.num_groups)]
        self._counts = [_Table.make(self.backend, (self.max_rows, 1), 0)
                        for _ in range(self.num_groups)]
        self._index: dict[tuple[int, str, IndexMode], _IndexTable] = {}
        self._rows: list[Any] = [None] * self.max_rows
        # Rows to rebuild from their members at the next publish: those whose member
        # reported a change (``mark_dirty``) and those seated, moved or emptied.
        self._dirty: set[int] = set()
        self._patched: set[int] = set()  # rows staged in place, not uploaded yet
        tpb = manager.tokens_per_block
        self._tpb = tpb
        self._max_tokens = self.max_blocks_per_row * tpb
        levels = manager.storage_levels
        lcs = manager.life_cycles
        # One full-attention cache group: Batch.resize takes the pages of every growing
        # row in one allocation and stages them in place.
        self._one_group = (len(lcs) == 1 and not lcs[0].is_ssm and not lcs[0].is_windowed
                           and manager.config.swa_scratch is None)
        self._levels = levels
        self._scratch: list[dict[int, ScratchDesc]] = [{} for _ in range(self.max_rows)]
        self._ready: Event | None = None
        # Reader fences by stream (id): record_read's, and each sparse write-back's (it
        # reads the tables the next upload writes in place); the latest of a stream covers
        # its earlier ones.
        self._fences: dict[int, Event] = {}
        self._uploading: Event | None = None  # recorded after the last upload's copies
        self._converted: Event | None = None  # a registration's conversion, not yet awaited
        self._writeback_unsynced = False  # a removal's write-back the host has not waited for
        self._closed = False
        has_sparse = any(getattr(layer, "sparse", None) is not None
                         for layer in manager.config.layers)
        self._sparse = SparseArena(manager, self.max_rows, self.max_blocks_per_row
                                   ) if has_sparse else None

    # -- membership --------------------------------------------------------------------------

    def add_kv_cache(self, cache: Any, row: int | None = None) -> int:
        """Seat an ACTIVE cache of this batch's manager in ``row`` (the first empty row when
        ``None``); returns the row. The row is uploaded by the next :meth:`publish`.

        Raises:
            InvalidArgumentError: another manager's cache, a cache seated already (here or
                in another batch), a row out of range or taken, no empty row, or a cache
                whose table is wider than the batch.
            InvalidStateError: the cache is not ACTIVE, or the batch is closed.
        """
        self._thread.check()
        self._check_open()
        self._check_cache(cache)
        if cache.batch_seat is not None:
            where = "this batch" if cache.batch_seat[0] is self else "another batch"
            raise InvalidArgumentError(
                f"cache {cache.id!r} is already seated in row {cache.batch_seat[1]} of {where}")
        if cache.status is not CacheStatus.ACTIVE:
            raise InvalidStateError(f"cache {cache.id!r} is {cache.status.name}; only an "
                                    "ACTIVE (resumed) cache can be seated")
        if row is None:
            row = self._first_empty()
        else:
            row = self._row_arg(row)
            if self._rows[row] is not None:
                raise InvalidArgumentError(f"row={row}: taken by cache "
                                           f"{self._rows[row].id!r}")
        self._check_fits(cache, cache.num_blocks, cache.beam_width)
        if self._sparse is not None:
            self._sparse.seat(row, cache)  # refuses beams before the row is taken
        self._rows[row] = cache
        cache.batch_seat = (self, row)
        self._dirty.add(row)
        return row

    def remove_kv_cache(self, cache: Any, stream: Stream | None = None) -> int:
        """Empty the row of ``cache`` (its table row becomes ``BAD_PAGE_INDEX`` at the next
        publish); waits for the last :meth:`record_read` fence first, so the cache's pages
        can be released right after. Returns the row it had.

        A sparse row's units that its history crossed since the last
        :meth:`flush_sparse_units` are written back to their host pages first, on
        ``stream`` (publishing first when the row changed since the last publish), so no
        written KV is lost when the cache is closed. Pass the stream the engine's last
        writes are queued on: the write-back is ordered after them and before what the
        engine queues on it next. Without a stream (``with cache:`` too) the host waits
        for all the device's work before the write-back, and for the write-back after it.

        Raises:
            InvalidArgumentError: the cache is not seated in this batch.
            InvalidStateError, InvalidArgumentError: the publish or flush that removal needs
                was refused (the row stays seated).
        """
        self._thread.check()
        row = self._member_row(cache)
        if self._sparse is not None:
            self._flush_rows([row], stream)
        self._wait_readers()
        if self._sparse is not None:
            self._sparse.leave(row)
        self._rows[row] = None
        self._scratch[row] = {}
        cache.batch_seat = None
        self._dirty.add(row)
        return row

    def move(self, cache: Any, row: int) -> None:
        """Move a member to the empty ``row`` (its old row empties).

        Raises:
            InvalidStateError: a sparse resolve awaits its fetches (its miss list is indexed
                by row): call ``fetch_resolved_pages`` for every layer of the group first.
        """
        self._thread.check()
        old = self._member_row(cache)
        row = self._row_arg(row)
        if row == old:
            return
        if self._rows[row] is not None:
            raise InvalidArgumentError(f"row={row}: taken by cache {self._rows[row].id!r}")
        if self._sparse is not None:
            self._sparse.check_fetched("move")
        self._rows[row], self._rows[old] = cache, None
        self._scratch[row], self._scratch[old] = self._scratch[old], {}
        if self._sparse is not None:
            self._sparse.move(old, row)
        cache.batch_seat = (self, row)
        self._dirty.update((row, old))

    def row_of(self, cache: Any) -> int | None:
        """The row of ``cache`` in this batch, or ``None``."""
        seat = getattr(cache, "batch_seat", None)
        return seat[1] if seat is not None and seat[0] is self else None

    @property
    def members(self) -> list[Any]:
        """The caches seated, by row (``None`` for an empty row)."""
        return list(self._rows)

    # -- publishing --------------------------------------------------------------------------

    def dirty_rows(self) -> np.ndarray:
        """Rows whose device row differs from what their member's tables say now."""
        return np.asarray(sorted(self._dirty | self._patched), dtype=np.int32)

    def mark_dirty(self, row: int) -> None:
        """Rebuild and upload ``row`` (an int in ``0..max_rows - 1``) at the next publish.
        A seated cache calls it whenever one of its page tables changes (each new
        ``page_table_version``); an engine needs it only for a row it wants rebuilt.

        Raises:
            ArgumentTypeError, InvalidArgumentError: ``row`` is not a row of this batch
                (nothing changed).
        """
        self._thread.check()
        if type(row) is not int or not 0 <= row < self.max_rows:  # (a seated row is fine)
            row = self._row_arg(row)
        self._dirty.add(row)

    def publish(self, stream: Stream | None = None) -> int:
        """Upload the dirty rows of every table (base page tables, block counts and the
        registered index tables) in one batched copy on ``stream``, then record the ready
        event. Returns the rows uploaded.

        A refused publish changes nothing: every check runs before any state moves.

        Raises:
            InvalidStateError: ``stream`` is capturing a CUDA graph (the upload would be
                captured, not run), the batch is closed, a sparse row took beams, or seats
                changed while a sparse resolve awaits its fetches.
            InvalidArgumentError: a member grew past ``max_blocks_per_row`` or
                ``max_beam_width``, or a sparse row has too many units in flight.
        """
        self._thread.check()
        self._check_open()
        self._check_publish(stream)
        # Sparse rows are checked before anything changes; they pin after the upload.
        sparse_moved = self._sparse is not None and self._sparse.prepare(self._rows,
                                                                         checked=True)
        if self._sparse is not None:
            # Its tables are written in place even with no row dirty (no host wait then):
            # after the fenced readers and write-backs, on whatever stream they ran.
            st = stream or self.backend.default_stream
            for fence in self._fences.values():
                st.wait_event(fence)
            # A pin list an interrupt left unfetched, before the tables it names change.
            self._sparse.settle_pin_copies(self._device_tables(), stream)
        if self._converted is not None:  # a registration's conversion, before this upload
            (stream or self.backend.default_stream).wait_event(self._converted)
            self._converted = None
        restage = self._dirty
        rows = np.asarray(sorted(restage | self._patched), dtype=np.int32)
        if len(rows):
            self._wait_upload()
            for r in sorted(restage):
                self._stage(r)
            pairs = np.repeat(rows[:, None], 2, axis=1)
            self.backend.copy_pages_batch(
                [t.task(pairs) for t in (*self._tables, *self._counts)], stream)
            self._convert(rows, stream)
            self._dirty = set()
            self._patched.clear()
        if self._sparse is not None:
            self._sparse.publish(sparse_moved, self._device_tables(), stream)
        event = self.backend.create_event()
        event.record(stream)
        self._ready = event
        if len(rows):
            self._uploading = event
        return len(rows)

    def _check_publish(self, stream: Stream | None, caps: Sequence[int] | None = None
                       ) -> None:
        """Refuse what :meth:`publish` would refuse, changing nothing (``caps``: the new
        capacities of a :meth:`resize`, whose rows' blocks it checks itself)."""
        if self.backend.is_capturing(stream):
            raise InvalidStateError("publish during CUDA graph capture: publish before "
                                    "capturing (the tables' addresses never change)")
        limit = self._max_tokens
        for r in self._dirty:
            cache = self._rows[r]
            if cache is not None:  # a resized row's blocks are its resize's to check
                resized = caps is not None and -1 != caps[r] <= limit
                self._check_fits(cache, 0 if resized else cache.num_blocks,
                                 cache.beam_width)
        if self._sparse is not None:
            skip = () if caps is None else [r for r, c in enumerate(self._rows) if
                                            c is not None and -1 != caps[r] <= limit]
            self._sparse.check(self._rows, skip)

    def wait_ready(self, stream: Stream | None = None) -> None:
        """Make ``stream`` wait for the last publish.

        Raises:
            InvalidStateError: a member's table changed since the last publish (publish
                first), or nothing was published yet.
        """
        self._check_open()
        if len(self.dirty_rows()):
            raise InvalidStateError("rows changed since the last publish: publish first")
        if self._ready is None:
            raise InvalidStateError("nothing was published yet: publish first")
        (stream or self.backend.default_stream).wait_event(self._ready)

    def record_read(self, stream: Stream | None = None) -> None:
        """Fence the readers queued on ``stream`` so far: the next upload and any release
        of a member's pages through this batch wait for them."""
        self._thread.check()
        self._check_open()
        self._fence(stream)

    def _fence(self, stream: Stream | None) -> None:
        event = self.backend.create_event()
        event.record(stream)
        self._fences[id(stream or self.backend.default_stream)] = event

    def resize(self, capacities: Sequence[int] | np.ndarray,
               history_lengths: Sequence[int] | np.ndarray | None = None,
               stream: Stream | None = None) -> list[bool]:
        """Resize members by row, then publish once.

        ``capacities`` and ``history_lengths`` have ``max_rows`` entries indexed by row;
        entries of empty rows are ignored, ``-1`` leaves a row unchanged (a capacity of
        ``-1`` with a history keeps the row's capacity and moves its history), and
        ``history_lengths=None`` leaves every history unchanged. Each row succeeds or rolls
        back on its own (``cache.resize``); the result is one bool per row (``True`` for
        rows left unchanged). A row whose ``cache.resize`` raises (its
        ``priority_callback``, a ``KeyboardInterrupt``) is unchanged and stops the call:
        rows resized before it (and the rows grown together, first) stay resized, the
        others are not resized, and the batch is published before the exception
        propagates (its tables match its members; see docs/batch.md).

        Every argument (and what the closing publish would refuse) is checked before any
        row's pages or table change (a row whose block count stays may already hold its
        new capacity: that much is decided row by row, in the same pass that sizes the
        batch's allocation). Pages pushed down to make room are ordered against ``stream`` as in
        ``cache.resize(..., stream=stream)``.

        Raises:
            InvalidArgumentError: a wrong length, a capacity past ``max_blocks_per_row``
                blocks, more new tokens than ``max_total_input_tokens``, or a row's
                capacity or history that its ``cache.resize`` refuses (nothing changed;
                the message names the row).
        """
        self._thread.check()
        self._check_open()
        caps = self._per_row("capacities", capacities)
        hist = None if history_lengths is None else self._per_row("history_lengths",
                                                                   history_lengths)
        rows = self._rows
        if hist is not None:  # a history without a capacity keeps the row's capacity
            for r, c in enumerate(rows):
                if c is not None and caps[r] == -1 and hist[r] != -1:
                    caps[r] = c.capacity
        for r, c in enumerate(rows) if max(caps) > self._max_tokens else ():
            if c is not None and caps[r] > self._max_tokens:  # it can never fit: an error
                raise InvalidArgumentError(
                    f"capacities[{r}]={caps[r]}: needs {-(-caps[r] // self._tpb)} blocks, "
                    f"past this batch's max_blocks_per_row={self.max_blocks_per_row} "
                    f"(cache {c.id!r})")
        if hist is not None and max(hist) == -1:
            hist = None
        if self.max_total_input_tokens is not None:
            live = [r for r, c in enumerate(rows) if c is not None and caps[r] != -1]
            self._check_new_tokens(live, caps, hist)
        if self._sparse is not None:
            self._check_sparse_resize(caps, hist)
        if hist is not None:  # (without histories _grow_together checks what it must)
            for r, c in enumerate(rows):
                if c is not None and caps[r] != -1:
                    self._check_row(r, caps[r], None if hist[r] == -1 else hist[r])
        # Rows resized here get their own block checks; the rest must let the publish through.
        self._check_publish(stream, caps)
        # (A member that releases pages waits for the reader fence itself: cache._unlock.)
        out = [True] * self.max_rows
        try:
            rest = self._grow_together(caps, stream) if hist is None else \
                [r for r, c in enumerate(rows) if c is not None and caps[r] != -1]
            for r in rest:
                h = None if hist is None or hist[r] == -1 else hist[r]
                out[r] = caps[r] <= self._max_tokens and rows[r].resize(caps[r], h, stream)
        except BaseException:
            # A row's resize raised (its priority_callback, an interrupt): that row is
            # unchanged, the rows resized before it stay resized; publish them, so that
            # the tables match the members, then let the exception go on (never one the
            # publish raises: a member grown past the batch's bounds behind its back
            # keeps the batch unpublished, see publish).
            with contextlib.suppress(KvcmError):
                self.publish(stream)
            raise
        self.publish(stream)
        return out

    def _check_row(self, r: int, capacity: int, history: int | None) -> None:
        """Row ``r``'s ``cache.check_resize``, its error naming the row and the cache."""
        cache = self._rows[r]
        assert cache is not None
        try:
            cache.check_resize(capacity, history)
        except (InvalidArgumentError, ArgumentTypeError) as exc:
            raise type(exc)(f"row {r} (cache {cache.id!r}): {exc}") from exc

    def _check_new_tokens(self, live: list[int], caps: list[int],
                          hist: list[int] | None) -> None:
        if self.max_total_input_tokens is None:
            return
        new = 0
        for r in live:
            h = self._rows[r].history_length if hist is None or hist[r] == -1 else hist[r]
            new += max(0, caps[r] - h)
        if new > self.max_total_input_tokens:
            raise InvalidArgumentError(
                f"capacities: {new} new tokens in one step exceed max_total_input_tokens"
                f"={self.max_total_input_tokens}")

    def _grow_together(self, caps: list[int], stream: Stream | None) -> list[int]:
        """The batched path of :meth:`resize` (histories unchanged): rows whose blocks stay
        are done by their caches at once; rows of plain growth of a one-group cache get
        their pages from one allocation, staged in place. Returns the rows left for
        ``cache.resize``."""
        rest: list[int] = []
        grow: list[tuple[int, int]] = []  # (row, pages needed)
        limit = self._max_tokens
        one_group = self._one_group
        for r, (cache, cap) in enumerate(zip(self._rows, caps, strict=True)):
            if cache is None or cap == -1:
                continue
            n = cache.batch_growth(cap, thread_checked=True) if cap <= limit else -1
            if n:
                if n > 0 and one_group:
                    grow.append((r, n))
                else:
                    rest.append(r)
        for r in rest:  # before any pages move: a bad row raises what its resize would
            if caps[r] <= limit:  # (a row whose blocks stay has only its capacity moved)
                self._check_row(r, caps[r], None)
        if not grow:
            return rest
        store = self._levels.gpu_store(0)
        total = sum(n for _, n in grow)
        if not self._levels.room(store, total):
            return sorted(rest + [r for r, _ in grow])  # each row then fails on its own
        self._levels.begin(stream)  # pages pushed down are ordered against ``stream``
        try:
            pids = self._levels.take(0, total)
        except OutOfPagesError:  # a write to a colder level failed: row by row instead
            self._levels.end(stream)
            return sorted(rest + [r for r, _ in grow])
        except BaseException:
            self._levels.end(stream)
            raise
        pl = pids.tolist()
        at = 0  # pages before ``at`` belong to rows; an error gives the rest back
        try:
            self._levels.end(stream)
            dirty, rows, tpb = self._dirty, self._rows, self._tpb
            clean = [r not in dirty for r, _ in grow]
            if any(clean):
                # The staging rows are what the last upload (maybe still queued) copies
                # from: it has run first (and its readers, fenced by record_read, are
                # done). Waited for before any row gets pages or is marked patched.
                self._wait_upload()
            for r, n in grow:
                rows[r].batch_grow(caps[r], pl[at: at + n], thread_checked=True)  # dirty
                at += n
        except BaseException:
            if at < total:
                self._levels.release_locked(pids[at:])
            raise
        # Rows that were current get their new blocks staged in place; a row is marked
        # patched (clean, its staging written) only once its staging is written: an
        # interrupt before that leaves it dirty, uploaded whole by the next publish.
        slots = self._levels.arena.slot[pids]
        keep = np.ones(total, dtype=np.bool_)  # pages staged in place
        where_r, where_b = [], []  # their rows and blocks
        count_r, count_v = [], []  # rows staged in place and their new block counts
        at = 0
        for (r, n), was_clean in zip(grow, clean, strict=True):
            if was_clean:
                nb = (caps[r] + tpb - 1) // tpb
                where_r.extend([r] * n)
                where_b.extend(range(nb - n, nb))
                count_r.append(r)
                count_v.append(nb)
            else:
                keep[at: at + n] = False
            at += n
        if where_r:
            r_arr = np.asarray(where_r, dtype=np.int64)
            b_arr = np.asarray(where_b, dtype=np.int64)
            self._tables[0].staging[r_arr, 0, b_arr] = slots[keep]
            self._counts[0].staging[count_r, 0] = count_v
            for r in count_r:
                dirty.discard(r)
                self._patched.add(r)
        return rest

    # -- sparse attention (kvcm_core.sparse; docs/sparse.md) ---------------------------------

    def _check_sparse_resize(self, caps: list[int], hist: list[int] | None) -> None:
        assert self._sparse is not None
        self._sparse.check_flushed(self._rows, hist)
        for r, cache in enumerate(self._rows):
            if cache is not None and caps[r] != -1:
                self._sparse.check_in_flight(cache, r, caps[r],
                                             None if hist is None else hist[r])

    def _arena(self) -> SparseArena:
        self._check_open()
        if self._sparse is None:
            raise InvalidStateError("the manager has no sparse layers")
        return self._sparse

    def resolve_sparse_selection(self, layer_id: int, selected: Any = None,
                                 stream: Stream | None = None) -> Any:
        """Resolve the selection of ``layer_id``'s selection group: ``selected`` (int32
        ``[max_rows, num_selected]`` unit ids, ``-1`` unused; a NumPy array is written
        synchronously, a contiguous int32 device array (``__cuda_array_interface__``)
        copied on ``stream``; ``None``: :meth:`sparse_selection_table` as the indexer left
        it). Returns the device entry map ``[max_rows, num_selected]``.

        Raises:
            InvalidStateError: the previous miss list was not fetched by every layer of
                the group, or the batch has unpublished changes.
            InvalidArgumentError: not a sparse layer, or a wrong shape.
        """
        self._thread.check()
        arena = self._arena()
        self._check_published()
        g = arena.resolve(layer_id, selected, stream)
        return arena.table(g, "entry_map")

    def fetch_resolved_pages(self, layer_id: int, buffers: Any = None,
                             stream: Stream | None = None) -> None:
        """Copy the units of the group's current miss list from the host pages of the
        layer's sparse buffers (``buffers``: roles, default all) into their entries."""
        self._thread.check()
        arena = self._arena()
        g = arena.group_of(layer_id)
        arena.fetch(layer_id, buffers, self._tables[g.group].device,
                    self.max_beam_width * self.max_blocks_per_row, stream)

    def fetch_sparse_pages(self, layer_id: int, selected: Any = None, buffers: Any = None,
                           stream: Stream | None = None) -> Any:
        """Resolve and fetch in one call, for a layer whose selection is its own; returns
        the entry map.

        Raises:
            InvalidStateError: the layer shares its selection with other layers.
        """
        self._thread.check()
        g = self._arena().group_of(layer_id)
        if len(g.layers) > 1:
            raise InvalidStateError(
                f"fetch_sparse_pages(layer_id={layer_id}): its selection {g.key[1]!r} is "
                f"shared by layers {list(g.layers)}; call resolve_sparse_selection once, "
                "then fetch_resolved_pages for each layer")
        if buffers is not None:  # checked before the resolve changes anything (as a list:
            buffers = self._arena().check_roles(layer_id, buffers)  # an iterator once)
        if g.pending:  # only an interrupted call leaves its fetch owed: complete it first
            self.fetch_resolved_pages(layer_id, None, stream)
        out = self.resolve_sparse_selection(layer_id, selected, stream)
        self.fetch_resolved_pages(layer_id, buffers, stream)
        return out

    def prepare_sparse_write_indices(self, layer_id: int, buffers: Any = None) -> Any:
        """The entries the step's new tokens go to: device int32 ``[max_rows,
        working_set_units]``, slot ``s`` the entry of unit ``history // unit_tokens + s``
        of the row (``-1`` past the capacity), as the last publish pinned them. Every
        buffer of the layer (``buffers`` only checks the roles) uses the same entries.
        Valid once the step's flush ran: ``history`` is the flushed one.

        Raises:
            InvalidStateError: unpublished changes (publish first), or a row's history
                moved since the last flush (flush first).
        """
        arena = self._arena()
        self._check_published()
        arena.check_write_map(self._rows)
        arena.cells(layer_id, buffers)
        return arena.table(arena.group_of(layer_id), "write_map")

    def flush_sparse_units(self, stream: Stream | None = None) -> int:
        """Write back, from their entries to their host pages, the units each row's history
        crossed since the last flush (``[old history, min(new history, old capacity))``
        in units); returns how many units per group were written, summed.

        Rows changed since the last publish (a commit that rebased a block, a move) are
        published first, so that units go to the pages the rows hold now.

        Raises:
            InvalidArgumentError: more units than the write-back bound (nothing written;
                only when more units crossed than were ever in flight: not for accepted
                steps).
        """
        self._thread.check()
        arena = self._arena()
        if len(self.dirty_rows()) or arena.owes():  # (owed: an interrupted publish)
            self.publish(stream)
        self._after_publish(stream)
        written = arena.flush(self._rows, self._device_tables(), stream)
        self._fence(stream)  # the next in-place upload waits for the write-back
        return written

    def _after_publish(self, stream: Stream | None) -> None:
        """Order ``stream`` after the last publish (a write-back reads its tables)."""
        if self._ready is not None:
            (stream or self.backend.default_stream).wait_event(self._ready)

    def _flush_rows(self, rows: list[int], stream: Stream | None) -> None:
        """Write back the crossed units of ``rows`` before they leave (remove, close).

        Without a ``stream`` nothing says which stream the engine's last writes of those
        units are queued on, nor where the next reader of their host pages runs: the host
        waits for all the device's work before the write-back and for the write-back
        after it (the write-back then runs between everything queued before the call and
        everything queued after it, on whatever stream)."""
        assert self._sparse is not None
        if self._writeback_unsynced:  # an interrupted wait for a write-back: wait again
            self.backend.synchronize()
            self._writeback_unsynced = False
        rows = [r for r in rows if self._sparse.unflushed(r, self._rows[r])]
        if not rows:
            return
        if stream is None:
            self.backend.synchronize()
        if not self._patched.isdisjoint(rows) or not self._dirty.isdisjoint(rows) or \
                self._sparse.owes():
            self.publish(stream)  # units go to the pages the rows hold now
        self._writeback_unsynced = stream is None  # (the marks move before the wait)
        self._after_publish(stream)
        self._sparse.flush(self._rows, self._device_tables(), stream, only=rows)
        self._fence(stream)  # the next in-place upload waits for the write-back
        if stream is None:
            self.backend.synchronize()
            self._writeback_unsynced = False

    def _device_tables(self) -> list[tuple[Buffer, int]]:
        """Each cache group's device page table and its int32 elements per row."""
        width = self.max_beam_width * self.max_blocks_per_row
        return [(t.device, width) for t in self._tables]

    def peek_hit_miss_counter(self) -> tuple[int, int]:
        """Distinct units resolved as hits and as misses since the batch was made
        (synchronous: reads the device counters)."""
        return self._arena().counters()

    def read_sparse_table(self, layer_id: int, name: str) -> np.ndarray:
        """A host copy of a selection group's ``"selected"``, ``"entry_map"`` or
        ``"write_map"`` table, or of its miss list ``"miss_unit"`` / ``"miss_entry"``
        (synchronous; for tests and tools)."""
        arena = self._arena()
        names = ("selected", "entry_map", "write_map", "miss_unit", "miss_entry")
        if name not in names:
            raise InvalidArgumentError(f"name={name!r}: must be one of {names}")
        return arena.read(arena.group_of(layer_id), name)

    def sparse_selection_table(self, layer_id: int) -> Any:
        """The device selection table ``[max_rows, num_selected]`` an indexer may write in
        place (then resolve with ``selected=None``)."""
        arena = self._arena()
        return arena.table(arena.group_of(layer_id), "selected")

    def sparse_cells(self, layer_id: int, role: str) -> Any:
        """Where a sparse buffer's entries live (:class:`~kvcm_core.backend.SparseBufferCells`):
        entry ``e`` of row ``r`` is at ``cells.page_start(sparse_lease(r) * lease_cells +
        e // units_per_page) + (e % units_per_page) * unit_bytes``."""
        return self._arena().cells(layer_id, [role])[0]

    def sparse_lease_table(self) -> Any:
        """The device lease of each row, int32 ``[max_rows]`` (``-1``: empty row)."""
        arena = self._arena()
        arr = self.backend.as_array(arena.lease_of_row.device)
        if hasattr(arr, "view") and hasattr(arr, "reshape"):
            return arr[: 4 * self.max_rows].view(np.int32)
        return arr.typed((self.max_rows,), "<i4")

    def sparse_lease(self, row: int) -> int:
        """The lease of ``row`` (``-1``: empty)."""
        return self._arena().lease(self._row_arg(row))

    def _check_published(self) -> None:
        if len(self.dirty_rows()):
            raise InvalidStateError("rows changed since the last publish: publish first")
        self._arena().check_pinned(self._rows)

    # -- tables ------------------------------------------------------------------------------

    def page_table(self, group: int) -> Any:
        """The device page table ``[max_rows, max_beam_width, max_blocks_per_row]`` (int32
        slot ids) of a cache group, as the last publish left it (zero-copy)."""
        return self._view(self._tables[self._group_arg(group)])

    def num_blocks(self, group: int) -> Any:
        """The device block counts ``[max_rows]`` (int32) of a cache group."""
        t = self._counts[self._group_arg(group)]
        view = self._view(t)
        return view.reshape(self.max_rows) if hasattr(view, "reshape") else view

    def read_page_table(self, group: int) -> np.ndarray:
        """A host copy of :meth:`page_table` (synchronous, after queued work: for tests
        and tools, not a data path)."""
        return self._read(self._tables[self._group_arg(group)])

    def read_num_blocks(self, group: int) -> np.ndarray:
        """A host copy of :meth:`num_blocks` (synchronous; for tests and tools)."""
        return self._read(self._counts[self._group_arg(group)]).reshape(self.max_rows)

    def read_index_table(self, layer_id: int, role: str,
                         mode: IndexMode = IndexMode.SHARED) -> np.ndarray:
        """A host copy of :meth:`index_table` (synchronous; for tests and tools)."""
        self.index_table(layer_id, role, mode)  # raises when not registered
        return self._read(self._index[self._index_key(layer_id, role, mode)].table)

    def register_index_table(self, layer_id: int, role: str,
                             mode: IndexMode = IndexMode.SHARED) -> Any:
        """Keep a converted page-index table of one buffer: every publish converts the dirty
        rows (``[max_rows, max_beam_width, max_blocks_per_row * expansion]`` int32,
        ``BAD_PAGE_INDEX`` kept). Registering the same table again returns it.

        Raises:
            InvalidArgumentError: an unknown buffer or mode, or PER_LAYER for a buffer of
                an SWA scratch group (its scratch sub-pages have no per-layer index).
        """
        self._thread.check()
        self._check_open()
        key = self._index_key(layer_id, role, mode)
        if key in self._index:
            return self._view(self._index[key].table)
        try:
            group = self.manager.get_buffer_group_id(layer_id, role)
            conv = self.manager.get_page_index_converter(layer_id, role)
        except (KeyError, ValueError) as exc:
            raise InvalidArgumentError(f"layer_id={layer_id!r}, role={role!r}: no such "
                                       f"buffer ({exc})") from None
        scale, offset, expansion = conv.scale, conv.offset, conv.expansion
        if key[2] is IndexMode.PER_LAYER:
            if conv.scratch_pages_per_block:
                raise InvalidArgumentError(
                    f"mode=PER_LAYER for layer {layer_id} role {role!r}: its group uses SWA "
                    "scratch, whose sub-pages only the SHARED index space can name")
            scale, offset, expansion = 1, 0, 1
        shape = (self.max_rows, self.max_beam_width, self.max_blocks_per_row * expansion)
        ix = _IndexTable(layer_id, role, group, scale, offset, expansion,
                         _Table.make(self.backend, shape, BAD_PAGE_INDEX, staged=False))
        # The table converts what the device base table holds once the last upload ran
        # (on the default stream, after that upload's event); rows changed since the last
        # publish follow at the next one. wait_ready and the next upload come after it.
        be = self.backend
        if self._ready is not None:
            be.default_stream.wait_event(self._ready)
        self._convert(np.arange(self.max_rows, dtype=np.int32), None, [ix])
        converted = be.create_event()
        converted.record(None)
        self._converted = converted
        if self._ready is not None:
            self._ready = converted
        self._index[key] = ix
        return self._view(ix.table)

    def has_index_table(self, layer_id: int, role: str,
                        mode: IndexMode = IndexMode.SHARED) -> bool:
        """Whether that index table is registered."""
        return self._index_key(layer_id, role, mode) in self._index

    def index_table(self, layer_id: int, role: str, mode: IndexMode = IndexMode.SHARED) -> Any:
        """The registered converted table of one buffer (zero-copy, stable address).

        Raises:
            InvalidArgumentError: the table was not registered.
        """
        key = self._index_key(layer_id, role, mode)
        ix = self._index.get(key)
        if ix is None:
            raise InvalidArgumentError(
                f"no index table for layer_id={layer_id!r}, role={role!r}, mode="
                f"{key[2].name}: call register_index_table first")
        return self._view(ix.table)

    def close(self, stream: Stream | None = None) -> None:
        """Empty every row and free the tables (idempotent). Sparse rows' crossed units
        are written back first, on ``stream``, as :meth:`remove_kv_cache` does (pass the
        stream the engine's last writes are queued on; without one the host waits for the
        device before and after the write-back)."""
        self._thread.check()
        if self._closed:
            return
        if self._sparse is not None:  # no written unit is lost (see remove_kv_cache)
            self._flush_rows([r for r, c in enumerate(self._rows) if c is not None], stream)
        for cache in self._rows:
            if cache is not None:
                self.remove_kv_cache(cache, stream)
        self.backend.synchronize()
        for t in (*self._tables, *self._counts, *(ix.table for ix in self._index.values())):
            t.free()
        if self._sparse is not None:
            self._sparse.free()
        self._closed = True

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        seated = sum(c is not None for c in self._rows)
        return (f"Batch({seated}/{self.max_rows} rows, {self.max_blocks_per_row} blocks, "
                f"{self.max_beam_width} beams, {len(self._index)} index tables)")

    # -- internals ---------------------------------------------------------------------------

    def _stage(self, r: int) -> None:
        """Rebuild row ``r`` of every host staging table from its member (or empty it)."""
        cache = self._rows[r]
        if cache is None:
            for t, c in zip(self._tables, self._counts, strict=True):
                t.staging[r] = BAD_PAGE_INDEX
                c.staging[r] = 0
            return
        width = cache.beam_width  # fits: checked by _check_publish
        scratch = {}
        for g in range(self.num_groups):
            rows = self._tables[g].staging[r]
            rows[...] = BAD_PAGE_INDEX
            nb = 0
            for beam in range(width):
                table = cache.get_base_page_indices(g, beam)
                nb = len(table)
                rows[beam, :nb] = table
            self._counts[g].staging[r, 0] = nb
            desc = cache.scratch(g) if g in self.manager.scratch_groups else None
            if desc is not None:
                scratch[g] = desc
        self._scratch[r] = scratch

    def _convert(self, rows: np.ndarray, stream: Stream | None,
                 tables: list[_IndexTable] | None = None) -> None:
        """Convert ``rows`` of the device base tables into the index tables, on the
        device, in one ``convert_page_tables`` call."""
        tables = list(self._index.values()) if tables is None else tables
        if not tables or not len(rows):
            return
        beams, blocks = self.max_beam_width, self.max_blocks_per_row
        jobs = []
        for ix in tables:
            scratch = {r: self._scratch[r][ix.group] for r in rows.tolist()
                       if ix.group in self._scratch[r]}
            jobs.append(TableConversion(self._tables[ix.group].device, ix.table.device,
                                        beams * blocks, blocks, ix.scale, ix.offset,
                                        ix.expansion, scratch or None))
        self.backend.convert_page_tables(jobs, rows, stream)

    def _view(self, t: _Table) -> Any:
        arr = self.backend.as_array(t.device)
        if hasattr(arr, "view") and hasattr(arr, "reshape"):  # NumPy, CuPy
            return arr[: t.row_bytes * t.shape[0]].view(np.int32).reshape(t.shape)
        return arr.typed(t.shape, "<i4")  # a backend's own zero-copy view

    def _read(self, t: _Table) -> np.ndarray:
        self._check_open()
        raw = self.backend.read(t.device, 0, t.row_bytes * t.shape[0])
        return raw.view(np.int32).reshape(t.shape)

    def wait_readers(self) -> None:
        """Wait until the kernels fenced by each stream's last :meth:`record_read` (and
        sparse write-back) are done (a seated cache calls it before it releases a page)."""
        self._thread.check()
        self._wait_readers()

    def _wait_readers(self) -> None:
        """Wait for every stream's last reader fence (see :func:`_poll`)."""
        while self._fences:
            key = next(iter(self._fences))
            _poll(self._fences[key])
            del self._fences[key]

    def _wait_upload(self) -> None:
        """Before the host staging rows are written: wait until the last upload, which
        copies from them when its stream reaches it, has run. The reader fence covers it
        when the engine records one; an engine that never calls :meth:`record_read`
        (one stream, its kernels ordered after the upload anyway) relies on this."""
        self._wait_readers()
        if self._uploading is not None:
            _poll(self._uploading)
            self._uploading = None

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidStateError("the batch is closed")
        if self.manager.is_shut_down:
            raise InvalidStateError("the batch's manager is shut down")

    def _check_cache(self, cache: Any) -> None:
        if not hasattr(cache, "batch_seat") or not hasattr(cache, "page_table_version"):
            raise ArgumentTypeError(f"cache={type(cache).__name__}: must be a KVCache")
        if cache.manager is not self.manager:
            raise InvalidArgumentError(f"cache {cache.id!r} belongs to another manager")

    def _check_fits(self, cache: Any, nb: int, width: int) -> None:
        if nb > self.max_blocks_per_row:
            raise InvalidArgumentError(
                f"cache {cache.id!r} has {nb} blocks; the batch's rows hold "
                f"max_blocks_per_row={self.max_blocks_per_row}")
        if width > self.max_beam_width:
            raise InvalidArgumentError(
                f"cache {cache.id!r} has beam width {width}; the batch holds "
                f"max_beam_width={self.max_beam_width}")

    def _member_row(self, cache: Any) -> int:
        self._check_open()
        row = self.row_of(cache)
        if row is None:
            raise InvalidArgumentError(
                f"cache {getattr(cache, 'id', cache)!r} is not seated in this batch")
        return row

    def _first_empty(self) -> int:
        for r, cache in enumerate(self._rows):
            if cache is None:
                return r
        raise InvalidArgumentError(f"the batch is full (max_rows={self.max_rows})")

    def _row_arg(self, row: Any) -> int:
        if isinstance(row, bool) or not isinstance(row, int | np.integer):
            raise ArgumentTypeError(f"row={row!r}: must be an int")
        if not 0 <= row < self.max_rows:
            raise InvalidArgumentError(f"row={row}: must be in 0..{self.max_rows - 1}")
        return int(row)

    def _group_arg(self, group: Any) -> int:
        if isinstance(group, bool) or not isinstance(group, int | np.integer):
            raise ArgumentTypeError(f"group={group!r}: must be an int")
        if not 0 <= group < self.num_groups:
            raise InvalidArgumentError(f"group={group}: must be a cache group id in "
                                       f"0..{self.num_groups - 1}")
        return int(group)

    def _index_key(self, layer_id: Any, role: Any, mode: Any) -> tuple[int, str, IndexMode]:
        if not isinstance(mode, IndexMode):
            try:
                mode = IndexMode(mode)
            except ValueError:
                raise InvalidArgumentError(
                    f"mode={mode!r}: must be an IndexMode (SHARED or PER_LAYER)") from None
        if isinstance(layer_id, bool) or not isinstance(layer_id, int | np.integer):
            raise ArgumentTypeError(f"layer_id={layer_id!r}: must be an int")
        if not isinstance(role, str):
            raise ArgumentTypeError(f"role={role!r}: must be a str")
        return int(layer_id), role, mode

    def _per_row(self, name: str, values: Any) -> list[int]:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"{name}: must be a sequence of ints") from None
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise ArgumentTypeError(f"{name}: must hold ints, got dtype {arr.dtype}")
        if arr.shape != (self.max_rows,):
            raise InvalidArgumentError(f"{name}: must have max_rows={self.max_rows} entries "
                                       f"indexed by row, got shape {arr.shape}")
        out = arr.astype(np.int64).tolist()
        if not isinstance(values, np.ndarray):  # (one pass at C speed: a decode step's)
            kinds = set(map(type, values))
            if bool in kinds or np.bool_ in kinds:
                raise ArgumentTypeError(f"{name}: must hold ints, got a bool")
        bad = [v for v in out if v < -1]
        if bad:
            raise InvalidArgumentError(f"{name}: entry {bad[0]} must be >= 0 (or -1: "
                                       "unchanged)")
        return out


def _poll(event: Event) -> None:
    """Wait for ``event``, polling with the GIL released between polls (other Python
    threads, such as the one that lets the device work finish, run)."""
    pause = 1e-6
    while not event.query():
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
