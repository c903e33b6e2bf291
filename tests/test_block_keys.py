"""The block-key rule (kvcm_core/radix.py, docs/semantics.md "Block keys"), stated by an
independent reference and checked where keys are made: the lookup walk, commits (in one
piece or a token at a time, continuing from the match's cursor or from a rebuilt one),
rewinds and multimodal prompts.

With ``root = SHA-256(scope.encode())``, ``enc(i)`` the tokens of full block ``i`` as
4-byte little-endian ints (a block holding multimodal digests: a marker, a bitmap of the
digest positions, then the items) and ``f`` the first full block holding a digest:
``key(i) = SHA-256(root || enc(0) || ... || enc(i))`` for ``i < f`` and
``key(i) = SHA-256(key(i - 1) || enc(i))`` from ``f`` on (``key(-1) = root``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from conftest import drop_page, full_layers, tokens, tree_node, tree_page
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcm_core import ReuseScope
from kvcm_core import matching as matching_mod
from kvcm_core.radix import KEY_HASH, block_keys, extend_keys, key_cursor, scope_root_key

TPB = 4
IMG = hashlib.sha256(b"image").digest()
IMG2 = hashlib.sha256(b"other image").digest()


# -- the reference -----------------------------------------------------------------------


def _enc_plain(items: Any) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=True) for t in items)


def _enc_mm(items: Any) -> bytes:
    bitmap = sum(1 << i for i, t in enumerate(items) if isinstance(t, bytes))
    return (b"\xffkvcm-mm\x00" + bitmap.to_bytes((len(items) + 7) // 8, "little")
            + b"".join(t if isinstance(t, bytes) else _enc_plain([t]) for t in items))


def ref_keys(toks: list[Any], tpb: int = TPB, scope: ReuseScope | None = None) -> list[bytes]:
    """Every full block's key, each computed from scratch (no running state)."""
    root = hashlib.sha256((scope or ReuseScope()).encode()).digest()
    nfull = len(toks) // tpb
    blocks = [toks[b * tpb : (b + 1) * tpb] for b in range(nfull)]
    f = next((b for b, blk in enumerate(blocks) if any(isinstance(t, bytes) for t in blk)),
             nfull)
    out: list[bytes] = []
    for i in range(nfull):
        if i < f:
            out.append(hashlib.sha256(root + _enc_plain(toks[: (i + 1) * tpb])).digest())
        else:
            prev = out[i - 1] if i else root
            blk = blocks[i]
            enc = _enc_mm(blk) if any(isinstance(t, bytes) for t in blk) else _enc_plain(blk)
            out.append(hashlib.sha256(prev + enc).digest())
    return out


def run(m: Any, toks: list[Any], *, pieces: int | None = None, scope: Any = None) -> Any:
    """Create a cache for ``toks`` (matching all of them), commit the rest in pieces of
    ``pieces`` tokens (None: one piece), close it; returns the cache."""
    c = m.create_kv_cache(scope, toks)
    assert c.resume()
    pos = c.history_length
    step = pieces or max(1, len(toks) - pos)
    while pos < len(toks):
        end = min(len(toks), pos + step)
        assert c.resize(end)
        c.commit(toks[pos:end])
        pos = end
    c.close()
    return c


def tree_keys(m: Any) -> set[bytes]:
    """The keys of every full block in the tree."""
    t = m.tree
    return {k for k, nid in t.index.items() if int(t.ordinal[nid]) >= 0}


# -- (1) the rule, computed independently ------------------------------------------------


