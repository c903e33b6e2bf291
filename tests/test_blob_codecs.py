"""The zstd and lz4 blob codecs (beyond the codec conformance suite, which every
registered codec runs): their options, codec ids, and lossless round trips of KV-like
payloads (float16 values, never fingerprint records, which compress absurdly well)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcm_core.errors import ConfigError, CorruptPageError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.records import CodecKind

#: name -> (package, codec id, some valid levels: lowest, default, highest)
CODECS = {"zstd": ("zstandard", 16, (-7, 3, 22)), "lz4": ("lz4", 17, (0, 16))}


@pytest.fixture(params=sorted(CODECS))
def spec(request):
    module = CODECS[request.param][0]
    pytest.importorskip(module, reason=f"the {module!r} package is not installed")
    return get_plugin_manager().codec(request.param)


def _kv_page(seed: int, nbytes: int = 64 << 10) -> bytes:
    """A page of float16 keys/values: normal values with a few outliers per row."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 0.6, nbytes // 2).astype(np.float16)
    values[rng.integers(0, len(values), len(values) // 128)] *= 20
    return values.tobytes()


def test_blob_codecs_are_lossless_blob_codecs_with_their_frame_ids(spec):
    caps = spec.capabilities
    assert caps.kind is CodecKind.BLOB and caps.lossless and caps.checksummed
    assert caps.codec_id == CODECS[spec.name][1]


def test_kv_like_pages_round_trip_and_never_grow_much(spec):
    codec = spec.factory({})
    for seed in range(3):
        page = _kv_page(seed)
        blob = codec.encode(page)
        assert codec.decode(blob, expected_size=len(page)) == page
        # Random mantissas leave little to gain; an incompressible page costs a few bytes.
        assert len(blob) <= len(page) + 64 + len(page) // 200


@pytest.mark.parametrize("options, field", [
    ({"level": 99}, "options.level"),
    ({"level": True}, "options.level"),
    ({"speed": 1}, "options.speed"),
])
def test_bad_codec_options_raise_config_error_naming_the_option(spec, options, field):
    with pytest.raises(ConfigError, match=field):
        spec.factory(options)


def test_a_blob_decoded_to_another_size_is_corrupt(spec):
    codec = spec.factory({"level": 1})
    with pytest.raises(CorruptPageError, match="bytes"):
        codec.decode(codec.encode(b"\x01" * 100), expected_size=99)


@pytest.mark.parametrize("size", [1, 100, 4096, 65_536, 300_001, 1 << 20])
def test_incompressible_pages_fit_the_room_a_blob_level_keeps_per_slot(spec, size):
    """A blob level's slot holds the frame plus ``size / 128 + 128`` bytes of room: the
    worst case of random bytes (which no codec shrinks) must fit it, at every level."""
    from kvcm_core.frame import FRAME_OVERHEAD, FrameFormat, LevelFrames

    page = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    room = LevelFrames(FrameFormat(0, bytes(16)), blob=spec.factory({})).slot_bytes(size)
    for level in CODECS[spec.name][2]:
        blob = spec.factory({"level": level}).encode(page)
        assert len(blob) + FRAME_OVERHEAD <= room, (level, len(blob) - size)


_RACE = """
import sys, threading, numpy as np
from kvcm_core.plugins import get_plugin_manager
spec = get_plugin_manager().codec(sys.argv[1])
rng = np.random.default_rng(0)
page = rng.normal(0, .6, 1 << 18).astype(np.float16).tobytes()
other = rng.normal(0, .6, 3 << 16).astype(np.float16).tobytes()
blob = spec.factory({}).encode(other)
for _ in range(int(sys.argv[2])):
    codec = spec.factory({})   # a fresh instance, as a new manager makes
    go, stop = threading.Event(), threading.Event()
    def writer():
        go.set()
        while not stop.is_set():
            codec.encode(page)
    t = threading.Thread(target=writer)
    t.start()
    go.wait()
    assert codec.decode(blob, len(other)) == other   # the first read of another size
    stop.set()
    t.join()
print("ok")
"""


def test_one_codec_encodes_on_one_thread_while_it_decodes_on_another(spec):
    """A level's writer thread encodes while the scheduler decodes with the same codec:
    zstd's compressor is not thread-safe (its first decode of a size compresses a frame
    header), which crashed the process (SIGSEGV). Run apart: a crash fails this test."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _RACE, spec.name, "150"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("fails", ["encode", "decode"])
def test_a_blob_codec_raising_a_plain_error_is_a_storage_failure_never_an_untyped_one(
        tmp_path, fails):
    """A third-party blob codec that breaks its contract (a ValueError, not
    CorruptPageError): its encode is a failed write (the pages are not kept there), its
    decode a damaged page (CorruptPageError at resume); nothing untyped reaches the
    engine and nothing is lost."""
    from codec_helpers import broken_blob_codec
    from conftest import Driver, tokens
    from levels_helpers import assert_invariants, close_all, make_manager

    from kvcm_core import KvcmError

    pm, calls = broken_blob_codec(999, encode_fails_every=3 if fails == "encode" else 0,
                                  decode_fails=fails == "decode")
    m = make_manager([("gpu", 9), ("disk", 30)], tmp_path, pm=pm,
                     disk={"mode": "blob", "blob_codec": "broken"})
    try:
        d = Driver(m)
        prompts = [tokens(24, seed=s) for s in range(4)]
        for r in range(3):
            for p in prompts:
                try:
                    d.run(p + tokens(3, seed=len(p) + r))
                except KvcmError as exc:  # typed: a damaged page read back
                    assert fails == "decode", exc
                m.check_invariants()
        assert calls["encode"] > 0
        if fails == "encode":
            assert m.storage_levels.stats.io_failures > 0
        close_all(m)  # (a cache whose resume met a damaged page stays SUSPENDED)
        assert_invariants(m)
    finally:
        m.shutdown()
