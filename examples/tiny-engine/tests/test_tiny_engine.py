"""The tiny engine on NumPy (CPU): greedy generation through kvcm's pages gives the logits
and tokens of the same model recomputing every sequence without a cache, while the run
reuses prefixes, preempts, and brings pages back from the disk level."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from kvcm_tiny_engine import (
    EngineError,
    ModelConfig,
    NumpyOps,
    PagedKV,
    Request,
    TinyEngine,
    TinyModel,
    compare_with_reference,
    demo_levels,
    kvcm_config,
    make_manager,
    run_demo,
)
from kvcm_tiny_engine.demo import TOLERANCE, DemoRun

from kvcm_core import ConfigError, LevelConfig


@pytest.fixture(scope="module")
def demo() -> DemoRun:
    return run_demo()


def test_every_generated_token_matches_recomputation_without_a_cache(demo: DemoRun) -> None:
    cmp = compare_with_reference(TinyModel(demo.model.config), demo.requests)
    assert cmp.steps == sum(r.max_new_tokens for r in demo.requests)
    assert cmp.worst_error <= TOLERANCE, cmp
    assert cmp.token_mismatches == [], cmp
    assert cmp.decided >= 0.9 * cmp.steps  # the token check is not vacuous
    print(f"\n{cmp.steps} tokens: worst logit error {cmp.worst_error:.2e} of scale, "
          f"{cmp.decided} decided, {cmp.close_calls} near-ties")


def test_the_run_reuses_prefixes_preempts_and_brings_pages_back_from_disk(
        demo: DemoRun) -> None:
    st = demo.stats
    print(f"\n{st.summary()}")
    assert st.reused_prompt_tokens > 0
    assert st.preemptions > 0 and st.resumes == st.preemptions
    assert st.onboarded_by_level.get(2, 0) > 0  # level 2 is the disk
    assert all(r.finished and len(r.output) == r.max_new_tokens for r in demo.requests)
    # Only what was not reused was computed: the prompts' rest plus one token per output
    # token but the last.
    assert st.computed_tokens == st.prompt_tokens - st.reused_prompt_tokens + sum(
        r.max_new_tokens - 1 for r in demo.requests)
    second_turns = [r for r in demo.requests if r.id.endswith("turn2")]
    first = {r.id: r for r in demo.requests}
    for r in second_turns:  # a second turn reuses at least its whole first prompt
        assert r.reused_tokens >= len(first[r.id.replace("turn2", "turn1")].prompt)


def test_sequences_outgrow_the_window_so_window_layers_matter(demo: DemoRun) -> None:
    config = demo.model.config
    longest = max(demo.requests, key=lambda r: len(r.tokens))
    assert len(longest.tokens) > config.window + 2 * 8  # window plus two blocks
    model = TinyModel(config)
    full = TinyModel(ModelConfig(window_layers=()))
    tokens = np.asarray(longest.tokens)
    assert not np.allclose(model.reference_logits(tokens), full.reference_logits(tokens),
                           rtol=0, atol=1e-3)


def test_page_views_are_kvcm_pages_without_a_copy() -> None:
    config = ModelConfig()
    manager, _ = make_manager(kvcm_config(config, levels=demo_levels()))
    try:
        kv = PagedKV(manager, config, NumpyOps())
        region = manager.get_page_region(2, "value")
        rng = np.random.default_rng(0)
        page = rng.standard_normal(kv.pages[2][1].shape[1:]).astype(np.float32)
        kv.pages[2][1][5] = page  # slot 5 of layer 2's values
        raw = manager.backend.read(region.buffer, region.page_start(5), page.nbytes)
        assert np.array_equal(raw.view(np.float32).reshape(page.shape), page)
    finally:
        manager.shutdown()


def test_a_corrupted_page_changes_what_the_engine_computes() -> None:
    """The engine reads K/V from kvcm's pages: spoil one committed page between steps and
    the next logits leave the reference."""
    config = ModelConfig()
    model = TinyModel(config)
    manager, moves = make_manager(kvcm_config(config, levels=demo_levels()))
    engine = TinyEngine(model, manager, moves)
    req = Request("r", "The quick brown fox jumps over the lazy dog. " * 2, max_new_tokens=3)
    engine.submit(req)
    while not req.output:
        engine.step()
    slot = int(req.cache.get_base_page_indices(manager.get_layer_group_id(0))[0])
    engine.kv.pages[0][0][slot] += 1.0  # layer 0 (full attention), keys of block 0
    engine.run()
    manager.shutdown()
    want = model.reference_logits(np.asarray(req.prompt + req.output[:1]))
    assert np.abs(req.logits[1] - want).max() > 100 * TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize(("field", "kwargs"), [
    ("ModelConfig.num_kv_heads", {"num_heads": 4, "num_kv_heads": 3}),
    ("ModelConfig.head_dim", {"head_dim": 15}),
    ("ModelConfig.window_layers", {"window_layers": (1, 7)}),
    ("ModelConfig.sink_tokens", {"window": 8, "sink_tokens": 8}),
    ("ModelConfig.num_layers", {"num_layers": 0}),
    ("ModelConfig.hidden", {"hidden": 64.0}),
])
def test_a_bad_model_config_names_field_value_and_rule(field: str, kwargs: dict) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)
    assert err.value.field == field
    assert repr(err.value.value) in str(err.value) and err.value.rule


@pytest.mark.parametrize("field", ["chunk_tokens", "max_batch", "token_budget"])
def test_a_bad_engine_setting_names_field_value_and_rule(field: str) -> None:
    config = ModelConfig()
    manager, _ = make_manager(kvcm_config(config, levels=demo_levels()))
    try:
        with pytest.raises(ConfigError, match=rf"TinyEngine\.{field}=0: must be an int >= 1"):
            TinyEngine(TinyModel(config), manager, **{field: 0})
    finally:
        manager.shutdown()


def test_a_manager_built_for_another_model_is_refused_naming_the_buffer() -> None:
    manager, _ = make_manager(kvcm_config(ModelConfig(head_dim=8), levels=demo_levels()))
    try:
        with pytest.raises(ConfigError, match=r"layers\[0\]\.buffers\[key\]\.size=512: "
                                              r"must be 1024 bytes"):
            PagedKV(manager, ModelConfig(head_dim=16), NumpyOps())
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("prompt", "match"), [
    ([1, 2, 300], r"Request\.prompt: token ids must be ints in 0\.\.255.*\[300\]"),
    ("", r"Request\.prompt: must hold at least one token"),
])
def test_a_bad_prompt_is_refused_naming_the_rule(prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Request("bad", prompt)


def test_a_request_larger_than_the_gpu_level_stops_the_engine_naming_it() -> None:
    config = ModelConfig()
    levels = [LevelConfig(tier="gpu", quota="64KiB"), LevelConfig(tier="host", quota="1MiB")]
    manager, moves = make_manager(kvcm_config(config, levels=levels))
    engine = TinyEngine(TinyModel(config), manager, moves)
    try:
        with pytest.raises(EngineError, match="request huge needs"):
            engine.run([Request("huge", "x" * 400, max_new_tokens=2)])
    finally:
        engine.close()
        manager.shutdown()


class _FakeTorchDevice:
    def __init__(self, spec: str, index: int | None = None) -> None:
        kind, _, idx = spec.partition(":")
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"Expected one of cpu, cuda device type: {spec}")
        self.type, self.index = kind, int(idx) if idx else index


def _torch_without_cuda() -> types.ModuleType:
    """A stand-in for a CPU build of torch: ``torch.cuda.current_device()`` fails the way
    the real one does (``AssertionError: Torch not compiled with CUDA enabled``)."""
    def current_device() -> int:
        raise AssertionError("Torch not compiled with CUDA enabled")

    torch = types.ModuleType("torch")
    torch.device = _FakeTorchDevice  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: False, current_device=current_device)
    return torch


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "tpu"])
def test_main_with_a_torch_device_it_cannot_use_exits_2_with_one_line(
        device: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m kvcm_tiny_engine --torch cuda`` where torch has no CUDA (or a device
    torch does not know) could not start: exit 2 and one line, not a traceback (exit 1
    means a check failed)."""
    from kvcm_tiny_engine.__main__ import main

    monkeypatch.setitem(sys.modules, "torch", _torch_without_cuda())
    assert main(["--torch", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kvcm_tiny_engine: ConfigError: TorchOps.device=")
    assert ("CUDA is not available to torch" if device != "tpu" else "not a torch device") \
        in err[0]


def _small_gpu_engine(levels: list[LevelConfig], **kw: int) -> TinyEngine:
    """An engine over a 32-slot GPU level (128 KiB of 4 KiB slots, 8-token blocks)."""
    config = ModelConfig()
    manager, moves = make_manager(kvcm_config(config, tokens_per_block=8, levels=levels,
                                              max_util_for_resume=0.9))
    return TinyEngine(TinyModel(config), manager, moves, **kw)


def _check_and_close(engine: TinyEngine, requests: list[Request]) -> None:
    """Every request finished with the logits of recomputation; nothing leaked."""
    manager = engine.manager
    assert all(r.finished for r in requests)
    cmp = compare_with_reference(TinyModel(engine.model.config), requests)
    assert cmp.worst_error <= TOLERANCE and cmp.token_mismatches == [], cmp
    manager.check_invariants()
    engine.close()
    manager.clear_reusable_blocks()
    for level in range(len(manager.levels)):
        st = manager.get_storage_statistics(level)
        assert st.free == st.total, (level, st)
    manager.shutdown()


def test_a_prefix_match_over_max_util_for_resume_with_nothing_else_running_is_cut_to_fit(
        ) -> None:
    """A second turn whose cached prefix alone would lock more of the GPU level than
    max_util_for_resume: its resume is refused at every retry, and with nothing else
    running nothing will change that. The engine matches less of it and computes the
    rest (it stopped with 'no request could run')."""
    levels = [LevelConfig(tier="gpu", quota="128KiB"), LevelConfig(tier="host", quota="1MiB")]
    engine = _small_gpu_engine(levels, chunk_tokens=8, max_batch=2, token_budget=16)
    first = Request("turn1", "x" * 180, max_new_tokens=2)
    engine.run([first])
    probe = engine.manager.create_kv_cache(None, list(b"x" * 180))
    assert not probe.resume() and "max_util_for_resume" in probe.last_refusal
    probe.close()
    second = Request("turn2", "x" * 180 + "y", max_new_tokens=2)
    engine.run([second])
    assert engine.stats.shortened_matches == 1
    assert 0 < second.reused_tokens < 180
    _check_and_close(engine, [first, second])


def test_a_suspended_request_grown_past_max_util_for_resume_is_recomputed_not_stuck(
        ) -> None:
    """B grows (resize has no utilisation cap) to 29 of 32 GPU slots, is suspended for
    the older A, and once A is done cannot resume: 29 slots are over max_util_for_resume
    (28), at every retry. The engine closes it and queues it again, matched again (cut to
    fit) and computed (it stopped with 'no request could run')."""
    levels = [LevelConfig(tier="gpu", quota="128KiB"), LevelConfig(tier="host", quota="1MiB")]
    engine = _small_gpu_engine(levels, chunk_tokens=16, max_batch=2, token_budget=32)
    reqs = [Request("A", "abcdefgh", max_new_tokens=40, arrival_step=10),
            Request("B", "q" * 174, max_new_tokens=3)]
    engine.run(reqs)
    assert reqs[1].preemptions == 1 and reqs[1].recomputes == 1
    assert engine.stats.recomputes == 1 and engine.stats.shortened_matches == 1
    _check_and_close(engine, reqs)


def test_with_the_gpu_level_alone_preemption_closes_and_recomputes_instead_of_suspending(
        ) -> None:
    """With no level below the GPU, a suspended cache's pages can go nowhere, so
    suspending frees nothing: two requests that each fit alone stopped the engine ('cannot
    provide them even with every other request suspended'). The engine preempts by closing
    the cache and queueing the request again; both finish with the right logits."""
    engine = _small_gpu_engine([LevelConfig(tier="gpu", quota="128KiB")], chunk_tokens=16,
                               max_batch=2, token_budget=32)
    reqs = [Request("A", "a" * 150, max_new_tokens=4), Request("B", "b" * 150, max_new_tokens=4)]
    engine.run(reqs)
    st = engine.stats
    assert st.preemptions == st.recomputes > 0 and st.resumes == 0
    assert st.kept_at_preemption == 0 and st.dropped_at_recompute > 0
    _check_and_close(engine, reqs)


def test_a_request_larger_than_a_gpu_only_level_stops_the_engine_with_the_refusal() -> None:
    engine = _small_gpu_engine([LevelConfig(tier="gpu", quota="64KiB")])
    try:
        with pytest.raises(EngineError, match=r"request huge needs \d+ tokens.* every other "
                                              r"request preempted: resize: level 0 pool "
                                              r"group 0 cannot provide"):
            engine.run([Request("huge", "x" * 400, max_new_tokens=2)])
    finally:
        engine.close()
        engine.manager.shutdown()


def test_a_refused_admission_keeps_its_cache_and_retries_resume_instead_of_recreating_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/semantics.md ("Waiting for room, cheaply"): with a level below the GPU, a
    scheduler keeps the cache of the request at the head of its queue while its resume is
    refused and retries ``resume`` only, instead of creating (matching) and closing a
    cache every step. It gives the kept cache back only when a running request cannot
    grow (its held pages may be the ones needed). In the demo (GPU, host and disk) a
    request's cache is created once plus once per such release, though admissions are
    refused at many steps (each one created a cache and closed it)."""
    from kvcm_core import KVCacheManager

    created: dict[str, int] = {}
    released: dict[str, int] = {}
    kept_waits = 0
    create = KVCacheManager.create_kv_cache
    step = TinyEngine.step
    release = getattr(TinyEngine, "_release_kept", None)

    def counting_release(self: TinyEngine) -> bool:
        head = self.waiting[0].id if self.waiting else None
        done = release is not None and release(self)
        if done:
            released[str(head)] = released.get(str(head), 0) + 1
        return done

    def counting_create(self: KVCacheManager, *args: object, **kw: object) -> object:
        created[str(kw["id"])] = created.get(str(kw["id"]), 0) + 1
        return create(self, *args, **kw)

    def watching_step(self: TinyEngine) -> int:
        nonlocal kept_waits
        done = step(self)
        kept_waits += bool(self.waiting and self.waiting[0].cache is not None)
        return done

    monkeypatch.setattr(KVCacheManager, "create_kv_cache", counting_create)
    monkeypatch.setattr(TinyEngine, "step", watching_step)
    monkeypatch.setattr(TinyEngine, "_release_kept", counting_release, raising=False)
    run = run_demo()
    print(f"\n{kept_waits} steps ended with a kept cache waiting; {sum(created.values())} "
          f"caches created for {len(run.requests)} requests; released {released}")
    assert kept_waits > 20  # refused admissions waited with their cache
    assert sum(released.values()) < kept_waits / 2
    assert run.stats.recomputes == 0 and run.stats.shortened_matches == 0
    assert created == {r.id: 1 + released.get(r.id, 0) for r in run.requests}


def test_when_colder_levels_cannot_take_suspended_pages_the_youngest_is_recomputed() -> None:
    """The same deadlock as with the GPU level alone, with a host level too small for the
    suspended request's pages: they stay held on the GPU ('no colder level can take the
    held pages'), and the older request could not grow although each fits alone. The
    engine closes the youngest of the suspended requests and the one that cannot grow,
    and queues it again; both finish with the right logits."""
    levels = [LevelConfig(tier="gpu", quota="128KiB"), LevelConfig(tier="host", quota="16KiB")]
    engine = _small_gpu_engine(levels, chunk_tokens=16, max_batch=2, token_budget=32)
    reqs = [Request("A", "a" * 150, max_new_tokens=4), Request("B", "b" * 100, max_new_tokens=4)]
    engine.run(reqs)
    assert reqs[0].recomputes == 0 and reqs[1].recomputes == 1
    assert engine.stats.preemptions >= 1 and engine.stats.recomputes == 1
    _check_and_close(engine, reqs)
