"""Multimodal prompts, second look (session 27's review): a deque of tokens and digests,
a NumPy bytes digest, a sink interrupt while pulled pages of an image prompt are
published, the oracle's record ids of digests, and the two-engine runner's images."""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import numpy as np
import pytest
from levels_helpers import SinkPlugin
from redis_fixtures import fresh_server, need_binaries
from remote_helpers import TPB, config, serve

import kvcm_core.levels as levels_mod
from kvcm_core import EventSink, KVCacheManager, KvcmPluginManager
from kvcm_core.testing.fingerprint import token_ids


def _image(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _local() -> KVCacheManager:
    from remote_helpers import BACKEND, layers

    from kvcm_core import KVCacheManagerConfig

    return KVCacheManager(KVCacheManagerConfig.from_dict({
        "tokens_per_block": TPB, "layers": layers(256), "kernel_backend": BACKEND,
        "levels": [{"tier": "gpu", "quota": "1MiB"}, {"tier": "host", "quota": "1MiB"}]}))


PROMPT = list(range(1000, 1000 + 2 * TPB)) + [_image("cat")] * TPB + \
    list(range(2000, 2000 + 3 * TPB + 2))


@pytest.mark.parametrize("length", [len(PROMPT), 200 * TPB])  # short, and past a gallop
def test_a_deque_holding_digests_matches_as_the_list_does(length: int) -> None:
    prompt = (PROMPT * (length // len(PROMPT) + 1))[:length]
    with _local() as m:
        serve(m, prompt)
        want = m.probe_reuse(None, prompt)
        assert want >= 2 * TPB
        assert m.probe_reuse(None, collections.deque(prompt)) == want
        c = m.create_kv_cache(None, collections.deque(prompt))
        assert c.history_length == want
        c.close()


def test_a_numpy_bytes_digest_is_a_digest_everywhere() -> None:
    """``numpy.bytes_`` is a ``bytes``: kept as the digest it is (it was taken for an int
    when the log froze the prompt: a raw ValueError at commit, and at a create over a
    cached prefix)."""
    prompt = [np.array([t], dtype="S32")[0] if isinstance(t, bytes) else t for t in PROMPT]
    with _local() as m:
        serve(m, list(PROMPT))  # cached with bytes digests
        want = m.probe_reuse(None, list(PROMPT))
        assert m.probe_reuse(None, prompt) == want >= 2 * TPB
        c = m.create_kv_cache(None, prompt)
        assert c.history_length == want
        c.close()
        assert serve(m, [7, *prompt], rid="fresh") == 0  # written and checked
        m.check_invariants()


class _Interrupt(BaseException):
    pass


class _StoredSink(EventSink):
    armed = False

    def on_events(self, events: Any) -> None:
        if self.armed and any(e.kind.name == "STORED" for e in events):
            self.armed = False
            raise _Interrupt("a sink's interrupt")


def test_a_sink_interrupt_while_pulled_pages_are_published_leaves_nothing_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    need_binaries()
    monkeypatch.setattr(levels_mod, "_EVENT_BATCH", 1)
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
        sink = _StoredSink()
        pm = KvcmPluginManager()
        pm.register(SinkPlugin(sink), name="sink")
        with KVCacheManager(config(server.url), plugin_manager=pm) as b:
            sink.armed = True
            with pytest.raises(_Interrupt):
                b.create_kv_cache(None, PROMPT[:-1])
            assert b.num_open_caches == 0
            b.check_invariants()
            b.clear_reusable_blocks()
            for level in range(len(b.levels)):
                st = b.get_storage_statistics(level)
                assert st.free == st.total, f"level {level}: {st.total - st.free} held"


def test_the_oracle_tells_a_digest_from_an_int_sharing_its_first_four_bytes() -> None:
    """The core's 32-bit id of a digest is its first 4 bytes: the fingerprint records
    use all its bytes, so KV wrongly shared between the two would fail the check."""
    d = _image("dog")
    same_head = d[:4] + bytes(28)
    as_int = int.from_bytes(d[:4], "little", signed=True)
    ids = token_ids([d, same_head, as_int], 3)
    assert len(set(ids.tolist())) == 3


def test_the_two_engine_runner_gives_its_managers_the_images_digests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from remote_helpers import BACKEND, layers

    from kvcm_core import KVCacheManagerConfig
    from kvcm_core.simulate.runner import SchedulerConfig
    from kvcm_core.simulate.two_engine import run_engines
    from kvcm_core.simulate.workload import WorkloadConfig, generate_trace

    trace = generate_trace(WorkloadConfig(requests=6, multimodal=1.0, image_tokens=(20, 30),
                                          images=2), 0)
    assert sum(isinstance(t, bytes) for r in trace for t in r.items()) > 0
    seen = {"digests": 0}
    real = KVCacheManager.create_kv_cache

    def spy(self: Any, scope: Any = None, input_tokens: Any = (), *a: Any, **k: Any) -> Any:
        seen["digests"] += sum(isinstance(t, bytes | bytearray) for t in input_tokens)
        return real(self, scope, input_tokens, *a, **k)

    monkeypatch.setattr(KVCacheManager, "create_kv_cache", spy)
    cfg = KVCacheManagerConfig.from_dict({
        "tokens_per_block": TPB, "layers": layers(256), "kernel_backend": BACKEND,
        "levels": [{"tier": "gpu", "quota": "4MiB"}, {"tier": "host", "quota": "4MiB"}]})
    run_engines(cfg, trace, SchedulerConfig(), "local only")
    assert seen["digests"] > 0  # (it passed int placeholders only)
