"""Bad arguments get the typed errors of the API (``ArgumentTypeError`` is a TypeError,
``InvalidArgumentError`` a ValueError), naming the argument and the rule, and change
nothing; a resize no level 0 could ever hold is a refusal, not a crash."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import full_layers, make_manager, tokens

from kvcm_core import ArgumentTypeError, InvalidArgumentError


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


@pytest.mark.parametrize("quota", [2**62, 10**30])
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


def test_a_list_of_float_tokens_is_a_type_error_naming_the_token() -> None:
    m = make_manager(full_layers())
    with pytest.raises(ArgumentTypeError, match=r"token 1=2.0: must be an int token id"):
        m.probe_reuse(None, [1, 2.0, 3])


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
