"""The galloping full-block walk (kvcm_core/matching.py ``_gallop``, docs/internals.md "The
lookup walk") against the walk it replaced, over random trees.

The reference below is main's block-by-block walk (before the gallop), kept verbatim but
for names: it hashes every block in turn and looks each key up, and takes the nodes and
keys from the index (the steps after the walk, the partial block, pruning and backoff,
call the product's own functions). The gallop finds the same run of cached blocks by
index membership at about ``2 log2 k`` positions, takes the nodes from the parent links
and the keys from the nodes; it must return exactly the same :class:`Match` (length,
nodes, keys, encoded tokens and key cursor) on every input: trees with holes (pages
evicted, nodes collected, node ids recycled), prompts matched not at all, partly, to a
chunk's end or fully, a partial block after the full ones, walk groups missing pages,
pruning and backoff, multimodal digests, a scope root absent, small encoding chunks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from conftest import full_layers, hybrid_layers, make_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core import ReuseScope
from kvcm_core import matching as matching_mod
from kvcm_core.matching import Match, match_prefix, reusable_length, with_partial_block
from kvcm_core.radix import PrefixTree, encode_tokens, extend_keys, scope_root_key

_DONE, _MISS, _MM = 0, 1, 2
_EMPTY = np.empty(0, dtype=np.int64)


def linear_match_prefix(tree: PrefixTree, root_key: bytes, tokens: Sequence[Any] | np.ndarray,
                        tpb: int, life_cycles: Sequence[Any], *, walk_groups: Sequence[int],
                        prune_groups: Sequence[int], partial: bool, backoff: int,
                        probe: bool = False) -> Match:
    """main's ``match_prefix`` before the gallop (chunk sizes read from matching.py, so a
    test can shrink them for both), with the encoding of lists whole (every token
    validated)."""
    n = len(tokens)
    if n == 0:
        return Match(0, _EMPTY, [])
    chunk = matching_mod._ARRAY_CHUNK if isinstance(tokens, np.ndarray) else matching_mod._CHUNK
    if isinstance(tokens, np.ndarray):
        data, mm = encode_tokens(tokens if n <= 2 * chunk * tpb else tokens[: chunk * tpb])
    else:  # a list is encoded (validated) whole; with digests, its first chunk walked
        data, mm = encode_tokens(tokens)
        if mm and n > 2 * chunk * tpb:
            data, mm = encode_tokens(tokens[: chunk * tpb])
    root = tree.index.get(root_key)
    if root is None:
        return Match(0, _EMPTY, [])
    nfull = n // tpb
    keys: list[bytes] = []
    found: list[int] = []
    cursor: Any = hashlib.sha256(root_key)
    chunks: list[bytes] = []
    stop = _MM
    if not mm:
        chunks.append(data)
        stop = _linear_walk(tree.index, cursor, tokens, data, tpb, nfull, chunk, found,
                            None if probe else keys, chunks)
    if stop == _MM:
        mm = True
        get = tree.index.get
        walked = keys if not probe else []
        stop = _DONE
        for b in range(len(found), nfull):
            k: list[bytes] = []
            cursor = extend_keys(k, root_key, tokens[b * tpb : (b + 1) * tpb], tpb, b, cursor)
            nid = get(k[0])
            if nid is None:
                stop = _MISS
                break
            walked.append(k[0])
            found.append(nid)
    nodes = np.fromiter(found, np.int64, len(found)) if found else _EMPTY
    if walk_groups and len(nodes):
        ok: Any
        if len(walk_groups) == 1:
            ok = tree.pages[:, walk_groups[0]][nodes] >= 0
        else:
            ok = (tree.pages[nodes][:, walk_groups] >= 0).all(axis=1)
        if np.count_nonzero(ok) != len(ok):
            cut = int(ok.argmin())
            nodes = nodes[:cut]
            del keys[cut:]
    length = len(nodes) * tpb
    # After the walk (the part under test), the same steps as match_prefix.
    if partial and length < n:
        nodes, length = with_partial_block(tree, root, tokens, nodes, tpb, walk_groups)
    if probe and not prune_groups and not backoff:
        return Match(length, _EMPTY, [])
    length = reusable_length(tree, nodes, length, tpb, life_cycles, prune_groups, partial,
                             backoff)
    nb = -(-length // tpb)
    encoded = None if mm else (chunks[0] if len(chunks) == 1 else b"".join(chunks))
    if probe or stop == _MISS or length // tpb != len(found):
        cursor = None
    return Match(length, nodes[:nb], keys[: length // tpb], encoded, cursor)


def _linear_walk(index: dict[bytes, int], running: Any, tokens: Any, data: bytes, tpb: int,
                 nfull: int, chunk: int, found: list[int], keys: list[bytes] | None,
                 chunks: list[bytes]) -> int:
    """main's ``_walk``: one update, one digest and one lookup per block."""
    update = running.update
    digest = running.digest
    get = index.get
    step = 4 * tpb
    vdt = np.dtype(f"V{step}")
    b = 0
    cut = 16
    while True:
        nblk = min(nfull - b, len(data) // step)
        view = np.frombuffer(data, dtype=vdt, count=nblk)
        i = 0
        while i < nblk:
            blocks = view[i : i + cut].tolist()
            i += cut
            cut *= 4
            for block in blocks:
                update(block)
                key = digest()
                nid = get(key)
                if nid is None:
                    return _MISS
                if keys is not None:
                    keys.append(key)
                found.append(nid)
        b += nblk
        if b >= nfull:
            return _DONE
        data, mm = encode_tokens(tokens[b * tpb : min(nfull, b + chunk) * tpb])
        if mm:
            return _MM
        chunks.append(data)


def cursor_state(cursor: Any) -> Any:
    """A cursor compared by value: the running hash by its digest so far (and its type),
    a chained key as itself."""
    if cursor is None or type(cursor) is bytes:
        return cursor
    return ("sha256", cursor.name, cursor.digest())


def same(got: Match, ref: Match) -> None:
    assert got.length == ref.length
    assert got.nodes.dtype == np.int64 or len(got.nodes) == 0
    assert got.nodes.tolist() == ref.nodes.tolist()
    assert got.keys == ref.keys
    assert got.data == ref.data
    assert cursor_state(got.cursor) == cursor_state(ref.cursor)


# -- random trees ------------------------------------------------------------------------

IMAGES = [hashlib.sha256(b"image %d" % i).digest() for i in range(2)]

item = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                 st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                 st.integers(0, 3), st.sampled_from(IMAGES))
tails = st.lists(st.integers(0, 3), max_size=48) | st.lists(item, max_size=48)

