"""Conformance tests for codecs (page codecs and blob codecs).

Page codecs run on the selected kernel backend (``KVCM_KERNEL_BACKEND``, else the available
backend of highest priority: ``numpy`` on a machine without a GPU), on random pool layouts
of one to four pools with odd slot sizes; their data is written and read back through the
backend's backdoor. Lossless codecs must round-trip bit for bit; lossy ones are checked on
random floats of :attr:`CodecConformance.lossy_element_dtype` in typed buffers (the
layout's ``BufferPlace.dtype``, ``group_size``, ``exact=False``) against their declared
``error_bound``, and on KV-like bf16 data (normal values with a few outlier channels) against
``error_bound`` times the largest magnitude of each element's scale group, with ``exact``
and ``"bytes"`` buffers bit for bit. On a device backend, every page codec must write the
same cold bytes, and decode the same values, as on the ``numpy`` backend. Blob codecs
round-trip random bytes, and checksummed ones must reject a flipped byte or a truncated blob with
:class:`~kvcm_core.errors.CorruptPageError`. Tests gate on ``capabilities.kind``,
``lossless`` and ``checksummed``, never on names.

Subclass to run it for one codec::

    from kvcm_core.testing.conformance.codec import CodecConformance

    class TestMyCodec(CodecConformance):
        plugin_name = "mine"
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core.backend import Buffer, KernelBackend, MemoryKind, PageRegion
from kvcm_core.codec import BlobCodec, BufferPlace, PageCodec, PageLayout
from kvcm_core.errors import CorruptPageError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.records import CodecKind
from kvcm_core.testing.conformance import ConformanceBase
from kvcm_core.testing.values import ITEMSIZE, extreme_values, from_bytes, to_bytes

__all__ = ["CodecConformance", "extreme_case"]

_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        # One base class, many subclasses (one per plugin): the same test function runs
        # with different `self`s by design.
        HealthCheck.differing_executors,
    ],
)
_seeds = st.integers(0, 2**32 - 1)


# -- random layouts ------------------------------------------------------------------------


def _slot_sizes(itemsize: int) -> st.SearchStrategy[int]:
    """Slot sizes in bytes, odd ones included when elements are bytes."""
    return st.one_of(st.integers(1, 16), st.integers(17, 3000)).map(lambda n: n * itemsize)


#: Buffer dtype names of the element types lossy data is drawn in.
_BUFFER_DTYPES = {"float16": "fp16", "float32": "fp32"}


@st.composite
def _layouts(draw: st.DrawFn, itemsize: int = 1, dtype: str = "bytes") -> PageLayout:
    """1 to 4 pools; each pool's slot holds one buffer of one layer (of ``dtype``, with a
    drawn scale group size, not exact, when it is not ``"bytes"``)."""
    sizes = tuple(draw(st.lists(_slot_sizes(itemsize), min_size=1, max_size=4)))
    group = draw(st.sampled_from([1, 7, 32, 128])) if dtype != "bytes" else 128
    places = tuple(
        BufferPlace(layer_id=pool, role="kv", pool=pool, offset=0, size=size, dtype=dtype,
                    group_size=group, exact=dtype == "bytes")
        for pool, size in enumerate(sizes)
    )
    return PageLayout(slot_sizes=sizes, buffers=places)


@attrs.frozen
class _Region:
    """Where slots lie in a buffer: slot ``i`` at ``offset + i * stride``."""

    offset: int
    stride: int
    slots: int

    @property
    def nbytes(self) -> int:
        return self.offset + self.slots * self.stride + 3


@attrs.frozen
class _RoundTrip:
    layout: PageLayout
    pools: list[_Region]  # where the encoded blocks come from
    targets: list[_Region]  # where they are decoded to (fresh buffers)
    cold: _Region
    cold_kind: str
    pool_slots: list[int]
    cold_slots: list[int]
    target_slots: list[int]
    seed: int


def _region(draw: st.DrawFn, size: int, slots: int, itemsize: int) -> _Region:
    """Unaligned regions, but with elements of lossy data starting on element boundaries."""
    return _Region(
        offset=draw(st.integers(0, 40)) * itemsize,
        stride=size + draw(st.integers(0, 24)) * itemsize,
        slots=slots,
    )


@st.composite
def _round_trips(
    draw: st.DrawFn, codec: PageCodec, itemsize: int, cold_kinds: list[str],
    dtype: str = "bytes",
) -> _RoundTrip:
    layout = draw(_layouts(itemsize, dtype))
    blocks = draw(st.integers(1, 12))
    cold_capacity = draw(st.integers(1, 12))
    count = draw(st.integers(0, min(blocks, cold_capacity)))
    pool_slots = draw(st.permutations(range(blocks)))[:count]
    target_slots = draw(st.permutations(range(blocks)))[:count]
    cold_slots = draw(st.permutations(range(cold_capacity)))[:count]
    return _RoundTrip(
        layout=layout,
        pools=[_region(draw, s, blocks, itemsize) for s in layout.slot_sizes],
        targets=[_region(draw, s, blocks, itemsize) for s in layout.slot_sizes],
        cold=_region(draw, codec.cold_page_size(layout), cold_capacity, 1),
        cold_kind=draw(st.sampled_from(cold_kinds)),
        pool_slots=list(pool_slots),
        cold_slots=list(cold_slots),
        target_slots=list(target_slots),
        seed=draw(_seeds),
    )


# -- helpers -------------------------------------------------------------------------------


def _random_fill(rng: np.random.Generator, nbytes: int, dtype: np.dtype[Any] | None) -> np.ndarray:
    """Random bytes, or (for lossy codecs) random floats in [-1, 1] as bytes."""
    if dtype is None:
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    count = -(-nbytes // dtype.itemsize)
    values = rng.uniform(-1.0, 1.0, count).astype(dtype)
    return values.view(np.uint8)[:nbytes].copy()


def _alloc(backend: KernelBackend, kind: str, nbytes: int) -> Buffer:
    return backend.alloc_host(nbytes) if kind == MemoryKind.HOST else backend.alloc_device(nbytes)


def _slot_bytes(image: np.ndarray, region: _Region, slot: int, size: int) -> np.ndarray:
    start = region.offset + slot * region.stride
    return image[start : start + size]


def _outside(image: np.ndarray, region: _Region, slots: list[int], size: int) -> np.ndarray:
    """The bytes of ``image`` outside the given slots (for untouched-memory checks)."""
    keep = np.ones(len(image), dtype=bool)
    for slot in slots:
        start = region.offset + slot * region.stride
        keep[start : start + size] = False
    return image[keep]


# -- KV-like typed pages ---------------------------------------------------------------------


@attrs.frozen
class _KvCase:
    layout: PageLayout
    images: list[np.ndarray]  # per pool: uint8 [blocks, slot size]


@st.composite
def _kv_cases(draw: st.DrawFn) -> _KvCase:
    """1 to 3 pools; each slot holds a lossy bf16 buffer of tokens x channels values
    (normal, with a few outlier channels 40x larger), an exact bf16 buffer and a few
    ``"bytes"``."""
    rng = np.random.default_rng(draw(_seeds))
    blocks = draw(st.integers(1, 6))
    group = draw(st.sampled_from([16, 64, 128]))
    sizes, places, images = [], [], []
    for pool in range(draw(st.integers(1, 3))):
        tokens, channels = draw(st.integers(1, 16)), draw(st.sampled_from([32, 64, 128]))
        lossy, exact = 2 * tokens * channels, 2 * draw(st.integers(1, 64))
        tail = 2 * draw(st.integers(0, 20))  # slots stay element-aligned
        places += [
            BufferPlace(pool, "k", pool, 0, lossy, "bf16", group, False),
            BufferPlace(pool, "scale", pool, lossy, exact, "bf16", group, True),
            BufferPlace(pool, "meta", pool, lossy + exact, tail),
        ]
        sizes.append(lossy + exact + tail)
        values = rng.normal(0.0, 1.0, (blocks, tokens, channels)).astype(np.float32)
        values[..., rng.choice(channels, 3, replace=False)] *= np.float32(40.0)
        image = rng.integers(0, 256, (blocks, sizes[-1]), dtype=np.uint8)
        image[:, :lossy] = to_bytes(values, "bf16").reshape(blocks, lossy)
        image[:, lossy : lossy + exact] = to_bytes(
            rng.normal(0.0, 1.0, (blocks, exact // 2)), "bf16")
        images.append(image)
    places = [p for p in places if p.size > 0]
    return _KvCase(PageLayout(tuple(sizes), tuple(places)), images)


#: (pool, dtype, group size, groups) of the extreme-value layout: the 16-bit buffers of
#: pool 0 are aligned whole groups of 128 (the kernels' vector paths), pool 1 takes the
#: general path (fp32, and an odd group size).
_EXTREME_BUFFERS = ((0, "bf16", 128, 8), (0, "fp16", 128, 8), (1, "fp32", 32, 8),
                    (1, "bf16", 7, 8))


def extreme_case(blocks: int = 8, seed: int = 0) -> _KvCase:
    """Typed buffers full of extreme values (:func:`kvcm_core.testing.values.extreme_values`:
    subnormal inputs and scales, +-0, the largest finite values, saturation and ties), no
    NaN or infinity: the inputs on which a kernel that flushes subnormals to zero, or rounds
    ties differently, parts from the NumPy reference."""
    rng = np.random.default_rng(seed)
    sizes = [0, 0]
    places: list[BufferPlace] = []
    parts: list[list[np.ndarray]] = [[], []]
    for i, (pool, dtype, group, groups) in enumerate(_EXTREME_BUFFERS):
        values = extreme_values(rng, blocks, groups, group, dtype)
        raw = to_bytes(values, dtype).reshape(blocks, -1)
        places.append(BufferPlace(i, "kv", pool, sizes[pool], raw.shape[1], dtype, group,
                                  False))
        sizes[pool] += raw.shape[1]
        parts[pool].append(raw)
        assert raw.shape[1] == groups * group * ITEMSIZE[dtype]
    images = [np.ascontiguousarray(np.concatenate(p, axis=1)) for p in parts]
    return _KvCase(PageLayout(tuple(sizes), tuple(places)), images)


def _assert_numpy_bytes(backend: KernelBackend, codec: Any, case: Any) -> None:
    """Cold pages and decoded pages of ``backend`` equal the ``numpy`` backend's, bit for
    bit."""
    reference = get_plugin_manager().kernel_backend("numpy").factory({})
    try:
        want_pages, want_out = _encode_decode(reference, codec, case)
    finally:
        reference.close()
    pages, out = _encode_decode(backend, codec, case)
    assert np.array_equal(pages, want_pages), "cold pages differ from the numpy backend's"
    for got, want in zip(out, want_out, strict=True):
        assert np.array_equal(got, want), "decoded pages differ from the numpy backend's"


def _encode_decode(backend: KernelBackend, codec: PageCodec, case: _KvCase
                   ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Encode every block of ``case`` on ``backend`` and decode into fresh pools: the cold
    pages ``[blocks, cold size]`` and the decoded pool images."""
    layout, blocks = case.layout, case.images[0].shape[0]
    size = codec.cold_page_size(layout)
    slots = np.arange(blocks, dtype=np.int32)
    buffers: list[Buffer] = []
    try:
        def alloc(nbytes: int, data: np.ndarray | None = None) -> Buffer:
            buf = backend.alloc_device(nbytes)
            buffers.append(buf)
            backend.write(buf, 0, data.reshape(-1) if data is not None else
                          np.zeros(nbytes, dtype=np.uint8))
            return buf

        src = [PageRegion(alloc(im.nbytes, im), 0, im.shape[1]) for im in case.images]
        dst = [PageRegion(alloc(im.nbytes), 0, im.shape[1]) for im in case.images]
        cold = PageRegion(alloc(blocks * size), 0, size)
        codec.encode(backend, layout, src, slots, cold, slots)
        codec.decode(backend, layout, cold, slots, dst, slots)
        backend.synchronize()
        pages = backend.read(cold.buffer, 0, blocks * size).reshape(blocks, size)
        out = [backend.read(r.buffer, 0, im.nbytes).reshape(im.shape)
               for r, im in zip(dst, case.images, strict=True)]
        return pages, out
    finally:
        for buf in buffers:
            buf.free()


