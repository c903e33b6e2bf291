"""Configuration: every pre-run rule of concepts.md and sparse.md refuses a bad value with a
ConfigError naming the field, the value and the rule; the three ways of building a config
agree; sizes are read the way people write them; to_dict round-trips."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    ConfigError,
    KVCacheManagerConfig,
    LevelConfig,
    ReusePolicy,
    SparseConfig,
    SsmLayerConfig,
    SwaScratchConfig,
)
from kvcm_core.units import format_size, parse_size

# A valid document: full attention, windowed attention with sinks, an SSM layer; three levels.
BASE: dict[str, Any] = {
    "tokens_per_block": 16,
    "layers": [
        {
            "layer_id": 0,
            "buffers": [{"role": "key", "size": "4KiB"}, {"role": "value", "size": 4096}],
        },
        {
            "layer_id": 1,
            "sliding_window_size": 128,
            "num_sink_tokens": 4,
            "buffers": [{"role": "key", "size": 4096}, {"role": "value", "size": 4096}],
        },
        {"type": "ssm", "layer_id": 2, "buffers": [{"role": "ssm_state", "size": 65536}]},
    ],
    "levels": [
        {"tier": "gpu", "quota": "1GiB"},
        {"tier": "host", "quota": "4GiB", "codec": "raw"},
        {"tier": "disk", "quota": "1TiB", "options": {"path": "/var/cache/kvcm"}},
    ],
}

SPARSE_LAYER: dict[str, Any] = {
    "layer_id": 0,
    "sparse": {"unit_tokens": 4, "num_selected": 8, "working_set_units": 16},
    "buffers": [
        {"role": "key", "size": 4096, "is_sparse": True},
        {"role": "value", "size": 4096, "is_sparse": True},
        {"role": "index_key", "size": 512},
    ],
}


def sparse_doc(*layers: dict[str, Any], quota: Any = "2GiB") -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["layers"] = [copy.deepcopy(x) for x in layers]
    if quota is not None:
        doc["sparse_host_quota"] = quota
    return doc


def shared(layer_id: int, selection: Any = "s0", **sparse: Any) -> dict[str, Any]:
    layer = copy.deepcopy(SPARSE_LAYER)
    layer["layer_id"] = layer_id
    layer["sparse"] = {**layer["sparse"], "selection_id": selection, **sparse}
    return layer


def edit(fn: Callable[[dict[str, Any]], Any]) -> Callable[[], dict[str, Any]]:
    """A document made by applying ``fn`` to a copy of BASE."""

    def make() -> dict[str, Any]:
        doc = copy.deepcopy(BASE)
        fn(doc)
        return doc

    return make


def const(doc: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    return lambda: copy.deepcopy(doc)


def layer0(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["layers"][0].update(changes)


def buffer(layer: int, index: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["layers"][layer]["buffers"][index].update(changes)


def level(index: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["levels"][index].update(changes)


def top(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.update(changes)


def drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.pop(key)


# (id, document, field named, offending value, words of the rule)
INVALID: list[tuple[str, Callable[[], Any], str, Any, str]] = [
    (
        "tpb_not_power_of_two",
        edit(top(tokens_per_block=24)),
        "tokens_per_block",
        24,
        "power of two",
    ),
    ("tpb_zero", edit(top(tokens_per_block=0)), "tokens_per_block", 0, ">= 1"),
    ("tpb_string", edit(top(tokens_per_block="16")), "tokens_per_block", "16", "must be an int"),
    ("tpb_too_large", edit(top(tokens_per_block=1 << 17)), "tokens_per_block", 1 << 17, "<= 65536"),
    ("unknown_top_level_key", edit(top(tokens_per_blok=16)), "tokens_per_blok", 16, "unknown key"),
    ("levels_missing", edit(drop("levels")), "levels", None, "required"),
    ("layers_empty", edit(top(layers=[])), "layers", (), "non-empty"),
    (
        "layer_ids_repeated",
        edit(lambda d: d["layers"][1].update(layer_id=0)),
        "layers[1].layer_id",
        0,
        "unique",
    ),
    ("layer_id_negative", edit(layer0(layer_id=-1)), "layers[0].layer_id", -1, ">= 0"),
    (
        "layer_type_unknown",
        edit(layer0(type="mlp")),
        "layers[0].type",
        "mlp",
        "'attention' or 'ssm'",
    ),
    ("layer_key_unknown", edit(layer0(window=128)), "layers[0].window", 128, "unknown key"),
    ("buffers_empty", edit(layer0(buffers=[])), "layers[0].buffers", (), "non-empty"),
    (
        "buffer_roles_repeated",
        edit(buffer(0, 1, role="key")),
        "layers[0].buffers[1].role",
        "key",
        "unique in a layer",
    ),
    (
        "buffer_role_empty",
        edit(buffer(0, 0, role="")),
        "layers[0].buffers[0].role",
        "",
        "non-empty string",
    ),
    (
        "buffer_size_negative",
        edit(buffer(0, 0, size=-1)),
        "layers[0].buffers[0].size",
        -1,
        ">= 0 bytes",
    ),
    (
        "buffer_size_not_a_size",
        edit(buffer(0, 0, size="lots")),
        "layers[0].buffers[0].size",
        "lots",
        "byte count",
    ),
    (
        "buffer_policy_unknown",
        edit(buffer(0, 0, reuse_policy="sometimes")),
        "layers[0].buffers[0].reuse_policy",
        "sometimes",
        "ReusePolicy",
    ),
    (
        "buffer_is_sparse_not_bool",
        edit(buffer(0, 0, is_sparse="no")),
        "layers[0].buffers[0].is_sparse",
        "no",
        "true or false",
    ),
    (
        "sinks_without_window",
        edit(layer0(num_sink_tokens=4)),
        "layers[0].num_sink_tokens",
        4,
        "need a sliding window",
    ),
    (
        "window_zero",
        edit(lambda d: d["layers"][1].update(sliding_window_size=0)),
        "layers[1].sliding_window_size",
        0,
        ">= 1",
    ),
    (
        "sink_required_only_on_full_attention",
        edit(buffer(0, 0, reuse_policy="sink_required_only")),
        "layers[0].buffers[0].reuse_policy",
        ReusePolicy.SINK_REQUIRED_ONLY,
        "needs a sliding window with sink tokens",
    ),
    (
        "sink_required_only_on_window_without_sinks",
        edit(lambda d: d["layers"][1].update(num_sink_tokens=0, reuse_policy="sink_required_only")),
        "layers[1].buffers[0].reuse_policy",
        ReusePolicy.SINK_REQUIRED_ONLY,
        "needs a sliding window with sink tokens",
    ),
    (
        "ssm_layer_sink_required_only",
        edit(lambda d: d["layers"][2].update(reuse_policy="sink_required_only")),
        "layers[2].reuse_policy",
        ReusePolicy.SINK_REQUIRED_ONLY,
        "SSM layers cannot use it",
    ),
    (
        "ssm_buffer_sink_required_only",
        edit(buffer(2, 0, reuse_policy="sink_required_only")),
        "layers[2].buffers[0].reuse_policy",
        ReusePolicy.SINK_REQUIRED_ONLY,
        "SSM buffers cannot use it",
    ),
    (
        "ssm_buffer_sparse",
        edit(buffer(2, 0, is_sparse=True)),
        "layers[2].buffers[0].is_sparse",
        True,
        "SSM buffers cannot be sparse",
    ),
    (
        "ssm_layer_with_window",
        edit(lambda d: d["layers"][2].update(sliding_window_size=64)),
        "layers[2].sliding_window_size",
        64,
        "unknown key",
    ),
    (
        "sparse_buffer_without_sparse_config",
        edit(buffer(0, 0, is_sparse=True)),
        "layers[0].buffers[0].is_sparse",
        True,
        "sparse=SparseConfig",
    ),
    (
        "sparse_layer_without_sparse_buffer",
        const(sparse_doc({**SPARSE_LAYER, "buffers": [{"role": "key", "size": 64}]})),
        "layers[0].sparse",
        SparseConfig(unit_tokens=4, num_selected=8, working_set_units=16),
        "at least one sparse buffer",
    ),
    (
        "working_set_smaller_than_selection",
        const(sparse_doc(shared(0, None, num_selected=8, working_set_units=4))),
        "layers[0].sparse.working_set_units",
        4,
        ">= num_selected (8)",
    ),
    (
        "unit_tokens_not_power_of_two",
        const(sparse_doc(shared(0, None, unit_tokens=3))),
        "layers[0].sparse.unit_tokens",
        3,
        "power of two",
    ),
    (
        "unit_tokens_not_dividing_block",
        const(sparse_doc(shared(0, None, unit_tokens=32))),
        "layers[0].sparse.unit_tokens",
        32,
        "divide tokens_per_block (16)",
    ),
    (
        "sparse_buffer_size_not_whole_units",
        const(
            sparse_doc(
                {**SPARSE_LAYER, "buffers": [{"role": "key", "size": 4098, "is_sparse": True}]}
            )
        ),
        "layers[0].buffers[0].size",
        4098,
        "multiple of units per page",
    ),
    (
        "sparse_without_host_quota",
        const(sparse_doc(SPARSE_LAYER, quota=None)),
        "sparse_host_quota",
        None,
        "host quota",
    ),
    (
        "sparse_host_quota_zero",
        const(sparse_doc(SPARSE_LAYER, quota="0")),
        "sparse_host_quota",
        0,
        ">= 1 bytes",
    ),
    (
        "selection_id_bool",
        const(sparse_doc(shared(0, True))),
        "layers[0].sparse.selection_id",
        True,
        "non-empty string, an int",
    ),
    (
        "shared_selection_disagrees_on_units",
        const(sparse_doc(shared(0), shared(1, num_selected=4))),
        "layers[1].sparse.selection_id",
        "s0",
        "must agree with layers[0]",
    ),
    (
        "shared_selection_in_two_life_cycles",
        const(sparse_doc(shared(0), {**shared(1), "sliding_window_size": 256})),
        "layers[1].sparse.selection_id",
        "s0",
        "one life cycle",
    ),
    (
        "sparse_buffers_of_a_layer_in_two_life_cycles",
        const(
            sparse_doc(
                {
                    **SPARSE_LAYER,
                    "buffers": [
                        {"role": "key", "size": 4096, "is_sparse": True},
                        {
                            "role": "value",
                            "size": 4096,
                            "is_sparse": True,
                            "reuse_policy": "private",
                        },
                    ],
                }
            )
        ),
        "layers[0].buffers[1].reuse_policy",
        ReusePolicy.PRIVATE,
        "one life cycle",
    ),
    ("levels_empty", edit(top(levels=[])), "levels", (), "non-empty"),
    (
        "codec_on_level_zero",
        edit(level(0, codec="raw")),
        "levels[0].codec",
        "raw",
        "level 0 holds GPU pages",
    ),
    ("quota_zero", edit(level(1, quota=0)), "levels[1].quota", 0, ">= 1 bytes"),
    (
        "quota_unit_unknown",
        edit(level(1, quota="8 GiBs")),
        "levels[1].quota",
        "8 GiBs",
        "size such as '8GiB'",
    ),
    (
        "quota_fraction_of_a_byte",
        edit(level(1, quota="1.5 B")),
        "levels[1].quota",
        "1.5 B",
        "whole number of bytes",
    ),
    ("quota_bool", edit(level(1, quota=True)), "levels[1].quota", True, "byte count"),
    (
        "level_quota_missing",
        edit(lambda d: d["levels"][1].pop("quota")),
        "levels[1].quota",
        None,
        "required",
    ),
    ("tier_name_empty", edit(level(0, tier="")), "levels[0].tier", "", "plugin name"),
    ("tier_name_upper_case", edit(level(0, tier="GPU")), "levels[0].tier", "GPU", "plugin name"),
    (
        "codec_name_invalid",
        edit(level(2, codec="zstd level 3")),
        "levels[2].codec",
        "zstd level 3",
        "plugin name",
    ),
    ("level_key_unknown", edit(level(0, size="1GiB")), "levels[0].size", "1GiB", "unknown key"),
    (
        "level_options_not_a_table",
        edit(level(2, options="/var/cache")),
        "levels[2].options",
        "/var/cache",
        "mapping with string keys",
    ),
    (
        "kernel_backend_invalid",
        edit(top(kernel_backend="CUDA!")),
        "kernel_backend",
        "CUDA!",
        "plugin name",
    ),
    ("eviction_policy_empty", edit(top(eviction_policy="")), "eviction_policy", "", "plugin name"),
    (
        "max_util_above_one",
        edit(top(max_util_for_resume=1.5)),
        "max_util_for_resume",
        1.5,
        "(0, 1]",
    ),
    ("max_util_zero", edit(top(max_util_for_resume=0)), "max_util_for_resume", 0, "(0, 1]"),
    (
        "partial_reuse_not_bool",
        edit(top(enable_partial_reuse="yes")),
        "enable_partial_reuse",
        "yes",
        "true or false",
    ),
    ("backoff_negative", edit(top(reuse_match_backoff=-1)), "reuse_match_backoff", -1, ">= 0"),
    ("rewind_negative", edit(top(max_rewind_len=-16)), "max_rewind_len", -16, ">= 0"),
    ("beam_width_zero", edit(top(max_beam_width=0)), "max_beam_width", 0, ">= 1"),
    (
        "scratch_pages_not_power_of_two",
        edit(top(swa_scratch={"scratch_pages_per_block": 3})),
        "swa_scratch.scratch_pages_per_block",
        3,
        "power of two",
    ),
    (
        "scratch_pages_above_block",
        edit(top(swa_scratch={"scratch_pages_per_block": 32})),
        "swa_scratch.scratch_pages_per_block",
        32,
        "<= tokens_per_block (16)",
    ),
    (
        "scratch_without_windowed_layer",
        edit(lambda d: (d.update(swa_scratch={"scratch_pages_per_block": 4}), d["layers"].pop(1))),
        "swa_scratch",
        SwaScratchConfig(scratch_pages_per_block=4),
        "has none",
    ),
    (
        "pool_group_ratio_negative",
        edit(top(pool_group_ratios=[1.0, -1.0])),
        "pool_group_ratios",
        (1.0, -1.0),
        "numbers > 0",
    ),
    (
        "every_buffer_empty",
        edit(lambda d: [b.update(size=0) for x in d["layers"] for b in x["buffers"]]),
        "layers",
        [0, 1, 2],
        "at least one buffer needs size > 0",
    ),
    (
        "document_not_a_table",
        lambda: ["tokens_per_block", 16],
        "KVCacheManagerConfig",
        ["tokens_per_block", 16],
        "must be a table",
    ),
]


def test_the_invalid_table_covers_at_least_thirty_distinct_rules() -> None:
    assert len({case[0] for case in INVALID}) == len(INVALID) >= 30


@pytest.mark.parametrize(
    ("make", "field", "value", "rule"),
    [pytest.param(*case[1:], id=case[0]) for case in INVALID],
)
def test_invalid_configuration_is_refused_naming_field_value_and_rule(
    make: Callable[[], Any], field: str, value: Any, rule: str
) -> None:
    with pytest.raises(ConfigError) as info:
        KVCacheManagerConfig.from_dict(make())
    err = info.value
    assert err.field == field
    assert err.value == value
    assert rule in err.rule
    assert f"{field}={value!r}" in str(err)


# -- the same rules from Python: the field is named by its record ----------------------------


def _kv(size: int = 4096) -> list[BufferConfig]:
    return [BufferConfig(role="key", size=size), BufferConfig(role="value", size=size)]


PY_INVALID: list[tuple[str, Callable[[], object], str]] = [
    ("empty_role", lambda: BufferConfig(role="", size=1), "BufferConfig.role"),
    ("negative_size", lambda: BufferConfig(role="k", size=-4), "BufferConfig.size"),
    (
        "sinks_without_window",
        lambda: AttentionLayerConfig(layer_id=3, buffers=_kv(), num_sink_tokens=4),
        "AttentionLayerConfig(layer_id=3).num_sink_tokens",
    ),
    (
        "ssm_sink_required_only",
        lambda: SsmLayerConfig(layer_id=1, buffers=_kv(), reuse_policy="sink_required_only"),
        "SsmLayerConfig(layer_id=1).reuse_policy",
    ),
    (
        "working_set_small",
        lambda: SparseConfig(unit_tokens=4, num_selected=8, working_set_units=2),
        "SparseConfig.working_set_units",
    ),
    ("quota_bool", lambda: LevelConfig(tier="gpu", quota=True), "LevelConfig.quota"),
    (
        "codec_on_level_zero",
        lambda: KVCacheManagerConfig(
            tokens_per_block=16,
            layers=[AttentionLayerConfig(layer_id=0, buffers=_kv())],
            levels=[LevelConfig(tier="gpu", quota="1GiB", codec="raw")],
        ),
        "levels[0].codec",
    ),
    (
        "level_not_a_level_config",
        lambda: KVCacheManagerConfig(
            tokens_per_block=16,
            layers=[AttentionLayerConfig(layer_id=0, buffers=_kv())],
            levels=[{"tier": "gpu", "quota": "1GiB"}],
        ),
        "levels[0]",
    ),
]


@pytest.mark.parametrize(
    ("make", "field"), [pytest.param(*case[1:], id=case[0]) for case in PY_INVALID]
)
def test_invalid_record_built_in_python_is_refused_naming_its_field(
    make: Callable[[], object], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field


def test_config_error_is_a_value_error_so_engines_catching_value_error_still_work() -> None:
    with pytest.raises(ValueError):
        BufferConfig(role="k", size=-1)


# -- valid configurations: Python, dict and TOML agree ---------------------------------------

TOML = """
tokens_per_block = 16

