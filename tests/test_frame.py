"""The cold frame (kvcm_core/frame.py): its byte layout, and that every read of a framed
slot is checked against what was written, on the disk tier itself.

A frame is checked for magic, version, codec id, layout fingerprint, block key, write
sequence number, payload length and CRC-32C; any damage (a flipped bit anywhere, a
truncated file re-extended with zeros, two frames swapped, an old frame put back) is
reported as a bad frame, never returned as a page.
"""

from __future__ import annotations

import hashlib
import os

import google_crc32c
import numpy as np
import pytest
from kvcm_tier_disk import HEADER_BYTES, DiskTier

from kvcm_core.frame import (
    FRAME_MAGIC,
    FRAME_OVERHEAD,
    FRAME_VERSION,
    HEADER,
    FrameBook,
    FrameFormat,
    layout_fingerprint,
    page_key,
)

PAYLOAD = 8  # bytes: a small frame, so that every one of its bits can be flipped
FRAME = PAYLOAD + FRAME_OVERHEAD
FMT = FrameFormat(codec_id=7, layout=layout_fingerprint({"layers": [1, 2], "tpb": 16}))


def _keys(n: int, seed: int = 0) -> np.ndarray:
    return np.stack([np.frombuffer(hashlib.sha256(bytes([seed, i])).digest(), np.uint8)
                     for i in range(n)])


def _payloads(n: int, size: int = PAYLOAD) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 256, (n, size), dtype=np.uint8)


# -- layout --------------------------------------------------------------------------------


def test_frame_is_a_little_endian_header_then_payload_then_crc32c():
    book = FrameBook(FMT, 4, PAYLOAD)
    keys = _keys(1)
    payload = _payloads(1)
    frame = book.wrap(np.array([3]), payload, keys)[0].tobytes()
    assert len(frame) == PAYLOAD + 72 == FRAME and HEADER.itemsize == 68
    assert frame[0:4] == FRAME_MAGIC == b"KVCM"
    assert int.from_bytes(frame[4:6], "little") == FRAME_VERSION
    assert int.from_bytes(frame[6:8], "little") == 7
    assert frame[8:24] == FMT.layout
    assert frame[24:56] == keys[0].tobytes()
    assert int.from_bytes(frame[56:64], "little") == int(book.seqs[3]) > 0
    assert int.from_bytes(frame[64:68], "little") == PAYLOAD
    assert frame[68:-4] == payload[0].tobytes()
    assert int.from_bytes(frame[-4:], "little") == google_crc32c.value(frame[:-4])


def test_every_write_gets_a_new_sequence_number():
    book = FrameBook(FMT, 4, PAYLOAD)
    book.wrap(np.array([0, 1]), _payloads(2), _keys(2))
    first = book.seqs.copy()
    book.wrap(np.array([0]), _payloads(1), _keys(1))
    assert len({int(first[0]), int(first[1]), int(book.seqs[0])}) == 3


def test_an_intact_frame_passes_and_its_payload_is_returned():
    book = FrameBook(FMT, 4, PAYLOAD)
    payloads = _payloads(3)
    frames = book.wrap(np.array([2, 0, 1]), payloads, _keys(3))
    assert book.check(np.array([2, 0, 1]), frames).all()
    np.testing.assert_array_equal(frames[:, HEADER.itemsize:-4], payloads)


def test_a_slot_never_written_fails_even_with_a_well_formed_frame():
    writer, reader = FrameBook(FMT, 2, PAYLOAD), FrameBook(FMT, 2, PAYLOAD)
    frames = writer.wrap(np.array([0]), _payloads(1), _keys(1))
    assert not reader.check(np.array([0]), frames).any()


@pytest.mark.parametrize("other", [
    FrameFormat(codec_id=8, layout=FMT.layout),
    FrameFormat(codec_id=7, layout=layout_fingerprint({"layers": [1, 3], "tpb": 16})),
], ids=["codec", "layout"])
def test_a_frame_of_another_codec_or_layout_fails(other):
    writer = FrameBook(other, 1, PAYLOAD)
    frames = writer.wrap(np.array([0]), _payloads(1), _keys(1))
    reader = FrameBook(FMT, 1, PAYLOAD)
    reader.keys[:] = writer.keys
    reader.seqs[:] = writer.seqs
    assert not reader.check(np.array([0]), frames).any()
    assert FrameBook(other, 1, PAYLOAD).check(np.array([0]), frames).sum() == 0  # never written
    writer_check = writer.check(np.array([0]), frames)
    assert writer_check.all()


def _as_block(frame: np.ndarray, key: np.ndarray) -> np.ndarray:
    """``frame`` rewritten as a valid frame of the block ``key``: the key put in its header,
    its sequence number kept, its CRC-32C computed again."""
    out = frame.copy()
    at = HEADER.fields["key"][1]
    out[at : at + 32] = key
    crc = google_crc32c.value(out[:-4].tobytes())
    out[-4:] = np.frombuffer(crc.to_bytes(4, "little"), np.uint8)
    return out