def _group_amax(values: np.ndarray, group: int) -> np.ndarray:
    """Each element's scale-group largest magnitude (``[blocks, n]``)."""
    blocks, n = values.shape
    groups = -(-n // group)
    padded = np.zeros((blocks, groups * group), dtype=np.float32)
    padded[:, :n] = np.abs(values)
    amax = padded.reshape(blocks, groups, group).max(axis=2)
    return np.repeat(amax, group, axis=1)[:, :n]


# -- the suite -----------------------------------------------------------------------------


class CodecConformance(ConformanceBase):
    """Checks a page codec's round trip and cold layout, or a blob codec's integrity."""

    kvcm_kind = "codec"
    #: Element type of the random data lossy page codecs are checked on (their
    #: ``error_bound`` is per element of this type).
    lossy_element_dtype: ClassVar[str] = "float16"
    #: Whether lossy page codecs are checked on KV-like bf16 buffers (a codec for other
    #: element types only may turn it off).
    kv_like_bf16: ClassVar[bool] = True

    @pytest.fixture(scope="class")
    @classmethod
    def codec(cls, kvcm_plugin_spec: Any) -> Any:
        """The codec under test, built with default options."""
        return kvcm_plugin_spec.factory({})

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> Iterator[KernelBackend]:
        """The selected kernel backend (``numpy`` where there is no GPU)."""
        spec = get_plugin_manager().select_kernel_backend()
        backend = spec.factory({})
        yield backend
        backend.close()

    def _itemsize(self, spec: Any) -> int:
        """Bytes per element of the random data: 1 for lossless codecs."""
        return 1 if spec.capabilities.lossless else np.dtype(self.lossy_element_dtype).itemsize

    def _buffer_dtype(self, spec: Any) -> str:
        """Buffer dtype of the random layouts: ``"bytes"`` for lossless codecs."""
        if spec.capabilities.lossless:
            return "bytes"
        return _BUFFER_DTYPES.get(self.lossy_element_dtype, "bytes")

    @staticmethod
    def _page(spec: Any) -> None:
        if spec.capabilities.kind is not CodecKind.PAGE:
            pytest.skip("not a page codec")

    @staticmethod
    def _blob(spec: Any) -> None:
        if spec.capabilities.kind is not CodecKind.BLOB:
            pytest.skip("not a blob codec")

    # -- both kinds ----------------------------------------------------------------------

    def test_codec_is_the_kind_and_precision_its_record_declares(
        self, codec: Any, kvcm_plugin_spec: Any
    ) -> None:
        caps = kvcm_plugin_spec.capabilities
        if caps.kind is CodecKind.PAGE:
            assert isinstance(codec, PageCodec)
            assert codec.lossless == caps.lossless
            assert codec.error_bound == caps.error_bound
        else:
            assert isinstance(codec, BlobCodec)
            assert caps.lossless, "a blob codec must give back the exact bytes"
        if not caps.lossless:
            assert caps.error_bound is not None and caps.error_bound > 0

    # -- page codecs ---------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_cold_page_size_is_fixed_and_positive(
        self, codec: Any, kvcm_plugin_spec: Any, data: st.DataObject
    ) -> None:
        self._page(kvcm_plugin_spec)
        layout = data.draw(_layouts(self._itemsize(kvcm_plugin_spec)))
        size = codec.cold_page_size(layout)
        assert isinstance(size, int) and size > 0
        again = PageLayout(slot_sizes=tuple(layout.slot_sizes), buffers=tuple(layout.buffers))
        assert codec.cold_page_size(again) == size
        if kvcm_plugin_spec.capabilities.lossless:
            # A fixed-size page cannot hold every possible block in fewer bytes.
            assert size >= layout.page_bytes

    @_SETTINGS
    @given(data=st.data())
    def test_encode_then_decode_round_trips_on_random_layouts(
        self, codec: Any, kvcm_plugin_spec: Any, backend: KernelBackend, data: st.DataObject
    ) -> None:
        """Lossless: bit exact; lossy: within ``error_bound`` per element. Encoding touches
        only its cold pages and no pool byte; decoding touches only its target slots."""
        self._page(kvcm_plugin_spec)
        caps = kvcm_plugin_spec.capabilities
        dtype = None if caps.lossless else np.dtype(self.lossy_element_dtype)
        cold_kinds = [MemoryKind.DEVICE]
        if backend.capabilities.host_mapped:
            cold_kinds.append(MemoryKind.HOST)
        case = data.draw(_round_trips(codec, self._itemsize(kvcm_plugin_spec), cold_kinds,
                                      self._buffer_dtype(kvcm_plugin_spec)))
        layout, cold_size = case.layout, codec.cold_page_size(case.layout)
        rng = np.random.default_rng(case.seed)
        buffers: list[Buffer] = []
        try:
            images = {}

            def filled(kind: str, region: _Region) -> Buffer:
                buf = _alloc(backend, kind, region.nbytes)
                buffers.append(buf)
                images[id(buf)] = _random_fill(rng, region.nbytes, dtype)
                backend.write(buf, 0, images[id(buf)])
                return buf

            pools = [filled(MemoryKind.DEVICE, r) for r in case.pools]
            targets = [filled(MemoryKind.DEVICE, r) for r in case.targets]
            cold = filled(case.cold_kind, case.cold)

            def read(buf: Buffer) -> np.ndarray:
                return backend.read(buf, 0, buf.nbytes)

            codec.encode(
                backend,
                layout,
                [PageRegion(b, r.offset, r.stride) for b, r in zip(pools, case.pools, strict=True)],
                np.array(case.pool_slots, dtype=np.int32),
                PageRegion(cold, case.cold.offset, case.cold.stride),
                np.array(case.cold_slots, dtype=np.int32),
            )
            backend.synchronize()
            for buf in pools:
                assert np.array_equal(read(buf), images[id(buf)]), "encode changed a GPU pool"
            cold_after = read(cold)
            assert np.array_equal(
                _outside(cold_after, case.cold, case.cold_slots, cold_size),
                _outside(images[id(cold)], case.cold, case.cold_slots, cold_size),
            ), "encode wrote outside its cold pages"

            codec.decode(
                backend,
                layout,
                PageRegion(cold, case.cold.offset, case.cold.stride),
                np.array(case.cold_slots, dtype=np.int32),
                [
                    PageRegion(b, r.offset, r.stride)
                    for b, r in zip(targets, case.targets, strict=True)
                ],
                np.array(case.target_slots, dtype=np.int32),
            )
            backend.synchronize()
            assert np.array_equal(read(cold), cold_after), "decode changed the cold pages"
            for p, size in enumerate(layout.slot_sizes):
                got_image = read(targets[p])
                want_image = images[id(targets[p])]
                assert np.array_equal(
                    _outside(got_image, case.targets[p], case.target_slots, size),
                    _outside(want_image, case.targets[p], case.target_slots, size),
                ), f"decode wrote outside its target slots in pool {p}"
                for src_slot, dst_slot in zip(case.pool_slots, case.target_slots, strict=True):
                    want = _slot_bytes(images[id(pools[p])], case.pools[p], src_slot, size)
                    got = _slot_bytes(got_image, case.targets[p], dst_slot, size)
                    if dtype is None:
                        assert np.array_equal(got, want), (
                            f"pool {p}: block {src_slot} came back different"
                        )
                    else:
                        error = np.abs(
                            got.view(dtype).astype(np.float64) - want.view(dtype).astype(np.float64)
                        )
                        assert np.all(np.isfinite(error)), f"pool {p}: non-finite values"
                        assert error.max(initial=0.0) <= caps.error_bound, (
                            f"pool {p}: error {error.max()} > bound {caps.error_bound}"
                        )
        finally:
            for buf in buffers:
                buf.free()

    @_SETTINGS
    @given(case=_kv_cases())
    def test_lossy_codec_stays_within_its_bound_on_kv_like_bf16_data(
        self, codec: Any, kvcm_plugin_spec: Any, backend: KernelBackend, case: _KvCase
    ) -> None:
        """Per element: ``|error| <= error_bound * amax`` of its scale group; exact and
        ``"bytes"`` buffers come back bit for bit."""
        self._page(kvcm_plugin_spec)
        caps = kvcm_plugin_spec.capabilities
        if caps.lossless or not self.kv_like_bf16:
            pytest.skip("lossless codec (checked bit for bit elsewhere) or no bf16 check")
        _, out = _encode_decode(backend, codec, case)
        for place in case.layout.buffers:
            lo, hi = place.offset, place.offset + place.size
            want, got = case.images[place.pool][:, lo:hi], out[place.pool][:, lo:hi]
            if place.exact:
                assert np.array_equal(got, want), f"exact buffer {place.role} changed"
                continue
            x, y = from_bytes(want, "bf16"), from_bytes(got, "bf16")
            limit = caps.error_bound * _group_amax(x, place.group_size)
            assert np.all(np.abs(x - y) <= limit), (
                f"pool {place.pool}: error {np.abs(x - y).max()} beyond the bound")

    @_SETTINGS
    @given(case=_kv_cases())
    def test_page_codec_gives_the_numpy_backends_bytes_on_a_device_backend(
        self, codec: Any, kvcm_plugin_spec: Any, backend: KernelBackend, case: _KvCase
    ) -> None:
        """Cold pages and decoded pages equal the ``numpy`` backend's, bit for bit."""
        self._page(kvcm_plugin_spec)
        if not backend.capabilities.has_device:
            pytest.skip("the selected backend is the numpy reference itself")
        _assert_numpy_bytes(backend, codec, case)

    def test_page_codec_gives_the_numpy_backends_bytes_on_extreme_values_on_a_device_backend(
        self, codec: Any, kvcm_plugin_spec: Any, backend: KernelBackend
    ) -> None:
        """Subnormal inputs and scales, +-0, the largest finite values, saturation and
        ties: cold pages and decoded pages equal the ``numpy`` backend's, bit for bit (a
        kernel compiled with flush-to-zero fails here)."""
        self._page(kvcm_plugin_spec)
        if not backend.capabilities.has_device:
            pytest.skip("the selected backend is the numpy reference itself")
        _assert_numpy_bytes(backend, codec, extreme_case())

    def test_encode_and_decode_of_no_blocks_change_nothing(
        self, codec: Any, kvcm_plugin_spec: Any, backend: KernelBackend
    ) -> None:
        self._page(kvcm_plugin_spec)
        itemsize = self._itemsize(kvcm_plugin_spec)
        layout = PageLayout(slot_sizes=(3 * itemsize, 5 * itemsize))
        cold_size = codec.cold_page_size(layout)
        rng = np.random.default_rng(5)
        pools = [backend.alloc_device(4 * s) for s in layout.slot_sizes]
        cold = backend.alloc_device(4 * cold_size)
        try:
            before = []
            for buf in [*pools, cold]:
                image = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
                backend.write(buf, 0, image)
                before.append(image)
            regions = [PageRegion(b, 0, s) for b, s in zip(pools, layout.slot_sizes, strict=True)]
            none = np.zeros(0, dtype=np.int32)
            codec.encode(backend, layout, regions, none, PageRegion(cold, 0, cold_size), none)
            codec.decode(backend, layout, PageRegion(cold, 0, cold_size), none, regions, none)
            backend.synchronize()
            for buf, image in zip([*pools, cold], before, strict=True):
                assert np.array_equal(backend.read(buf, 0, buf.nbytes), image)
        finally:
            for buf in [*pools, cold]:
                buf.free()

    # -- blob codecs ---------------------------------------------------------------------

    @_SETTINGS
    @given(payload=st.binary(max_size=5000))
    def test_blob_round_trips_random_bytes(
        self, codec: Any, kvcm_plugin_spec: Any, payload: bytes
    ) -> None:
        self._blob(kvcm_plugin_spec)
        blob = codec.encode(payload)
        assert isinstance(blob, bytes)
        assert codec.decode(blob) == payload
        assert codec.decode(memoryview(blob), expected_size=len(payload)) == payload
        assert codec.decode(codec.encode(memoryview(payload))) == payload

    @_SETTINGS
    @given(payload=st.binary(max_size=3000), data=st.data())
    def test_checksummed_blob_with_a_flipped_byte_raises_or_decodes_the_same_bytes(
        self, codec: Any, kvcm_plugin_spec: Any, payload: bytes, data: st.DataObject
    ) -> None:
        self._blob(kvcm_plugin_spec)
        if not kvcm_plugin_spec.capabilities.checksummed:
            pytest.skip("blob codec declares no checksum")
        blob = bytearray(codec.encode(payload))
        where = data.draw(st.integers(0, len(blob) - 1))
        blob[where] ^= data.draw(st.integers(1, 255))
        try:
            out = codec.decode(bytes(blob))
        except CorruptPageError:
            return
        # Undetected only where harmless: a change that decodes to the very same bytes
        # (zstd's checksum covers the decoded bytes: a raw block rewritten as an equal
        # run passes it). Never other bytes.
        assert out == payload, f"byte {where} flipped: decoded wrong bytes, not detected"

    @_SETTINGS
    @given(payload=st.binary(max_size=3000), data=st.data())
    def test_checksummed_blob_truncated_raises_corrupt_page_error(
        self, codec: Any, kvcm_plugin_spec: Any, payload: bytes, data: st.DataObject
    ) -> None:
        self._blob(kvcm_plugin_spec)
        if not kvcm_plugin_spec.capabilities.checksummed:
            pytest.skip("blob codec declares no checksum")
        blob = codec.encode(payload)
        cut = data.draw(st.integers(0, len(blob) - 1))
        with pytest.raises(CorruptPageError):
            codec.decode(blob[:cut])

    def test_checksummed_blob_of_unexpected_size_raises_corrupt_page_error(
        self, codec: Any, kvcm_plugin_spec: Any
    ) -> None:
        self._blob(kvcm_plugin_spec)
        if not kvcm_plugin_spec.capabilities.checksummed:
            pytest.skip("blob codec declares no checksum")
        blob = codec.encode(b"kv page bytes" * 10)
        with pytest.raises(CorruptPageError):
            codec.decode(blob, expected_size=131)
