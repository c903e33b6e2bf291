"""Token and scope input found wrong by session 25's review of multimodal inputs: what the
manager keeps of a request's tokens must not change under the caller, every token sequence
is checked whatever its type, and bad input is refused when it is given, naming what is
wrong."""

from __future__ import annotations

import collections
import hashlib
from pathlib import Path

import numpy as np
import pytest
from levels_helpers import make_manager

from kvcm_core import ReuseScope
from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError
from kvcm_core.manager import KVCacheManager


def _digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


@pytest.fixture
def manager(tmp_path: Path) -> KVCacheManager:  # 4 tokens per block, one GPU level
    m = make_manager([("gpu", 64)], tmp_path)
    yield m
    m.shutdown()


def _publish(m: KVCacheManager, tokens: list, scope: ReuseScope | None = None) -> None:
    c = m.create_kv_cache(scope, [])
    assert c.resume() and c.resize(len(tokens))
    c.commit(tokens)
    c.close()


def test_a_bytearray_digest_the_engine_reuses_after_commit_never_makes_blocks_match_another_image(
        manager: KVCacheManager) -> None:
    a, b = _digest("image A"), _digest("image B")
    buf = bytearray(a)  # an engine that reuses one buffer for each request's image hash
    _publish(manager, [1, 2, buf, buf, buf, buf, 3, 4])
    buf[:] = b  # the next request's image
    assert manager.probe_reuse(None, [1, 2, a, a, a, a, 3, 4]) == 8
    # Image B shares only the text before the image, however its prefix is cut.
    assert manager.probe_reuse(None, [1, 2, b, b, b, b, 3, 4]) == 2
    assert manager.probe_reuse(None, [1, 2, b]) == 2
    assert manager.probe_reuse(None, [1, 2, a]) == 3
    c = manager.create_kv_cache(None, [1, 2, b])
    assert c.history_length == 2
    c.close()


def test_commit_checks_a_deque_of_tokens_as_it_checks_a_list_and_a_refusal_changes_nothing(
        manager: KVCacheManager) -> None:
    a = _digest("image A")
    c = manager.create_kv_cache(None, [])
    assert c.resume() and c.resize(16)
    c.commit([1, a, 3, 4, 5, 6])
    for bad, error in ((collections.deque([7.9]), ArgumentTypeError),
                       (collections.deque([7, True]), ArgumentTypeError),
                       (collections.deque([2**40]), InvalidArgumentError)):
        with pytest.raises(error, match="token"):
            c.commit(bad)
        assert c.history_length == 6
    c.commit(collections.deque([7, 8]))  # a good deque, after the refusals
    assert c.history_length == 8
    c.close()
    c = manager.create_kv_cache(None, [])  # plain tokens (no digest): bools refused too
    assert c.resume() and c.resize(16)
    with pytest.raises(ArgumentTypeError, match="bool"):
        c.commit(collections.deque([True, False, 3, 4]))
    assert c.history_length == 0
    c.commit(collections.deque([1, 0, 3, 4]))
    c.close()
    assert manager.probe_reuse(None, [1, 0, 3, 4]) == 4


@pytest.mark.parametrize("n", [10, 2 * 1024 * 4 + 10])
def test_an_out_of_range_token_in_an_integer_array_is_named_by_its_position_and_value(
        manager: KVCacheManager, n: int) -> None:
    tokens = np.arange(1, n + 1, dtype=np.int64)
    tokens[7] = 2**31
    with pytest.raises(InvalidArgumentError, match=r"token 7=2147483648: token ids must fit"):
        manager.probe_reuse(None, tokens)
    c = manager.create_kv_cache(None, [])
    assert c.resume() and c.resize(16)
    with pytest.raises(InvalidArgumentError, match=r"token 7=2147483648"):
        c.commit(tokens[:8])
    assert c.history_length == 0
    c.close()


@pytest.mark.parametrize("kw, shown", [
    ({"salt": "\ud800"}, r"ReuseScope\.salt='\\ud800'"),
    ({"salt": 10**5000}, r"ReuseScope\.salt=<an int of \d+ bits>"),
    ({"lora_id": 10**5000}, r"ReuseScope\.lora_id=<an int of \d+ bits>"),
])
def test_a_scope_field_that_cannot_be_encoded_is_refused_when_the_scope_is_made(
        kw: dict, shown: str) -> None:
    with pytest.raises(InvalidArgumentError, match=shown):
        ReuseScope(**kw)


def test_a_trailing_partial_block_of_numpy_ints_after_an_image_is_shared_like_plain_ints(
        manager: KVCacheManager) -> None:
    a = _digest("image A")
    prompt = [1, 2, a, a, 5, 6, 7, 8, np.int64(11), np.int64(12)]
    _publish(manager, prompt)
    assert manager.probe_reuse(None, prompt) == 10
    assert manager.probe_reuse(None, [1, 2, a, a, 5, 6, 7, 8, 11, 12]) == 10


def test_an_image_block_published_beside_a_partial_block_of_colliding_ints_keeps_it(
        manager: KVCacheManager) -> None:
    """A full block holding a digest does not cover a partial block of plain tokens, even
    when the partial block's first token equals the digest's first 4 bytes read as an
    int32 (the tree's compact form of the digest)."""
    a = _digest("image A")
    x = int.from_bytes(a[:4], "little", signed=True)
    _publish(manager, [x, 7, 8])
    assert manager.probe_reuse(None, [x, 7, 8]) == 3
    _publish(manager, [a, 7, 8, 9])
    assert manager.probe_reuse(None, [x, 7, 8]) == 3
    assert manager.probe_reuse(None, [a, 7, 8, 9]) == 4


def test_a_partial_block_of_plain_tokens_beside_an_image_block_with_a_colliding_id_is_shared(
        manager: KVCacheManager) -> None:
    """A closed request's partial block ``[1, 2, x]`` is published although a full block
    ``[1, 2, d, d]`` starts the same way in the tree's compact form (``x``: the digest's
    first 4 bytes as an int32): a block holding digests covers no plain partial block."""
    from kvcm_core.radix import token_id32

    a = _digest("image A")
    x = token_id32(a)
    _publish(manager, [1, 2, a, a])
    _publish(manager, [1, 2, x])
    assert manager.probe_reuse(None, [1, 2, x]) == 3


def test_the_log_keeps_digests_exactly_across_appends_and_rewinds() -> None:
    from kvcm_core.radix import token_id32
    from kvcm_core.tokens import TokenLog

    a, b = _digest("image A"), _digest("image B")
    log = TokenLog([1, 2, a, 3])
    assert log.has_digests and list(log.items(0)) == [1, 2, a, 3]
    log.extend([b, 4])
    log.truncate(2)  # the digests are cut off
    assert list(log.items(0)) == [1, 2] and log.n == 2
    log.extend([5, bytearray(b)])  # a caller's bytearray is kept as bytes
    items = list(log.items(0))
    assert items == [1, 2, 5, b] and type(items[3]) is bytes
    rows, mm = log.rows(0, 4, 2)
    assert mm and rows.tolist() == [[1, 2], [5, int(np.uint32(token_id32(b)).view(np.int32))]]
    rows, mm = log.rows(0, 2, 2)
    assert not mm and rows.tolist() == [[1, 2]]
    assert not TokenLog([1, 2, 3]).has_digests