def test_a_committed_blocks_key_is_the_sha256_of_the_root_and_its_whole_prefix(managers):
    m = managers(full_layers(), slots=32)
    toks = tokens(9 * TPB + 3, seed=11)
    run(m, toks)
    root = hashlib.sha256(ReuseScope().encode()).digest()
    assert root == scope_root_key(None)
    expect = []
    for i in range(len(toks) // TPB):
        prefix = b"".join(t.to_bytes(4, "little", signed=True) for t in toks[: (i + 1) * TPB])
        expect.append(hashlib.sha256(root + prefix).digest())
        nid = tree_node(m, toks, (i + 1) * TPB)
        assert nid is not None and m.tree.key(nid) == expect[i], i
        assert int(m.tree.ordinal[nid]) == i
    assert tree_keys(m) == set(expect)
    assert block_keys(root, toks, TPB, 0, len(expect)) == expect
    assert block_keys(root, np.asarray(toks, dtype=np.int32), TPB, 3, 7) == expect[3:7]


@pytest.mark.parametrize("tpb", [1, 16, 32])
def test_the_rule_at_other_block_sizes_and_in_another_scope(managers, tpb):
    m = managers(full_layers(tpb), slots=24, tpb=tpb)
    scope = ReuseScope(lora_id=3, salt="tenant")
    toks = tokens(6 * tpb, seed=tpb)
    run(m, toks, scope=scope)
    assert tree_keys(m) == set(ref_keys(toks, tpb, scope))
    assert not set(ref_keys(toks, tpb)) & tree_keys(m)  # the default scope's keys differ
    assert m.probe_reuse(scope, toks) == len(toks)
    assert m.probe_reuse(None, toks) == 0


def test_the_rule_is_recorded_in_the_layout_fingerprint_of_framed_levels(tmp_path,
                                                                         monkeypatch):
    from kvcm_core import KVCacheManager, KVCacheManagerConfig, LevelConfig
    from kvcm_core import frame as frame_mod

    seen: list[Any] = []
    real = frame_mod.layout_fingerprint
    monkeypatch.setattr(frame_mod, "layout_fingerprint",
                        lambda d: seen.append(d) or real(d))
    levels = [LevelConfig(tier="gpu", quota=1 << 16),
              LevelConfig(tier="disk", quota=1 << 20, options={"path": str(tmp_path / "d")})]
    with KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, layers=full_layers(),
                                             levels=levels, kernel_backend="numpy")):
        pass
    assert KEY_HASH == "sha256-prefix"
    assert [d["hash"] for d in seen] == [KEY_HASH]
    assert real(seen[0]) != real({**seen[0], "hash": "sha256"})  # the old rule's data


# -- (2) one go, in pieces, from cursors or rebuilt ones; distinct prefixes ----------------


item = st.one_of(st.integers(0, 3), st.sampled_from([IMG, IMG2]))
plain_item = st.integers(0, 3)


@settings(max_examples=150, deadline=None)
@given(tpb=st.integers(2, 4), toks=st.lists(st.one_of(plain_item, plain_item, item),
                                            max_size=40),
       cuts=st.lists(st.integers(0, 12), max_size=6), rebuild=st.lists(st.booleans(),
                                                                       max_size=8),
       as_array=st.booleans())
# A digest in an early block, a cut after it, then several all-plain blocks keyed in one
# call from the chained cursor (continued, rebuilt from the last key, rebuilt from the
# tokens); the strategy below forces this shape.
@example(tpb=2, toks=[IMG, 0, 1, 2, 3, 1, 2, 0], cuts=[1], rebuild=[], as_array=False)
@example(tpb=2, toks=[IMG, 0, 1, 2, 3, 1, 2, 0], cuts=[1], rebuild=[False, True],
         as_array=False)
@example(tpb=3, toks=[0, 1, 2, 3, IMG2, 1, 2, 2, 0, 1, 1, 1, 3, 0, 0], cuts=[2, 2],
         rebuild=[False, False, True], as_array=False)
@example(tpb=4, toks=[1, IMG, 2, 3, *range(4), 3, 3, 2, 2, 0, 1, 0, 1, 2], cuts=[1, 3],
         rebuild=[], as_array=True)
def test_keys_in_one_go_equal_keys_in_pieces(tpb, toks, cuts, rebuild, as_array):
    root = scope_root_key(None)
    nfull = len(toks) // tpb
    ref = ref_keys(toks, tpb)
    seq: Any = toks
    if as_array and not any(isinstance(t, bytes) for t in toks):
        seq = np.asarray(toks, dtype=np.int32)
    assert block_keys(root, seq, tpb, 0, nfull) == ref
    # Pieces, as commits make them: each continues from the cursor the last one left, or
    # (as after a cut match or a rewind) from one rebuilt from the tokens (given the last
    # key or not).
    bounds = sorted({min(c, nfull) for c in cuts} | {nfull})
    keys: list[bytes] = []
    cursor: Any = None
    for i, end in enumerate(bounds):
        if i < len(rebuild) and rebuild[i]:
            cursor = None
        b0 = len(keys)
        if cursor is None:
            last = keys[-1] if keys and i % 2 else None
            cursor = key_cursor(root, seq[: b0 * tpb], tpb, b0, last)
        cursor = extend_keys(keys, root, seq[b0 * tpb : end * tpb], tpb, b0, cursor)
        assert keys == ref[:end]
        # The cursor stands after ``end`` blocks: a rebuilt one is the same.
        again = key_cursor(root, seq, tpb, end)
        if isinstance(cursor, bytes):
            assert again == cursor == keys[-1]
        else:
            assert again.digest() == cursor.digest()
            assert cursor.digest() == (keys[-1] if end else hashlib.sha256(root).digest())