#: (prefix index, prefix length, tail): prompts share random prefixes of three seeds.
prompts = st.tuples(st.integers(0, 2), st.integers(0, 200), tails)

#: A prompt made from one stored before (the ``src``-th, modulo): its first ``cut`` tokens
#: (modulo its length + 1), one token changed at ``change`` (when within them, else
#: none), then ``tail``.
derived = st.tuples(st.integers(0, 1 << 16), st.integers(0, 1 << 16),
                    st.integers(0, 1 << 16), st.lists(st.integers(0, 3), max_size=12))

ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), prompts, st.booleans()),  # commit; close it or not
        st.tuples(st.just("store"), prompts, st.booleans()),
        st.tuples(st.just("restore"), derived, st.booleans()),  # a stored one, extended
        st.tuples(st.just("drop"), st.integers(0, 1 << 16)),  # evict one droppable page
        st.tuples(st.just("close"), st.integers(0, 7)),  # close an open cache
        st.tuples(st.just("probe"), prompts, st.integers(0, 1 << 16)),
        st.tuples(st.just("reprobe"), derived, st.integers(0, 1 << 16)),
        st.tuples(st.just("reprobe"), derived, st.integers(0, 1 << 16)),
    ),
    min_size=3, max_size=30)

PREFIXES = [[int(t) for t in np.random.default_rng(40 + i).integers(0, 4, 200)]
            for i in range(3)]


