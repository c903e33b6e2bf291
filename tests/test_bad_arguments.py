"""Bad arguments get the typed errors of the API (``ArgumentTypeError`` is a TypeError,
``InvalidArgumentError`` a ValueError), naming the argument and the rule, and change
nothing; a resize no level 0 could ever hold is a refusal, not a crash."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import full_layers, make_manager, tokens

from kvcm_core import ArgumentTypeError, ConfigError, InvalidArgumentError


@pytest.mark.parametrize("bad", [np.array([1.0, 2.0, 3.0, 4.0, 5.0]),
                                 np.array([True, False, True]),
                                 np.array([1, 2, 3], dtype=object)],
                         ids=["float64", "bool", "object"])
def test_token_arrays_of_float_bool_or_object_dtype_are_refused_not_truncated(bad) -> None:
    m = make_manager(full_layers())
    c = m.create_kv_cache(None, tokens(8))
    assert c.resume() and c.resize(8)
    c.commit(tokens(8))
    with pytest.raises(ArgumentTypeError, match=f"integer dtype, got {bad.dtype}"):
        m.probe_reuse(None, bad)
    with pytest.raises(ArgumentTypeError, match="integer dtype"):
        m.create_kv_cache(None, bad)
    assert c.resize(8 + len(bad))
    with pytest.raises(ArgumentTypeError, match="integer dtype"):
        c.commit(bad)
    assert c.history_length == 8 and c.num_committed_tokens == 8, "nothing was committed"
    assert m.num_open_caches == 1
    c.close()


def test_a_two_dimensional_token_array_is_refused() -> None:
    m = make_manager(full_layers())
    with pytest.raises(InvalidArgumentError, match=r"must be 1-D, got shape \(2, 2\)"):
        m.probe_reuse(None, np.zeros((2, 2), dtype=np.int32))


@pytest.mark.parametrize("size", [2**62, 10**30])
def test_a_resize_no_level_0_could_hold_is_refused_at_once_with_a_reason(size) -> None:
    m = make_manager(full_layers())
    c = m.create_kv_cache(None, tokens(4))
    assert c.resume() and c.resize(4)
    tracemalloc.start()
    try:
        assert c.resize(size) is False
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"the refusal allocated {peak} bytes (it must not size anything)"
    assert "level 0 holds" in c.last_refusal and str(size) in c.last_refusal
    assert c.capacity == 4
    assert c.resize(8) and c.last_refusal is None
    c.close()


@pytest.mark.parametrize(("value", "error"), [(-1, InvalidArgumentError),
                                              (2.5, ArgumentTypeError),
                                              (True, ArgumentTypeError)])
def test_resize_arguments_get_typed_errors_naming_the_argument(value, error) -> None:
    m = make_manager(full_layers())
    c = m.create_kv_cache(None, tokens(4))
    assert c.resume()
    with pytest.raises(error, match=f"capacity={value!r}: must be an int >= 0"):
        c.resize(value)


@pytest.mark.parametrize(("level", "error"), [("1", ArgumentTypeError), (True, ArgumentTypeError),
                                              (1.0, ArgumentTypeError), (9, InvalidArgumentError),
                                              (-1, InvalidArgumentError)])
def test_a_manager_resize_of_a_bad_level_gets_the_typed_error_naming_the_level(level, error
                                                                              ) -> None:
    """The rule every call taking a level follows (prefetch, statistics): a level that is
    not an int is an ArgumentTypeError, one the manager does not have an
    InvalidArgumentError; nothing changes."""
    m = make_manager(full_layers())
    before = m.get_storage_statistics(0).total
    with pytest.raises(error, match=rf"level={level!r}: must be"):
        m.resize(level, 1 << 20)
    assert m.get_storage_statistics(0).total == before


@pytest.mark.parametrize("quota", [2**62, 2**63 - 1])
def test_a_manager_resize_past_32_bit_slot_ids_is_refused_at_once_with_a_reason(quota) -> None:
    m = make_manager(full_layers())
    before = m.get_storage_statistics(0).total
    tracemalloc.start()
    try:
        assert m.resize(0, quota) is False
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"the refusal allocated {peak} bytes (it must not size anything)"
    assert "32-bit" in m.last_refusal and str(quota) in m.last_refusal
    assert m.get_storage_statistics(0).total == before
    assert m.resize(0, 1 << 20) and m.last_refusal is None


def test_a_manager_resize_past_8_EiB_is_a_config_error_at_once() -> None:
    """A quota is a size: at most 2**63 - 1 bytes (larger ones were refused as 32-bit slot
    ids before; 1e308 crashed the split with an OverflowError)."""
    m = make_manager(full_layers())
    before = m.get_storage_statistics(0).total
    for quota in (10**30, 1e308):
        with pytest.raises(ConfigError, match="at most 8 EiB"):
            m.resize(0, quota)
    assert m.get_storage_statistics(0).total == before
    assert m.resize(0, 1 << 20) and m.last_refusal is None


def test_a_list_of_float_tokens_is_a_type_error_naming_the_token() -> None:
    m = make_manager(full_layers())
    with pytest.raises(ArgumentTypeError, match=r"token 1=2.0: must be an int token id"):
        m.probe_reuse(None, [1, 2.0, 3])


def _with_bool(n: int, at: int) -> list:
    """``n`` int tokens holding ints 0 and 1 (they stay valid) and a ``True`` at ``at``."""
    toks = tokens(n)
    toks[0], toks[-1] = 1, 0
    toks[at] = True
    return toks


@pytest.mark.parametrize(("n", "at"), [(3, 1), (40, 37), (500, 317)],
                         ids=["short", "long", "past-the-type-scan"])
def test_a_list_holding_a_bool_token_is_a_type_error_naming_the_token(n, at) -> None:
    m = make_manager(full_layers())
    bad = _with_bool(n, at)
    rule = rf"tokens: token {at}=True: a bool is not a token id"
    with pytest.raises(ArgumentTypeError, match=rule):
        m.probe_reuse(None, bad)
    with pytest.raises(ArgumentTypeError, match=rule):
        m.create_kv_cache(None, bad)
    assert m.num_open_caches == 0
    c = m.create_kv_cache(None, tokens(8))
    assert c.resume() and c.resize(8 + n)
    c.commit(tokens(8))
    with pytest.raises(ArgumentTypeError, match=rule):
        c.commit(bad)
    assert c.history_length == 8 and c.num_committed_tokens == 8, "nothing was committed"
    c.close()


@pytest.mark.parametrize("bad", [[True], [False, False], [7, 8, 9, False]],
                         ids=["decode-step", "two", "four"])
def test_a_short_commit_of_bool_tokens_is_refused_like_a_long_one(bad) -> None:
    m = make_manager(full_layers())
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    with pytest.raises(ArgumentTypeError, match=r"=(True|False): a bool is not a token id"):
        c.commit(bad)
    assert c.history_length == 0
    c.close()


def test_a_bool_in_a_later_chunk_of_a_long_prompt_is_named_at_its_place_in_the_prompt() -> None:
    m = make_manager(full_layers())
    prompt = tokens(4096)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(4096)
    c.commit(prompt)  # cached: the walk encodes every chunk
    c.close()
    bad = [*prompt[:4000], True, *prompt[4001:]]
    with pytest.raises(ArgumentTypeError, match="tokens: token 4000=True: a bool is not"):
        m.create_kv_cache(None, bad)


@pytest.mark.parametrize("bad, error, rule", [
    (1 << 40, InvalidArgumentError, "token 4999=1099511627776: token ids must fit"),
    (1.5, ArgumentTypeError, "token 4999=1.5: must be an int token id"),
    ("x", ArgumentTypeError, "token 4999='x': must be an int token id"),
    (True, ArgumentTypeError, "token 4999=True: a bool is not a token id"),
    (bytes(31), InvalidArgumentError, "token 4999: a multimodal item must be a 32-byte"),
], ids=["out-of-int32", "float", "str", "bool", "short-digest"])
@pytest.mark.parametrize("cached", [0, 16, 4996], ids=["nothing", "a-block", "all-but-one"])
@pytest.mark.parametrize("mm", [False, True], ids=["ints", "with-a-digest"])
def test_a_bad_token_is_refused_wherever_it_is_and_whatever_is_cached(bad, error, rule,
                                                                       cached, mm) -> None:
    # A bad token is refused naming its place and value however long the prompt and
    # whatever part of it is cached: the prefix walk reads only what it needs.
    m = make_manager(full_layers())
    prompt = tokens(5000)
    if mm:
        prompt[7] = bytes(range(32))
    if cached:
        c = m.create_kv_cache(None, [])
        assert c.resume() and c.resize(cached)
        c.commit(prompt[:cached])
        c.close()
    bad_prompt = [*prompt[:4999], bad]
    if mm and isinstance(bad, bool):
        rule = "token 4999=True: must be an int token id"
    for call in (m.probe_reuse, m.create_kv_cache):
        with pytest.raises(error, match=rule):
            call(None, bad_prompt)
    assert m.num_open_caches == 0


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.uint64])
def test_a_token_array_value_out_of_int32_is_refused_wherever_it_is(dtype) -> None:
    m = make_manager(full_layers())
    prompt = np.asarray(tokens(40000), dtype=dtype)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(64)
    c.commit(prompt[:64])
    c.close()
    prompt[-1] = 1 << 31
    for call in (m.probe_reuse, m.create_kv_cache):
        with pytest.raises(InvalidArgumentError, match="token 39999=2147483648: token ids"):
            call(None, prompt)


def test_token_ids_0_and_1_given_as_ints_are_still_taken() -> None:
    m = make_manager(full_layers())
    for n in (4, 40, 600):
        toks = [t % 2 for t in range(n)]
        c = m.create_kv_cache(None, [])
        assert c.resume() and c.resize(n)
        c.commit(toks)
        c.close()
        assert m.probe_reuse(None, toks) == n


@pytest.mark.parametrize(("call", "error", "rule"), [
    (lambda m, c: m.probe_reuse("tenant", [1]), ArgumentTypeError, "scope='tenant'"),
    (lambda m, c: m.get_storage_statistics(7), InvalidArgumentError, "level=7"),
    (lambda m, c: m.get_storage_statistics("0"), ArgumentTypeError, "level='0'"),
    (lambda m, c: c.pages(99), InvalidArgumentError, "group=99"),
    (lambda m, c: c.pages(0, beam=3), InvalidArgumentError, "beam=3"),
    (lambda m, c: c.prefetch(5), InvalidArgumentError, "level=5"),
    (lambda m, c: c.commit(list(range(100))), InvalidArgumentError, "past capacity"),
    (lambda m, c: c.commit(None), ArgumentTypeError, "got NoneType"),
    (lambda m, c: c.recompute_blocks(99), InvalidArgumentError, "group=99"),
    (lambda m, c: c.scratch_page_ids("0"), ArgumentTypeError, "group='0'"),
    (lambda m, c: m.create_kv_cache(None, 5), ArgumentTypeError, "got int"),
    (lambda m, c: m.probe_reuse(None, None), ArgumentTypeError, "got NoneType"),
    (lambda m, c: m.create_kv_cache(None, [1], priority_callback=3), ArgumentTypeError,
     "priority_callback=3"),
], ids=["scope", "stats-level", "stats-level-type", "pages-group", "pages-beam",
        "prefetch-level", "commit-past-capacity", "commit-none", "recompute-group",
        "scratch-group-type", "create-tokens-int", "probe-tokens-none", "priority-callback"])
def test_public_calls_raise_only_typed_kvcm_errors_for_bad_arguments(call, error, rule) -> None:
    m = make_manager(full_layers())
    c = m.create_kv_cache(None, tokens(4))
    assert c.resume() and c.resize(4)
    with pytest.raises(error, match=rule):
        call(m, c)
    assert m.num_open_caches == 1 and c.capacity == 4, "a refused call changed something"
    c.close()


# -- found by a first-use review: each call below raised a bare Python error or named the
# -- wrong field

def _one_layer(**kw):
    from kvcm_core import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
    levels = kw.pop("levels", [LevelConfig(tier="gpu", quota="4MiB")])
    layers = kw.pop("layers", [AttentionLayerConfig(
        layer_id=0, buffers=[BufferConfig(role="key", size=4096)])])
    return KVCacheManagerConfig(tokens_per_block=16, layers=layers, levels=levels, **kw)


@pytest.mark.parametrize("ratios", [[1], [1, 1, 1]], ids=["short", "long"])
def test_pool_group_ratios_need_exactly_one_ratio_per_pool_group(ratios) -> None:
    from kvcm_core import AttentionLayerConfig, BufferConfig, ConfigError, KVCacheManager
    layers = [AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="key", size=4096)]),
              AttentionLayerConfig(layer_id=1, sliding_window_size=64,
                                   buffers=[BufferConfig(role="key", size=1024)])]
    with pytest.raises(ConfigError, match=r"one ratio per pool group \(2") as info:
        KVCacheManager(_one_layer(layers=layers, pool_group_ratios=ratios))
    assert info.value.field == "pool_group_ratios"


def test_a_sparse_host_quota_too_small_for_one_slot_is_blamed_on_that_field() -> None:
    from kvcm_core import AttentionLayerConfig, BufferConfig, ConfigError, KVCacheManager
    from kvcm_core.config import SparseConfig
    layer = AttentionLayerConfig(
        layer_id=0, buffers=[BufferConfig(role="k", size=64, is_sparse=True)],
        sparse=SparseConfig(unit_tokens=4, num_selected=1, working_set_units=2))
    with pytest.raises(ConfigError, match="too small") as info:
        KVCacheManager(_one_layer(layers=[layer], sparse_host_quota=10))
    assert info.value.field == "sparse_host_quota"


# (A quota past 8 EiB, 10**30, is refused when parsed: tests/test_config_review27.py.)
@pytest.mark.parametrize("quota", ["64TiB", 2**63 - 1], ids=["no-memory", "past-any-array"])
def test_a_quota_no_pool_can_have_is_a_config_error_naming_the_level(quota) -> None:
    from kvcm_core import ConfigError, KVCacheManager, LevelConfig
    levels = [LevelConfig(tier="gpu", quota="4MiB"), LevelConfig(tier="host", quota=quota)]
    with pytest.raises(ConfigError, match="cannot be allocated") as info:
        KVCacheManager(_one_layer(levels=levels))
    assert info.value.field == "levels[1].quota"


@pytest.mark.parametrize("groups", [5, "0"], ids=["int", "str"])
def test_optional_reuse_groups_must_be_a_sequence_and_a_bad_one_changes_nothing(groups):
    from kvcm_core import KVCacheManager
    m = KVCacheManager(_one_layer())
    c = m.create_kv_cache(None, list(range(40)))
    with pytest.raises(ArgumentTypeError, match=r"optional_reuse_groups=.*must be a sequence"):
        c.resume(None, groups)
    assert c.status.name == "SUSPENDED" and c.resume()
    c.close()
    m.shutdown()


@pytest.mark.parametrize("layer_id", ["0", 0.0, True], ids=["str", "float", "bool"])
def test_layer_ids_of_another_type_are_argument_type_errors_not_unknown_layers(layer_id):
    from kvcm_core import KVCacheManager
    m = KVCacheManager(_one_layer())
    with pytest.raises(ArgumentTypeError, match=f"layer_id={layer_id!r}: must be an int"):
        m.get_layer_group_id(layer_id)
    with pytest.raises(ArgumentTypeError, match="must be an int"):
        m.get_buffer_group_id(layer_id, "key")
    with pytest.raises(ArgumentTypeError, match="role=0: must be a buffer role"):
        m.get_buffer_group_id(0, 0)
    assert m.get_layer_group_id(np.int32(0)) == m.get_buffer_group_id(np.int64(0), "key") == 0
    m.shutdown()


def test_a_level_given_as_a_numpy_integer_is_taken_and_a_float_level_is_refused() -> None:
    from kvcm_core import KVCacheManager, LevelConfig
    m = KVCacheManager(_one_layer(levels=[LevelConfig(tier="gpu", quota="4MiB"),
                                          LevelConfig(tier="host", quota="4MiB")]))
    assert m.resize(np.int64(1), "8MiB")
    assert m.get_storage_statistics(1).total_bytes == 8 << 20
    with pytest.raises(ArgumentTypeError, match=r"level=1.0: must be an int in 0..1"):
        m.resize(1.0, "8MiB")
    m.shutdown()


def test_numpy_integers_in_the_configuration_are_taken_as_ints_and_bools_still_refused():
    from kvcm_core import (
        AttentionLayerConfig,
        BufferConfig,
        ConfigError,
        KVCacheManagerConfig,
        LevelConfig,
    )
    layer = AttentionLayerConfig(layer_id=np.int32(0), sliding_window_size=np.int64(64),
                                 buffers=[BufferConfig(role="k", size=np.int64(16))])
    cfg = KVCacheManagerConfig(tokens_per_block=np.int64(16), layers=[layer],
                               levels=[LevelConfig(tier="gpu", quota="1MiB")])
    assert type(cfg.tokens_per_block) is int and cfg.tokens_per_block == 16
    assert type(cfg.layers[0].layer_id) is int and type(cfg.layers[0].sliding_window_size) is int
    with pytest.raises(ConfigError, match="must be an int"):
        AttentionLayerConfig(layer_id=True, buffers=[BufferConfig(role="k", size=16)])


def test_reading_a_configuration_from_something_not_a_path_is_a_config_error() -> None:
    from kvcm_core import ConfigError, KVCacheManagerConfig
    with pytest.raises(ConfigError, match="toml=None: must be a path"):
        KVCacheManagerConfig.from_toml(None)
