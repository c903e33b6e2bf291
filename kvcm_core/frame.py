"""The cold frame: how a cold page travels to a persistent or remote tier.

Every cold page written to a tier whose capabilities say ``persistent`` (disk, remote
stores) is wrapped by the core, never by the tier, in one frame::

    magic b"KVCM" | version u16 | codec id u16 | layout fingerprint 16 B | block key 32 B
    | write sequence u64 | payload length u32 | payload | CRC-32C u32 (header + payload)

all little-endian. The header and checksum (:data:`FRAME_OVERHEAD` bytes) count against
the level's quota. A :class:`FrameBook` belongs to one framed store: it remembers, per
slot, the block key and the write sequence number it wrote, so a read is checked against
what was written (magic, version, codec, layout, key, sequence, length, checksum). A frame
that fails any check is never returned as KV: the caller gets the positions of the bad
frames and the core drops those blocks (``CorruptPageError``).

Pages in device-accessible memory (GPU, pinned host) carry no frame.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import google_crc32c
import numpy as np

from kvcm_core.errors import ConfigError, CorruptPageError
from kvcm_core.radix import KEY_HASH
from kvcm_core.records import CodecKind, Medium

if TYPE_CHECKING:
    from kvcm_core.codec import BlobCodec
    from kvcm_core.config import KVCacheManagerConfig
    from kvcm_core.plugins import KvcmPluginManager
    from kvcm_core.tier import Tier

__all__ = [
    "FRAME_MAGIC",
    "FRAME_OVERHEAD",
    "FRAME_VERSION",
    "HEADER",
    "FrameBook",
    "FrameCheckFailed",
    "FrameFormat",
    "LevelFrames",
    "layout_fingerprint",
    "level_frames",
    "page_key",
    "page_key_rows",
]

FRAME_MAGIC = b"KVCM"
FRAME_VERSION = 1
#: The header as a packed little-endian record (68 bytes).
HEADER = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("codec", "<u2"), ("layout", "u1", (16,)),
    ("key", "u1", (32,)), ("seq", "<u8"), ("length", "<u4"),
])
_CRC_BYTES = 4
#: Bytes a frame adds to its payload: header and checksum.
FRAME_OVERHEAD = HEADER.itemsize + _CRC_BYTES
KEY_BYTES = 32
_KEY_AT = HEADER.fields["key"][1]
_KEY_ITEM = np.dtype((np.void, KEY_BYTES))
_SEQ_AT = HEADER.fields["seq"][1]
# FrameBook.check reads the header up to the sequence number's end as 8-byte words
# (before the key, the key, the sequence number), then the length, its last field.
_KEY_WORD, _SEQ_WORD, _HEAD_WORDS = _KEY_AT // 8, _SEQ_AT // 8, _SEQ_AT // 8 + 1
# (A check, not an assert: it must hold under ``python -O`` too. _HEAD_WORDS == 8: a
# row of its equalities is read as one u64.)
if not (_KEY_AT % 8 == 0 and _SEQ_AT == _KEY_AT + KEY_BYTES and _HEAD_WORDS == 8 and
        HEADER.fields["length"][1] == _SEQ_AT + 8 == HEADER.itemsize - 4):
    raise ImportError("kvcm_core.frame: FrameBook.check assumes the header's key at an "
                      "8-byte offset, the sequence number right after it, then the length")
_ALL_EQUAL = np.uint64(0x0101010101010101)  # eight True bytes read as one u64
_FEW_FRAMES = 8  # reads of up to this many frames are checked frame by frame
_FEW_WRAPS = 4  # writes of up to this many pages are framed page by page


def _crc(data: Any) -> int:
    # google-crc32c takes read-only bytes; one copy per frame is small next to the I/O.
    return int(google_crc32c.value(bytes(data)))


_crc_value = google_crc32c.value


def layout_fingerprint(description: Any) -> bytes:
    """16-byte digest of what makes cold pages readable: layers, buffers, sizes, tokens
    per block, the block-key rule (:data:`~kvcm_core.radix.KEY_HASH`) and codec
    (``description`` is plain JSON-able data)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def page_key(tree_key: bytes | None, pid: int) -> bytes:
    """The 32-byte block key a frame carries: the prefix-tree key of a full block, or (a
    partial or uncommitted block has none) a key derived from the page id. Either way the
    core checks a read against the key it recorded when writing, so the derived key need
    only be distinct per page: ``kvcm-page-id`` padded with zeros to 24 bytes, then the
    page id (u64, little-endian), no hash (a SHA-256 tree key equal to it is as unlikely
    as any collision of the hash)."""
    if tree_key is not None:
        return tree_key
    return _PAGE_KEY_PREFIX + int(pid).to_bytes(8, "little")