def prompt_of(spec: tuple[int, int, list[Any]]) -> list[Any]:
    pfx, cut, tail = spec
    return PREFIXES[pfx][:cut] + list(tail)


def derive(stored: list[list[Any]], spec: tuple[int, int, int, list[int]]) -> list[Any]:
    src, cut, change, tail = spec
    if not stored:
        return list(tail)
    base = stored[src % len(stored)]
    out = base[: cut % (len(base) + 1)]
    if change < len(out):
        out[change] = 7 if out[change] != 7 else 8  # a token no prefix or tail holds
    return out + list(tail)


def forms(toks: list[Any]) -> list[Any]:
    if any(isinstance(t, bytes) for t in toks):
        return [toks]
    return [toks, tuple(toks), np.asarray(toks, dtype=np.int32),
            np.asarray(toks, dtype=np.int64)]


def check_probe(m: Any, toks: list[Any], choice: int) -> None:
    """Every token form and walk option: the gallop equals the reference; and what a
    cache created for the prompt starts with (reuse length, keys, cursor) too."""
    tree = m.tree
    tpb = m.tokens_per_block
    lcs = m.life_cycles
    ngroups = len(lcs)
    walk_sets = [list(m._walk_groups), [], list(range(ngroups))]
    prune_sets = [list(m._prune_groups), []]
    scope = None if choice % 5 else ReuseScope(salt="absent")
    root_key = scope_root_key(scope)
    for f in forms(toks):
        for i in range(4):
            k = choice >> (2 * i)
            kw = dict(walk_groups=walk_sets[k % 3], prune_groups=prune_sets[(k >> 1) % 2],
                      partial=bool(k & 4), backoff=(k >> 3) % 3 * (tpb // 2 + 1) % 5,
                      probe=bool(k & 2))
            ref = linear_match_prefix(tree, root_key, f, tpb, lcs, **kw)
            got = match_prefix(tree, root_key, f, tpb, lcs, **kw)
            same(got, ref)
    # What create_kv_cache keeps (the manager's own options).
    arr = toks if any(isinstance(t, bytes) for t in toks) else np.asarray(toks, np.int32)
    kw = dict(walk_groups=m._walk_groups, prune_groups=m._prune_groups,
              partial=m.config.enable_partial_reuse, backoff=m.config.reuse_match_backoff)
    for f in (toks, arr):
        ref = linear_match_prefix(tree, scope_root_key(None), f, tpb, lcs, **kw)
        assert m.probe_reuse(None, f) == ref.length
        c = m.create_kv_cache(None, f)
        try:
            assert c.history_length == ref.length
            assert c._keys == ref.keys
            assert cursor_state(c._cursor) == cursor_state(ref.cursor)
        finally:
            c.close()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.sampled_from(["full", "hybrid"]),
    tpb=st.sampled_from([1, 2, 4]),
    slots=st.integers(8, 64),
    backoff=st.sampled_from([0, 0, 1, 3]),
    chunks=st.tuples(st.sampled_from([1, 2, 3, 64]), st.sampled_from([1, 2, 5, 1024])),
    steps=ops,
)
def test_gallop_equals_the_linear_walk_over_random_trees(layers, tpb, slots, backoff, chunks,
                                                          steps):
    kw: dict[str, Any] = {"reuse_match_backoff": backoff}
    if layers == "full":
        m = make_manager(full_layers(tpb), slots=slots, tpb=tpb, **kw)
    else:
        m = make_manager(hybrid_layers(window=2 * tpb, sinks=tpb, tpb=tpb), slots=slots,
                         tpb=tpb, commit_min_snapshot=True, **kw)
    saved = matching_mod._CHUNK, matching_mod._ARRAY_CHUNK
    matching_mod._CHUNK, matching_mod._ARRAY_CHUNK = chunks
    open_caches: list[Any] = []
    stored: list[list[Any]] = []
    try:
        for op in steps:
            if op[0] in ("store", "restore"):
                toks = prompt_of(op[1]) if op[0] == "store" else derive(stored, op[1])
                stored.append(toks)
                c = m.create_kv_cache(None, toks)
                if toks and c.resume() and c.resize(len(toks)):
                    c.commit(toks[c.history_length:])
                if op[2] or len(open_caches) >= 3:
                    c.close()
                else:
                    open_caches.append(c)
                check_probe(m, toks, len(toks) * 7 + 3)
            elif op[0] == "drop":
                levels = m.storage_levels
                for store in m.stores[0]:
                    victims = [p for p in store.pages().tolist() if p in store.droppable]
                    if victims:
                        pid = victims[op[1] % len(victims)]
                        levels.drop(store, np.array([pid], dtype=np.int64), queued=True)
                        break
            elif op[0] == "close":
                if open_caches:
                    open_caches.pop(op[1] % len(open_caches)).close()
            elif op[0] == "probe":
                check_probe(m, prompt_of(op[1]), op[2])
            else:
                check_probe(m, derive(stored, op[1]), op[2])
    finally:
        matching_mod._CHUNK, matching_mod._ARRAY_CHUNK = saved
        for c in open_caches:
            c.close()
        m.shutdown()


