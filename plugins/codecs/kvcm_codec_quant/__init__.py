"""The quantizing page codecs ``fp8``, ``int8`` and ``int4``: lossy cold pages of fixed size.

Each scale group of ``group_size`` values of a ``bf16``, ``fp16`` or ``fp32`` buffer that is
not ``exact`` becomes one fp32 scale (``amax / Q``) and one code per value (fp8 e4m3,
int8, or int4 packed two per byte); exact buffers, ``"bytes"`` buffers and bytes no buffer
covers are copied unchanged. The cold page layout, the scale rule, the rounding and the
error bounds are defined in :mod:`kvcm_codec_quant.reference`, the NumPy reference. On a
backend that compiles CUDA C (``cupy``, ``cuda``) one kernel launch encodes or decodes every
block of a call, bit for bit equal to the reference; elsewhere (``numpy``) the reference
itself runs on the host views of the buffers, after the stream it was given has run what
it queued (on a backend with a device), so it reads what a kernel on that stream would.
``KVCM_QUANT_KERNEL`` picks the kernel variant (:data:`kvcm_codec_quant.source.VARIANTS`; default
:data:`~kvcm_codec_quant.source.DEFAULT_VARIANT`); all give the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_codec_quant.reference import (
    BOUNDS,
    LOSSY_DTYPES,
    MODES,
    RAW_CHUNK,
    Plan,
    Segment,
    decode_pages,
    encode_pages,
    make_plan,
)
from kvcm_codec_quant.source import (
    DEFAULT_VARIANT,
    FAST_GROUPS,
    KERNEL_ENV,
    PARAM_WORDS,
    SEG_DESC_WORDS,
    VARIANTS,
    Variant,
    source_for,
)
from kvcm_core import hookimpl
from kvcm_core.backend import Buffer, Event, KernelBackend, PageRegion, Stream
from kvcm_core.codec import PageCodec, PageLayout
from kvcm_core.errors import ConfigError
from kvcm_core.records import CodecCapabilities, CodecKind, CodecSpec

__all__ = ["CODEC_IDS", "QuantCodec", "capabilities", "kernel_variant"]

#: Frame ids of the codecs (``raw`` is 0).
CODEC_IDS = {"fp8": 1, "int8": 2, "int4": 3}
_DESCRIPTIONS = {
    "fp8": "Lossy page codec: fp8 e4m3 codes with an fp32 scale per group (amax / 448)",
    "int8": "Lossy page codec: int8 codes with an fp32 scale per group (amax / 127)",
    "int4": "Lossy page codec: int4 codes, two per byte, fp32 scale per group (amax / 7)",
}
_MAX_GRID_X = 65535
_MAX_GRID_Y = 65535
_I32_MAX = int(np.iinfo(np.int32).max)


def capabilities(mode: str) -> CodecCapabilities:
    """What codec ``mode`` declares: lossy, its error bound and frame id."""
    return CodecCapabilities(kind=CodecKind.PAGE, lossless=False, error_bound=BOUNDS[mode],
                             codec_id=CODEC_IDS[mode])


def _slots(label: str, slots: np.ndarray) -> np.ndarray:
    arr = np.asarray(slots)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{label}: must be a 1-D integer array; got {arr.dtype}, {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _I32_MAX):
        raise ValueError(f"{label}: slot ids must be in 0..2**31-1; got "
                         f"{int(arr.min())}..{int(arr.max())}")
    return arr.astype(np.int32, copy=False)


def _check_pages(label: str, region: PageRegion, slots: np.ndarray, size: int) -> None:
    if region.offset < 0 or region.stride < 0:
        raise ValueError(f"{label}: offset {region.offset} and stride {region.stride} "
                         "must be >= 0")
    if len(slots) > 1 and region.stride < size:
        raise ValueError(f"{label}: stride {region.stride} < page size {size}: pages overlap")
    if len(slots):
        end = region.offset + int(slots.max()) * region.stride + size
        if end > region.buffer.nbytes:
            raise ValueError(f"{label}: page {int(slots.max())} ends at byte {end}, past the "
                             f"buffer's {region.buffer.nbytes} bytes")


def _check_elements(plan: Plan, pools: Sequence[PageRegion]) -> None:
    """Lossy segments must start on an element boundary in every slot."""
    for seg in plan.segments:
        if not seg.dtype:
            continue
        item = LOSSY_DTYPES[seg.dtype][1]
        region = pools[seg.pool]
        if (region.buffer.ptr + region.offset + seg.offset) % item or region.stride % item:
            raise ValueError(
                f"pool {seg.pool}: {seg.dtype} buffer at slot offset {seg.offset} is not "
                f"aligned to its {item}-byte elements (region offset {region.offset}, "
                f"stride {region.stride})")


def _pages(region: PageRegion, size: int, slots: np.ndarray) -> np.ndarray | None:
    """``[n, size]`` copies of host-visible pages (None for device memory)."""
    if region.buffer.host_ptr is None:
        return None
    base = region.buffer.host_view()
    count = int(slots.max()) + 1
    view = np.ndarray((count, size), dtype=np.uint8, buffer=base, offset=region.offset,
                      strides=(region.stride, 1))
    return view[slots]


def _host_ready(backend: KernelBackend, stream: Stream | None) -> None:
    """The NumPy path runs now, on the host, in place of a kernel on ``stream``: on a
    backend with a device (that cannot compile the kernel) what ``stream`` has queued, and
    what it was made to wait for, runs first, as it would before the kernel. The host
    work is done when the call returns, so whatever is queued on ``stream`` later sees
    it."""
    if backend.capabilities.has_device:
        (stream or backend.default_stream).synchronize()


def _read(backend: KernelBackend, region: PageRegion, size: int,
          slots: np.ndarray) -> np.ndarray:
    got = _pages(region, size, slots)
    if got is not None:
        return got
    return np.stack([backend.read(region.buffer, region.page_start(int(s)), size)
                     for s in slots.tolist()])


def _write(backend: KernelBackend, region: PageRegion, slots: np.ndarray,
           rows: np.ndarray) -> None:
    size = rows.shape[1]
    if region.buffer.host_ptr is not None:
        base = region.buffer.host_view()
        view = np.ndarray((int(slots.max()) + 1, size), dtype=np.uint8, buffer=base,
                          offset=region.offset, strides=(region.stride, 1))
        view[slots] = rows
        return
    for s, row in zip(slots.tolist(), rows, strict=True):
        backend.write(region.buffer, region.page_start(int(s)), row)


#: Whether the kernel's fast paths (see :mod:`kvcm_codec_quant.source`) may be used.
FAST_PATH = True


def _path(seg: Segment, variant: Variant, pool_base: int, pool_stride: int, cold_base: int,
          cold_stride: int) -> int:
    """The kernel path of a segment: 2 the half-warp path (16-bit values in whole groups of
    128, 16-byte aligned in every slot, cold sections 8-byte aligned in every page; variants
    with ``hw_groups``), 1 the warp path (8-byte aligned values, 4-byte aligned cold
    sections), 0 the general path."""
    if not (FAST_PATH and seg.dtype in ("bf16", "fp16") and seg.group_size == 128
            and seg.elements % 128 == 0):
        return 0
    if (variant.hw_groups and pool_base % 16 == 0 and pool_stride % 16 == 0
            and cold_base % 8 == 0 and cold_stride % 8 == 0):
        return 2
    if pool_base % 8 == 0 and pool_stride % 8 == 0 and cold_base % 4 == 0 and cold_stride % 4 == 0:
        return 1
    return 0


def kernel_variant(name: str | None = None) -> Variant:
    """The kernel variant called ``name``, else named by ``$KVCM_QUANT_KERNEL``, else the
    default.

    Raises:
        ConfigError: the name is not one of :data:`~kvcm_codec_quant.source.VARIANTS`.
    """
    field = "kernel"
    if name is None:
        name, field = os.environ.get(KERNEL_ENV) or DEFAULT_VARIANT, KERNEL_ENV
    variant = VARIANTS.get(name)
    if variant is None:
        raise ConfigError(field, name, f"must be one of {sorted(VARIANTS)}")
    return variant


#: Smallest device area that keeps descriptor tables between calls (bytes).
_TABLE_AREA = 16 << 10


class _Staging:
    """A backend's compiled kernels for one variant, and the device memory a launch reads.

    Descriptor tables (one per layout and set of buffers: the same for every migration of
    a manager's cold group) are uploaded once into an append-only device area and reused
    while their bytes are the same; the area starts over (after a device synchronize, and
    larger if a table needs it) when full. Slot pairs (variants whose ``slots`` is
    ``device`` or ``mapped``, and ``param`` tables too large for the parameter) go through
    two pinned-and-device slots: a slot is rewritten only after the launch that read it has
    finished. ``param`` tables are packed into a reused host array per parameter size.
    Consecutive slots (block ``i`` at pool slot ``p0 + i`` and cold slot ``c0 + i``) need
    no pairs."""

    def __init__(self, backend: KernelBackend, variant: Variant) -> None:
        self.backend = backend
        self.module = backend.compile(source_for(variant))  # type: ignore[attr-defined]
        self.cap = 0
        self.host: Buffer | None = None
        self.dev: Buffer | None = None
        self.events: list[Event] = [backend.create_event(), backend.create_event()]
        self.next = 0
        self.table_cap = 0
        self.table_host: Buffer | None = None
        self.table_dev: Buffer | None = None
        self.tables: dict[bytes, tuple[int, Event]] = {}
        self.table_used = 0
        self.params: dict[int, np.ndarray] = {}

    def table(self, table: np.ndarray, stream: Stream | None) -> int:
        """Device address of descriptor table ``table``, uploaded on ``stream`` the first
        time; a later call on another stream waits for that upload."""
        key = table.tobytes()
        known = self.tables.get(key)
        if known is not None:
            addr, uploaded = known
            if not uploaded.query():
                (stream or self.backend.default_stream).wait_event(uploaded)
            return addr
        nbytes = -(-len(key) // 16) * 16
        if self.table_used + nbytes > self.table_cap:
            if self.table_cap:
                self.backend.synchronize()  # no launch reads the area any more
            self.tables.clear()
            self.table_used = 0
            if nbytes * 4 > self.table_cap:
                for buf in (self.table_host, self.table_dev):
                    if buf is not None:
                        buf.free()
                self.table_cap = max(_TABLE_AREA, 4 * nbytes)
                self.table_host = self.backend.alloc_host(self.table_cap)
                self.table_dev = self.backend.alloc_device(self.table_cap)
        assert self.table_host is not None and self.table_dev is not None
        at = self.table_used
        self.table_used += nbytes
        self.table_host.host_view()[at : at + len(key)] = np.frombuffer(key, dtype=np.uint8)
        self.backend.copy_bytes(self.table_dev, at, self.table_host, at, len(key), stream)
        uploaded = self.backend.create_event()
        uploaded.record(stream)
        self.tables[key] = (self.table_dev.ptr + at, uploaded)
        return self.table_dev.ptr + at

    def upload(self, table: np.ndarray, stream: Stream | None,
               mapped: bool = False) -> tuple[int, Event]:
        """Copy ``table`` (bytes) to the device on ``stream``: its device address and the
        event to record after the launch that reads it. ``mapped``: no copy; the address is
        the pinned host copy's, which the kernel reads over the bus."""
        nbytes = table.nbytes
        if nbytes * 2 > self.cap:
            for ev in self.events:
                ev.synchronize()
            for buf in (self.host, self.dev):
                if buf is not None:
                    buf.free()
            self.cap = max(2 * nbytes, 64 << 10)
            self.host = self.backend.alloc_host(self.cap)
            self.dev = self.backend.alloc_device(self.cap)
        assert self.host is not None and self.dev is not None
        k = self.next
        self.next ^= 1
        event = self.events[k]
        event.synchronize()
        at = k * (self.cap // 2)
        self.host.host_view()[at : at + nbytes] = table.view(np.uint8).reshape(-1)
        if mapped:
            return self.host.ptr + at, event
        self.backend.copy_bytes(self.dev, at, self.host, at, nbytes, stream)
        return self.dev.ptr + at, event

    def param(self, words: int) -> np.ndarray:
        """The reused ``uint32 [words]`` host array of the slot-table parameter of that size
        (the driver copies a launch's parameters when it queues the launch)."""
        arr = self.params.get(words)
        if arr is None:
            arr = self.params[words] = np.zeros(words, dtype=np.uint32)
        return arr


def _consecutive(slots: np.ndarray) -> bool:
    return len(slots) < 2 or bool(np.all(np.diff(slots) == 1))


class QuantCodec(PageCodec):
    """A quantizing page codec (see the module docstring).

    Args:
        mode: ``"fp8"``, ``"int8"`` or ``"int4"``.
        options: ``None``, or ``{"kernel": name}`` (the same as ``kernel=name``).
        kernel: the CUDA kernel variant (a name of
            :data:`~kvcm_codec_quant.source.VARIANTS`, or a :class:`Variant`); ``None``:
            ``$KVCM_QUANT_KERNEL``, else the default. Every variant gives the same bytes.

    Raises:
        ValueError: an unknown mode or an option was given.
        ConfigError: an unknown kernel variant (also from ``$KVCM_QUANT_KERNEL``).
    """

    lossless = False

    def __init__(self, mode: str, options: Mapping[str, Any] | None = None, *,
                 kernel: str | Variant | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {sorted(MODES)}")
        extra = sorted(set(options or {}) - {"kernel"})
        if extra:
            raise ValueError(f"{mode} codec takes only the option 'kernel'; got {extra}")
        if kernel is None and options:
            kernel = options.get("kernel")
            if not isinstance(kernel, str):
                raise ConfigError("kernel", kernel, "must be a kernel variant name (a string)")
        self.variant = kernel if isinstance(kernel, Variant) else kernel_variant(kernel)
        self.mode = mode
        self.error_bound = BOUNDS[mode]
        self._plans: dict[PageLayout, Plan] = {}
        # Per backend (kept alive with it, so ids are not reused): the compiled kernel and
        # the descriptor staging, which live as long as this codec (one per manager).
        self._staging: dict[int, tuple[KernelBackend, _Staging]] = {}

    def plan(self, layout: PageLayout) -> Plan:
        """The cold page layout of ``layout`` (cached)."""
        plan = self._plans.get(layout)
        if plan is None:
            plan = self._plans[layout] = make_plan(layout, self.mode)
        return plan

    def cold_page_size(self, layout: PageLayout) -> int:
        return self.plan(layout).cold_page_size

    def _prepare(self, layout: PageLayout, pools: Sequence[PageRegion], pool_slots: np.ndarray,
                 cold: PageRegion, cold_slots: np.ndarray) -> tuple[Plan, np.ndarray, np.ndarray]:
        plan = self.plan(layout)
        if len(pools) != len(layout.slot_sizes):
            raise ValueError(
                f"{len(pools)} pool regions given for a layout of {len(layout.slot_sizes)} pools")
        ps, cs = _slots("pool slots", pool_slots), _slots("cold slots", cold_slots)
        if ps.shape != cs.shape:
            raise ValueError(f"{len(ps)} pool slots but {len(cs)} cold slots: one each per block")
        for p, (region, size) in enumerate(zip(pools, layout.slot_sizes, strict=True)):
            _check_pages(f"pool {p}", region, ps, size)
        _check_pages("cold", cold, cs, plan.cold_page_size)
        _check_elements(plan, pools)
        return plan, ps, cs

    def encode(self, backend: KernelBackend, layout: PageLayout, src: Sequence[PageRegion],
               src_slots: np.ndarray, dst: PageRegion, dst_slots: np.ndarray,
               stream: Stream | None = None) -> None:
        """Encode block ``src_slots[i]`` of the pools ``src`` into cold page ``dst_slots[i]``.

        Raises:
            ValueError: mismatched slot arrays or pool count, overlapping cold pages, a page
                outside its buffer, or a lossy buffer off its element alignment.
        """
        plan, ps, cs = self._prepare(layout, src, src_slots, dst, dst_slots)
        if not len(ps):
            return
        if backend.capabilities.compiles_sources:
            self._launch(backend, plan, src, ps, dst, cs, stream, encode=True)
            return
        _host_ready(backend, stream)
        rows = [_read(backend, r, s, ps) for r, s in zip(src, layout.slot_sizes, strict=True)]
        _write(backend, dst, cs, encode_pages(plan, rows))

    def decode(self, backend: KernelBackend, layout: PageLayout, src: PageRegion,
               src_slots: np.ndarray, dst: Sequence[PageRegion], dst_slots: np.ndarray,
               stream: Stream | None = None) -> None:
        """Decode cold page ``src_slots[i]`` into block ``dst_slots[i]`` of the pools ``dst``.

        Raises:
            ValueError: as for :meth:`encode`.
        """
        plan, ps, cs = self._prepare(layout, dst, dst_slots, src, src_slots)
        if not len(ps):
            return
        if backend.capabilities.compiles_sources:
            self._launch(backend, plan, dst, ps, src, cs, stream, encode=False)
            return
        _host_ready(backend, stream)
        cold = _read(backend, src, plan.cold_page_size, cs)
        rows = [_read(backend, r, s, ps) for r, s in zip(dst, layout.slot_sizes, strict=True)]
        decode_pages(plan, cold, rows)
        for region, r in zip(dst, rows, strict=True):
            _write(backend, region, ps, r)

    def _table(self, plan: Plan, pools: Sequence[PageRegion], cold: PageRegion) -> np.ndarray:
        variant = self.variant
        table = np.zeros((len(plan.segments), SEG_DESC_WORDS), dtype=np.int64)
        ends = [s.cold_offset for s in plan.segments[1:]] + [plan.cold_page_size]
        for i, (seg, end) in enumerate(zip(plan.segments, ends, strict=True)):
            region = pools[seg.pool]
            pool_base = region.buffer.ptr + region.offset + seg.offset
            cold_base = cold.buffer.ptr + cold.offset + seg.cold_offset
            path = _path(seg, variant, pool_base, region.stride, cold_base, cold.stride)
            if path == 2:
                units = -(-seg.groups // variant.hw_block_groups)
            elif path == 1:
                units = -(-seg.groups // FAST_GROUPS)
            else:
                units = seg.groups if seg.dtype else -(-seg.size // RAW_CHUNK)
            table[i] = (
                pool_base, region.stride, cold_base, cold.stride,
                seg.size, seg.elements, seg.group_size, 1 if seg.dtype else 0,
                LOSSY_DTYPES[seg.dtype][0] if seg.dtype else 0, units,
                seg.payload_offset() if seg.dtype else 0,
                seg.group_bytes(self.mode) if seg.dtype else 0, path,
                4 * seg.groups, seg.used_bytes(self.mode), end - seg.cold_offset,
            )
        return table

    def _launch(self, backend: KernelBackend, plan: Plan, pools: Sequence[PageRegion],
                ps: np.ndarray, cold: PageRegion, cs: np.ndarray, stream: Stream | None,
                encode: bool) -> None:
        known = self._staging.get(id(backend))
        if known is None:
            known = self._staging[id(backend)] = (backend, _Staging(backend, self.variant))
        staging = known[1]
        variant = self.variant
        table = self._table(plan, pools, cold)
        rows = len(ps) * len(plan.segments)
        if rows >= 2**32:
            raise ValueError(f"{len(ps)} blocks x {len(plan.segments)} segments: at most "
                             "2**32 - 1 rows a launch")
        descs = staging.table(table, stream)
        per_block = [int(u) if path == 2 else -(-int(u) // variant.warps)
                     for u, path in zip(table[:, 9], table[:, 12], strict=True)]
        grid = (max(1, min(max(per_block), _MAX_GRID_X)), min(rows, _MAX_GRID_Y), 1)
        name = "kvcm_quant_encode" if encode else "kvcm_quant_decode"
        common = [np.uint64(descs), np.uint64(len(plan.segments))]
        mode = np.uint64(MODES[self.mode])
        event: Event | None = None
        if _consecutive(ps) and _consecutive(cs):
            args = [*common, np.uint64(0), np.uint64(len(ps)), mode,
                    np.uint64(int(ps[0]) | (int(cs[0]) << 32))]
        else:
            packed = _param_table(staging, ps, cs) if variant.slots == "param" else None
            if packed is not None:
                words, wide = packed
                name = f"{name}_p{len(words)}"
                args = [*common, np.uint64(len(ps)), mode, np.uint64(wide),
                        words.view(np.dtype((np.void, words.nbytes)))]
            else:
                pairs = np.empty((len(ps), 2), dtype=np.int32)
                pairs[:, 0], pairs[:, 1] = ps, cs
                pairs_at, event = staging.upload(pairs.view(np.uint8).reshape(-1), stream,
                                                 mapped=variant.slots == "mapped")
                args = [*common, np.uint64(pairs_at), np.uint64(len(ps)), mode, np.uint64(0)]
        staging.module.launch(name, grid, (variant.threads, 1, 1), args, stream=stream)
        if event is not None:
            event.record(stream)


def _param_table(staging: _Staging, ps: np.ndarray, cs: np.ndarray
                 ) -> tuple[np.ndarray, int] | None:
    """The slot table as the parameter of a ``param`` kernel: ``(words, wide)`` with
    ``words`` the smallest of :data:`PARAM_WORDS` that holds it (narrow: one word
    ``pool | cold << 16`` a block when every slot is below 2**16; wide: two words a block),
    or None when no size holds it (the launch then uploads the pairs)."""
    wide = int(max(int(ps.max()), int(cs.max())) >= 1 << 16)
    need = len(ps) << wide
    size = next((w for w in PARAM_WORDS if w >= need), None)
    if size is None:
        return None
    words = staging.param(size)
    if wide:
        words[0:need:2] = ps
        words[1:need:2] = cs
    else:
        words[:need] = ps.astype(np.uint32) | (cs.astype(np.uint32) << 16)
    return words, wide


def _factory(mode: str) -> Any:
    def build(options: Mapping[str, Any] | None = None) -> QuantCodec:
        return QuantCodec(mode, options)

    return build


@hookimpl
def kvcm_codecs() -> Iterator[CodecSpec]:
    """Register the ``fp8``, ``int8`` and ``int4`` page codecs."""
    for mode in MODES:
        yield CodecSpec(name=mode, factory=_factory(mode), description=_DESCRIPTIONS[mode],
                        capabilities=capabilities(mode))
