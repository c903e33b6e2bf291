"""SWA scratch pages for chunked prefill (docs/semantics.md).

A model runs layer by layer. During a prefill chunk ``[H, C)`` a windowed block that will
be stale once history reaches ``C`` (stale at ``max(0, C - max_rewind_len)``, so a rewind
never needs it; sink blocks never) is read only by the attention of each layer in this
step. Such a *scratch block* gets no slot of its own: the blocks of one step share a few
*scratch slots* of their cache group's pool group.

Index arithmetic (one pool of the group; ``scale = slot_bytes // page_size`` sub-pages per
slot, a buffer at sub-page ``layer_offset = offset // page_size``, ``spb`` =
``scratch_pages_per_block``). Scratch block ``b`` of the range ``[begin, end)``, at
position ``p = b - begin``::

    total = p * spb
    slot  = slot_ids[total // scale]
    sub   = (total % scale + layer_offset) % scale
    index = slot * scale + sub           # in units of the page size, from the pool base

So a scratch slot holds ``scale / spb`` blocks instead of one. Different layers of one
block never share a sub-page (their ``layer_offset`` differ modulo ``scale``), and, where
the configuration passes :func:`validate_scratch_layout`, different blocks of one layer
never share one either. Different layers of *different* blocks may share a sub-page (layer
``l + 1``'s block ``p`` reuses layer ``l``'s block ``p + 1`` sub-page when ``spb`` equals
a layer's buffer count): that is safe only because the model finishes layer ``l`` (its
writes and its attention reads) before layer ``l + 1`` starts. A scratch page holds
nothing after the step.

When ``spb`` does not divide ``scale``, a block's nominal sub-pages
``[total, total + spb)`` may cross the end of its slot. kvcm keeps every buffer of such a
block in the slot where the block starts (``slot_ids[total // scale]``), folding the
sub-page index back with the modulo. The folded sub-pages must not meet those of the
first block of the same slot for the same layer: :func:`validate_scratch_layout` proves
this for every pool at manager construction (the pattern repeats every
``spb / gcd(spb, scale)`` slots) and raises :class:`~kvcm_core.errors.ConfigError`
naming the layer otherwise.

A pool group whose pools have different scales (buffers of different page sizes, each
layer present in some pools only: *unequal membership*) uses one list of slot ids for all
its pools; a range of ``n`` blocks needs ``max over pools of ceil(n * spb / scale)`` of
them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from kvcm_core.pagetable import BAD_PAGE_INDEX, ScratchDesc

if TYPE_CHECKING:
    from kvcm_core.backend import KernelBackend, Stream
    from kvcm_core.config import KVCacheManagerConfig
    from kvcm_core.lifecycle import LifeCycleRegistry

__all__ = [
    "ScratchDesc",
    "ScratchKernelArgs",
    "convert_page_indices_reference",
    "convert_with_scratch",
    "max_scratch_blocks",
    "scratch_kernel_args",
    "scratch_page_index",
    "scratch_slots_needed",
    "validate_scratch_layout",
]

_I32_MAX = (1 << 31) - 1


def scratch_slots_needed(num_blocks: int, spb: int, scales: Sequence[int]) -> int:
    """Slot ids a range of ``num_blocks`` scratch blocks needs (shared by all pools)."""
    if num_blocks <= 0:
        return 0
    return max(-(-num_blocks * spb // s) for s in scales)


def max_scratch_blocks(max_slots: int, spb: int, scales: Sequence[int]) -> int:
    """The most scratch blocks ``max_slots`` slot ids can hold in every pool."""
    return min(max_slots * s // spb for s in scales)


def scratch_page_index(position: int, layer_offset: int, scale: int, spb: int,
                       slot_ids: Sequence[int]) -> int:
    """Page index (units of the page size, from the pool base) of a buffer at sub-page
    ``layer_offset`` for the scratch block at ``position`` of its range."""
    total = position * spb
    slot = int(slot_ids[total // scale])
    return slot * scale + (total % scale + layer_offset) % scale


@attrs.frozen
class ScratchKernelArgs:
    """A :class:`ScratchDesc` checked against one conversion, as a kernel takes it.

    The scratch arithmetic runs in whole pages of ``expansion`` units: ``unit_scale =
    scale // expansion`` pages a slot, the buffer at page ``unit_offset = (offset //
    expansion) % unit_scale``. Blocks ``b`` of the table with ``begin <= b < stop`` (``stop``
    is the descriptor's ``end`` clipped to the table's width) are scratch blocks, at position
    ``p = b - begin``::

        total = p * spb
        page  = slot_ids[total // unit_scale] * unit_scale
                + (total % unit_scale + unit_offset) % unit_scale
        out[..., b*expansion + e] = page * expansion + e     (e < expansion)
    """

    begin: int
    stop: int
    spb: int
    unit_scale: int
    unit_offset: int
    #: int32, at least the slot ids the blocks ``[begin, stop)`` use.
    slot_ids: np.ndarray


def scratch_kernel_args(scratch: ScratchDesc, width: int, scale: int, offset: int,
                        expansion: int) -> ScratchKernelArgs | None:
    """Check ``scratch`` for a conversion of a table ``width`` blocks wide; ``None`` when no
    block of the table is a scratch block (the plain conversion applies).

    Raises:
        TypeError: ``scratch`` is not a :class:`ScratchDesc`.
        ValueError: ``begin < 0``, ``scratch_pages_per_block < 1``, ``scale`` or ``offset``
            not a multiple of ``expansion``, ``scale < 1`` or above int32, a slot id outside
            ``[0, INT32_MAX]``, or fewer slot ids than the blocks in the table need.
    """
    if not isinstance(scratch, ScratchDesc):
        raise ArgumentTypeError(f"scratch={scratch!r}: must be a kvcm_core.scratch.ScratchDesc or "
                                "None")
    begin, end, spb = int(scratch.begin), int(scratch.end), int(scratch.scratch_pages_per_block)
    if begin < 0:
        raise InvalidArgumentError(f"scratch begin={begin}: must be >= 0")
    if spb < 1:
        raise InvalidArgumentError(f"scratch_pages_per_block={spb}: must be >= 1")
    scale, offset, expansion = int(scale), int(offset), int(expansion)
    if not 1 <= scale <= _I32_MAX:
        raise InvalidArgumentError(f"scale={scale}: with scratch it must be in [1, {_I32_MAX}]")
    if scale % expansion or offset % expansion:
        raise InvalidArgumentError(
            f"scale={scale}, offset={offset}: with scratch both must be multiples of "
            f"expansion={expansion} (the scratch arithmetic runs in whole pages)")
    stop = min(end, int(width))
    if stop <= begin:
        return None
    unit_scale = scale // expansion
    needed = (stop - 1 - begin) * spb // unit_scale + 1
    ids = scratch.slot_ids
    if len(ids) < needed:
        raise InvalidArgumentError(
            f"scratch descriptor has {len(ids)} slot ids; blocks [{begin}, {stop}) need "
            f"{needed}")
    if any(not 0 <= i <= _I32_MAX for i in ids[:needed]):
        raise InvalidArgumentError(f"scratch slot ids {ids[:needed]}: must be in [0, {_I32_MAX}]")
    return ScratchKernelArgs(begin, stop, spb, unit_scale, (offset // expansion) % unit_scale,
                             np.asarray(ids[:needed], dtype=np.int32))


def convert_page_indices_reference(slots: Any, scale: int, offset: int, expansion: int = 1,
                                   scratch: ScratchDesc | None = None) -> np.ndarray:
    """The reference of :meth:`KernelBackend.convert_page_indices` (the ``numpy`` backend
    runs it): ``out[..., i*expansion + e] = slots[..., i] * scale + offset + e`` (int64,
    wrapping), ``BAD_PAGE_INDEX`` for all ``expansion`` entries of a ``BAD_PAGE_INDEX``
    slot, and the rotated scratch index (:class:`ScratchKernelArgs`) for the blocks of
    ``scratch``, whatever their slot entry.

    Raises:
        ValueError: ``expansion < 1``, a 0-d ``slots``, or a bad ``scratch``
            (:func:`scratch_kernel_args`).
        OverflowError: a result outside ``[BAD_PAGE_INDEX, INT32_MAX]``.
    """
    if expansion < 1:
        raise InvalidArgumentError(f"expansion={expansion}: must be >= 1")
    s = np.asarray(slots, dtype=np.int32)
    if s.ndim == 0:
        raise InvalidArgumentError("slots must be an array of slot ids (last axis: blocks)")
    sa = None if scratch is None else scratch_kernel_args(
        scratch, s.shape[-1], scale, offset, expansion)
    wide = s.astype(np.int64)[..., None] * scale + offset + np.arange(expansion)
    wide = np.where(s[..., None] == BAD_PAGE_INDEX, BAD_PAGE_INDEX, wide)
    if sa is not None:
        total = np.arange(sa.stop - sa.begin, dtype=np.int64) * sa.spb
        page = (sa.slot_ids.astype(np.int64)[total // sa.unit_scale] * sa.unit_scale
                + (total % sa.unit_scale + sa.unit_offset) % sa.unit_scale)
        wide[..., sa.begin : sa.stop, :] = (page[:, None] * expansion
                                            + np.arange(expansion, dtype=np.int64))
    if wide.size and (wide.max() > _I32_MAX or wide.min() < BAD_PAGE_INDEX):
        raise OverflowError("converted page index does not fit int32")
    return wide.reshape(*s.shape[:-1], s.shape[-1] * expansion).astype(np.int32)


def convert_with_scratch(base: np.ndarray, scale: int, offset: int, expansion: int,
                         spb: int, scratch: ScratchDesc | None,
                         backend: KernelBackend | None = None,
                         stream: Stream | None = None) -> np.ndarray:
    """A base page table (slot ids, ``BAD_PAGE_INDEX`` for absent or stale blocks) to one
    buffer's page indices: ``out[..., i*expansion + e] = slot * scale + offset + e`` for
    ordinary blocks, the rotated scratch index for the blocks of ``scratch``, and
    ``BAD_PAGE_INDEX`` (all ``expansion`` of them) where the base table has it.

    ``spb`` is the buffer's ``scratch_pages_per_block`` (0: not in a scratch group), checked
    against the descriptor's. The conversion itself is
    :meth:`KernelBackend.convert_page_indices` of ``backend`` (on ``stream``), or without
    one its reference :func:`convert_page_indices_reference`; see
    :class:`ScratchKernelArgs` for the arithmetic (with ``expansion > 1`` it runs in whole
    pages, ``scale // expansion`` a slot, and each page expands to ``expansion`` units).
    Output is int32.
    """
    if np.ndim(base) == 0:
        raise InvalidArgumentError("base must be an array of slot ids (last axis: blocks)")
    if scratch is not None and scratch.end > scratch.begin:
        if spb <= 0:
            raise InvalidArgumentError("this buffer is not in an SWA scratch group "
                             "(scratch_pages_per_block is 0); pass scratch=None")
        if scratch.scratch_pages_per_block != spb:
            raise InvalidArgumentError(
                f"scratch descriptor has scratch_pages_per_block="
                f"{scratch.scratch_pages_per_block}, the converter {spb}")
    else:
        scratch = None
    if backend is None:
        return convert_page_indices_reference(base, scale, offset, expansion, scratch)
    return np.asarray(backend.convert_page_indices(base, scale, offset, expansion, stream,
                                                   scratch=scratch))


# -- construction-time validation ---------------------------------------------------------


def _layer_spans(places: Mapping[tuple[int, str], Any], pool: int,
                 members: set[tuple[int, str]], size_of: Mapping[tuple[int, str], int]
                 ) -> dict[int, list[int]]:
    """layer id -> sorted sub-page offsets of its buffers (of ``members``) in ``pool``."""
    spans: dict[int, list[int]] = {}
    for key, place in places.items():
        if key in members and place.pool == pool:
            spans.setdefault(key[0], []).append(place.offset // size_of[key])
    for offs in spans.values():
        offs.sort()
    return spans


def _wrap_gaps(scale: int, spb: int) -> list[tuple[int, int]]:
    """For each slot of one period: (blocks starting in it, cyclic gap between its last
    and its first block's sub-page windows)."""
    period = spb // math.gcd(spb, scale)
    out = []
    for k in range(period):
        first = -(-k * scale // spb)  # first block starting in slot k
        last = -(-(k + 1) * scale // spb) - 1
        m = last - first + 1
        if m >= 2:
            r0 = first * spb - k * scale
            r1 = last * spb - k * scale
            out.append((m, scale - (r1 - r0)))
    return out


def validate_scratch_layout(config: KVCacheManagerConfig, registry: LifeCycleRegistry,
                            layout: Any) -> dict[int, tuple[int, ...]]:
    """Check that the scratch arithmetic aliases nothing within a layer, for every pool of
    every windowed (dense) cache group; returns ``group -> scale of each pool``.

    Raises:
        ConfigError: naming ``swa_scratch.scratch_pages_per_block`` and the layer.
    """
    sc = config.swa_scratch
    if sc is None:
        return {}
    spb = sc.scratch_pages_per_block
    field = "swa_scratch.scratch_pages_per_block"
    index_of = {layer.layer_id: i for i, layer in enumerate(config.layers)}
    out: dict[int, tuple[int, ...]] = {}
    for g, lc in enumerate(registry.life_cycles):
        if not lc.is_windowed or lc.sparse:
            continue
        members = {(lid, role) for lid, role, _ in registry.members[g]}  # type: ignore[index]
        size_of = {(lid, role): size for lid, role, size in registry.members[g]}  # type: ignore[index]
        pgid = layout.group_to_pool_group[g]  # type: ignore[index]
        pg = layout.pool_groups[pgid]
        scales = []
        for pool, slot_bytes in enumerate(pg.slot_sizes):
            sizes = {size_of[k] for k in members if pg.places[k].pool == pool}
            (size,) = sizes  # one life cycle's pool coalesces one page size
            scale = slot_bytes // size
            scales.append(scale)
            if spb > scale:
                raise ConfigError(
                    field, spb,
                    f"must be <= the sub-pages per slot of every scratch pool: cache group "
                    f"{g} ({lc.describe()}) pool {pool} holds {scale} pages of {size} bytes "
                    "a slot")
            spans = _layer_spans(pg.places, pool, members, size_of)
            gaps = _wrap_gaps(scale, spb)
            for layer_id, offs in spans.items():
                where = f"layers[{index_of[layer_id]}] (layer_id={layer_id})"
                n = len(offs)
                if offs != list(range(offs[0], offs[0] + n)):
                    raise ConfigError(
                        field, spb,
                        f"{where}: its buffers in pool {pool} of cache group {g} are not "
                        f"contiguous sub-pages ({offs}); scratch blocks would alias")
                if n > spb:
                    raise ConfigError(
                        field, spb,
                        f"{where} has {n} buffers of {size} bytes in pool {pool} of cache "
                        f"group {g}; a scratch block needs at least that many sub-pages "
                        f"(scratch_pages_per_block >= {n}), else two blocks of the layer "
                        "alias")
            for layer_id, offs in spans.items():
                where = f"layers[{index_of[layer_id]}] (layer_id={layer_id})"
                n = len(offs)
                for m, gap in gaps:
                    if gap < n:
                        raise ConfigError(
                            field, spb,
                            f"{where}: with {scale} sub-pages a slot in pool {pool} of "
                            f"cache group {g}, {m} scratch blocks start in one slot and "
                            f"the last one's sub-pages wrap onto the first one's ({n} "
                            f"buffers, gap {gap}); two blocks of the layer would alias. "
                            "Use a scratch_pages_per_block that divides the slot's "
                            "sub-pages")
        out[g] = tuple(scales)
    return out