[[layers]]
layer_id = 0
buffers = [{ role = "key", size = "4KiB" }, { role = "value", size = 4096 }]

[[layers]]
layer_id = 1
sliding_window_size = 128
num_sink_tokens = 4
buffers = [{ role = "key", size = 4096 }, { role = "value", size = 4096 }]

[[layers]]
type = "ssm"
layer_id = 2
buffers = [{ role = "ssm_state", size = 65536 }]

[[levels]]
tier = "gpu"
quota = "1GiB"

[[levels]]
tier = "host"
quota = "4GiB"
codec = "raw"

[[levels]]
tier = "disk"
quota = "1TiB"
options = { path = "/var/cache/kvcm" }
"""


def python_config() -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=16,
        layers=[
            AttentionLayerConfig(layer_id=0, buffers=_kv()),
            AttentionLayerConfig(
                layer_id=1, buffers=_kv(), sliding_window_size=128, num_sink_tokens=4
            ),
            SsmLayerConfig(layer_id=2, buffers=[BufferConfig(role="ssm_state", size=65536)]),
        ],
        levels=[
            LevelConfig(tier="gpu", quota=1 << 30),
            LevelConfig(tier="host", quota="4 GiB", codec="raw"),
            LevelConfig(tier="disk", quota="1TiB", options={"path": "/var/cache/kvcm"}),
        ],
    )


def test_python_dict_and_toml_give_equal_configs(tmp_path: Path) -> None:
    path = tmp_path / "kvcm.toml"
    path.write_text(TOML)
    from_py = python_config()
    assert KVCacheManagerConfig.from_dict(BASE) == from_py
    assert KVCacheManagerConfig.from_toml(path) == from_py
    assert KVCacheManagerConfig.from_toml(str(path)) == from_py


def test_toml_may_nest_the_config_under_a_kvcm_table(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    nested = TOML.replace("[[layers]]", "[[kvcm.layers]]").replace("[[levels]]", "[[kvcm.levels]]")
    path.write_text("[kvcm]\n" + nested)
    assert KVCacheManagerConfig.from_toml(path) == python_config()


def test_toml_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "kvcm.toml"
    path.write_text(TOML.replace('codec = "raw"', 'codec = "raw"\ncompress = true'))
    with pytest.raises(ConfigError) as info:
        KVCacheManagerConfig.from_toml(path)
    assert info.value.field == "levels[1].compress"
    assert "allowed: blob_codec, codec, evict_ahead, io_deadline_s, options, quota, " \
        "tier, write_combine_bytes, write_queue_depth" in info.value.rule


def test_malformed_or_missing_toml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("tokens_per_block = = 16\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        KVCacheManagerConfig.from_toml(bad)
    assert info.value.value == str(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        KVCacheManagerConfig.from_toml(tmp_path / "missing.toml")


def test_policy_names_are_read_case_insensitively_and_layers_inherit_them() -> None:
    layer = AttentionLayerConfig(
        layer_id=0,
        reuse_policy="Optional",
        buffers=[
            BufferConfig(role="k", size=8),
            BufferConfig(role="v", size=8, reuse_policy="private"),
        ],
    )
    assert layer.reuse_policy is ReusePolicy.OPTIONAL
    assert [layer.effective_policy(b) for b in layer.buffers] == [
        ReusePolicy.OPTIONAL,
        ReusePolicy.PRIVATE,
    ]


def test_sink_required_only_companion_with_window_and_sinks_is_accepted() -> None:
    layer = AttentionLayerConfig(
        layer_id=0,
        buffers=_kv(),
        sliding_window_size=64,
        num_sink_tokens=4,
        reuse_policy=ReusePolicy.SINK_REQUIRED_ONLY,
    )
    assert layer.effective_policy(layer.buffers[0]) is ReusePolicy.SINK_REQUIRED_ONLY


def test_layers_sharing_a_selection_in_one_life_cycle_are_accepted() -> None:
    cfg = KVCacheManagerConfig.from_dict(sparse_doc(shared(0), shared(1), shared(2, None)))
    assert cfg.sparse_host_quota == 2 << 30
    assert [layer.sparse.selection_id for layer in cfg.layers] == ["s0", "s0", None]


def test_layers_without_selection_id_never_share_so_they_may_differ() -> None:
    cfg = KVCacheManagerConfig.from_dict(
        sparse_doc(shared(0, None), shared(1, None, num_selected=2, working_set_units=2))
    )
    assert len(cfg.layers) == 2


def test_sink_blocks_not_tokens_define_the_life_cycle_of_a_shared_selection() -> None:
    # 1 and 4 sink tokens are both one block at 16 tokens per block: one life cycle.
    a = {**shared(0), "sliding_window_size": 64, "num_sink_tokens": 1}
    b = {**shared(1), "sliding_window_size": 64, "num_sink_tokens": 4}
    assert len(KVCacheManagerConfig.from_dict(sparse_doc(a, b)).layers) == 2


# -- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("8GiB", 8 << 30),
        ("1.5 GB", 1_500_000_000),
        (4096, 4096),
        ("4096", 4096),
        ("1.5 KiB", 1536),
        (" 2 mib ", 2 << 20),
        ("1TiB", 1 << 40),
        ("512MB", 512_000_000),
        ("0", 0),
        (np.int64(7), 7),
        (8e9, 8_000_000_000),
    ],
)
def test_sizes_are_read_as_people_write_them(text: object, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    "bad", ["1.5 B", "-1", -1, True, "8 GiBs", 1.5, None, [], "", "nan", math.inf, "1e9"]
)
def test_what_is_not_a_whole_byte_count_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, "levels[1].quota")
    assert info.value.field == "levels[1].quota"
    assert info.value.value is bad or info.value.value == bad


def test_quota_and_buffer_size_accept_size_strings() -> None:
    assert LevelConfig(tier="host", quota="8GiB") == LevelConfig(tier="host", quota=8 << 30)
    assert BufferConfig(role="k", size="16KiB").size == 16384


def test_format_size_uses_binary_units() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 << 30) == "3.0 GiB"
    assert format_size(5 << 40) == "5.0 TiB"


# -- to_dict round trip ----------------------------------------------------------------------


def _walk(value: Any) -> list[Any]:
    out = [value]
    if isinstance(value, dict):
        for v in value.values():
            out += _walk(v)
    elif isinstance(value, list | tuple):
        for v in value:
            out += _walk(v)
    return out


def test_to_dict_is_plain_json_data_without_tuples_or_nones() -> None:
    cfg = KVCacheManagerConfig.from_dict(
        {**sparse_doc(shared(0), shared(1)), "pool_group_ratios": [1, 3], "swa_scratch": None}
    )
    data = cfg.to_dict()
    kinds = {type(v) for v in _walk(data)}
    assert kinds <= {dict, list, str, int, float, bool}
    assert json.loads(json.dumps(data)) == data
    assert KVCacheManagerConfig.from_dict(json.loads(json.dumps(data))) == cfg


policies = st.sampled_from(list(ReusePolicy))
plain_policies = st.sampled_from([ReusePolicy.REQUIRED, ReusePolicy.OPTIONAL, ReusePolicy.PRIVATE])
names = st.from_regex(r"\A[a-z][a-z0-9_]{0,8}\Z")


@st.composite
def buffers(draw: st.DrawFn, *, sparse_unit: int | None = None, ssm: bool = False) -> list[Any]:
    roles = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    out = []
    for i, role in enumerate(roles):
        is_sparse = sparse_unit is not None and i == 0
        size = draw(st.integers(0, 1 << 16))
        if is_sparse:
            size = draw(st.integers(1, 256)) * sparse_unit  # type: ignore[operator]
        plain = ssm or sparse_unit is not None  # SINK_REQUIRED_ONLY needs window and sinks
        policy = None if is_sparse else draw(st.none() | (plain_policies if plain else policies))
        out.append(BufferConfig(role=role, size=size, reuse_policy=policy, is_sparse=is_sparse))
    return out


@st.composite
def valid_configs(draw: st.DrawFn) -> KVCacheManagerConfig:
    tpb = draw(st.sampled_from([1, 2, 16, 32, 64]))
    layers: list[Any] = []
    ids = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=5, unique=True))
    any_sparse = False
    for layer_id in ids:
        kind = draw(st.sampled_from(["full", "window", "ssm", "sparse"]))
        if kind == "ssm":
            layers.append(
                SsmLayerConfig(
                    layer_id=layer_id,
                    buffers=draw(buffers(ssm=True)),
                    reuse_policy=draw(plain_policies),
                )
            )
        elif kind == "sparse":
            unit = draw(st.sampled_from([u for u in (1, 2, 4, 8, 16) if tpb % u == 0]))
            selected = draw(st.integers(1, 64))
            sp = SparseConfig(
                unit_tokens=unit,
                num_selected=selected,
                working_set_units=selected * draw(st.integers(1, 3)),
                selection_id=draw(st.none() | st.integers(0, 3)),
            )
            sp = attrs_evolve_selection(sp, layer_id)
            layers.append(
                AttentionLayerConfig(
                    layer_id=layer_id,
                    sparse=sp,
                    buffers=draw(buffers(sparse_unit=tpb // unit)),
                    reuse_policy=draw(plain_policies),
                )
            )
            any_sparse = True
        else:
            window = None if kind == "full" else draw(st.integers(1, 1 << 16))
            sinks = 0 if window is None else draw(st.integers(0, 64))
            bufs = draw(buffers())
            if window is None or sinks == 0:
                bufs = [b for b in bufs if b.reuse_policy is not ReusePolicy.SINK_REQUIRED_ONLY]
                bufs = bufs or [BufferConfig(role="k", size=64)]
            layers.append(
                AttentionLayerConfig(
                    layer_id=layer_id,
                    buffers=bufs,
                    sliding_window_size=window,
                    num_sink_tokens=sinks,
                    reuse_policy=draw(plain_policies),
                )
            )
    if all(b.size == 0 for layer in layers for b in layer.buffers):
        layers[0] = AttentionLayerConfig(
            layer_id=layers[0].layer_id, buffers=[BufferConfig(role="k", size=64)]
        )
        any_sparse = any(getattr(x, "sparse", None) for x in layers)
    quotas = st.integers(1, 1 << 44) | st.sampled_from(["8GiB", "1.5 GB", "4096", "64 MiB"])
    options = st.dictionaries(
        names, st.integers(-5, 5) | names | st.lists(st.integers(0, 9), max_size=3), max_size=3
    )
    # io_deadline_s: None (no I/O thread) is not its default, so to_dict must keep it.
    deadlines = st.none() | st.floats(1e-3, 3600) | st.integers(1, 3600)
    levels = [LevelConfig(tier=draw(names), quota=draw(quotas), options=draw(options),
                          io_deadline_s=draw(deadlines))]
    for _ in range(draw(st.integers(0, 3))):
        levels.append(
            LevelConfig(
                tier=draw(names),
                quota=draw(quotas),
                codec=draw(st.none() | names),
                options=draw(options),
                io_deadline_s=draw(deadlines),
            )
        )
    windowed = any(getattr(x, "sliding_window_size", None) for x in layers)
    scratch = None
    if windowed and draw(st.booleans()):
        scratch = SwaScratchConfig(
            scratch_pages_per_block=draw(st.sampled_from([p for p in (1, 2, 4, 8) if p <= tpb])),
            max_scratch_slots=draw(st.integers(1, 8)),
        )
    return KVCacheManagerConfig(
        tokens_per_block=tpb,
        layers=layers,
        levels=levels,
        kernel_backend=draw(st.sampled_from(["auto", "numpy", "cupy", "cuda"])),
        eviction_policy=draw(names),
        max_util_for_resume=draw(st.floats(0.01, 1.0)),
        enable_partial_reuse=draw(st.booleans()),
        reuse_match_backoff=draw(st.integers(0, 64)),
        commit_min_snapshot=draw(st.booleans()),
        max_rewind_len=draw(st.integers(0, 256)),
        max_beam_width=draw(st.integers(1, 8)),
        swa_scratch=scratch,
        sparse_host_quota=draw(quotas) if any_sparse else draw(st.none() | quotas),
        pool_group_ratios=draw(st.none() | st.lists(st.floats(0.01, 100), min_size=1, max_size=4)),
    )


def attrs_evolve_selection(sp: SparseConfig, layer_id: int) -> SparseConfig:
    # Generated layers differ in life cycle and settings, so only ever share within one layer.
    if sp.selection_id is None:
        return sp
    return SparseConfig(
        unit_tokens=sp.unit_tokens,
        num_selected=sp.num_selected,
        working_set_units=sp.working_set_units,
        selection_id=f"sel{layer_id}",
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs())
def test_from_dict_of_to_dict_gives_back_an_equal_config(cfg: KVCacheManagerConfig) -> None:
    data = cfg.to_dict()
    assert KVCacheManagerConfig.from_dict(data) == cfg
    assert KVCacheManagerConfig.from_dict(json.loads(json.dumps(data))) == cfg
