"""``FrameBook.wrap`` builds a batch's frames through one record per frame whose fields
are the frame's parts (header, key, sequence number, payload, CRC-32C). These tests hold it
to an independent construction of the same frames: the header record ``HEADER`` of
``frame.py``'s format description, its bytes followed by the payload and the CRC-32C of
both (what ``wrap_blobs`` writes for a payload of the same size), with the same records
in the book, for any batch (a few pages, framed one by one, or more)."""

from __future__ import annotations

import google_crc32c
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm_core.frame import FRAME_OVERHEAD, HEADER, FrameBook, FrameFormat

SLOTS = 64


def _expected(fmt: FrameFormat, slots: list[int], payloads: np.ndarray, keys: np.ndarray,
              first_seq: int) -> np.ndarray:
    """The frames, built field by field from the format's description."""
    n, size = payloads.shape
    head = np.zeros(n, dtype=HEADER)
    head["magic"] = b"KVCM"
    head["version"] = 1
    head["codec"] = fmt.codec_id
    head["layout"] = np.frombuffer(fmt.layout, dtype=np.uint8)
    head["key"] = keys
    head["seq"] = np.arange(first_seq, first_seq + n)
    head["length"] = size
    rows = []
    for i in range(n):
        body = head[i].tobytes() + payloads[i].tobytes()
        rows.append(body + google_crc32c.value(body).to_bytes(4, "little"))
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(n, size + FRAME_OVERHEAD)


@settings(max_examples=60, deadline=None)
@given(slots=st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=40, unique=True),
       size=st.integers(1, 80), seed=st.integers(0, 2**32 - 1), before=st.integers(0, 3))
def test_wrap_gives_the_frames_of_the_format_and_records_them(slots, size, seed, before):
    rng = np.random.default_rng(seed)
    fmt = FrameFormat(int(rng.integers(0, 2**16)), rng.bytes(16))
    book = FrameBook(fmt, SLOTS, size)
    for _ in range(before):  # earlier writes: the sequence numbers go on from them
        book.wrap(np.array([0]), np.zeros((1, size), dtype=np.uint8),
                  np.zeros((1, 32), dtype=np.uint8))
    n = len(slots)
    payloads = rng.integers(0, 256, (n, size), dtype=np.uint8)
    keys = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    want = _expected(fmt, slots, payloads, keys, before + 1)
    got = book.wrap(np.array(slots), payloads, keys)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(book.keys[slots], keys)
    assert book.seqs[slots].tolist() == list(range(before + 1, before + 1 + n))
    assert book.check(np.array(slots), got).all()


def test_wrap_takes_keys_as_an_assignment_would():
    """Keys that are not packed bytes (another integer type, one key for every page, a
    strided view) frame and record as their assignment to the rows would give them."""
    fmt = FrameFormat(7, bytes(range(16)))
    payloads = np.arange(8 * 6, dtype=np.uint8).reshape(8, 6)
    slots = np.array([9, 2, 30, 4, 5, 60, 7, 8])
    keys = np.arange(8 * 32, dtype=np.uint8).reshape(8, 32)
    want = FrameBook(fmt, SLOTS, 6).wrap(slots, payloads, keys)
    for given_keys in (keys.astype(np.int64), np.asfortranarray(keys),
                       np.repeat(keys, 2, axis=1)[:, ::2]):
        book = FrameBook(fmt, SLOTS, 6)
        np.testing.assert_array_equal(book.wrap(slots, payloads, given_keys), want)
        np.testing.assert_array_equal(book.keys[slots], keys)
    one = FrameBook(fmt, SLOTS, 6).wrap(slots, payloads, keys[:1])
    np.testing.assert_array_equal(one, FrameBook(fmt, SLOTS, 6).wrap(
        slots, payloads, np.repeat(keys[:1], 8, axis=0)))


def _intact(fmt: FrameFormat, book: FrameBook, slots: list[int], frames: np.ndarray
            ) -> list[bool]:
    """Which frames hold, byte for byte, the frame the format gives the book's record of
    their slot (key, sequence number; never written: none), with the CRC-32C of the header
    and payload they carry."""
    out = []
    for i, slot in enumerate(slots):
        seq = int(book.seqs[slot])
        if not seq:
            out.append(False)
            continue
        payload = frames[i : i + 1, HEADER.itemsize : -4]
        want = _expected(fmt, [slot], payload, book.keys[slot : slot + 1], seq)[0]
        out.append(bool((frames[i] == want).all()))
    return out


@settings(max_examples=80, deadline=None)
@given(n=st.integers(9, 40), size=st.integers(1, 80), seed=st.integers(0, 2**32 - 1),
       flips=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 8 * 200 - 1)), max_size=6),
       stale=st.lists(st.integers(0, 39), max_size=3), strided=st.booleans())
def test_check_of_many_frames_passes_exactly_the_intact_frames(n, size, seed, flips, stale,
                                                                strided):
    """``check`` of a batch (more frames than the frame-by-frame path takes) passes a frame
    iff every byte of it is what the book's record of its slot and its payload give:
    bit flips anywhere (header, payload, CRC), frames of an older write, slots never
    written, in frames given as a strided view too."""
    rng = np.random.default_rng(seed)
    fmt = FrameFormat(int(rng.integers(0, 2**16)), rng.bytes(16))
    book = FrameBook(fmt, SLOTS, size)
    slots = rng.permutation(SLOTS)[:n].tolist()
    written = slots[: n - 2] if n % 2 else slots  # some batches name unwritten slots
    payloads = rng.integers(0, 256, (len(written), size), dtype=np.uint8)
    keys = rng.integers(0, 256, (len(written), 32), dtype=np.uint8)
    old = book.wrap(np.array(written), payloads, keys)
    frames = np.zeros((n, size + FRAME_OVERHEAD), dtype=np.uint8)
    frames[: len(written)] = book.wrap(np.array(written), payloads, keys)  # a newer write
    for i in stale:  # the older write's frame put back
        if i < len(written):
            frames[i] = old[i]
    for i, bit in flips:
        if i < n:
            bit %= 8 * frames.shape[1]
            frames[i, bit // 8] ^= 1 << (bit % 8)
    if strided:
        wide = np.zeros((n, 2 * frames.shape[1]), dtype=np.uint8)
        wide[:, ::2] = frames
        frames = wide[:, ::2]
    got = book.check(np.array(slots), frames)
    assert got.tolist() == _intact(fmt, book, slots, np.ascontiguousarray(frames))
