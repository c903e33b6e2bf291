"""Lossy page codecs on cold levels, under the fingerprint engine: typed (``bf16``) buffers
come back within the codec's bound, ``exact`` ones bit for bit; a codec per cold level, with
moves between levels of different codecs transcoding; buffer metadata in the config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TEST_BACKEND, TPB, Driver, tokens

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    SsmLayerConfig,
)
from kvcm_core.backend import CopyTask, copy_pairs
from kvcm_core.errors import ConfigError
from kvcm_core.testing.fingerprint import FingerprintEngine, FingerprintMismatch, StepWork

#: 16 bf16 values per token slot: the page of one block.
TYPED_PAGE = 32 * TPB


def typed_layers() -> list[Any]:
    """Two attention layers: bf16 K and V (lossy-encodable) and an exact bf16 scale."""
    return [AttentionLayerConfig(layer_id=i, buffers=[
        BufferConfig(role="k", size=TYPED_PAGE, dtype="bf16", group_size=32),
        BufferConfig(role="v", size=TYPED_PAGE, dtype="bf16", group_size=32),
        BufferConfig(role="scale", size=TYPED_PAGE, dtype="bf16", exact=True)])
        for i in range(2)]


def manager(levels: list[LevelConfig], layers: list[Any] | None = None) -> KVCacheManager:
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers or typed_layers(), levels=levels,
        kernel_backend=TEST_BACKEND))


#: Bytes of one block over every buffer of :func:`typed_layers`.
BLOCK = 6 * TYPED_PAGE


def gpu_level(blocks: int = 10) -> LevelConfig:
    return LevelConfig(tier="gpu", quota=blocks * BLOCK + TYPED_PAGE)


def churn(m: KVCacheManager, rounds: int = 3) -> Driver:
    """Requests sharing prefixes, more than the GPU holds: pages go down and come back."""
    d = Driver(m)
    prompts = [tokens(24, seed=s) for s in range(4)]
    for _ in range(rounds):
        for p in prompts:
            d.run(p + tokens(3, seed=len(p)))
    return d


def onboarded(m: KVCacheManager) -> int:
    return sum(g.onboard_blocks for g in m.storage_levels.stats.groups)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_lossy_host_level_brings_typed_pages_back_within_the_bound(codec: str) -> None:
    m = manager([gpu_level(), LevelConfig(tier="host", quota=1 << 20, codec=codec)])
    try:
        d = churn(m)
        assert onboarded(m) > 0, "nothing came back from the host level"
        assert d.engine.typed_tolerance == pytest.approx(8 * m.codecs[1].error_bound)
    finally:
        m.shutdown()


def test_raw_host_and_fp8_disk_levels_transcode_between_them(tmp_path: Path) -> None:
    m = manager([gpu_level(), LevelConfig(tier="host", quota=8 * BLOCK),
                 LevelConfig(tier="disk", quota=1 << 20, codec="fp8",
                             options={"path": str(tmp_path)})])
    try:
        levels = m.storage_levels
        sizes = {levels.cold_bytes(0, 1), levels.cold_bytes(0, 2)}
        assert levels.cold_bytes(0, 2) < levels.cold_bytes(0, 1), sizes
        churn(m, rounds=4)
        assert levels.statistics(2).total > levels.statistics(2).free, "disk level unused"
        assert onboarded(m) > 0
    finally:
        m.shutdown()


def test_fp8_host_and_int8_disk_levels_keep_pages_within_the_looser_bound(
        tmp_path: Path) -> None:
    m = manager([gpu_level(), LevelConfig(tier="host", quota=8 * BLOCK, codec="fp8"),
                 LevelConfig(tier="disk", quota=1 << 20, codec="int8",
                             options={"path": str(tmp_path)})])
    try:
        churn(m, rounds=4)
        assert onboarded(m) > 0
    finally:
        m.shutdown()


def test_a_wrong_block_in_a_typed_page_is_detected_beyond_the_lossy_tolerance() -> None:
    m = manager([gpu_level(16), LevelConfig(tier="host", quota=1 << 20, codec="int4")])
    try:
        d = Driver(m)
        toks = tokens(16, seed=3)
        cache = d.create(toks)
        d.run_to(cache, 12)
        region = m.get_page_region(0, "k")
        table = cache.get_base_page_indices(m.get_buffer_group_id(0, "k"))
        # Block 1's K page now holds block 0's values: another block's data.
        m.backend.copy_pages_batch([CopyTask(region, region, TYPED_PAGE,
                                             copy_pairs(table[1:2], table[0:1]))])
        with pytest.raises(FingerprintMismatch, match="typed page"):
            d.engine.check([StepWork(cache, toks)])
        cache.close()
    finally:
        m.shutdown()


def test_typed_pages_without_a_lossy_level_are_checked_exactly() -> None:
    m = manager([gpu_level(16)])
    try:
        engine = FingerprintEngine(m)
        assert engine.typed_tolerance == 0.0
        Driver(m).run(tokens(20, seed=1))
    finally:
        m.shutdown()


def test_cold_groups_key_each_cold_levels_page_size_when_codecs_differ(
        tmp_path: Path) -> None:
    m = manager([gpu_level(), LevelConfig(tier="host", quota=1 << 20, codec="fp8"),
                 LevelConfig(tier="disk", quota=1 << 20, options={"path": str(tmp_path)})])
    try:
        key = m.storage_levels.cold_key_of[0]
        # (policy, size on level 1, size on level 2, the layout transcodes use)
        assert len(key) == 4 and key[1] < key[2] == BLOCK
        assert key[3] == m.storage_levels.layouts[0]
        assert m.codecs[1] is not m.codecs[2] and m.codecs[0] is None
        assert [s and (s.name, s.capabilities.codec_id) for s in m.codec_specs] == [
            None, ("fp8", 1), ("raw", 0)]
    finally:
        m.shutdown()


def test_levels_naming_one_codec_share_one_instance(tmp_path: Path) -> None:
    m = manager([gpu_level(), LevelConfig(tier="host", quota=1 << 20, codec="fp8"),
                 LevelConfig(tier="disk", quota=1 << 20, codec="fp8",
                             options={"path": str(tmp_path)})])
    try:
        assert m.codecs[1] is m.codecs[2]
        assert len(m.storage_levels.cold_key_of[0]) == 2
    finally:
        m.shutdown()


# -- buffer metadata ----------------------------------------------------------------------


def test_buffer_exact_defaults_follow_dtype_and_layer_kind() -> None:
    att = AttentionLayerConfig(layer_id=0, buffers=[
        BufferConfig(role="k", size=64, dtype="bf16"), BufferConfig(role="raw", size=64),
        BufferConfig(role="v", size=64, dtype="fp16", exact=True)])
    ssm = SsmLayerConfig(layer_id=1, buffers=[
        BufferConfig(role="state", size=64, dtype="fp32"),
        BufferConfig(role="conv", size=64, dtype="bf16", exact=False)])
    assert [att.effective_exact(b) for b in att.buffers] == [False, True, True]
    assert [ssm.effective_exact(b) for b in ssm.buffers] == [True, False]


@pytest.mark.parametrize(("fields", "field", "rule"), [
    ({"dtype": "bfloat16"}, "dtype", "must be one of"),
    ({"dtype": "fp32", "size": 6}, "size", "whole number of fp32 elements"),
    ({"group_size": 0}, "group_size", ">= 1"),
    ({"exact": "yes"}, "exact", "true or false"),
])
def test_bad_buffer_metadata_raises_config_error_naming_field_and_rule(
        fields: dict[str, Any], field: str, rule: str) -> None:
    data = {
        "tokens_per_block": 4,
        "layers": [{"layer_id": 0, "buffers": [{"role": "k", "size": 64, **fields}]}],
        "levels": [{"tier": "gpu", "quota": "1MiB"}],
    }
    with pytest.raises(ConfigError, match=rule) as err:
        KVCacheManagerConfig.from_dict(data)
    assert field in err.value.field


def test_buffer_metadata_reaches_the_layout_a_codec_sees() -> None:
    m = manager([gpu_level()])
    try:
        places = {(p.layer_id, p.role): p for pg in m.layout.pool_groups
                  for p in pg.page_layout().buffers}
        assert (places[(0, "k")].dtype, places[(0, "k")].group_size,
                places[(0, "k")].exact) == ("bf16", 32, False)
        assert places[(1, "scale")].exact
    finally:
        m.shutdown()


def test_buffer_metadata_round_trips_through_toml_text(tmp_path: Path) -> None:
    text = """
