"""Helpers of the remote-level tests: model configurations with a shared ``redis`` level,
an engine run verified by the fingerprint engine, and a second process that serves a
prompt through its own manager (what another engine instance does)."""

from __future__ import annotations

import os
from typing import Any

from kvcm_core import KVCacheManager, KVCacheManagerConfig
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.types import ReuseScope

TPB = 16
#: The ``model`` option of the test configurations' remote level.
MODEL = "test-model@rev1"
#: As in conftest: ``KVCM_TEST_BACKEND=cuda`` (or ``cupy``) runs these on a GPU.
BACKEND = os.environ.get("KVCM_TEST_BACKEND", "numpy")


def layers(size: int = 256, window: int | None = None) -> list[dict[str, Any]]:
    """Two full-attention layers (and a windowed one with ``window``)."""
    out: list[dict[str, Any]] = [
        {"layer_id": 0, "buffers": [{"role": "kv", "size": size}]},
        {"layer_id": 1, "buffers": [{"role": "kv", "size": size}]}]
    if window is not None:
        out.append({"layer_id": 2, "buffers": [{"role": "kv", "size": size}],
                    "sliding_window_size": window, "num_sink_tokens": TPB})
    return out


def config(url: str, *, local: tuple[str, ...] = ("gpu", "host"), size: int = 256,
           window: int | None = None, quota: str | int = "64MiB",
           cluster: bool = False, level: dict[str, Any] | None = None,
           **options: Any) -> KVCacheManagerConfig:
    """A manager configuration: ``local`` levels (1 MiB each; disk 4 MiB), then a redis
    level at ``url`` with ``options``. ``io_deadline_s`` is 5 s unless given: a lookup on a
    loaded test machine must not miss for lack of time (tests of deadlines pass theirs).
    ``model`` and ``shard`` are ``MODEL`` and ``"0"`` unless given (None leaves one out)."""
    options.setdefault("io_deadline_s", 5.0)
    options.setdefault("model", MODEL)
    options.setdefault("shard", "0")
    for name in ("model", "shard"):
        if options[name] is None:
            del options[name]
    levels: list[dict[str, Any]] = [
        {"tier": t, "quota": "4MiB" if t == "disk" else "1MiB"} for t in local]
    opts = {"url": url, **options}
    if cluster:
        opts["cluster"] = True
    levels.append({"tier": "redis", "quota": quota, "options": opts, **(level or {})})
    return KVCacheManagerConfig.from_dict({
        "tokens_per_block": TPB, "layers": layers(size, window), "levels": levels,
        "kernel_backend": BACKEND})


def serve(manager: KVCacheManager, prompt: list[int], answer: int = 3, rid: Any = "r",
          scope: ReuseScope | None = None) -> int:
    """Run one request (prompt then ``answer`` tokens) through an engine loop that checks
    every page it reads with the fingerprint engine; returns the tokens it reused."""
    loop = EngineLoop(manager, chunk_tokens=64)
    req = Request(rid, prompt + list(range(7, 7 + answer)), len(prompt), scope=scope)
    loop.submit(req)
    steps = 0
    while not loop.idle:
        loop.step()
        steps += 1
        assert steps < 10_000
    loop.close_all()
    return req.reused


def serve_in_another_process(url: str, prompt: list[int], cluster: bool = False,
                             salt: int | None = None) -> dict[str, int]:
    """Body of the second process: its own manager serves ``prompt``, waits until its
    writes are made, and reports its counters."""
    with KVCacheManager(config(url, cluster=cluster)) as m:
        reused = serve(m, prompt, scope=None if salt is None else ReuseScope(salt=salt))
        assert m.flush_remote(30.0)
        st = m.get_remote_statistics()
        return {"reused": reused, "written": st.written, "write_failures": st.write_failures}
