"""Configuration and command line (review 27): every bad value is a typed error naming the
field (its full dotted path), the value and the rule, never a raw exception, and ``kvcm
simulate`` says it in one line with exit status 2.

- sizes are at most 8 EiB (``2**63 - 1`` bytes) where they are parsed, and a level's quota
  splits over its pool groups exactly (no float overflow for huge finite ratios);
- ``io_deadline_s = None`` survives ``to_dict`` and has a TOML spelling (``"none"``);
- the redis tier's ``connect_timeout_s`` is finite, at most an hour;
- numbers past Python's 4300-digit limit are typed errors (TOML, sizes, traces);
- ``[simulate] max_batch``, ``working_set_units`` and the run's batch are bounded before
  the run;
- ``kvcm simulate`` names ``[kvcm]`` fields under ``kvcm.``;
- a ``group_size`` above a buffer's values never makes a lossy cold page larger.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvcm_codec_quant.reference import decode_pages, encode_pages, make_plan
from kvcm_tier_redis import RedisTier

import kvcm_core.simulate.runner as runner
from kvcm_core import KVCacheManager, KVCacheManagerConfig, LevelConfig
from kvcm_core.codec import BufferPlace, PageLayout
from kvcm_core.errors import ConfigError
from kvcm_core.simulate import load_config, main
from kvcm_core.simulate.mooncake import TraceError, read_trace
from kvcm_core.units import parse_size

MAX_SIZE = 2**63 - 1  # (kvcm_core.units.MAX_SIZE)

DEFAULT = (Path(runner.__file__).parent / "default.toml").read_text()
SPARSE = (Path(runner.__file__).parent / "sparse.toml").read_text()
QUICK = ["--requests", "4", "--seed", "3", "--quiet", "--no-plots", "--no-compare"]
LONG = "9" * 5000  # past sys.get_int_max_str_digits() (4300)


def _model(**kw: Any) -> dict[str, Any]:
    return {"tokens_per_block": 16, "kernel_backend": "numpy",
            "layers": [{"layer_id": 0, "buffers": [{"role": "kv", "size": 256}]}],
            "levels": [{"tier": "gpu", "quota": "1MiB"}], **kw}


def _two_groups(**kw: Any) -> dict[str, Any]:
    return _model(layers=[
        {"layer_id": 0, "buffers": [{"role": "kv", "size": 256}]},
        {"layer_id": 1, "sliding_window_size": 32, "buffers": [{"role": "kv", "size": 512}]},
    ], **kw)


def _sim_file(tmp_path: Path, text: str, **replace: str) -> str:
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "sim.toml"
    path.write_text(text)
    return str(path)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# -- 1. sizes at most 8 EiB; exact quota split ---------------------------------------------


@pytest.mark.parametrize("quota", [1e308, 2.0**63, 2**63, "9" * 40, "9000000 TiB", 10**5000],
                         ids=["1e308", "2.0**63", "2**63", "40 nines", "9000000 TiB",
                              "10**5000"])
def test_a_level_quota_above_8_EiB_is_a_config_error_naming_the_level(quota: Any) -> None:
    with pytest.raises(ConfigError) as info:
        KVCacheManagerConfig.from_dict(_model(levels=[{"tier": "gpu", "quota": quota}]))
    assert info.value.field == "levels[0].quota"
    assert "at most 8 EiB" in info.value.rule
    str(info.value)  # printable, also for an int past the digit limit


def test_a_size_of_exactly_2_to_63_minus_1_bytes_is_accepted_by_parse_size() -> None:
    assert parse_size(MAX_SIZE) == MAX_SIZE == 2**63 - 1
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE
    with pytest.raises(ConfigError, match="at most 8 EiB"):
        parse_size(MAX_SIZE + 1, "x")


def test_sparse_host_quota_above_8_EiB_is_a_config_error_naming_it() -> None:
    d = _model(sparse_host_quota=1e308, layers=[
        {"layer_id": 0, "sparse": {"unit_tokens": 4, "num_selected": 8, "working_set_units": 16},
         "buffers": [{"role": "kv", "size": 256, "is_sparse": True}]}])
    with pytest.raises(ConfigError) as info:
        KVCacheManagerConfig.from_dict(d)
    assert info.value.field == "sparse_host_quota"


def test_manager_resize_to_a_quota_above_8_EiB_is_a_config_error() -> None:
    with KVCacheManager(KVCacheManagerConfig.from_dict(_model())) as m:
        for quota in (1e308, 2**63, LONG):
            with pytest.raises(ConfigError) as info:
                m.resize(0, quota)
            assert info.value.field == "quota" and "at most 8 EiB" in info.value.rule


def test_huge_finite_pool_group_ratios_split_the_quota_exactly_without_overflow() -> None:
    # One group takes everything, whatever its ratio.
    with KVCacheManager(KVCacheManagerConfig.from_dict(_model(pool_group_ratios=[1e308]))) \
            as m:
        assert [s.num_slots for s in m.stores[0]] == [4096]
    # Two equal huge ratios: half each (a float product would be inf).
    cfg = KVCacheManagerConfig.from_dict(_two_groups(pool_group_ratios=[1e308, 1e308]))
    with KVCacheManager(cfg) as m:
        assert [s.num_slots for s in m.stores[0]] == [2048, 1024]
    # A ratio too small for a slot is the usual refusal, not an OverflowError.
    cfg = KVCacheManagerConfig.from_dict(_two_groups(pool_group_ratios=[1e308, 1e-308]))
    with pytest.raises(ConfigError) as info:
        KVCacheManager(cfg)
    assert info.value.field == "levels[0].quota" and "gets no slot" in info.value.rule


def test_kvcm_simulate_with_a_quota_above_8_EiB_exits_2_in_one_line(tmp_path, capsys) -> None:
    cfg = _sim_file(tmp_path, DEFAULT, **{"level_fractions = [0.10, 0.5, 4.0]\n": "",
                                          'quota = "4MiB"': "quota = 1e308"})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "kvcm.levels[0].quota=1e+308" in line and "at most 8 EiB" in line


# -- 2. io_deadline_s = None round trip and TOML spelling ------------------------------------


def test_to_dict_keeps_io_deadline_none_so_from_dict_gives_back_an_equal_config() -> None:
    cfg = KVCacheManagerConfig.from_dict(_model(levels=[
        {"tier": "gpu", "quota": "1MiB"},
        {"tier": "host", "quota": "1MiB", "io_deadline_s": None}]))
    assert cfg.levels[1].io_deadline_s is None
    data = cfg.to_dict()
    assert data["levels"][1]["io_deadline_s"] == "none"
    assert data["levels"][0]["io_deadline_s"] == 5.0
    back = KVCacheManagerConfig.from_dict(data)
    assert back == cfg and back.levels[1].background_write_depth == 0


@pytest.mark.parametrize("spelling", ['"none"', '"None"', '" NONE "'])
def test_toml_io_deadline_s_none_spelling_turns_the_io_thread_off(tmp_path, spelling) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"""
tokens_per_block = 16
[[layers]]
layer_id = 0
buffers = [{{ role = "kv", size = 256 }}]
[[levels]]
tier = "gpu"
quota = "1MiB"
[[levels]]
tier = "host"
quota = "1MiB"
io_deadline_s = {spelling}
""")
    level = KVCacheManagerConfig.from_toml(path).levels[1]
    assert level.io_deadline_s is None and level.background_write_depth == 0


@pytest.mark.parametrize("bad", ["never", "", False, 0, math.inf])
def test_io_deadline_s_other_strings_and_values_are_refused_naming_the_spelling(bad) -> None:
    with pytest.raises(ConfigError) as info:
        LevelConfig(tier="host", quota=1 << 20, io_deadline_s=bad)
    assert info.value.field == "LevelConfig.io_deadline_s"
    assert "'none' in TOML" in info.value.rule


# -- 3. redis connect_timeout_s ----------------------------------------------------------------


@pytest.mark.parametrize("timeout", [math.inf, 1e308, 2**63, math.nan, 3600.5])
def test_redis_connect_timeout_s_must_be_finite_seconds_at_most_an_hour(timeout) -> None:
    with pytest.raises(ConfigError) as info:
        RedisTier(None, {"url": "redis://127.0.0.1:1", "connect_timeout_s": timeout})
    assert info.value.field == "redis.options.connect_timeout_s"
    assert "(0, 3600]" in info.value.rule


def test_redis_connect_timeout_s_inf_is_named_by_its_level_when_the_manager_is_built() -> None:
    options = {"url": "redis://127.0.0.1:1/0", "model": "m", "shard": "0",
               "connect_timeout_s": math.inf}
    cfg = KVCacheManagerConfig.from_dict(_model(levels=[
        {"tier": "gpu", "quota": "64KiB"},
        {"tier": "redis", "quota": "64KiB", "options": options}]))
    with pytest.raises(ConfigError) as info:
        KVCacheManager(cfg)
    assert info.value.field == "levels[1].options.connect_timeout_s"


# -- 4. numbers past 4300 digits ------------------------------------------------------------


def test_toml_with_a_number_past_4300_digits_is_a_config_error_naming_the_file(
        tmp_path) -> None:
    path = tmp_path / "long.toml"
    path.write_text(f"tokens_per_block = {LONG}\n")
    with pytest.raises(ConfigError) as info:
        KVCacheManagerConfig.from_toml(path)
    assert info.value.field == "toml" and info.value.value == str(path)


def test_a_size_string_past_4300_digits_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(LONG, "levels[0].quota")
    assert info.value.field == "levels[0].quota" and "at most 8 EiB" in info.value.rule
    with pytest.raises(ConfigError) as info:
        parse_size("1." + LONG + " GiB", "q")
    assert info.value.field == "q"


def test_a_trace_line_with_a_number_past_4300_digits_is_a_trace_error_naming_the_line(
        tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 0, "input_length": ' + LONG +
                    ', "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=rf"{path}:2: .*number too long"):
        read_trace(path)
    assert main(["--trace", str(path), "--quiet", "--no-plots",
                 "--out", str(tmp_path / "out")]) == 2
    assert f"{path}:2" in _one_line(capsys.readouterr().err)


def test_kvcm_simulate_config_with_a_number_past_4300_digits_exits_2_in_one_line(
        tmp_path, capsys) -> None:
    cfg = _sim_file(tmp_path, DEFAULT, **{"seed = 0": f"seed = {LONG}"})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    assert "configuration error: toml=" in _one_line(capsys.readouterr().err)


# -- 5. simulate bounds its batch ---------------------------------------------------------------


@pytest.mark.parametrize("value", [4097, 2**62, 2**63 - 1])
def test_simulate_max_batch_above_4096_is_a_config_error_exit_2(tmp_path, capsys, value):
    cfg = _sim_file(tmp_path, DEFAULT, **{"max_batch = 16": f"max_batch = {value}"})
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.field == "simulate.max_batch" and "at most 4096" in info.value.rule
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"configuration error: simulate.max_batch={value}: must be at most 4096" in line
    assert not (tmp_path / "out").exists()


def test_simulate_sparse_working_set_units_above_2_to_20_is_a_config_error_exit_2(
        tmp_path, capsys) -> None:
    cfg = _sim_file(tmp_path, SPARSE, **{"working_set_units = 32": "working_set_units = "
                                                                    "1000000000"})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "kvcm.layers[0].sparse.working_set_units=1000000000: must be at most 1048576" \
        in line


def test_simulate_refuses_a_batch_of_more_than_4_GiB_before_the_run(tmp_path, capsys) -> None:
    cfg = _sim_file(tmp_path, SPARSE, **{"working_set_units = 32": "working_set_units = "
                                                                    "1048576",
                                         "max_batch = 16": "max_batch = 64"})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "configuration error: simulate.max_batch=64: the run's batch would take about" \
        in line and "at most 4.0 GiB" in line
    assert not (tmp_path / "out").exists()


# -- 6. simulate names [kvcm] fields under kvcm. ---------------------------------------------


@pytest.mark.parametrize(("old", "new", "field"), [
    ('quota = "16MiB"', 'qouta = "16MiB"', "kvcm.levels[1].qouta"),
    ('tokens_per_block = 16', 'tokens_per_block = 16\nbogus = 1', "kvcm.bogus"),
    ('tokens_per_block = 16', 'tokens_per_block = 16\npool_group_ratios = [0]',
     "kvcm.pool_group_ratios"),
    ('tokens_per_block = 16', 'tokens_per_block = 16\npool_group_ratios = [1, 1, 1, 1, 1]',
     "kvcm.pool_group_ratios"),  # (found when the manager is built)
    ('tokens_per_block = 16', 'tokens_per_block = 3', "kvcm.tokens_per_block"),
])
def test_simulate_names_a_kvcm_field_with_its_table(tmp_path, capsys, old, new, field):
    cfg = _sim_file(tmp_path, DEFAULT, **{old: new})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"configuration error: {field}=" in line


# -- 7. group_size larger than a buffer's values -------------------------------------------------


def _cold_page_bytes(size: int, group_size: int, codec: str) -> int:
    d = {"tokens_per_block": 16, "kernel_backend": "numpy",
         "layers": [{"layer_id": 0, "buffers": [
             {"role": "kv", "size": size, "dtype": "bf16", "group_size": group_size}]}],
         "levels": [{"tier": "gpu", "quota": "64KiB"},
                    {"tier": "host", "quota": "1MiB", "codec": codec}]}
    with KVCacheManager(KVCacheManagerConfig.from_dict(d)) as m:
        return (1 << 20) // m.get_storage_statistics(1).total


@pytest.mark.parametrize(("size", "group_size"), [(64, 128), (256, 1000), (256, 1 << 30)])
def test_a_group_size_above_the_buffers_values_never_makes_a_lossy_cold_page_larger(
        size, group_size) -> None:
    clamped = _cold_page_bytes(size, size // 2, "fp8")
    assert _cold_page_bytes(size, group_size, "fp8") == clamped <= size


@pytest.mark.parametrize("mode", ["fp8", "int8", "int4"])
def test_a_group_size_above_the_buffers_values_is_one_group_of_the_buffer(mode) -> None:
    """Same plan, same codes and same decoded values as ``group_size = values``."""
    def plan(gs: int) -> Any:
        return make_plan(PageLayout((64,), (BufferPlace(0, "k", 0, 0, 64, "bf16", gs, False),)),
                         mode)
    wide, exact = plan(1000), plan(32)
    assert wide == exact and wide.segments[0].group_size == 32
    rng = np.random.default_rng(0)
    vals = rng.standard_normal((3, 32)).astype(np.float32)
    pages = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(3, 64)
    cold = encode_pages(wide, [pages])
    np.testing.assert_array_equal(cold, encode_pages(exact, [pages]))
    out = np.zeros_like(pages)
    decode_pages(wide, cold, [out])
    back = np.zeros_like(pages)
    decode_pages(exact, cold, [back])
    np.testing.assert_array_equal(out, back)