tokens_per_block = 4
[[layers]]
layer_id = 0
buffers = [{role = "k", size = 128, dtype = "bf16", group_size = 64, exact = false}]
[[levels]]
tier = "gpu"
quota = "1MiB"
[[levels]]
tier = "host"
quota = "1MiB"
codec = "fp8"
"""
    path = tmp_path / "kvcm.toml"
    path.write_text(text)
    cfg = KVCacheManagerConfig.from_toml(path)
    buf = cfg.layers[0].buffers[0]
    assert (buf.dtype, buf.group_size, buf.exact) == ("bf16", 64, False)
    assert KVCacheManagerConfig.from_dict(cfg.to_dict()) == cfg
    assert np.isclose(cfg.levels[1].quota, 1 << 20)


# -- kvcm simulate with lossy cold levels ---------------------------------------------------

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "codecs"


def simulate_hit_rate(config: str, tmp_path: Path) -> float:
    from kvcm_core.simulate import main as simulate

    out = tmp_path / config
    assert simulate(["--config", str(CONFIGS / config), "--quiet", "--no-compare",
                     "--requests", "60", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["ok"]
    return float(report["run"]["hit_rate"]["overall"])


def test_simulate_with_an_fp8_host_level_beats_raw_at_equal_quota(tmp_path: Path) -> None:
    """The host level alone below the GPU, the same quota: fp8 pages are about half the
    size, so the host level keeps more blocks and more prefixes hit."""
    raw = simulate_hit_rate("simulate-raw-host.toml", tmp_path)
    fp8 = simulate_hit_rate("simulate-fp8-host.toml", tmp_path)
    assert fp8 > raw


def test_simulate_with_fp8_host_and_disk_levels_exits_zero(tmp_path: Path) -> None:
    assert 0.0 < simulate_hit_rate("simulate-fp8.toml", tmp_path) <= 1.0


@pytest.mark.parametrize(("disk", "host"), [("fp8", None), ("int8", "fp8")])
def test_groups_of_different_layouts_with_equal_cold_sizes_transcode_with_their_own_layout(
        tmp_path: Path, disk: str, host: str | None) -> None:
    """Two pool groups whose cold pages have the same sizes on every level but different
    layouts (buffers, scale groups): a move between differently coded cold levels must
    transcode each page with its own group's layout, so they never share a cold store."""
    layers = [
        AttentionLayerConfig(layer_id=0, buffers=[
            BufferConfig(role="k", size=256, dtype="bf16"),
            BufferConfig(role="v", size=128, dtype="bf16")]),
        AttentionLayerConfig(layer_id=1, buffers=[
            BufferConfig(role="k", size=384, dtype="bf16", group_size=272)],
            sliding_window_size=64),
    ]
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers, kernel_backend=TEST_BACKEND,
        max_util_for_resume=1.0,
        levels=[LevelConfig(tier="gpu", quota=8 * 768),
                LevelConfig(tier="host", quota=6 * 768, codec=host),
                LevelConfig(tier="disk", quota=1 << 20, codec=disk,
                            options={"path": str(tmp_path)})]))
    try:
        levels = m.storage_levels
        assert len(levels.stores[2]) == 2                # one cold store per layout
        d = Driver(m)
        prompts = [tokens(12, seed=s) for s in range(6)]
        for rnd in range(4):                             # fingerprint-checked every step
            for p in prompts:
                d.run(p + tokens(3, seed=len(p) + rnd))
        assert levels.statistics(2).total > levels.statistics(2).free, "disk level unused"
        assert onboarded(m) > 0
    finally:
        m.shutdown()