@st.composite
def _chained_then_plain(draw: Any) -> tuple[int, list[Any], int]:
    """``(tpb, tokens, cut)``: plain blocks, a block holding a digest, then at least two
    all-plain blocks; ``cut`` (in blocks) falls after the digest's block and leaves at
    least two plain blocks after it."""
    tpb = draw(st.integers(1, 4))
    head = draw(st.lists(plain_item, min_size=draw(st.integers(0, 3)) * tpb,
                         max_size=3 * tpb).map(lambda x: x[: len(x) // tpb * tpb]))
    mm = draw(st.lists(item, min_size=tpb, max_size=tpb).filter(
        lambda b: any(isinstance(t, bytes) for t in b)))
    nplain = draw(st.integers(2, 6))
    tail = draw(st.lists(plain_item, min_size=nplain * tpb, max_size=nplain * tpb + tpb - 1))
    f = len(head) // tpb
    cut = draw(st.integers(f + 1, f + 1 + nplain - 2))
    return tpb, head + mm + tail, cut


@settings(max_examples=100, deadline=None)
@given(shape=_chained_then_plain(), how=st.sampled_from(["continued", "from the last key",
                                                         "rebuilt"]))
def test_plain_blocks_after_a_multimodal_block_each_chain_on_the_key_before(shape, how):
    """After the first block holding a digest, keys chain: an all-plain block's key is
    SHA-256 of the key before it and its tokens, also when several such blocks are keyed
    in one call (the commit of a chunk after a multimodal one)."""
    tpb, toks, cut = shape
    root = scope_root_key(None)
    nfull = len(toks) // tpb
    ref = ref_keys(toks, tpb)
    keys: list[bytes] = []
    cursor = extend_keys(keys, root, toks[: cut * tpb], tpb, 0, key_cursor(root, [], tpb, 0))
    assert isinstance(cursor, bytes) and keys == ref[:cut]
    if how == "from the last key":
        cursor = key_cursor(root, toks[: cut * tpb], tpb, cut, keys[-1])
    elif how == "rebuilt":
        cursor = key_cursor(root, toks[: cut * tpb], tpb, cut)
    assert cursor == ref[cut - 1]
    end = extend_keys(keys, root, toks[cut * tpb : nfull * tpb], tpb, cut, cursor)
    assert keys == ref
    assert end == ref[-1]
    assert len(set(keys)) == len(keys)  # equal plain blocks after the digest: distinct keys
    assert block_keys(root, toks, tpb, cut, nfull) == ref[cut:]


@settings(max_examples=150, deadline=None)
@given(tpb=st.integers(2, 4), a=st.lists(item, max_size=24), b=st.lists(item, max_size=24),
       shared=st.integers(0, 24))
def test_two_sequences_share_a_key_only_where_they_share_the_whole_prefix(tpb, a, b, shared):
    b = a[:shared] + b  # often a common prefix, often not
    root = scope_root_key(None)
    ka = block_keys(root, a, tpb, 0, len(a) // tpb)
    kb = block_keys(root, b, tpb, 0, len(b) // tpb)
    prefix_of: dict[bytes, tuple[Any, ...]] = {}
    for toks, keys in ((a, ka), (b, kb)):
        for i, k in enumerate(keys):
            prefix = tuple(toks[: (i + 1) * tpb])
            assert prefix_of.setdefault(k, prefix) == prefix  # one key, one prefix
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[: (i + 1) * tpb] == b[: (i + 1) * tpb])
    other = block_keys(scope_root_key(ReuseScope(salt=1)), a, tpb, 0, len(a) // tpb)
    assert not set(other) & set(ka)  # another scope: no key in common


# -- (3) reuse across requests committed in pieces ---------------------------------------


def test_blocks_committed_a_token_at_a_time_are_reused_by_one_lookup(managers):
    m = managers(full_layers(), slots=32)
    toks = tokens(7 * TPB + 2, seed=21)
    c = m.create_kv_cache(None, toks[:1])
    assert c.resume() and c.history_length == 0
    for pos in range(len(toks)):  # one token per step
        assert c.resize(pos + 1)
        c.commit(toks[pos : pos + 1])
    c.close()
    assert tree_keys(m) == set(ref_keys(toks))
    assert m.probe_reuse(None, toks) == len(toks)
    assert m.probe_reuse(None, np.asarray(toks[: 5 * TPB], dtype=np.int32)) == 5 * TPB
    b = m.create_kv_cache(None, toks)
    assert b.history_length == len(toks)
    b.close()


@pytest.mark.parametrize("matched", ["whole prompt", "then a miss", "cut by a drop"])
def test_a_prompt_committed_in_one_go_is_extended_a_token_at_a_time(managers, matched):
    """The second request continues the keys from its match's cursor (the whole prompt
    matched) or from a rebuilt one (the walk went past the match: a miss, or a block
    without its page), then a third finds all of it in one lookup."""
    m = managers(full_layers(), slots=48)
    first = tokens(6 * TPB, seed=31)
    run(m, first)
    longer = first + tokens(5 * TPB + 1, seed=32)
    prompt = longer[: 8 * TPB] if matched == "then a miss" else first
    if matched == "cut by a drop":  # block 4 stays in the tree (under it: 5), pageless
        drop_page(m, tree_page(m, first, 4, 0))
    c = m.create_kv_cache(None, prompt)
    reused = 4 * TPB if matched == "cut by a drop" else len(first)
    assert c.history_length == reused
    if matched == "whole prompt":
        assert c._cursor is not None and c._cursor.digest() == c._keys[-1]
    else:
        assert c._cursor is None  # rebuilt at the first commit
    assert c.resume()
    for pos in range(reused, len(longer)):
        assert c.resize(pos + 1)
        c.commit(longer[pos : pos + 1])
    c.close()
    assert set(ref_keys(longer)) <= tree_keys(m)
    assert m.probe_reuse(None, longer) == len(longer)
    assert m.probe_reuse(None, np.asarray(longer, dtype=np.int64)) == len(longer)


def test_a_rewind_past_the_keyed_blocks_rebuilds_the_cursor(managers):
    m = managers(full_layers(), slots=32, max_rewind_len=3 * TPB)
    toks = tokens(6 * TPB, seed=41)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(4 * TPB)
    c.commit(toks[: 2 * TPB + 1])
    keys_before = list(c._keys)
    # A rewind never goes below the committed tokens, whose blocks are the keyed ones; a
    # key past it is left only by a commit that stopped publishing. Planted here.
    c._keys.append(b"x" * 32)
    assert c.resize(4 * TPB, history_length=2 * TPB)
    assert c._keys == keys_before and c._cursor is None
    other = toks[: 2 * TPB] + tokens(4 * TPB, seed=42)
    for pos in range(2 * TPB, len(other)):
        assert c.resize(max(pos + 1, c.capacity))
        c.commit(other[pos : pos + 1])
    c.close()
    assert m.probe_reuse(None, other) == len(other)
    assert set(ref_keys(other)) <= tree_keys(m)


def test_the_walk_hands_its_cursor_only_when_it_stopped_at_the_match(managers):
    m = managers(full_layers(), slots=32)
    toks = tokens(5 * TPB, seed=51)
    run(m, toks)

    def match(prompt: Any, **kw: Any) -> Any:
        return matching_mod.match_prefix(m.tree, scope_root_key(None), prompt, TPB,
                                         m.life_cycles, walk_groups=[0], prune_groups=[],
                                         partial=True, backoff=kw.get("backoff", 0),
                                         probe=kw.get("probe", False))

    full = match([*toks, 1, 2])
    assert full.length == len(toks)
    assert full.cursor is not None and full.cursor.digest() == full.keys[-1]
    assert match(toks + tokens(TPB, seed=52)).cursor is None  # a miss: hashed one more
    assert match(toks, probe=True).cursor is None
    cut = match(toks, backoff=TPB + 1)
    assert cut.length < len(toks) and cut.cursor is None


# -- (4) multimodal prompts ----------------------------------------------------------------


@pytest.mark.parametrize("plain_first", [True, False])
def test_a_multimodal_prompt_reuses_the_plain_blocks_before_its_first_item(managers,
                                                                             plain_first):
    m = managers(full_layers(), slots=48)
    plain = tokens(7 * TPB, seed=61)
    mm: list[Any] = list(plain)
    mm[3 * TPB] = IMG  # block f = 3 holds the item, first in the block
    mm[5 * TPB + 2] = IMG2
    first, second = (plain, mm) if plain_first else (mm, plain)
    run(m, first)
    assert m.probe_reuse(None, second) == 3 * TPB  # blocks 0..2, then the item differs
    c = m.create_kv_cache(None, second)
    assert c.history_length == 3 * TPB
    assert c.resume()
    for pos in range(3 * TPB, len(second)):  # the rest decode-like
        assert c.resize(pos + 1)
        c.commit(second[pos : pos + 1])
    c.close()
    assert tree_keys(m) == set(ref_keys(plain)) | set(ref_keys(mm))
    assert len(tree_keys(m)) == 7 + 4
    for toks in (plain, mm):
        assert m.probe_reuse(None, toks) == len(toks)


def test_a_multimodal_item_past_the_walks_first_chunk(managers):
    """A list prompt is encoded 64 blocks at a time: an item in a later chunk continues
    the walk block by block from the running hash."""
    m = managers(full_layers(), slots=96)
    n = matching_mod._CHUNK + 6
    plain = tokens(n * TPB, seed=71)
    mm: list[Any] = list(plain)
    f = matching_mod._CHUNK + 2
    mm[f * TPB + 1] = IMG
    run(m, mm)
    assert tree_keys(m) == set(ref_keys(mm))
    assert m.probe_reuse(None, mm) == len(mm)
    assert m.probe_reuse(None, plain) == f * TPB + 1  # and the partial block's one token
    got = matching_mod.match_prefix(m.tree, scope_root_key(None), mm, TPB, m.life_cycles,
                                    walk_groups=[0], prune_groups=[], partial=False,
                                    backoff=0)
    assert got.keys == ref_keys(mm) and got.data is None
    assert isinstance(got.cursor, bytes) and got.cursor == got.keys[-1]  # chained


def test_multimodal_keys_continue_the_chain_a_block_at_a_time(managers):
    m = managers(full_layers(), slots=32)
    mm: list[Any] = [*tokens(TPB + 1, seed=81), IMG, *tokens(4 * TPB, seed=82)]
    c = m.create_kv_cache(None, [])
    assert c.resume()
    for pos in range(len(mm)):
        assert c.resize(pos + 1)
        c.commit(mm[pos : pos + 1])
    c.close()
    assert tree_keys(m) == set(ref_keys(mm))
    assert m.probe_reuse(None, mm) == len(mm)



@pytest.mark.parametrize("pieces", [None, TPB, 2 * TPB])
def test_plain_blocks_committed_after_a_multimodal_block_continue_its_chain(managers,
                                                                           pieces):
    """An image block committed, then three plain blocks committed in chunks (one chunk,
    a block at a time, two blocks then one): the tree holds the reference keys, a lookup
    matches the whole prompt, and a prompt differing only in the middle plain block
    shares no key from that block on (the next block's tokens are equal, its prefix
    is not)."""
    m = managers(full_layers(), slots=32)
    image: list[Any] = [IMG, *tokens(TPB - 1, seed=101)]
    plain = tokens(3 * TPB, seed=102)
    a = image + plain
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(TPB)
    c.commit(image)
    step = pieces or len(plain)
    for pos in range(0, len(plain), step):
        assert c.resize(min(len(a), TPB + pos + step))
        c.commit(plain[pos : pos + step])
    c.close()
    assert tree_keys(m) == set(ref_keys(a))
    assert m.probe_reuse(None, a) == len(a)
    b = list(a)
    b[2 * TPB + 1] += 1  # the middle plain block differs
    assert m.probe_reuse(None, b) == 2 * TPB + 1  # two blocks, and 1 token of the third
    run(m, b, pieces=pieces)
    ka, kb = ref_keys(a), ref_keys(b)
    assert ka[:2] == kb[:2] and not set(ka[2:]) & set(kb[2:])
    assert tree_keys(m) == set(ka) | set(kb)
    assert len(tree_keys(m)) == 4 + 2
    for toks in (a, b):
        assert m.probe_reuse(None, toks) == len(toks)
