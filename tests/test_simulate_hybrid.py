"""``kvcm simulate --preset hybrid``: a hybrid model (full attention, SWA with sinks, SSM),
a lossy int8 disk level, multimodal prompts, an engine that grows rows with Batch.resize
and compacts them with Batch.move, and speculative-decoding rewinds (in a companion run on
the model less its SSM layer: SSM cannot rewind). A short run verifies every step and its
report counts each feature; corrupting each new path makes the fingerprint check fail."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from kvcm_core.batch import Batch
from kvcm_core.config import AttentionLayerConfig, KVCacheManagerConfig, SsmLayerConfig
from kvcm_core.manager import KVCacheManager
from kvcm_core.simulate import _fit_levels, _manager_config, _speculative, load_config, main
from kvcm_core.simulate.runner import run_trace, working_set
from kvcm_core.simulate.workload import generate_trace
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.testing.fingerprint import FingerprintEngine, FingerprintMismatch

REQUESTS = 16
#: What the fingerprint check says of a page holding the wrong KV: records (exact buffers)
#: or values beyond the codecs' tolerance (typed buffers, checked first).
WRONG_KV = r"does not hold its tokens' records|typed page .* error beyond"


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, float]:
    out = tmp_path_factory.mktemp("hybrid")
    t0 = time.perf_counter()
    code = main(["--preset", "hybrid", "--requests", str(REQUESTS), "--quiet", "--no-plots",
                 "--no-compare", "--out", str(out)])
    return code, _report(out), time.perf_counter() - t0


def _setup(requests: int = REQUESTS, seed: int = 0) -> tuple[Any, KVCacheManagerConfig, list]:
    """The hybrid preset's scheduler of the measured run (no rewinds: the model has an SSM
    layer), manager configuration (quotas from the fractions, as ``kvcm simulate`` sets
    them) and trace."""
    sim = load_config(None, "hybrid")
    trace = generate_trace(attrs.evolve(sim.workload, requests=requests), seed)
    ws = working_set(trace, KVCacheManagerConfig.from_dict(sim.kvcm))
    fitted: dict = {}
    cfg = _fit_levels(_manager_config(sim, ws, False, [], fitted), fitted,
                      ws["bytes_per_block"], [])
    return _speculative(cfg, sim.scheduler)[0], cfg, trace


def _installing(install: Any) -> Any:
    """An on_step hook that calls ``install(manager, loop)`` once, after step 0."""
    done: list[bool] = []

    def hook(manager: KVCacheManager, loop: EngineLoop, step: int) -> None:
        if not done:
            done.append(True)
            install(manager, loop)

    return hook


# -- the preset runs verified and exercises every feature ----------------------------------


def test_hybrid_preset_runs_verified_quickly_and_exits_zero(hybrid_run) -> None:
    code, rep, wall = hybrid_run
    assert code == 0
    assert rep["verification"] == {"ok": True, "error": None}
    assert rep["run"]["requests_finished"] == REQUESTS
    assert rep["speculative"]["requests_finished"] == REQUESTS
    for run in (rep["run"], rep["speculative"]):
        assert run["verification"]["steps_checked"] == run["steps"] > 0
        assert run["verification"]["pages_checked"] > 0
    assert wall < 30


def test_hybrid_report_counts_each_feature_exercised(hybrid_run) -> None:
    _, rep, _ = hybrid_run
    f = rep["run"]["features"]
    for key in ("ssm_snapshots", "ssm_states_reused", "lossy_encoded_blocks",
                "lossy_decoded_blocks", "multimodal_requests", "batch_resize_calls",
                "batch_resize_rows", "batch_moves", "batch_table_checks"):
        assert f[key] > 0, key
    assert "rewinds" not in f  # the SSM model cannot rewind: no speculative steps here
    assert f["multimodal_requests"] == rep["workload"]["multimodal_requests"]
    spec = rep["speculative"]["features"]
    for key in ("speculative_steps", "rewinds", "rewound_tokens", "batch_resize_calls",
                "batch_moves", "lossy_encoded_blocks", "multimodal_requests"):
        assert spec[key] > 0, key
    assert "ssm_snapshots" not in spec  # the companion run's model has no SSM layer
    assert spec["rewinds"] <= spec["speculative_steps"]
    assert any("cannot rewind" in n for n in rep["meta"]["notes"])


def test_hybrid_preset_model_and_levels() -> None:
    sim = load_config(None, "hybrid")
    cfg = KVCacheManagerConfig.from_dict(sim.kvcm)
    ssm = [lay for lay in cfg.layers if isinstance(lay, SsmLayerConfig)]
    attn = [lay for lay in cfg.layers if isinstance(lay, AttentionLayerConfig)]
    assert len(ssm) == 1 and all(ssm[0].effective_exact(b) for b in ssm[0].buffers)
    assert any(lay.sliding_window_size and lay.num_sink_tokens for lay in attn)
    assert any(lay.sliding_window_size is None for lay in attn)
    lossy = [b for lay in attn for b in lay.buffers if not lay.effective_exact(b)]
    exact = [b for lay in attn for b in lay.buffers if lay.effective_exact(b)]
    assert lossy and all(b.dtype == "bf16" for b in lossy) and exact
    assert [lv.tier for lv in cfg.levels] == ["gpu", "host", "disk"]
    assert cfg.levels[2].codec == "int8" and cfg.levels[1].codec in (None, "raw")
    assert cfg.commit_min_snapshot
    assert sim.scheduler.batch_ops and sim.scheduler.rewind_every and sim.scheduler.rewind_draft
    assert 0 < sim.workload.multimodal < 1
    sched, spec = _speculative(cfg, sim.scheduler)
    assert sched.rewind_every == 0 and spec is not None
    assert not any(isinstance(lay, SsmLayerConfig) for lay in spec.layers)
    assert spec.max_rewind_len >= sim.scheduler.rewind_draft


def test_multimodal_workload_is_seeded_and_leaves_the_rest_of_the_trace_alone() -> None:
    sim = load_config(None, "hybrid")
    wl = attrs.evolve(sim.workload, requests=40)
    a, b = generate_trace(wl, 5), generate_trace(wl, 5)
    plain = generate_trace(attrs.evolve(wl, multimodal=0.0), 5)
    assert [r.images for r in a] == [r.images for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert not any(r.images for r in plain)
    assert [(r.id, r.arrival, r.after) for r in a] == [(r.id, r.arrival, r.after) for r in plain]
    with_images = [r for r in a if r.images]
    assert 0 < len(with_images) < len(a)
    by_id = {r.id: r for r in a}
    for r in with_images:
        items = r.items()
        for start, length, digest in r.images:
            assert len(digest) == 32
            assert all(items[p] == digest for p in range(start, start + length))
            assert start + length <= r.prompt_len
        assert sum(isinstance(t, bytes) for t in items) == sum(n for _, n, _ in r.images)
        if r.after is not None:  # a later turn carries its predecessor's images
            assert by_id[r.after].images == r.images[:len(by_id[r.after].images)]


def test_a_model_with_ssm_layers_refuses_rewinds_in_the_engine() -> None:
    _, cfg, _ = _setup(4)
    with KVCacheManager(attrs.evolve(cfg, max_rewind_len=4)) as m, \
            pytest.raises(ValueError, match="SSM layers cannot rewind"):
        EngineLoop(m, rewind_every=2, rewind_draft=2)


# -- fault injection: each new path, corrupted, fails the check ------------------------------


def _moved_row_corrupter(manager: KVCacheManager, loop: EngineLoop,
                         index: bool = False) -> None:
    """After each Batch.move, the next publish leaves one wrong slot id in the moved row's
    device table (block 0 of the first full-attention group), or with ``index`` one wrong
    page index in its registered index table of layer 0's ``kv`` buffer."""
    batch = loop.batch
    assert batch is not None
    group = manager.get_buffer_group_id(0, "kv")
    slots = manager.stores[0][manager.layout.group_to_pool_group[group]].num_slots
    moved: list[int] = []
    move, publish = batch.move, batch.publish

    def tracked_move(cache: Any, row: int) -> None:
        move(cache, row)
        moved.append(row)

    def corrupting_publish(*args: Any, **kwargs: Any) -> int:
        n = publish(*args, **kwargs)
        while moved:
            row = moved.pop()
            if batch.members[row] is not None and batch.read_num_blocks(group)[row] > 0:
                table = batch.index_table(0, "kv") if index else batch.page_table(group)
                table[row, 0, 0] = (int(table[row, 0, 0]) + 1) % slots
                loop.kvcm_corrupted_rows = getattr(loop, "kvcm_corrupted_rows", 0) + 1
        return n

    batch.move = tracked_move  # type: ignore[method-assign]
    batch.publish = corrupting_publish  # type: ignore[method-assign]


