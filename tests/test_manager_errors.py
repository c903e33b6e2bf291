"""API misuse gives clear typed errors and changes nothing (quality.md §3 "Bad input";
scenarios.md "Concurrency and lifecycle").

No ``AssertionError``, ``IndexError`` or ``KeyError`` may reach a user: every test here
checks the exact error type, and that the manager and the cache are unchanged afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import (
    PAGE,
    Driver,
    assert_invariants,
    full_layers,
    hybrid_layers,
    kv,
    snapshot_state,
    tokens,
)

from kvcm_core import (
    ArgumentTypeError,
    AttentionLayerConfig,
    BufferConfig,
    CacheStatus,
    ConfigError,
    InvalidArgumentError,
    InvalidStateError,
    KVCacheManager,
    ReusePolicy,
    ReuseScope,
)

FORBIDDEN = (AssertionError, IndexError, KeyError)


def _expect(exc: type[BaseException] | tuple, fn: Callable[[], Any], m: KVCacheManager,
            *caches: Any, match: str | None = None) -> BaseException:
    """``fn()`` raises ``exc`` (never a forbidden type) and changes nothing."""
    before = snapshot_state(m, *caches)
    with pytest.raises(exc, match=match) as info:
        fn()
    assert not isinstance(info.value, FORBIDDEN), repr(info.value)
    assert snapshot_state(m, *caches) == before
    assert_invariants(m)
    return info.value


@pytest.fixture
def active(managers):
    """A manager and an ACTIVE cache at history 10, capacity 12 (8 tokens committed)."""
    m = managers(hybrid_layers(), slots=16, max_rewind_len=2)
    d = Driver(m)
    c = d.create(tokens(30))
    d.run_to(c, 10)
    assert c.resize(12)
    return m, d, c


# -- resize ------------------------------------------------------------------------------


@pytest.mark.parametrize(("capacity", "error"), [
    (-1, InvalidArgumentError), (1.5, ArgumentTypeError), (True, ArgumentTypeError),
    ("12", ArgumentTypeError), (None, ArgumentTypeError), (np.float64(3), ArgumentTypeError)])
def test_resize_rejects_a_capacity_that_is_not_a_count(active, capacity, error):
    m, _, c = active
    _expect(error, lambda: c.resize(capacity), m, c, match="capacity")


def test_resize_rejects_a_capacity_below_history(active):
    m, _, c = active
    _expect(ValueError, lambda: c.resize(9), m, c, match="capacity")


@pytest.mark.parametrize(("history", "error"), [
    (-1, InvalidArgumentError), (7, InvalidArgumentError), (9, InvalidArgumentError),
    (13, InvalidArgumentError), (2.0, ArgumentTypeError), (False, ArgumentTypeError)])
def test_resize_rejects_history_outside_its_range(active, history, error):
    # Allowed: [max(committed=8, old capacity 12 - max_rewind_len 2), old capacity 12].
    m, _, c = active
    _expect(error, lambda: c.resize(14, history_length=history), m, c,
            match="history_length")


def test_resize_accepts_history_inside_its_range(active):
    _m, _d, c = active
    assert c.resize(12, history_length=10)
    assert c.history_length == 10
    assert c.resize(13, history_length=12)
    assert c.history_length == 12


def test_a_model_with_ssm_layers_refuses_to_rewind_history(active):
    # The live SSM state already holds every token up to the current history and no
    # earlier state is kept: a rewind would leave it ahead of history silently.
    m, _, c = active
    assert c.resize(12, history_length=12)  # forward: the engine wrote 10..11
    _expect(InvalidArgumentError, lambda: c.resize(12, history_length=10), m, c,
            match="SSM layers cannot rewind")
    _expect(InvalidArgumentError, lambda: c.check_resize(12, history_length=11), m, c,
            match="SSM layers cannot rewind")
    assert c.resize(13, history_length=12)  # not a rewind: accepted


def test_a_rewind_never_reaches_window_pages_an_earlier_higher_history_released(managers):
    # Window pages are released once stale at (history - max_rewind_len) of the highest
    # history reached. Rewind, step forward, rewind again: the second rewind is within
    # max_rewind_len of the capacity, but below that mark the window would read released
    # pages. Refused, nothing changed; rewinds the kept pages allow still work.
    from kvcm_core.testing.fingerprint import StepWork

    m = managers([AttentionLayerConfig(layer_id=0, buffers=kv(PAGE),
                                       sliding_window_size=5)], slots=16, max_rewind_len=4)
    d = Driver(m)
    toks = tokens(40, seed=3)
    c = d.create(toks, match_len=0)
    assert c.resume()
    c.stop_committing()  # speculative decoding: the engine rewinds rejected drafts

    def step(capacity: int, history: int) -> None:
        assert c.resize(capacity, history_length=history)
        d.engine.step([StepWork(c, toks)])  # reads every page the window needs

    step(17, 0)
    step(17, 17)  # blocks 0 and 1 (tokens 0..7) are stale at 17 - 4 and released
    step(14, 13)  # a rewind of 4: the window at 13 reads tokens 9..12
    step(14, 14)
    _expect(InvalidArgumentError, lambda: c.resize(15, history_length=10), m, c,
            match="window pages of blocks below 2")
    _expect(InvalidArgumentError, lambda: c.check_resize(15, history_length=10), m, c,
            match="window pages of blocks below 2")
    step(14, 13)  # still reachable
    step(20, 14)
    step(24, 20)
    d.check(c)


# -- commit -------------------------------------------------------------------------------


def test_commit_past_capacity_is_refused(active):
    m, d, c = active
    toks = d.toks[id(c)]
    _expect(ValueError, lambda: c.commit(toks[10:13]), m, c, match="capacity")


@pytest.mark.parametrize("bad", [["x", "y"], [2**40, 1]], ids=["str", "out-of-int32"])
def test_commit_of_unencodable_tokens_changes_nothing(managers, bad):
    m = managers(full_layers(), slots=16)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    c.commit([1, 2, 3, 4, 5, 6])
    _expect((ValueError, TypeError), lambda: c.commit(bad), m, c)


def test_token_ids_outside_int32_give_a_value_error(managers):
    m = managers(full_layers(), slots=16)
    with pytest.raises(ValueError):
        m.probe_reuse(None, [2**40] * 8)
    with pytest.raises(ValueError):
        m.create_kv_cache(None, [2**40] * 8)


def test_a_bad_multimodal_digest_is_a_value_error(managers):
    m = managers(full_layers(), slots=16)
    Driver(m).run(tokens(5))  # the scope's root exists: the walk hashes block 0
    _expect(ValueError, lambda: m.create_kv_cache(None, [b"x" * 31, 1, 2, 3, 4]), m,
            match="32-byte")


# -- priority callbacks ------------------------------------------------------------------------


@pytest.mark.parametrize("callback", [lambda b: 500, lambda b: -1, lambda b: 1 / 0],
                         ids=["too-high", "negative", "raises"])
def test_a_bad_priority_callback_fails_the_resize_and_changes_nothing(managers, callback):
    m = managers(full_layers(), slots=16)
    c = m.create_kv_cache(None, [], priority_callback=callback)
    assert c.resume()
    _expect((ValueError, ZeroDivisionError), lambda: c.resize(8), m, c)


# -- page tables ------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [-1, 4, "0", True, 1.0, None])
def test_page_table_rejects_a_bad_group_id(active, group):
    m, _, c = active
    error = InvalidArgumentError if type(group) is int else ArgumentTypeError
    _expect(error, lambda: c.get_base_page_indices(group), m, c, match="group")


@pytest.mark.parametrize("beam", [1, -1, 2])
def test_page_table_rejects_a_beam_other_than_0(active, beam):
    m, _, c = active
    _expect(ValueError, lambda: c.get_base_page_indices(0, beam), m, c, match="beam")


def test_page_tables_are_read_only(active):
    _, _, c = active
    tab = c.get_base_page_indices(1)
    with pytest.raises(ValueError):
        tab[0] = 3


# -- scopes and tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["tenant", 0, ("a",), {"lora_id": 1}])
def test_scope_of_the_wrong_type_is_refused(managers, scope):
    m = managers(full_layers(), slots=16)
    _expect(TypeError, lambda: m.create_kv_cache(scope, [1, 2, 3]), m, match="scope")
    _expect(TypeError, lambda: m.probe_reuse(scope, [1, 2, 3]), m, match="scope")


@pytest.mark.parametrize("fields", [{"lora_id": True}, {"salt": False}, {"salt": [1, 2]},
                                    {"salt": 1.5}, {"lora_id": "a"}])
def test_scope_fields_of_the_wrong_type_are_refused_at_construction(fields):
    with pytest.raises(TypeError, match="ReuseScope"):
        ReuseScope(**fields)


# -- closed and suspended caches -------------------------------------------------------------


def test_operations_on_a_closed_cache_are_refused(managers):
    m = managers(full_layers(), slots=16)
    d = Driver(m)
    c = d.create(tokens(9))
    d.run_to(c, 9)
    c.close()
    for op in (c.resume, lambda: c.resize(12), lambda: c.commit([1]), c.suspend,
               c.stop_committing):
        _expect(InvalidStateError, op, m, c, match="CLOSED")
    c.close()
    assert c.status is CacheStatus.CLOSED


def test_page_table_of_a_closed_cache_is_refused(managers):
    m = managers(full_layers(), slots=16)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    c.commit(list(range(8)))
    c.close()
    with pytest.raises(InvalidStateError):
        c.get_base_page_indices(0)


def test_resize_and_commit_need_an_active_cache(managers):
    m = managers(full_layers(), slots=16)
    c = m.create_kv_cache(None, [1, 2, 3])
    _expect(InvalidStateError, lambda: c.resize(4), m, c, match="SUSPENDED")
    _expect(InvalidStateError, lambda: c.commit([1]), m, c, match="SUSPENDED")
    c.close()


@pytest.mark.parametrize("groups", [[0], [7]], ids=["required", "unknown"])
def test_resume_naming_a_non_optional_group_is_refused(managers, groups):
    m = managers(full_layers(), slots=16)
    c = m.create_kv_cache(None, [1, 2, 3])
    with pytest.raises(ValueError):
        c.resume(optional_reuse_groups=groups)
    assert c.status is CacheStatus.SUSPENDED


# -- manager-wide ------------------------------------------------------------------------------


def test_refused_shutdown_and_clear_are_no_ops(managers):
    m = managers(full_layers(), slots=16)
    d = Driver(m)
    d.run(tokens(9, seed=1))
    c = d.create(tokens(9, seed=2))
    d.run_to(c, 5)
    _expect(InvalidStateError, m.shutdown, m, c, match="open")
    _expect(InvalidStateError, m.clear_reusable_blocks, m, c, match="open")
    assert m.probe_reuse(None, tokens(9, seed=1)[:8]) == 8
    d.run_to(c, 9)
    c.close()


@pytest.mark.parametrize("level", [1, -1, "0", True, None])
def test_storage_statistics_of_a_missing_level_is_a_typed_argument_error(managers, level):
    m = managers(full_layers(), slots=16)
    error = InvalidArgumentError if type(level) is int else ArgumentTypeError
    _expect(error, lambda: m.get_storage_statistics(level), m, match="level")


def test_manager_needs_a_config_object():
    with pytest.raises(ConfigError, match="KVCacheManagerConfig"):
        KVCacheManager({"tokens_per_block": 4})  # type: ignore[arg-type]


# -- lookups -----------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda m: m.get_buffer_group_id(9, "k"),
    lambda m: m.get_buffer_group_id(0, "q"),
    lambda m: m.get_layer_group_id(9),
    lambda m: m.get_mem_pool_base_address(0, "q"),
    lambda m: m.get_page_stride(9, "k"),
    lambda m: m.get_page_index_converter(0, "q"),
    lambda m: m.get_page_region(0, "q"),
    lambda m: m.buffer_attr(1, "state"),
], ids=["buffer-layer", "buffer-role", "layer", "base", "stride", "converter", "region",
        "attr"])
def test_unknown_layers_and_roles_are_config_errors(managers, call):
    m = managers(full_layers(), slots=16)
    err = _expect(ConfigError, lambda: call(m), m)
    assert err.field and err.rule


def test_split_layer_lookup_is_a_config_error_and_buffer_lookups_work(managers):
    m = managers([
        AttentionLayerConfig(layer_id=0, buffers=[
            BufferConfig(role="k", size=PAGE),
            BufferConfig(role="v", size=PAGE, reuse_policy=ReusePolicy.OPTIONAL)]),
    ])
    err = _expect(ConfigError, lambda: m.get_layer_group_id(0), m, match="split")
    assert err.value == 0
    assert m.get_buffer_group_id(0, "k") != m.get_buffer_group_id(0, "v")
    assert set(m.buffer_grouping) == {(0, "k"), (0, "v")}


def test_layer_of_size_zero_buffers_has_no_group_but_a_clear_error(managers):
    m = managers([
        AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=PAGE)]),
        AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=0)]),
    ])
    _expect(ConfigError, lambda: m.get_layer_group_id(1), m, match="size > 0")
    _expect(ConfigError, lambda: m.get_buffer_group_id(1, "k"), m)


@pytest.mark.parametrize("options, key, value", [
    ({"mode": "bogus"}, "mode", "bogus"),
    ({"batch_syscalls": "maybe"}, "batch_syscalls", "maybe"),
    ({"no_such_option": 1}, "no_such_option", 1),
])
def test_a_bad_tier_option_is_named_under_its_level(tmp_path, options, key, value) -> None:
    """The field of a tier's option error is the level's (``levels[2].options.mode``), as
    the configuration is written: a tier's own name for it does not say which level."""
    from kvcm_core import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig

    cfg = KVCacheManagerConfig(
        tokens_per_block=4, kernel_backend="numpy",
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=64)])],
        levels=[LevelConfig(tier="gpu", quota=1 << 16), LevelConfig(tier="host", quota=1 << 16),
                LevelConfig(tier="disk", quota=1 << 18,
                            options={"path": str(tmp_path), **options})])
    with pytest.raises(ConfigError) as info:
        KVCacheManager(cfg)
    assert info.value.field == f"levels[2].options.{key}"
    assert info.value.value == value
    assert "(tier 'disk')" in info.value.rule


@pytest.mark.parametrize(("where", "level"), [
    ("levels[1].codec", {"tier": "host", "quota": "1MiB", "codec": "nosuch"}),
    ("levels[1].blob_codec", {"tier": "disk", "quota": "1MiB", "blob_codec": "nosuch",
                              "options": {"mode": "blob"}}),
])
def test_a_level_naming_no_installed_codec_is_a_config_error_naming_the_field(
        tmp_path, where, level):
    """An unknown codec name is a configuration error of that level's field, listing the
    installed codecs (it was a PluginError that named no field)."""
    from kvcm_core import KVCacheManagerConfig
    from kvcm_core.errors import ConfigError

    if level["tier"] == "disk":
        level["options"]["path"] = str(tmp_path)
    cfg = KVCacheManagerConfig.from_dict({
        "tokens_per_block": 16, "kernel_backend": "numpy",
        "layers": [{"layer_id": 0, "buffers": [{"role": "kv", "size": 64}]}],
        "levels": [{"tier": "gpu", "quota": "1MiB"}, level]})
    with pytest.raises(ConfigError) as info:
        KVCacheManager(cfg)
    assert info.value.field == where and info.value.value == "nosuch"
    assert "raw" in str(info.value) and "zstd" in str(info.value)  # the installed ones