_PAGE_KEY_PREFIX = b"kvcm-page-id".ljust(24, b"\0")
_PAGE_KEY_PREFIX_ROW = np.frombuffer(_PAGE_KEY_PREFIX, dtype=np.uint8)


def page_key_rows(pids: np.ndarray) -> np.ndarray:
    """:func:`page_key` of pages that have no tree key, as rows (``uint8 [n, 32]``)."""
    rows = np.empty((len(pids), KEY_BYTES), dtype=np.uint8)
    rows[:, : len(_PAGE_KEY_PREFIX)] = _PAGE_KEY_PREFIX_ROW
    rows[:, len(_PAGE_KEY_PREFIX) :] = np.asarray(pids, dtype="<u8").view(np.uint8
                                                                          ).reshape(-1, 8)
    return rows


class FrameCheckFailed(CorruptPageError):
    """Frames of a transfer failed their check; ``positions`` are their indices in the
    transfer (the other pages of the transfer arrived intact)."""

    def __init__(self, message: str, positions: np.ndarray) -> None:
        super().__init__(message)
        self.positions = positions


@attrs.frozen
class FrameFormat:
    """What every frame of one level says besides its key: codec id and layout."""

    codec_id: int
    layout: bytes = attrs.field()

    @layout.validator
    def _check_layout(self, attribute: attrs.Attribute[bytes], value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != 16:
            raise ValueError(f"layout={value!r}: must be a 16-byte fingerprint")


@attrs.frozen
class LevelFrames:
    """How one level's pages are framed: the frame format and the blob codec (if any)
    that compresses payloads before framing."""

    format: FrameFormat
    blob: BlobCodec | None = None

    def slot_bytes(self, page_bytes: int) -> int:
        """Largest stored size of one cold page of ``page_bytes``: the frame, and with a
        blob codec room for incompressible data to grow a little (both codecs' bounds
        stay well within ``size / 128 + 128``)."""
        slack = 0 if self.blob is None else page_bytes // 128 + 128
        return page_bytes + FRAME_OVERHEAD + slack


def framed(tier: Tier) -> bool:
    """Whether the core frames the pages of ``tier``: persistent or remote storage
    reached through I/O (device-accessible memory carries no frame)."""
    caps = tier.capabilities
    return not caps.device_accessible and (caps.persistent or caps.medium is Medium.REMOTE)


def level_frames(config: KVCacheManagerConfig, pm: KvcmPluginManager,
                 tiers: Sequence[Tier]) -> list[LevelFrames | None]:
    """Per level, how its pages are framed (None: not framed), after checking each
    level's ``blob_codec``.

    The frame's codec id is the blob codec's when a level has one (it produced the stored
    bytes), else the page codec's; the layout fingerprint covers both.

    Raises:
        ConfigError: a blob codec on an unframed level or on a tier that does not store
            blobs by size, or a name that is not a blob codec.
    """
    out: list[LevelFrames | None] = [None]
    layers = config.to_dict()["layers"]
    for li, level in enumerate(config.levels[1:], start=1):
        page = pm.level_codec(level.codec or "raw", f"levels[{li}].codec")
        blob_spec = None
        if level.blob_codec is not None:
            field = f"levels[{li}].blob_codec"
            blob_spec = pm.level_codec(level.blob_codec, field)
            if blob_spec.capabilities.kind is not CodecKind.BLOB:
                raise ConfigError(field, level.blob_codec, "must be a blob codec (such as "
                                  "'zstd' or 'lz4'); page codecs go in 'codec'")
            if not framed(tiers[li]) or not tiers[li].capabilities.blobs:
                raise ConfigError(field, level.blob_codec, "needs a tier that stores blobs "
                                  "by size (e.g. tier 'disk' with options mode='blob')")
        if not framed(tiers[li]):
            out.append(None)
            continue
        outer = blob_spec if blob_spec is not None else page
        fingerprint = layout_fingerprint({
            "layers": layers, "tokens_per_block": config.tokens_per_block,
            "hash": KEY_HASH, "codec": page.name,
            "blob_codec": None if blob_spec is None else blob_spec.name})
        out.append(LevelFrames(FrameFormat(outer.capabilities.codec_id, fingerprint),
                               None if blob_spec is None else blob_spec.factory({})))
    return out


class FrameBook:
    """Frames of one store: wraps payloads for writing and checks frames read back against
    the key and write sequence number recorded per slot.

    Args:
        fmt: codec id and layout fingerprint of the level.
        num_slots: slots of the store.
        page_bytes: size of the cold pages it frames.
        blob: the level's blob codec (payloads are compressed and stored by size).
    """

    def __init__(self, fmt: FrameFormat, num_slots: int, page_bytes: int,
                 blob: BlobCodec | None = None) -> None:
        self.format = fmt
        self.page_bytes = page_bytes
        self.blob = blob
        self._layout = np.frombuffer(fmt.layout, dtype=np.uint8)
        self.keys = np.zeros((num_slots, KEY_BYTES), dtype=np.uint8)
        self.seqs = np.zeros(num_slots, dtype=np.uint64)  # 0: never written
        self._next_seq = 1
        self._templates: dict[int, np.ndarray] = {}  # payload size -> shared header bytes
        self._parts: dict[int, tuple[bytes, bytes, bytes]] = {}  # see _template_parts
        self._framing: dict[int, tuple[np.dtype, np.void]] = {}  # see _frame_fields
        self._checking: dict[int, tuple[np.dtype, np.ndarray, int]] = {}  # _check_fields
        # keys seen as one 32-byte item per slot (see _key_items), and the array it views
        self._items: tuple[np.ndarray, np.ndarray] | None = None

    # -- slots ---------------------------------------------------------------------------

    def resize(self, num_slots: int) -> None:
        """Keep the records of slots below ``min(old, new)``; new slots are unwritten."""
        old = len(self.seqs)
        if num_slots <= old:
            self.keys = self.keys[:num_slots].copy()
            self.seqs = self.seqs[:num_slots].copy()
            return
        self.keys = np.concatenate([self.keys, np.zeros((num_slots - old, KEY_BYTES),
                                                        dtype=np.uint8)])
        self.seqs = np.concatenate([self.seqs, np.zeros(num_slots - old, dtype=np.uint64)])

    # -- writing -------------------------------------------------------------------------

    def _key_items(self) -> np.ndarray:
        """``keys`` seen as one 32-byte item per slot (kept while ``keys`` is the same
        array)."""
        kept = self._items
        if kept is None or kept[0] is not self.keys:
            kept = self._items = (self.keys, self.keys.view(_KEY_ITEM)[:, 0])
        return kept[1]

    def _record(self, slots: np.ndarray, keys: np.ndarray) -> np.ndarray:
        n = len(slots)
        if keys.dtype == np.uint8 and keys.flags.c_contiguous and len(keys) == n:
            return self._record_items(slots, keys.view(_KEY_ITEM)[:, 0])
        seqs = np.arange(self._next_seq, self._next_seq + n, dtype=np.uint64)
        self._next_seq += n
        self.keys[slots] = keys
        self.seqs[slots] = seqs
        return seqs

    def _record_items(self, slots: np.ndarray, items: np.ndarray) -> np.ndarray:
        """:meth:`_record` of keys given as 32-byte items, one per slot."""
        n = len(slots)
        seqs = np.arange(self._next_seq, self._next_seq + n, dtype=np.uint64)
        self._next_seq += n
        # A key per item, not a byte; put: the fancy assignment (the same index rules,
        # one key per slot) without its per-item overhead.
        self._key_items().put(slots, items)
        self.seqs[slots] = seqs
        return seqs

    def _headers(self, slots: np.ndarray, keys: np.ndarray, lengths: Any) -> np.ndarray:
        head = np.zeros(len(slots), dtype=HEADER)
        head["magic"] = FRAME_MAGIC
        head["version"] = FRAME_VERSION
        head["codec"] = self.format.codec_id
        head["layout"] = self._layout
        head["key"] = keys
        head["seq"] = self._record(slots, keys)
        head["length"] = lengths
        return head

    def _template(self, size: int) -> np.ndarray:
        """The header bytes every fixed-size frame of ``size`` shares (key and sequence
        left zero)."""
        head = self._templates.get(size)
        if head is None:
            head = np.zeros(1, dtype=HEADER)
            head["magic"] = FRAME_MAGIC
            head["version"] = FRAME_VERSION
            head["codec"] = self.format.codec_id
            head["layout"] = self._layout
            head["length"] = size
            head = self._templates[size] = head.view(np.uint8)
        return head

    def _template_parts(self, size: int) -> tuple[bytes, bytes, bytes]:
        """:meth:`_template` as bytes, cut around the key and the sequence number: the
        header bytes before the key, between key and sequence number, and after it."""
        parts = self._parts.get(size)
        if parts is None:
            head = self._template(size).tobytes()
            parts = self._parts[size] = (head[:_KEY_AT], head[_KEY_AT + KEY_BYTES : _SEQ_AT],
                                         head[_SEQ_AT + 8 :])
        return parts

    def _frame_fields(self, size: int) -> tuple[np.dtype, np.void]:
        """A frame of a ``size``-byte payload as one record whose fields are its parts
        (little-endian, at their offsets; ``body``: the bytes the CRC covers, header and
        payload), and the :meth:`_template` header as one item of its ``head``."""
        kept = self._framing.get(size)
        if kept is None:
            hb = HEADER.itemsize
            fields = np.dtype({
                "names": ["head", "key", "seq", "body", "payload", "crc"],
                "formats": [f"V{hb}", f"V{KEY_BYTES}", "<u8", f"V{hb + size}", f"V{size}",
                            "<u4"],
                "offsets": [0, _KEY_AT, _SEQ_AT, 0, hb, hb + size],
                "itemsize": size + FRAME_OVERHEAD})
            head = self._template(size).view(np.dtype((np.void, hb)))[0]
            kept = self._framing[size] = (fields, head)
        return kept

    def wrap(self, slots: np.ndarray, payloads: np.ndarray, keys: np.ndarray,
             out: np.ndarray | None = None) -> np.ndarray:
        """Frames ``uint8 [n, payload + FRAME_OVERHEAD]`` of fixed-size ``payloads[i]``
        for ``slots[i]`` (block keys ``keys[i]``, 32 bytes each), recorded as written;
        built in ``out`` (returned) when given: C-contiguous rows of that shape (a storage
        level's held rows, see :meth:`~kvcm_core.tier.StoragePool.write_into`)."""
        n, size = payloads.shape
        if out is None and n <= _FEW_WRAPS and payloads.dtype == np.uint8 and \
                keys.dtype == np.uint8 and keys.shape == (n, KEY_BYTES):
            return self._wrap_few(slots, payloads, keys)
        hb = HEADER.itemsize
        if out is None:
            out = np.empty((n, size + FRAME_OVERHEAD), dtype=np.uint8)
        elif out.dtype != np.uint8 or out.shape != (n, size + FRAME_OVERHEAD) or \
                not out.flags.c_contiguous:
            raise ValueError(f"out: {out.dtype} {out.shape} array; frames take C-contiguous "
                             f"uint8 {(n, size + FRAME_OVERHEAD)}")
        fields, head = self._frame_fields(size)
        frames = out.view(fields)[:, 0]  # each row one record (its bytes adjacent)
        # The shared header bytes, then each frame's key, sequence number, payload, CRC.
        frames["head"] = head
        if not (keys.dtype == np.uint8 and keys.flags.c_contiguous and
                keys.shape == (n, KEY_BYTES)):  # as an assignment of them would take them
            given, keys = keys, np.empty((n, KEY_BYTES), dtype=np.uint8)
            keys[...] = given
        items = keys.view(_KEY_ITEM)[:, 0]
        frames["key"] = items
        frames["seq"] = self._record_items(slots, items)
        out[:, hb : hb + size] = payloads
        frames["crc"] = np.fromiter(map(_crc_value, frames["body"].tolist()), np.uint32, n)
        return out

    def _wrap_few(self, slots: np.ndarray, payloads: np.ndarray, keys: np.ndarray
                  ) -> np.ndarray:
        """:meth:`wrap` of a few pages, frame by frame as bytes (the same bytes and
        records)."""
        n, size = payloads.shape
        before, between, after = self._template_parts(size)
        seq = self._next_seq
        self._next_seq += n
        book_keys, book_seqs = self.keys, self.seqs
        out = bytearray()
        for i, slot in enumerate(slots.tolist()):  # recorded in order, as _record does
            key = keys[i]
            book_keys[slot] = key
            book_seqs[slot] = seq + i
            frame = b"".join((before, key.tobytes(), between, (seq + i).to_bytes(8, "little"),
                              after, payloads[i].tobytes()))
            out += frame
            out += _crc_value(frame).to_bytes(_CRC_BYTES, "little")
        return np.frombuffer(out, dtype=np.uint8).reshape(n, size + FRAME_OVERHEAD)

    def wrap_blobs(self, slots: np.ndarray, payloads: Sequence[bytes],
                   keys: np.ndarray) -> list[bytes]:
        """Frames of variable-size ``payloads`` (see :meth:`wrap`), as bytes."""
        lengths = np.fromiter((len(p) for p in payloads), np.uint32, len(payloads))
        heads = self._headers(slots, keys, lengths)
        out = []
        for head, payload in zip(heads, payloads, strict=True):
            body = head.tobytes() + bytes(payload)
            out.append(body + _crc(body).to_bytes(_CRC_BYTES, "little"))
        return out

    # -- reading -------------------------------------------------------------------------

    def _header_ok(self, slots: np.ndarray, head: np.ndarray, lengths: np.ndarray
                   ) -> np.ndarray:
        return ((head["magic"] == FRAME_MAGIC) & (head["version"] == FRAME_VERSION)
                & (head["codec"] == self.format.codec_id)
                & (head["layout"] == self._layout).all(axis=1)
                & (head["key"] == self.keys[slots]).all(axis=1)
                & (head["seq"] == self.seqs[slots]) & (self.seqs[slots] != 0)
                & (head["length"] == lengths))

    def check(self, slots: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """Which fixed-size ``frames[i]`` (read from ``slots[i]``) are intact: a bool
        mask. The payload of frame ``i`` is ``frames[i, HEADER.itemsize:-4]``."""
        n, width = frames.shape
        size = width - FRAME_OVERHEAD
        if n <= _FEW_FRAMES and size >= 0 and frames.dtype == np.uint8:
            return self._check_few(slots, frames, size)
        if frames.strides[1] != 1:  # a record view needs each row's bytes adjacent
            frames = np.ascontiguousarray(frames)
        fields, pre, tail = self._check_fields(size)
        rec = frames.view(fields)[:, 0]
        # The header each frame must have (as wrap wrote it) up to its length, as
        # little-endian 8-byte words: the part before the key, the key, the sequence
        # number. A row's eight equalities, read as one u64 of eight bools, are all true
        # when it is _ALL_EQUAL (a reduction over rows of eight costs several times more).
        seqs = self.seqs.take(slots)
        want = np.empty((n, _HEAD_WORDS), dtype=np.uint64)
        want[:, :_KEY_WORD] = pre
        want[:, _KEY_WORD:_SEQ_WORD] = self.keys.view("<u8").take(slots, axis=0)
        want[:, _SEQ_WORD] = seqs
        ok = (rec["words"] == want).view(np.uint64)[:, 0] == _ALL_EQUAL
        ok &= (seqs != 0) & (rec["tail"] == tail)  # never written; the length
        if np.count_nonzero(ok):
            ok &= np.fromiter(map(_crc_value, rec["body"].tolist()), np.uint32, n) \
                == rec["crc"]
        return ok

    def _check_fields(self, size: int) -> tuple[np.dtype, np.ndarray, int]:
        """A frame of a ``size``-byte payload as the record :meth:`check` reads: the
        header up to its length as little-endian 8-byte words (``words``), the rest of
        it (``tail``: the length), the bytes the CRC covers (``body``) and the CRC; with
        the words before the key and the tail value that :meth:`_template` holds."""
        kept = self._checking.get(size)
        if kept is None:
            hb = HEADER.itemsize
            fields = np.dtype({
                "names": ["words", "tail", "body", "crc"],
                "formats": [("<u8", (_HEAD_WORDS,)), "<u4", f"V{hb + size}", "<u4"],
                "offsets": [0, _SEQ_AT + 8, 0, hb + size],
                "itemsize": size + FRAME_OVERHEAD})
            head = self._template(size)
            kept = self._checking[size] = (
                fields, head[:_KEY_AT].view("<u8").copy(),
                int(head[_SEQ_AT + 8 :].view("<u4")[0]))
        return kept

    def _check_few(self, slots: np.ndarray, frames: np.ndarray, size: int) -> np.ndarray:
        """:meth:`check` of a few frames, one by one as bytes (NumPy's per-call costs
        dominate there): the same header compared byte for byte, the same sequence rule
        and the same CRC-32C."""
        hb = HEADER.itemsize
        body = hb + size
        before, between, after = self._template_parts(size)
        keys, seqs = self.keys, self.seqs
        ok = np.zeros(len(frames), dtype=bool)
        for i, slot in enumerate(slots.tolist()):
            seq = int(seqs[slot])
            if not seq:  # never written
                continue
            frame = frames[i].tobytes()
            want = b"".join((before, keys[slot].tobytes(), between, seq.to_bytes(8, "little"),
                             after))
            ok[i] = frame[:hb] == want and \
                _crc_value(frame[:body]) == int.from_bytes(frame[body:], "little")
        return ok

    def unwrap_blob(self, slot: int, blob: bytes | None) -> bytes | None:
        """The payload of a variable-size frame read from ``slot``; None when the frame
        is damaged (or missing)."""
        hb = HEADER.itemsize
        if blob is None or len(blob) < FRAME_OVERHEAD:
            return None
        head = np.frombuffer(blob, dtype=HEADER, count=1)
        length = len(blob) - FRAME_OVERHEAD
        slots = np.array([slot], dtype=np.int64)
        if not self._header_ok(slots, head, np.array([length], dtype=np.uint32))[0]:
            return None
        if _crc(blob[:-_CRC_BYTES]) != int.from_bytes(blob[-_CRC_BYTES:], "little"):
            return None
        return bytes(blob[hb:-_CRC_BYTES])