def test_the_reference_walk_is_exercised_on_long_matches():
    """A sanity check of the test itself: a 300-block prompt matched fully and cut at
    many points walks the same both ways, with the real chunk sizes."""
    m = make_manager(full_layers(2), slots=400, tpb=2)
    try:
        base = [int(t) for t in np.random.default_rng(7).integers(0, 50, 600)]
        c = m.create_kv_cache(None, base)
        assert c.resume() and c.resize(len(base))
        c.commit(base)
        c.close()
        for cut in (0, 1, 2, 127, 128, 129, 255, 256, 257, 511, 599, 600):
            for extra in ([], [99, 98, 97]):
                check_probe(m, base[:cut] + extra, cut)
    finally:
        m.shutdown()


# -- PrefixTree.path_to ------------------------------------------------------------------

tree_ops = st.lists(
    st.one_of(
        st.tuples(st.just("chain"), st.integers(0, 1 << 16), st.integers(1, 90)),
        st.tuples(st.just("one"), st.integers(0, 1 << 16), st.integers(1, 1)),
        st.tuples(st.just("detach"), st.integers(0, 1 << 16), st.integers(1, 1)),
    ),
    min_size=1, max_size=40)


@settings(max_examples=150)
@given(steps=tree_ops)
def test_path_to_equals_the_parent_links_walked_one_by_one(steps):
    """Chains added at once (consecutive ids), one block at a time, under random nodes,
    subtrees removed (their ids recycled): ``path_to`` of every node gives its ancestors
    exactly, whichever way it finds them (consecutive-id guesses or link by link)."""
    tree = PrefixTree(1, 1, capacity=16)
    root = tree.root(b"r" * 32)
    serial = 0

    def key() -> bytes:
        nonlocal serial
        serial += 1
        return serial.to_bytes(32, "little")

    def nodes() -> list[int]:
        return [root, *tree.subtree(root)]

    for op, pick, n in steps:
        live = nodes()
        at = live[pick % len(live)]
        ordinal = int(tree.ordinal[at]) + 1
        if op == "chain":
            tree.add_chain(at, [key() for _ in range(n)], np.zeros((n, 1), np.int32), ordinal)
        elif op == "one":
            tree.add_one(at, key(), np.zeros(1, np.int32), ordinal)
        elif at != root:
            tree.detach(at)
    for nid in nodes()[1:]:
        up = [nid]
        while int(tree.parent[up[-1]]) != root:
            up.append(int(tree.parent[up[-1]]))
        got = tree.path_to(nid, len(up))
        assert got.dtype == np.int64
        assert got.tolist() == up[::-1]
        assert len(up) == int(tree.ordinal[nid]) + 1