def test_a_wrong_entry_in_a_moved_rows_device_table_fails_the_batch_check() -> None:
    sched, cfg, trace = _setup()
    with pytest.raises(FingerprintMismatch, match="device table differs from the cache's"):
        run_trace(cfg, trace, sched, on_step=_installing(_moved_row_corrupter))


def test_a_wrong_entry_in_a_moved_rows_index_table_fails_the_batch_check() -> None:
    sched, cfg, trace = _setup()
    with pytest.raises(FingerprintMismatch, match="index table of layer 0/kv beam 0: the "
                                                  "device table differs"):
        run_trace(cfg, trace, sched, on_step=_installing(
            lambda m, loop: _moved_row_corrupter(m, loop, index=True)))


def test_the_page_check_reads_through_the_moved_rows_table(monkeypatch) -> None:
    # Without the table check, the fingerprint check reads the page table through the
    # batch: the wrong slot id shows (a page two blocks share, or records not the request's).
    monkeypatch.setattr(FingerprintEngine, "check_batch", lambda self: None)
    sched, cfg, trace = _setup()
    with pytest.raises(FingerprintMismatch,
                       match=f"two blocks share one page|{WRONG_KV}"):
        run_trace(cfg, trace, sched, on_step=_installing(_moved_row_corrupter))