@pytest.mark.parametrize("n", [1, 2, 8, 9, 16], ids=lambda n: f"{n}_frames")
def test_a_valid_frame_of_another_block_fails_in_its_slot(n):
    """A frame whose key is another block's (sequence number kept, CRC recomputed: it is
    intact, just not what this slot recorded) fails the check, on the frame-by-frame path
    (up to 8 frames) and the vectorised one."""
    book = FrameBook(FMT, 2 * n, PAYLOAD)
    slots = np.arange(n, dtype=np.int64)[::-1].copy()
    keys = _keys(n)
    frames = book.wrap(slots, _payloads(n), keys)
    assert book.check(slots, frames).all()
    for i in range(n):
        bad = frames.copy()
        other = keys[(i + 1) % n] if n > 1 else _keys(1, seed=9)[0]
        bad[i] = _as_block(frames[i], other)
        assert (bad[i, HEADER.fields["seq"][1] :] != frames[i, HEADER.fields["seq"][1] :]
                ).sum() <= 4  # the same sequence number and payload: only the CRC moved
        want = np.ones(n, dtype=bool)
        want[i] = False
        assert book.check(slots, bad).tolist() == want.tolist(), i
        # Put back under its own key, the same bytes are intact again.
        assert book.check(slots, np.where(np.arange(n)[:, None] == i,
                                          _as_block(bad[i], keys[i]), bad)).all()


def test_partial_blocks_get_a_key_derived_from_the_page():
    assert page_key(b"k" * 32, 5) == b"k" * 32
    assert page_key(None, 5) != page_key(None, 6)
    assert len(page_key(None, 5)) == 32
    assert page_key(None, 2**40 + 3) == b"kvcm-page-id".ljust(24, b"\0") + \
        (2**40 + 3).to_bytes(8, "little")


@pytest.mark.parametrize("n", [1, 3, 9], ids=lambda n: f"{n}_frames")
def test_frames_built_in_given_rows_are_the_frames_wrap_returns(n):
    """``wrap(..., out)`` (a storage level's held rows) writes the very frames a plain
    ``wrap`` returns, records the same sequence numbers, and refuses rows of another
    shape, type or layout before writing or recording anything."""
    slots = np.arange(n, dtype=np.int64)[::-1].copy()
    a, b = FrameBook(FMT, n, PAYLOAD), FrameBook(FMT, n, PAYLOAD)
    want = a.wrap(slots, _payloads(n), _keys(n))
    rows = np.full((n + 2, FRAME), 0xEE, dtype=np.uint8)
    got = b.wrap(slots, _payloads(n), _keys(n), rows[1 : n + 1])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(rows[1 : n + 1], want)
    assert (rows[[0, n + 1]] == 0xEE).all()  # nothing outside the rows given
    np.testing.assert_array_equal(b.seqs, a.seqs)
    for bad in (np.zeros((n, FRAME + 1), np.uint8), np.zeros((n, FRAME), np.int8),
                np.zeros((n, 2 * FRAME), np.uint8)[:, ::2]):
        seqs = b.seqs.copy()
        with pytest.raises(ValueError, match="out"):
            b.wrap(slots, _payloads(n), _keys(n), bad)
        np.testing.assert_array_equal(b.seqs, seqs)


def test_blob_frames_check_length_and_checksum():
    book = FrameBook(FMT, 2, PAYLOAD)
    blobs = book.wrap_blobs(np.array([0, 1]), [b"abc", b"defgh"], _keys(2))
    assert book.unwrap_blob(0, blobs[0]) == b"abc"
    assert book.unwrap_blob(1, blobs[1]) == b"defgh"
    assert book.unwrap_blob(0, blobs[1]) is None  # swapped
    assert book.unwrap_blob(1, blobs[1][:-1]) is None  # truncated
    assert book.unwrap_blob(1, None) is None


def test_a_valid_blob_frame_of_another_block_fails_in_its_slot():
    book = FrameBook(FMT, 2, PAYLOAD)
    keys = _keys(2)
    blobs = book.wrap_blobs(np.array([0, 1]), [b"abc", b"defgh"], keys)
    assert book.unwrap_blob(0, blobs[0]) == b"abc"
    at = HEADER.fields["key"][1]
    body = bytearray(blobs[0][:-4])
    body[at : at + 32] = keys[1].tobytes()
    other = bytes(body) + google_crc32c.value(bytes(body)).to_bytes(4, "little")
    assert book.unwrap_blob(0, other) is None


# -- on the disk tier ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    tier = DiskTier(None, {"path": str(tmp_path_factory.mktemp("frames") / "d")})
    yield tier
    tier.close()


