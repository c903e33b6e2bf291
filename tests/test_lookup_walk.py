"""The prefix lookup's full-block walk (kvcm_core/matching.py, docs/internals.md "The
lookup walk"): a gallop and a bisection on the tree's index, over the running hash.

The walk must find exactly the blocks the key rule names (without multimodal items,
``key(i) = SHA-256(scope root || tokens of blocks 0..i as 4-byte little-endian ints)``),
whatever form the tokens come in (list, tuple, int32 or int64 array), across the chunks it
encodes the prompt in, stopping at the first block not cached with O(log k) digests and
without hashing the rest of the prompt; and ``probe_reuse`` must say exactly what
``create_kv_cache`` reuses. The reference below computes each key from scratch with
``int.to_bytes``, independently of the walk's running hash and its NumPy and ``struct``
encodings; tests/test_gallop_walk.py compares the walk with the block-by-block walk it
replaced.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import numpy as np
import pytest
from conftest import drop_page, full_layers, hybrid_layers, make_manager, tokens, tree_page
from hypothesis import given
from hypothesis import strategies as st

from kvcm_core import ArgumentTypeError, InvalidArgumentError, ReuseScope
from kvcm_core import matching as matching_mod
from kvcm_core.matching import Match, match_prefix
from kvcm_core.radix import encode_tokens, scope_root_key

TPB = 4


def ref_keys(toks: Any, tpb: int = TPB, scope: ReuseScope | None = None) -> list[bytes]:
    """The keys of the full blocks of ``toks`` (int tokens), each the SHA-256 of the scope
    root and the whole prefix up to its block's end, encoded one token at a time."""
    root = hashlib.sha256((scope or ReuseScope()).encode()).digest()
    out = []
    for b in range(len(toks) // tpb):
        prefix = b"".join(int(t).to_bytes(4, "little", signed=True)
                          for t in toks[:(b + 1) * tpb])
        out.append(hashlib.sha256(root + prefix).digest())
    return out


def store(m: Any, toks: list[int]) -> None:
    """Commit ``toks`` as one request and close it (its blocks stay cached)."""
    c = m.create_kv_cache(None, toks)
    assert c.resume() and c.resize(len(toks))
    c.commit(toks[c.history_length:])
    c.close()


def walk(m: Any, toks: Any, *, probe: bool = False, partial: bool = False,
         scope: ReuseScope | None = None) -> Match:
    """The full-block walk alone (no partial block, no pruning) on ``m``'s tree."""
    return match_prefix(m.tree, scope_root_key(scope), toks, m.tokens_per_block,
                        m.life_cycles, walk_groups=[0], prune_groups=[], partial=partial,
                        backoff=0, probe=probe)


def forms(toks: list[int]) -> list[Any]:
    return [toks, tuple(toks), np.asarray(toks, dtype=np.int32),
            np.asarray(toks, dtype=np.int64)]


@pytest.fixture
def cached(managers):
    """A manager holding 12 committed blocks of ``base`` (48 tokens)."""
    m = managers(full_layers(), slots=64)
    base = tokens(48, seed=3)
    store(m, base)
    return m, base


# -- the key rule ----------------------------------------------------------------------


def test_walk_keys_equal_the_reference_keys_for_every_prefix_length(cached):
    m, base = cached
    for n in range(len(base) + 1):
        got = walk(m, base[:n])
        assert got.keys == ref_keys(base[:n]), n
        assert got.length == n // TPB * TPB


@pytest.mark.parametrize("tpb", [1, 16, 32])
def test_walk_keys_equal_the_reference_keys_at_other_block_sizes(managers, tpb):
    m = managers(full_layers(tpb), slots=40, tpb=tpb)
    base = tokens(10 * tpb + tpb // 2, seed=tpb)
    store(m, base)
    for form in forms(base):
        got = walk(m, form)
        assert got.length == 10 * tpb
        assert got.keys == ref_keys(base, tpb)


def test_walk_nodes_are_the_tree_nodes_of_the_reference_keys(cached):
    m, base = cached
    got = walk(m, base)
    assert got.nodes.dtype == np.int64
    assert got.nodes.tolist() == [m.tree.index[k] for k in ref_keys(base)]


def test_walk_encoded_tokens_are_the_matched_tokens_little_endian(cached):
    m, base = cached
    got = walk(m, base[:30])
    assert got.data is not None
    assert got.data[:4 * got.length] == b"".join(
        t.to_bytes(4, "little", signed=True) for t in base[:got.length])


def test_walk_stops_at_the_first_block_not_cached(cached):
    m, base = cached
    for b in range(len(base) // TPB):
        other = list(base)
        other[b * TPB + 1] += 1  # block b differs: blocks after it hash differently too
        got = walk(m, other)
        assert got.length == b * TPB
        assert got.keys == ref_keys(base)[:b]


def test_walk_under_another_scope_finds_nothing(cached):
    m, base = cached
    assert walk(m, base, scope=ReuseScope(salt="other")).length == 0
    assert m.probe_reuse(ReuseScope(salt="other"), base) == 0


_SHA256 = hashlib.sha256  # the real one (the test below patches the module's)


class _CountingHash:
    """A SHA-256 object that records the length of every update and counts digests and
    copies (a copy shares the log)."""

    def __init__(self, data: bytes, log: list[Any], h: Any = None) -> None:
        self._h = _SHA256(data) if h is None else h
        self._log = log
        if h is None:
            log.append(("new", len(data)))

    def update(self, data: Any) -> None:
        self._log.append(("update", len(memoryview(data).cast("B"))))
        self._h.update(data)

    def digest(self) -> bytes:
        self._log.append(("digest", 0))
        return self._h.digest()

    def copy(self) -> _CountingHash:
        self._log.append(("copy", 0))
        return _CountingHash(b"", self._log, self._h.copy())


def _walk_digests(k: int, nfull: int) -> tuple[int, int]:
    """(digests, copies) of the walk when blocks ``0..k-1`` are cached and block ``k`` is
    not (``k == nfull``: every full block is), the whole prompt encoded at once, from its
    schedule: the first ``_LINEAR`` blocks one at a time (a digest each, up to the first
    miss); a gallop to twice as many blocks each time (capped at ``nfull``) up to the
    first miss, then a bisection down to ``_SCAN`` blocks, each probe one copy and one
    digest; then the blocks left one at a time (a digest each, up to the first miss)."""
    lin, scan = matching_mod._LINEAR, matching_mod._SCAN
    digests = copies = lo = 0
    for b in range(min(lin, nfull)):
        digests += 1
        if b >= k:
            return digests, copies
        lo += 1
    hi = 0
    while lo < nfull:  # a probe at p blocks hits when blocks 0..p-1 are all cached
        p = min(2 * lo or 1, nfull)
        digests += 1
        copies += 1
        if p > k:
            hi = p
            break
        lo = p
    if not hi:
        return digests, copies
    while hi - lo > scan:
        mid = (lo + hi) // 2
        digests += 1
        copies += 1
        if mid > k:
            hi = mid
        else:
            lo = mid
    while lo < hi - 1:
        digests += 1
        if lo >= k:
            break
        lo += 1
    return digests, copies


def test_walk_takes_at_most_2_log2_k_plus_11_digests_and_hashes_at_most_3k_blocks(
        managers, monkeypatch):
    """A prompt whose first ``k >= 1`` blocks are cached costs O(log k) digests, at most
    ``2 log2 k + 3 + 8``: the first four blocks one at a time, then a gallop over 8, 16,
    32, ... blocks and a bisection, each probe a copy of one running hash (started once,
    from the scope root) fed the blocks since the last hit in one update, down to 8
    blocks or fewer, walked one at a time; and at most ``3 k`` blocks hashed in all,
    however long the prompt is."""
    assert (matching_mod._LINEAR, matching_mod._SCAN) == (4, 8)
    m = managers(full_layers(), slots=160)
    base = tokens(130 * TPB, seed=3)
    store(m, base)
    calls: list[Any] = []
    monkeypatch.setattr(matching_mod.hashlib, "sha256",
                        lambda data=b"": _CountingHash(data, calls))
    chunk = matching_mod._CHUNK
    for k in (0, 1, 2, 3, 4, 5, 7, 8, 9, 20, 31, 32, 33, 47, 64, 100, 129, 130):
        # Then 1000 blocks not cached, 1 block, or nothing.
        for rest in (tokens(4000, seed=9), tokens(TPB, seed=9), []):
            prompt = base[: k * TPB] + rest
            nfull = len(prompt) // TPB
            if not nfull:
                continue
            for probe in (True, False):
                calls.clear()
                assert walk(m, prompt, probe=probe).length == k * TPB
                assert calls[0] == ("new", 32)  # one object, started from the root key
                digests = sum(1 for c in calls if c[0] == "digest")
                copies = sum(1 for c in calls if c[0] == "copy")
                if nfull <= 2 * chunk:  # encoded at once: no probe capped at a chunk's end
                    assert (digests, copies) == _walk_digests(k, nfull), (k, nfull)
                assert digests <= max(1, 2 * k.bit_length() + 1 + 8), (k, nfull)
                assert copies <= 2 * k.bit_length(), (k, nfull)
                hashed = sum(c[1] for c in calls[1:] if c[0] == "update") // (4 * TPB)
                assert hashed <= 3 * max(k, 1), (k, nfull)


def test_probe_keeps_no_keys_nodes_or_tokens(cached):
    m, base = cached
    got = walk(m, base, probe=True)
    assert got.length == len(base)
    assert got.keys == [] and len(got.nodes) == 0 and got.data is None


# -- token forms and chunks ------------------------------------------------------------


def test_list_tuple_int32_and_int64_prompts_walk_the_same(cached):
    m, base = cached
    prompt = [*base[:37], 7, 8, 9]
    results = [walk(m, f) for f in forms(prompt)]
    for r in results[1:]:
        assert (r.length, r.keys, r.nodes.tolist(), r.data) == \
            (results[0].length, results[0].keys, results[0].nodes.tolist(), results[0].data)
    probes = {m.probe_reuse(None, f) for f in forms(prompt)}
    assert len(probes) == 1 and probes.pop() >= results[0].length


@pytest.mark.parametrize("form", ["list", "int32"])
def test_walk_crosses_its_encoding_chunks(managers, form):
    """Prompts longer than two encoding chunks (64 blocks for lists, 1024 for arrays; up to
    two are encoded at once) are walked to the end, and a miss at or next to a chunk or
    batch boundary is found."""
    chunk = matching_mod._CHUNK if form == "list" else matching_mod._ARRAY_CHUNK
    nblocks = 2 * chunk + 5
    m = managers(full_layers(), slots=nblocks + 8)
    base = tokens(nblocks * TPB, seed=4)
    store(m, base)

    def as_form(toks: list[int]) -> Any:
        return toks if form == "list" else np.asarray(toks, dtype=np.int32)

    full = walk(m, as_form(base))
    assert full.length == len(base)
    assert full.keys == ref_keys(base)
    assert full.data == np.asarray(base, dtype="<i4").tobytes()
    # Misses around the chunk boundaries and the walk's probes (4 blocks one by one, then
    # a gallop to 8, 16, 32, ... blocks).
    edges = {3, 4, 5, 7, 8, 9, 15, 16, 17, 79, 80, 81, chunk - 1, chunk, chunk + 1,
             2 * chunk - 1, 2 * chunk, 2 * chunk + 1}
    for miss in sorted(edges & set(range(nblocks))):
        other = list(base)
        other[miss * TPB] += 1
        assert walk(m, as_form(other)).length == miss * TPB
        assert m.probe_reuse(None, as_form(other)) == miss * TPB


def test_bad_token_in_the_first_chunk_fails_with_nothing_cached(managers):
    m = managers(full_layers(), slots=8)
    with pytest.raises(InvalidArgumentError, match="2147483648"):
        m.probe_reuse(None, [1, 2, 3, 2**31])
    with pytest.raises(ArgumentTypeError, match=r"1\.5"):
        m.probe_reuse(None, [1, 2, 1.5])
    with pytest.raises(InvalidArgumentError, match="32-bit"):
        m.probe_reuse(None, np.asarray([1, 2, 3, -(2**31) - 1], dtype=np.int64))


# -- the list encoding (struct) --------------------------------------------------------


def test_list_encoding_equals_the_array_module_encoding():
    toks = [0, 1, -1, 2**31 - 1, -(2**31), 127999, np.int64(42), True]
    data, mm = encode_tokens(toks)
    assert not mm
    assert data == array("i", [int(t) for t in toks]).tobytes()
    assert data == b"".join(int(t).to_bytes(4, "little", signed=True) for t in toks)


def test_list_encoding_refuses_out_of_range_and_non_int_tokens_by_name():
    with pytest.raises(InvalidArgumentError, match=r"token 1=-2147483649"):
        encode_tokens([5, -(2**31) - 1])
    with pytest.raises(ArgumentTypeError, match=r"token 2='x'"):
        encode_tokens([5, 6, "x"])


def test_list_encoding_leaves_multimodal_digests_to_the_block_hash():
    assert encode_tokens([1, b"d" * 32, 2]) == (b"", True)


def test_multimodal_prompt_walks_its_digest_blocks(managers):
    m = managers(full_layers(), slots=16)
    prompt: list[Any] = [*tokens(6, seed=5), hashlib.sha256(b"img").digest(), *tokens(9)]
    c = m.create_kv_cache(None, prompt)
    assert c.resume() and c.resize(len(prompt))
    c.commit(prompt)
    c.close()
    got = walk(m, prompt)
    assert got.length == len(prompt) // TPB * TPB
    assert got.data is None
    assert m.probe_reuse(None, prompt[:-1]) == len(prompt) - 1  # the partial tail too


# -- the group check after the walk ----------------------------------------------------


def test_a_block_missing_its_full_attention_page_ends_the_match(managers):
    """The walk finds the node by key, the check after it sees the page is gone."""
    m = managers(hybrid_layers(), slots=64, commit_min_snapshot=True)
    base = tokens(32, seed=6)
    store(m, base)
    before = m.probe_reuse(None, base)
    assert before > 12
    full_g = m.get_layer_group_id(0)
    drop_page(m, tree_page(m, base, 2, full_g))
    assert m.probe_reuse(None, base) <= 2 * TPB
    c = m.create_kv_cache(None, base)
    assert c.history_length == m.probe_reuse(None, base)
    c.close()


# -- probe equals create, over random trees (hypothesis) -------------------------------


prompt_parts = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@given(
    stored=st.lists(st.tuples(st.integers(0, 2), prompt_parts), min_size=1, max_size=6),
    probes=st.lists(st.tuples(st.integers(0, 2), prompt_parts, st.integers(0, 60)),
                    min_size=1, max_size=6),
)
def test_walk_and_probe_agree_with_the_reference_over_random_trees(stored, probes):
    """Prompts share one of three prefixes and go on with a small vocabulary (so their
    blocks collide often); each probe is checked against the reference chain and the
    tree's index, in every token form, and against what ``create_kv_cache`` reuses."""
    prefixes = [tokens(12, seed=20 + i) for i in range(3)]
    m = make_manager(full_layers(), slots=256)
    try:
        for pfx, tail in stored:
            store(m, prefixes[pfx][: 4 * (pfx + 1)] + tail)
        index = m.tree.index
        for pfx, tail, cut in probes:
            prompt = (prefixes[pfx] + tail)[:cut]
            ref = ref_keys(prompt)
            expect = 0
            while expect < len(ref) and ref[expect] in index:
                expect += 1
            for f in forms(prompt):
                got = walk(m, f)
                assert got.length == expect * TPB
                assert got.keys == ref[:expect]
                assert walk(m, f, probe=True).length == expect * TPB
            probe = m.probe_reuse(None, prompt)
            assert probe >= expect * TPB  # a partial block may add to the full ones
            c = m.create_kv_cache(None, np.asarray(prompt, dtype=np.int32))
            assert c.history_length == probe
            c.close()
    finally:
        m.shutdown()


@given(toks=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=50))
def test_any_int32_prompt_encodes_the_same_as_a_list_and_an_array(toks):
    data, mm = encode_tokens(toks)
    assert not mm
    assert data == np.asarray(toks, dtype="<i4").tobytes()
    assert encode_tokens(np.asarray(toks, dtype=np.int64))[0] == data
