"""Codec contracts: page codecs (GPU pages <-> cold pages) and blob codecs (bytes <-> bytes).

A page codec is configured with a pool group's page layout and converts the pages of one
block, spread over the group's pools, to and from one fixed-size cold page. It runs as
device work through the backend (``copy_pages`` or compiled sources) so the same codec
works on every backend. A blob codec compresses and checksums stored blobs for storage
tiers; a corrupted blob raises :class:`~kvcm_core.errors.CorruptPageError`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.backend import KernelBackend, PageRegion, Stream
from kvcm_core.errors import ConfigError, CorruptPageError

__all__ = ["BlobCodec", "BufferPlace", "PageCodec", "PageLayout", "level_option"]


@attrs.frozen
class BufferPlace:
    """Where one buffer's page of one block lies inside a pool group's slot."""

    layer_id: int
    role: str
    pool: int  # index of the pool within the group
    offset: int  # bytes from the start of the slot in that pool
    size: int
    dtype: str = "bytes"  # element type (BufferConfig.dtype)
    group_size: int = 128  # values per scale group of lossy codecs
    exact: bool = True  # never encoded lossily (cold pages keep its bytes)


@attrs.frozen
class PageLayout:
    """The layout of one pool group: slot size per pool, and where each buffer lies."""

    slot_sizes: tuple[int, ...]
    buffers: tuple[BufferPlace, ...] = ()

    @property
    def page_bytes(self) -> int:
        """Bytes of one block over all pools."""
        return sum(self.slot_sizes)


class PageCodec(abc.ABC):
    """Converts the pages of a pool group to and from cold pages.

    ``lossless`` codecs give back every byte; lossy ones declare ``error_bound``: the
    largest error per value relative to the largest magnitude of its scale group. A codec
    reads each buffer's ``dtype``, ``group_size`` and ``exact`` from ``layout.buffers`` and
    keeps ``exact`` and ``"bytes"`` buffers bit for bit.
    """

    lossless: bool = True
    error_bound: float | None = None
    #: True when a cold page is the block's pool slots concatenated in pool order,
    #: unchanged (``cold_page_size(layout) == layout.page_bytes``; the ``raw`` codec).
    #: Between device-accessible memory the core then copies the slots itself, one copy
    #: task per pool, without calling :meth:`encode` or :meth:`decode`.
    identity: bool = False

    @abc.abstractmethod
    def cold_page_size(self, layout: PageLayout) -> int:
        """Fixed size in bytes of one cold page for ``layout``."""

    @abc.abstractmethod
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
        """Encode block ``src_slots[i]`` (page ``src_slots[i]`` of every region of ``src``,
        one region per pool) into cold page ``dst_slots[i]`` of ``dst``, in order on
        ``stream``: after the work queued on it so far (the core may have just queued the
        copy that fills the source pages), before the work queued on it later. Work done
        on the host instead first waits for the stream."""

    @abc.abstractmethod
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
        """Decode cold page ``src_slots[i]`` of ``src`` into block ``dst_slots[i]`` of the
        pools ``dst``, in order on ``stream`` (as :meth:`encode`)."""


class BlobCodec(abc.ABC):
    """Bytes to bytes, for storage tiers; ``decode`` checks integrity."""

    @abc.abstractmethod
    def encode(self, data: bytes | memoryview) -> bytes:
        """Encoded (compressed, checksummed) form of ``data``."""

    @abc.abstractmethod
    def decode(self, blob: bytes | memoryview, expected_size: int | None = None) -> bytes:
        """The original bytes.

        Raises:
            CorruptPageError: the blob fails its checksum or length check.
        """

    @staticmethod
    def checked_size(data: bytes, expected_size: int | None, what: str) -> bytes:
        """``data``, after checking it has ``expected_size`` bytes (when given).

        Raises:
            CorruptPageError: it has another size (``what`` names the codec).
        """
        if expected_size is not None and len(data) != expected_size:
            raise CorruptPageError(
                f"{what} blob decodes to {len(data)} bytes; {expected_size} were stored")
        return data


def level_option(codec: str, options: Mapping[str, Any] | None, lo: int, hi: int,
                 default: int) -> int:
    """The ``level`` option of a compressing codec (the only option it takes).

    Raises:
        ConfigError: an unknown option, or a level that is not an int in ``lo..hi``.
    """
    options = dict(options or {})
    for key in options:
        if key != "level":
            raise ConfigError(f"{codec}.options.{key}", options[key], "unknown option; "
                              "known: level")
    level = options.get("level", default)
    if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
        raise ConfigError(f"{codec}.options.level", level, f"must be an int in {lo}..{hi}")
    return level
