"""A blob codec that breaks its contract (plain exceptions instead of CorruptPageError),
registered in a plugin manager of its own: for tests of what the levels make of it."""
from __future__ import annotations

from typing import Any

from kvcm_core import KvcmPluginManager, hookimpl
from kvcm_core.codec import BlobCodec
from kvcm_core.records import CodecCapabilities, CodecKind, CodecSpec


def broken_blob_codec(codec_id: int, *, encode_fails_every: int = 0,
                      decode_fails: bool = False) -> tuple[KvcmPluginManager, dict[str, int]]:
    """A plugin manager with blob codec ``"broken"`` (identity otherwise): its encode
    raises ValueError every ``encode_fails_every``-th call (0: never), its decode always
    with ``decode_fails``; and the count of encodes (``calls["encode"]``)."""
    calls = {"encode": 0}

    class Broken(BlobCodec):
        def __init__(self, options: Any = None) -> None:
            pass

        def encode(self, data: Any) -> bytes:
            calls["encode"] += 1
            if encode_fails_every and calls["encode"] % encode_fails_every == 0:
                raise ValueError("broken encode")
            return bytes(data)

        def decode(self, blob: Any, expected_size: int | None = None) -> bytes:
            if decode_fails:
                raise ValueError("broken decode")
            return self.checked_size(bytes(blob), expected_size, "broken")

    class Plugin:
        @hookimpl
        def kvcm_codecs(self) -> Any:
            yield CodecSpec(name="broken", factory=Broken, description="breaks its contract",
                            capabilities=CodecCapabilities(
                                kind=CodecKind.BLOB, lossless=True, checksummed=True,
                                codec_id=codec_id))

    pm = KvcmPluginManager()
    pm.register(Plugin(), name="broken-codec")
    return pm, calls