def test_without_the_corruption_the_same_run_with_moves_verifies() -> None:
    sched, cfg, trace = _setup()
    res = run_trace(cfg, trace, sched)
    assert res.features["batch_moves"] > 0 and res.features["batch_table_checks"] > 0


def _lossy_corrupter(manager: KVCacheManager, loop: EngineLoop) -> None:
    """Every page the lossy codec encodes gets one code byte of its first quantized
    segment flipped after encoding (element 0, the token slot's outlier: far beyond the
    codec's error bound). Frames are made from the encoded bytes, so only the fingerprint
    check can see it."""
    from kvcm_codec_quant.reference import _up

    codec = next(c for c in manager.codecs if c is not None and not c.lossless)
    encode = codec.encode

    def corrupting_encode(backend: Any, layout: Any, src: Any, src_slots: Any, dst: Any,
                          dst_slots: Any, stream: Any = None) -> None:
        encode(backend, layout, src, src_slots, dst, dst_slots, stream)
        seg = next((s for s in codec.plan(layout).segments if s.dtype is not None), None)
        if seg is None:  # an exact-only layout (the SSM state): kept bit for bit
            return
        groups = -(-seg.size // {"bf16": 2, "fp16": 2, "fp32": 4}[seg.dtype]
                   // seg.group_size)
        code0 = seg.cold_offset + _up(4 * groups)
        backend.synchronize()
        for slot in np.asarray(dst_slots).tolist():
            at = dst.page_start(int(slot)) + code0
            byte = backend.read(dst.buffer, at, 1)
            backend.write(dst.buffer, at, byte ^ 0x40)

    codec.encode = corrupting_encode  # type: ignore[method-assign]


def test_a_flipped_code_in_a_lossy_cold_page_fails_the_typed_check() -> None:
    sched, cfg, trace = _setup()
    with pytest.raises(FingerprintMismatch, match=r"typed page .* error beyond"):
        run_trace(cfg, trace, sched, on_step=_installing(_lossy_corrupter))


def _snapshot_corrupter(manager: KVCacheManager, loop: EngineLoop) -> None:
    """Every SSM snapshot page gets its first byte flipped right after the copy."""
    levels = manager.storage_levels
    layer = next(lay for lay in manager.config.layers if isinstance(lay, SsmLayerConfig))
    role = layer.buffers[0].role
    group = manager.get_buffer_group_id(layer.layer_id, role)
    region = manager.get_page_region(layer.layer_id, role)
    copy_blocks = levels.copy_blocks

    def corrupting_copy(g: int, dst: Any, src: Any, stream: Any = None) -> None:
        copy_blocks(g, dst, src, stream)
        if g != group:
            return
        manager.backend.synchronize()
        for pid in np.asarray(dst).tolist():
            at = region.page_start(int(levels.arena.slot[pid]))
            byte = manager.backend.read(region.buffer, at, 1)
            manager.backend.write(region.buffer, at, byte ^ 0xFF)

    levels.copy_blocks = corrupting_copy  # type: ignore[method-assign]


def test_a_corrupted_ssm_snapshot_fails_the_check_of_the_request_that_reuses_it() -> None:
    sched, cfg, trace = _setup()
    layer = next(lay.layer_id for lay in cfg.layers if isinstance(lay, SsmLayerConfig))
    with pytest.raises(FingerprintMismatch, match=f"layer {layer}, buffer 0"):
        run_trace(cfg, trace, sched, on_step=_installing(_snapshot_corrupter))


def _spec_setup() -> tuple[Any, KVCacheManagerConfig, list]:
    _, cfg, trace = _setup()
    sched = load_config(None, "hybrid").scheduler
    _, spec = _speculative(cfg, sched)
    assert spec is not None
    return sched, spec, trace


def test_the_speculative_run_verifies_with_rewinds() -> None:
    sched, spec, trace = _spec_setup()
    res = run_trace(spec, trace, sched, label="speculative")
    assert res.features["rewinds"] > 0 and res.features["rewound_tokens"] > 0


def test_rejected_drafts_left_in_history_fail_the_check(monkeypatch) -> None:
    # An engine (or manager) that moves history over the drafts and never rewinds it: the
    # rejected drafts' KV is then read as if it were the request's tokens.
    monkeypatch.setattr(EngineLoop, "REWIND_PHASES", ("forward",))
    sched, spec, trace = _spec_setup()
    with pytest.raises(FingerprintMismatch, match=WRONG_KV):
        run_trace(spec, trace, sched, label="speculative")


def _image_requests(digest_b: bytes) -> tuple[Request, Request]:
    rng = np.random.default_rng(11)
    head = rng.integers(0, 30000, 40).tolist()
    tail = rng.integers(0, 30000, 60).tolist()
    image_a = bytes(range(32))
    a = Request("a", head + [image_a] * 48 + tail, 40 + 48 + 60 - 4)
    b = Request("b", head + [digest_b] * 48 + tail, 40 + 48 + 60 - 4)
    return a, b


def _mm_manager() -> KVCacheManager:
    _, cfg, _ = _setup(4)
    return KVCacheManager(attrs.evolve(cfg, levels=cfg.levels[:1]))


def test_requests_with_different_images_share_only_the_blocks_before_them() -> None:
    a, b = _image_requests(bytes(range(1, 33)))
    with _mm_manager() as m:
        loop = EngineLoop(m, chunk_tokens=32, batch_ops=True)
        loop.run([a])
        loop.run([b])
        assert b.reused == 32  # the two full blocks of plain tokens before the image
        loop.close()


def test_a_manager_that_ignored_digests_would_fail_the_check() -> None:
    # A lookup that took image A's blocks for image B's (as a manager that keyed blocks
    # without their digests would): the fingerprint records of B's tokens differ.
    image_b = bytes(range(1, 33))
    a, b = _image_requests(image_b)
    with _mm_manager() as m:
        loop = EngineLoop(m, chunk_tokens=32, batch_ops=True)
        loop.run([a])
        create = m.create_kv_cache

        def digest_blind(scope: Any, tokens: Any = (), **kwargs: Any) -> Any:
            return create(scope, [a.tokens[i] if t == image_b else t
                                  for i, t in enumerate(tokens)], **kwargs)

        m.create_kv_cache = digest_blind  # type: ignore[method-assign]
        with pytest.raises(FingerprintMismatch, match=WRONG_KV):
            loop.run([b])
        assert b.reused > 32
        loop.close_all()


def test_a_one_group_model_takes_the_batch_resize_fast_path_and_verifies() -> None:
    # One full-attention group: Batch.resize grows the rows together, staging them in
    # place (docs/batch.md, "The decode step's fast path"), between moves and rewinds.
    sim = load_config(None, "hybrid")
    kvcm = {**sim.kvcm, "max_rewind_len": 4, "commit_min_snapshot": False,
            "layers": [{"layer_id": 0, "buffers": [{"role": "kv", "size": 256}]}],
            "levels": [{"tier": "gpu", "quota": "4MiB"}, {"tier": "host", "quota": "8MiB"}]}
    cfg = KVCacheManagerConfig.from_dict(kvcm)
    trace = generate_trace(attrs.evolve(sim.workload, requests=24), 1)
    ws = working_set(trace, cfg)
    quota = 2 * (ws["largest_request_blocks"] + 1) * ws["bytes_per_block"]
    cfg = attrs.evolve(cfg, levels=type(cfg.levels)([
        attrs.evolve(cfg.levels[0], quota=quota), cfg.levels[1]]))
    sched = attrs.evolve(sim.scheduler, rewind_every=2, rewind_draft=4)
    with KVCacheManager(cfg) as m:
        assert Batch(m, 1, 1)._one_group  # (the fast path's condition)
    patched: list[int] = []
    publish = Batch.publish

    def counting_publish(self: Batch, *args: Any, **kwargs: Any) -> int:
        patched.append(len(self._patched))
        return publish(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batch, "publish", counting_publish)
        res = run_trace(cfg, trace, sched)
    assert sum(patched) > 0  # rows staged in place by the fast path, then uploaded
    f = res.features
    assert f["batch_moves"] > 0 and f["rewinds"] > 0 and f["multimodal_requests"] > 0


def test_the_report_names_the_kernel_backend_the_run_selected(tmp_path) -> None:
    """``kernel_backend = "auto"`` (or KVCM_KERNEL_BACKEND) picks a backend at run time:
    the report says which, beside what the configuration asked for."""
    import json

    from kvcm_core.plugins import get_plugin_manager
    from kvcm_core.simulate import main

    out = tmp_path / "out"
    assert main(["--requests", "4", "--no-plots", "--quiet", "--out", str(out)]) == 0
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["kernel_backend"] == "auto"
    assert meta["kernel_backend_selected"] == \
        get_plugin_manager().select_kernel_backend("auto").name


def test_batch_ops_with_a_sparse_model_is_a_config_error_naming_it(tmp_path) -> None:
    """The engine's Batch.resize/move path is for dense models: asked of a sparse one,
    ``kvcm simulate`` says so before the run (exit 2), not as an internal error (exit 3)."""
    from kvcm_core.simulate import PRESETS, main

    assert "sparse" in PRESETS
    from importlib import resources

    text = resources.files("kvcm_core.simulate").joinpath("sparse.toml").read_text()
    cfg = tmp_path / "sparse-batch-ops.toml"
    cfg.write_text(text.replace("[simulate]\n", "[simulate]\nbatch_ops = true\n", 1))
    assert main(["--config", str(cfg), "--requests", "4", "--no-plots", "--quiet",
                 "--out", str(tmp_path / "out")]) == 2


def test_sparse_layers_with_speculative_rewinds_verify_against_the_exact_lru(tmp_path
                                                                             ) -> None:
    """A rewind resizes rows after the step's publish: the flush publishes them first, and
    that publish pins. The checker replays that pin, so the entry maps stay the exact
    LRU's (it pinned the drafted range and failed at step 19 although every entry held its
    unit's KV)."""
    from importlib import resources

    from kvcm_core.simulate import main

    text = resources.files("kvcm_core.simulate").joinpath("sparse.toml").read_text()
    text = text.replace("\n[simulate]\n", "\n[simulate]\nrewind_every = 2\nrewind_draft = 3\n", 1)
    text = text.replace("\n[kvcm]\n", "\n[kvcm]\nmax_rewind_len = 4\n", 1)
    cfg = tmp_path / "sparse-rewinds.toml"
    cfg.write_text(text)
    out = tmp_path / "out"
    assert main(["--config", str(cfg), "--requests", "30", "--no-plots", "--quiet",
                 "--no-compare", "--out", str(out)]) == 0
    import json

    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["ok"] and report["run"]["features"]["rewinds"] > 0
