"""The ``zstd`` blob codec: lossless Zstandard compression of cold pages (codec id 16).

For tiers that store blobs by size (the disk tier in blob mode, remote stores). Each blob
is one Zstandard frame that records the content size and a content checksum, so a damaged
or truncated blob raises :class:`~kvcm_core.errors.CorruptPageError` (the core's cold frame
checks every stored blob as well). Zstandard's checksum covers the content only, and some
header bits do not change what a frame decodes to; so the frame header must also be the
one this codec writes for that content size, which catches a flip of any bit. Needs the
``zstandard`` package (``pip install 'kvcm[zstd]'``).

Options:
    level: compression level, an int in -7..22 (default 3; negative levels are faster).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from kvcm_core import hookimpl
from kvcm_core.codec import BlobCodec, level_option
from kvcm_core.errors import CorruptPageError
from kvcm_core.records import Availability, CodecCapabilities, CodecKind, CodecSpec

__all__ = ["CAPABILITIES", "ZstdCodec"]

CAPABILITIES = CodecCapabilities(kind=CodecKind.BLOB, lossless=True, checksummed=True,
                                 codec_id=16)


def _availability() -> Availability:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return Availability(False, "the 'zstandard' package is missing: pip install "
                                   "'kvcm[zstd]'")
    return Availability(True)


class ZstdCodec(BlobCodec):
    """Zstandard frames with content size and checksum (see module docstring).

    Raises:
        ConfigError: an unknown option or a bad level.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        import zstandard

        self.level = level_option("zstd", options, -7, 22, 3)
        self._error = zstandard.ZstdError
        self._zstd = zstandard
        # A zstandard compressor is not thread-safe, and one codec serves several threads
        # (a level's writer encodes while the scheduler decodes): one per thread.
        self._local = threading.local()
        self._headers: dict[int, bytes] = {}  # content size -> the header we write

    def _compressor(self) -> Any:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = self._zstd.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True)
        return compressor

    def encode(self, data: bytes | memoryview) -> bytes:
        return self._compressor().compress(data)

    def _header(self, size: int) -> bytes:
        """The frame header this codec writes for ``size`` bytes of content (it depends
        on the size only; cold pages of a level all have one size)."""
        header = self._headers.get(size)
        if header is None:
            frame = self._compressor().compress(bytes(size))
            header = frame[: self._zstd.frame_header_size(frame)]
            if len(self._headers) >= 64:
                self._headers.clear()
            self._headers[size] = header
        return header

    def decode(self, blob: bytes | memoryview, expected_size: int | None = None) -> bytes:
        """The original bytes.

        Raises:
            CorruptPageError: the blob is not one intact frame, or not of
                ``expected_size`` bytes once decoded.
        """
        raw = bytes(blob)
        decompressor = self._zstd.ZstdDecompressor().decompressobj()
        try:
            data = decompressor.decompress(raw)
            if not decompressor.eof or decompressor.unused_data:
                raise self._error("not exactly one complete frame")
            if not raw.startswith(self._header(len(data))):
                raise self._error("frame header differs from the one written")
        except self._error as exc:
            raise CorruptPageError(f"zstd blob of {len(raw)} bytes: {exc}") from exc
        return self.checked_size(data, expected_size, "zstd")


@hookimpl
def kvcm_codecs() -> Iterator[CodecSpec]:
    """Register the ``zstd`` blob codec."""
    yield CodecSpec(
        name="zstd",
        factory=ZstdCodec,
        description="Lossless Zstandard blobs with content checksum (tiers storing blobs)",
        capabilities=CAPABILITIES,
        availability=_availability,
    )