class _Slots:
    """A disk pool of framed slots: write frames through the tier, damage the file
    behind its back, read frames back through the tier and check them."""

    def __init__(self, tier: DiskTier, name: str, n: int = 4) -> None:
        self.pool = tier.create_pool(FRAME, n, name=name)
        self.book = FrameBook(FMT, n, PAYLOAD)
        self.payloads = _payloads(n)
        slots = np.arange(n)
        self.pool.write(slots, self.book.wrap(slots, self.payloads, _keys(n))).wait()

    def offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * FRAME

    def ok(self, *slots: int) -> np.ndarray:
        s = np.array(slots)
        rows = np.zeros((len(s), FRAME), dtype=np.uint8)
        self.pool.read(s, rows).wait()
        return self.book.check(s, rows)

    def raw(self, slot: int) -> bytes:
        with open(self.pool.path, "rb") as f:
            f.seek(self.offset(slot))
            return f.read(FRAME)

    def put_raw(self, slot: int, data: bytes) -> None:
        with open(self.pool.path, "r+b") as f:
            f.seek(self.offset(slot))
            f.write(data)

    def flip(self, slot: int, bit: int) -> None:
        raw = bytearray(self.raw(slot))
        raw[bit // 8] ^= 1 << (bit % 8)
        self.put_raw(slot, bytes(raw))

    def close(self) -> None:
        self.pool.close()


@pytest.fixture
def slots(disk, request):
    s = _Slots(disk, request.node.name[:60])
    yield s
    s.close()


@pytest.mark.parametrize("bit", range(FRAME * 8))
def test_every_single_bit_flip_of_a_disk_frame_is_detected(slots, bit):
    """Header, payload and checksum: each of the frame's bits, flipped alone."""
    assert slots.ok(1).all()
    slots.flip(1, bit)
    assert slots.ok(0, 1, 2).tolist() == [True, False, True]


def test_two_swapped_disk_frames_are_both_detected(slots):
    raw = [slots.raw(i) for i in (0, 1)]
    slots.put_raw(0, raw[1])
    slots.put_raw(1, raw[0])
    assert slots.ok(0, 1, 2).tolist() == [False, False, True]


def test_an_old_frame_put_back_in_its_slot_is_detected(slots):
    old = slots.raw(2)
    s = np.array([2])
    slots.pool.write(s, slots.book.wrap(s, _payloads(1), slots.book.keys[2:3].copy())).wait()
    assert slots.ok(2).all()
    slots.put_raw(2, old)  # same key, older sequence number
    assert not slots.ok(2).any()


def test_a_truncated_disk_file_re_extended_by_later_writes_reads_as_bad_frames(slots):
    """Issue 13, defect 2: the lost slots read back as zeros; they must not pass."""
    os.truncate(slots.pool.path, slots.offset(1))  # slots 1.. lost
    s = np.array([3])
    slots.pool.write(s, slots.book.wrap(s, _payloads(1), slots.book.keys[3:4])).wait()
    assert slots.ok(0, 1, 2, 3).tolist() == [True, False, False, True]


# -- on the disk tier in blob mode ------------------------------------------------------------


class _Blobs:
    """A blob-mode disk pool of framed blobs (see :class:`_Slots`)."""

    def __init__(self, tmp_path, n: int = 4) -> None:
        self.tier = DiskTier(None, {"path": str(tmp_path / "blobs"), "mode": "blob"})
        self.pool = self.tier.create_pool(FRAME, n)
        self.book = FrameBook(FMT, n, PAYLOAD)
        slots = np.arange(n)
        payloads = [row.tobytes() for row in _payloads(n)]
        self.pool.write_blobs(slots, self.book.wrap_blobs(slots, payloads, _keys(n))).wait()

    def ok(self, *slots: int) -> list[bool]:
        out = [b""] * len(slots)
        self.pool.read_blobs(np.array(slots), out).wait()
        return [self.book.unwrap_blob(s, blob) is not None
                for s, blob in zip(slots, out, strict=True)]

    def edit(self, slot: int, change) -> None:
        path, offset, length = self.pool.locate(slot)
        with open(path, "r+b") as f:
            f.seek(offset)
            raw = f.read(length)
            f.seek(offset)
            f.write(change(raw))

    def close(self) -> None:
        self.tier.close()


@pytest.fixture
def blobs(tmp_path):
    b = _Blobs(tmp_path)
    yield b
    b.close()


@pytest.mark.parametrize("bit", range(FRAME * 8))
def test_every_single_bit_flip_of_a_blob_mode_frame_is_detected(blobs, bit):
    assert blobs.ok(1) == [True]

    def flip(raw: bytes) -> bytes:
        out = bytearray(raw)
        out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)

    blobs.edit(1, flip)
    assert blobs.ok(0, 1, 2) == [True, False, True]


def test_two_swapped_blob_mode_frames_are_both_detected(blobs):
    first = {}
    blobs.edit(0, lambda raw: first.setdefault(0, raw))
    second = {}
    blobs.edit(1, lambda raw: second.setdefault(1, raw))
    blobs.edit(0, lambda raw: second[1])
    blobs.edit(1, lambda raw: first[0])
    assert blobs.ok(0, 1, 2) == [False, False, True]


def test_a_truncated_blob_segment_reads_as_bad_frames(blobs):
    path, offset, _ = blobs.pool.locate(2)
    os.truncate(path, offset + 5)  # slot 2 cut short, slot 3 gone
    assert blobs.ok(0, 1, 2, 3) == [True, True, False, False]
