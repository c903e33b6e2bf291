"""Every registered codec through the codec conformance suite, plus the suite's own lossy
and blob branches exercised on small codecs defined here (so they are never dead code)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from kvcm_core.backend import KernelBackend, PageRegion, Stream
from kvcm_core.codec import BlobCodec, PageCodec, PageLayout
from kvcm_core.errors import CorruptPageError
from kvcm_core.records import CodecCapabilities, CodecKind, CodecSpec
from kvcm_core.testing.conformance.codec import CodecConformance


class TestCodecs(CodecConformance):
    pass


# -- the suite's lossy and blob branches, on codecs defined here -------------------------


class _TruncatingCodec(PageCodec):
    """Lossy: keeps only the high byte of each float16 (error < 2**-3 on [-1, 1])."""

    lossless = False
    error_bound = 0.125

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        pass

    def cold_page_size(self, layout: PageLayout) -> int:
        return layout.page_bytes // 2

    def _move(
        self,
        backend: KernelBackend,
        layout: PageLayout,
        pools: Sequence[PageRegion],
        pool_slots: np.ndarray,
        cold: PageRegion,
        cold_slots: np.ndarray,
        encode: bool,
    ) -> None:
        for pool_slot, cold_slot in zip(pool_slots.tolist(), cold_slots.tolist(), strict=True):
            at = cold.page_start(cold_slot)
            for region, size in zip(pools, layout.slot_sizes, strict=True):
                start = region.page_start(pool_slot)
                if encode:
                    page = backend.read(region.buffer, start, size)
                    backend.write(cold.buffer, at, page[1::2].copy())
                else:
                    page = np.zeros(size, dtype=np.uint8)
                    page[1::2] = backend.read(cold.buffer, at, size // 2)
                    backend.write(region.buffer, start, page)
                at += size // 2

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
        self._move(backend, layout, src, src_slots, dst, dst_slots, encode=True)

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
        self._move(backend, layout, dst, dst_slots, src, src_slots, encode=False)


class _Crc32Codec(BlobCodec):
    """Identity with a length and CRC-32 header."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        pass

    def encode(self, data: bytes | memoryview) -> bytes:
        raw = bytes(data)
        return len(raw).to_bytes(8, "little") + zlib.crc32(raw).to_bytes(4, "little") + raw

    def decode(self, blob: bytes | memoryview, expected_size: int | None = None) -> bytes:
        raw = bytes(blob)
        if len(raw) < 12:
            raise CorruptPageError(f"blob of {len(raw)} bytes is shorter than its header")
        size, crc, body = int.from_bytes(raw[:8], "little"), raw[8:12], raw[12:]
        if size != len(body) or (expected_size is not None and size != expected_size):
            raise CorruptPageError(f"blob says {size} bytes, holds {len(body)}")
        if zlib.crc32(body).to_bytes(4, "little") != crc:
            raise CorruptPageError("blob fails its CRC-32")
        return body


class TestSuiteOnALossyPageCodec(CodecConformance):
    plugin_name = "test-lossy"
    kv_like_bf16 = False  # keeps the high byte of float16 values only

    @pytest.fixture(scope="class")
    @classmethod
    def kvcm_plugin_spec(cls) -> CodecSpec:
        return CodecSpec(
            name="test-lossy",
            factory=_TruncatingCodec,
            capabilities=CodecCapabilities(kind=CodecKind.PAGE, lossless=False, error_bound=0.125),
        )


class TestSuiteOnAChecksummedBlobCodec(CodecConformance):
    plugin_name = "test-crc32"

    @pytest.fixture(scope="class")
    @classmethod
    def kvcm_plugin_spec(cls) -> CodecSpec:
        return CodecSpec(
            name="test-crc32",
            factory=_Crc32Codec,
            capabilities=CodecCapabilities(kind=CodecKind.BLOB, checksummed=True),
        )
