"""The ``lz4`` blob codec: lossless LZ4 frame compression of cold pages (codec id 17).

For tiers that store blobs by size (the disk tier in blob mode, remote stores). Each blob
is one LZ4 frame that records the content size and a content checksum, so a damaged or
truncated blob raises :class:`~kvcm_core.errors.CorruptPageError` (the core's cold frame
checks every stored blob as well). Faster than ``zstd``, compresses less. Needs the ``lz4``
package (``pip install 'kvcm[lz4]'``).

Options:
    level: compression level, an int in 0..16 (default 0, the fast mode; 3 and above
        select LZ4-HC).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvcm_core import hookimpl
from kvcm_core.codec import BlobCodec, level_option
from kvcm_core.errors import CorruptPageError
from kvcm_core.records import Availability, CodecCapabilities, CodecKind, CodecSpec

__all__ = ["CAPABILITIES", "Lz4Codec"]

CAPABILITIES = CodecCapabilities(kind=CodecKind.BLOB, lossless=True, checksummed=True,
                                 codec_id=17)


def _availability() -> Availability:
    try:
        import lz4.frame  # noqa: F401
    except ImportError:
        return Availability(False, "the 'lz4' package is missing: pip install 'kvcm[lz4]'")
    return Availability(True)


class Lz4Codec(BlobCodec):
    """LZ4 frames with content size and checksum (see module docstring).

    Raises:
        ConfigError: an unknown option or a bad level.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        import lz4.frame

        self.level = level_option("lz4", options, 0, 16, 0)
        self._frame = lz4.frame

    def encode(self, data: bytes | memoryview) -> bytes:
        return self._frame.compress(
            data, compression_level=self.level, content_checksum=True, block_checksum=True,
            store_size=True)

    def decode(self, blob: bytes | memoryview, expected_size: int | None = None) -> bytes:
        """The original bytes.

        Raises:
            CorruptPageError: the blob is not one intact frame, or not of
                ``expected_size`` bytes once decoded.
        """
        raw = bytes(blob)
        decompressor = self._frame.LZ4FrameDecompressor()
        try:
            data = decompressor.decompress(raw)
        except RuntimeError as exc:
            raise CorruptPageError(f"lz4 blob of {len(raw)} bytes: {exc}") from exc
        if not decompressor.eof or decompressor.unused_data:
            raise CorruptPageError(f"lz4 blob of {len(raw)} bytes is not exactly one "
                                   "complete frame")
        return self.checked_size(data, expected_size, "lz4")


@hookimpl
def kvcm_codecs() -> Iterator[CodecSpec]:
    """Register the ``lz4`` blob codec."""
    yield CodecSpec(
        name="lz4",
        factory=Lz4Codec,
        description="Lossless LZ4 frame blobs with content checksum (tiers storing blobs)",
        capabilities=CAPABILITIES,
        availability=_availability,
    )
