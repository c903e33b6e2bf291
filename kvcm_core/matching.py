"""Prefix matching: the full-block walk, partial matching, pruning to a fixed point and
backoff (docs/semantics.md).

The walk finds the longest run of full blocks whose keys (the running prefix hash of
kvcm_core/radix.py) the tree's one index holds: the index is prefix-closed, so it gallops
and bisects on membership (``_gallop``: a digest at about ``2 log2 k`` positions, not one
per block; the first and the last few blocks one by one), takes the nodes from the parent
links up from the last one found and, for a cache, the keys from those nodes. Multimodal
blocks (chained keys) are walked block by block. The nodes found are then checked at once
(arrays) for the pages of the life cycles that constrain every block (full-attention
REQUIRED), and the match ends at the first block one of them cannot serve. Pruning then
checks candidate endpoints from the longest down: SSM life cycles need a snapshot exactly at
the endpoint; windowed constraining life cycles need a page for every block outside their
stale range at the endpoint (SINK_REQUIRED_ONLY: its sink blocks only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.radix import NO_NODE, PrefixTree, extend_keys
from kvcm_core.tokens import check_token_range, encode_token_ids, sliceable
from kvcm_core.types import ReusePolicy

if TYPE_CHECKING:
    from kvcm_core.lifecycle import LifeCycle

__all__ = ["Match", "match_prefix", "reusable_length", "token_array", "with_partial_block"]

_CHUNK = 64  # blocks encoded at a time during the walk
_ARRAY_CHUNK = 1024  # the same for int32 arrays (encoding is one copy)
_LINEAR = 4  # blocks walked one by one before the gallop (cheaper for short matches)
_SCAN = 8  # the bisection ends with a walk block by block once this few blocks are left
_EMPTY = np.empty(0, dtype=np.int64)
_DONE, _MISS, _MM = 0, 1, 2  # how the walk ended: every full block found, a miss, digests


@attrs.define
class Match:
    """Result of a lookup.

    Attributes:
        length: tokens reused (the endpoint).
        nodes: the node of every block ``[0, ceil(length / tpb))`` (int64 array); the last
            may be used partially (then it is copied into a private page at first resume).
        keys: block keys of the full blocks matched (reusable for commit).
        data: the prompt's tokens encoded during the walk (4-byte little-endian ints, at
            least the matched full blocks' worth), or None; the cache keeps them rather
            than encoding the prompt again.
        cursor: the key cursor after exactly ``len(keys)`` blocks (kvcm_core/radix.py:
            the running hashlib object, or the last key in the chained part), or None
            when the walk's hash went past the match (a miss, a cut, a probe); the cache
            continues the keys from it at commit instead of rebuilding it.
    """

    length: int
    nodes: np.ndarray
    keys: list[bytes]
    data: bytes | None = None
    cursor: Any = None


def token_array(tokens: Sequence[Any] | np.ndarray) -> np.ndarray | None:
    """Tokens as an int32 array, or None when they hold multimodal digests."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32:
        return tokens
    data, mm = encode_token_ids(tokens)
    if mm:
        return None
    return np.frombuffer(data, dtype="<i4")


def match_prefix(
    tree: PrefixTree,
    root_key: bytes,
    tokens: Sequence[Any] | np.ndarray,
    tpb: int,
    life_cycles: Sequence[LifeCycle],
    *,
    walk_groups: Sequence[int],
    prune_groups: Sequence[int],
    partial: bool,
    backoff: int,
    probe: bool = False,
) -> Match:
    """Find the longest reusable prefix of ``tokens`` (see module docstring). A ``probe``
    needs the length only: the keys, nodes and encoded tokens are not kept."""
    tokens = sliceable(tokens)  # (a deque)
    n = len(tokens)
    if n == 0:
        return Match(0, _EMPTY, [])
    # Every token is validated here, whatever is cached (a bad token is refused the same
    # way in a short prompt and a long one). A list is encoded whole, in one C call
    # (which validates it): the walk reads its blocks from that, and the cache its
    # matched tokens. An int32 array needs no check (its dtype says it all) and another
    # integer array one min and max; they are encoded a chunk at a time (one copy each:
    # a short match never pays for a long prompt), a prompt of up to two chunks at once.
    if isinstance(tokens, np.ndarray):
        chunk = _ARRAY_CHUNK
        if n <= 2 * chunk * tpb:
            data, mm = encode_token_ids(tokens)
        else:
            check_token_range(tokens)
            data, mm = encode_token_ids(tokens[: chunk * tpb])
    else:
        chunk = _CHUNK
        data, mm = encode_token_ids(tokens)  # (digests: every item checked, data empty)
        if mm and n > 2 * chunk * tpb:  # the walk gallops up to the first digest's chunk
            data, mm = encode_token_ids(tokens[: chunk * tpb])
    root = tree.index.get(root_key)
    if root is None:
        return Match(0, _EMPTY, [])
    nfull = n // tpb
    found: list[int] = []  # the nodes of the blocks walked one by one from block 0
    keys: list[bytes] | None = None if probe else []  # their keys (a probe keeps none)
    walked = 0  # blocks found (len(found) or more)
    last = NO_NODE  # the node of block walked - 1
    cursor: Any = hashlib.sha256(root_key)  # the running hash, after `walked` blocks
    chunks: list[bytes] = []
    stop = _MM
    if not mm:
        chunks.append(data)
        stop, walked, last, cursor = _gallop(tree.index, cursor, tokens, data, tpb, nfull,
                                             chunk, chunks, found, keys)
    if stop == _MM:  # multimodal digests from block `walked` on: block by block
        mm = True
        if walked > len(found):  # the gallop went further: list its blocks first
            nodes = tree.path_to(last, walked)
            found = nodes.tolist()
            keys = None if probe else tree.keys_at(nodes)
        get = tree.index.get
        stop = _DONE
        for b in range(walked, nfull):
            k: list[bytes] = []
            cursor = extend_keys(k, root_key, tokens[b * tpb : (b + 1) * tpb], tpb, b, cursor)
            nid = get(k[0])
            if nid is None:
                stop = _MISS
                break
            found.append(nid)
            if keys is not None:
                keys.append(k[0])
        walked = len(found)
    listed = walked == len(found)  # else: the nodes up the parent links from the last
    if listed:
        nodes = np.fromiter(found, np.int64, walked) if walked else _EMPTY
    else:
        nodes = tree.path_to(last, walked)
    # The candidates' pages, checked once for all the blocks walked.
    if walk_groups and len(nodes):
        ok: Any
        if len(walk_groups) == 1:
            ok = tree.pages[:, walk_groups[0]][nodes] >= 0  # (a column view: one 1-D gather)
        else:
            ok = (tree.pages[nodes][:, walk_groups] >= 0).all(axis=1)
        if np.count_nonzero(ok) != len(ok):
            nodes = nodes[: int(ok.argmin())]
    length = len(nodes) * tpb
    if partial and length < n:  # (the tokens encoded in one chunk are read, not joined)
        nodes, length = with_partial_block(tree, root, tokens, nodes, tpb, walk_groups,
                                           None if mm or len(chunks) != 1 else chunks[0])
    if probe and not prune_groups and not backoff:
        return Match(length, _EMPTY, [])
    length = reusable_length(tree, nodes, length, tpb, life_cycles, prune_groups, partial,
                             backoff)
    nb = -(-length // tpb)
    encoded = None if mm else (chunks[0] if len(chunks) == 1 else b"".join(chunks))
    if probe or stop == _MISS or length // tpb != walked:
        cursor = None  # the hash went past the match: the cache rebuilds it if it commits
    if keys is None or length < tpb:
        keys = []
    elif listed:
        keys = keys[: length // tpb]
    else:  # the keys of the blocks galloped over, as the tree holds them
        keys = tree.keys_at(nodes[: length // tpb])
    return Match(length, nodes[:nb], keys, encoded, cursor)


def with_partial_block(tree: PrefixTree, root: int, tokens: Sequence[Any] | np.ndarray,
                       nodes: np.ndarray, tpb: int, walk_groups: Sequence[int],
                       encoded: bytes | None = None) -> tuple[np.ndarray, int]:
    """The matched full-block ``nodes`` (under scope root ``root``) and the tokens they
    cover, with the partial block that shares the longest prefix with what follows, of
    those cached with every walk group's page, appended.

    ``encoded``: the first tokens of ``tokens`` as :func:`encode_tokens` wrote them (the
    walk's encoded chunks), or None; when it covers the tail, the tail is read from it
    rather than encoded again (the same int32 values: those tokens encoded without a
    multimodal digest, so ``token_array`` of the slice gives exactly these)."""
    length = len(nodes) * tpb
    parent = int(nodes[-1]) if len(nodes) else root
    limit = min(tpb, len(tokens) - length)
    tail: Any
    if encoded is not None and len(encoded) >= 4 * (length + limit):
        tail = np.frombuffer(encoded, dtype="<i4", count=limit, offset=4 * length)
    else:
        tail = token_array(tokens[length : length + limit])
        if tail is None:  # multimodal digests: compared item by item
            tail = list(tokens[length : length + limit])
    # The child sharing the most tokens among those with every walk group's page.
    best, plen = tree.best_partial(parent, tail, walk_groups)
    if best != NO_NODE:
        # np.append(nodes, best), without its ravels (nodes is a 1-D int64 array).
        out = np.empty(len(nodes) + 1, dtype=np.int64)
        out[:-1] = nodes
        out[-1] = best
        return out, length + plen
    return nodes, length


def reusable_length(tree: PrefixTree, nodes: np.ndarray, length: int, tpb: int,
                    life_cycles: Sequence[LifeCycle], prune_groups: Sequence[int],
                    partial: bool, backoff: int) -> int:
    """The tokens of a match of ``length`` (``nodes``) that can be reused: pruned where a
    pruned group's life cycle cannot resume, then backed off by ``backoff`` tokens
    (block-aligned without partial reuse) and pruned again."""
    length = _prune(tree, nodes, length, tpb, life_cycles, prune_groups)
    if backoff and length:
        length = max(0, length - backoff)
        if not partial:
            length = length // tpb * tpb  # no partial reuse: block-aligned endpoints only
        length = _prune(tree, nodes, length, tpb, life_cycles, prune_groups)
    return length


def _gallop(index: dict[bytes, int], h: Any, tokens: Sequence[Any] | np.ndarray,
            data: bytes, tpb: int, nfull: int, chunk: int, chunks: list[bytes],
            found: list[int], keys: list[bytes] | None) -> tuple[int, int, int, Any]:
    """The full-block walk over the running-hash part: the longest run of full blocks
    whose keys are cached, found by galloping then bisecting on index membership.

    ``h`` is the running hash started as ``sha256(scope root)``. The index is
    prefix-closed (a node exists only under its parent, and is removed only with its
    subtree), so if block ``k``'s key is cached, so is every earlier block's: membership
    is monotone in the block count, and a key is needed only where the search probes.
    The first ``_LINEAR`` blocks are walked one by one (an update and a digest of ``h``
    each: cheaper for short matches). Then a probe at ``p`` blocks (``p > lo``, ``lo`` the
    blocks known cached) copies the hash state after ``lo`` blocks, feeds the copy blocks
    ``lo..p-1`` in one C call, takes its digest and looks it up: a hit moves ``lo`` to
    ``p`` (the copy becomes the state after ``lo`` blocks), a miss sets ``hi = p``. Probes
    go to twice ``lo`` blocks (8, 16, 32, ...), capped at the blocks encoded; after the
    first miss, bisection between ``lo`` and ``hi`` until at most ``_SCAN`` blocks are
    left, which are walked one by one (a probe costs about two such steps). For ``k >= 1``
    blocks cached: at most ``2 log2 k + 3 + _SCAN`` digests instead of ``k + 1`` (one more
    for each chunk end the match passes after the first two chunks), and at most ``3 k``
    blocks hashed.

    The blocks walked one by one from block 0 (the first ``_LINEAR``, and those walked
    at the end when no probe hit) are listed as they go: their nodes appended to
    ``found``, their keys to ``keys`` unless it is None (a probe); the caller takes the
    other blocks' nodes from the parent links and keys from the nodes.

    ``data`` holds the first blocks' tokens encoded (4-byte little-endian: a list's
    whole, an array's first chunk); when ``lo`` reaches its end, the next ``chunk`` blocks
    are encoded and appended to ``chunks`` (the chunks a block-by-block walk encodes: a
    short match never copies a long array, and a multimodal digest further on is met
    exactly when it was). Returns
    ``(stop, lo, nid, h)``: ``nid`` the node of block ``lo - 1`` (``NO_NODE`` when ``lo``
    is 0); ``stop`` is ``_DONE`` (``lo == nfull``; ``h`` is the state after them), ``_MISS``
    (block ``lo`` is not cached; ``h`` may be past it) or ``_MM`` (the next chunk holds
    multimodal digests; ``h`` is the state after ``lo`` blocks, where the caller goes on
    block by block)."""
    get = index.get
    step = 4 * tpb
    buf = memoryview(data)
    enc = min(nfull, len(data) // step)  # blocks encoded
    lo = 0
    nid = NO_NODE
    add = found.append
    append = None if keys is None else keys.append
    update = h.update
    digest = h.digest
    for a in range(0, min(_LINEAR, enc) * step, step):  # the first blocks one by one
        update(data[a : a + step])
        key = digest()
        x = get(key)
        if x is None:
            return _MISS, lo, nid, h  # (h is past block lo: no cursor after a miss)
        add(x)
        if append is not None:
            append(key)
        lo += 1
        nid = x
    at = lo * step  # where block lo starts in buf

    def probe(p: int) -> tuple[int | None, Any, int]:
        """Whether block ``p - 1`` is cached: its node (or None), the hash past it, and
        where block ``p`` starts in ``buf`` (blocks ``lo..p`` hashed in one call)."""
        end = at + (p - lo) * step
        g = h.copy()
        g.update(buf[at:end])
        return get(g.digest()), g, end

    while True:
        while lo < enc:  # gallop
            p = 2 * lo or 1
            if p > enc:
                p = enc
            x, g, end = probe(p)
            if x is None:
                hi = p
                break
            lo, nid, h, at = p, x, g, end
        else:
            if lo >= nfull:
                return _DONE, lo, nid, h
            data, mm = encode_token_ids(tokens[lo * tpb : min(nfull, lo + chunk) * tpb], lo * tpb)
            if mm:
                return _MM, lo, nid, h
            chunks.append(data)
            buf = memoryview(data)
            at = 0
            enc = min(nfull, lo + len(data) // step)
            continue
        break
    while hi - lo > _SCAN:  # bisect: block lo - 1 is cached, block hi - 1 is not
        mid = (lo + hi) >> 1
        x, g, end = probe(mid)
        if x is None:
            hi = mid
        else:
            lo, nid, h, at = mid, x, g, end
    # The last few blocks one by one, h updated in place (a miss leaves no cursor); listed
    # when they follow the blocks listed.
    listing = lo == len(found)
    update = h.update
    digest = h.digest
    while lo < hi - 1:
        update(data[at : at + step])
        key = digest()
        x = get(key)
        if x is None:
            break
        if listing:
            add(x)
            if append is not None:
                append(key)
        lo += 1
        nid = x
        at += step
    return _MISS, lo, nid, h


def _feasible(tree: PrefixTree, nodes: np.ndarray, end: int, tpb: int,
              life_cycles: Sequence[LifeCycle], groups: Sequence[int]) -> bool:
    nb = -(-end // tpb)
    for g in groups:
        lc = life_cycles[g]
        if lc.is_ssm:
            if end == 0:
                continue
            node = int(nodes[(end - 1) // tpb])
            if tree.pages[node, g] < 0 or tree.end(node) != end:
                return False
            continue
        # The blocks needed are [0, start) and [stop, nb) (SINK_REQUIRED_ONLY: those of
        # them below the sinks), checked as two slices rather than one index array
        # (np.r_): the same blocks, as 0 <= start <= nb.
        if lc.policy is ReusePolicy.REQUIRED:
            hi = nb
        elif lc.policy is ReusePolicy.SINK_REQUIRED_ONLY:
            hi = min(nb, lc.num_sink_blocks)
        else:
            continue
        head, tail = lc.stale_range(end, tpb)
        head = min(head, hi)
        col = tree.pages[:, g]
        if head and np.count_nonzero(col[nodes[:head]] < 0):
            return False
        if tail < hi and np.count_nonzero(col[nodes[tail:hi]] < 0):
            return False
    return True


def _prune(tree: PrefixTree, nodes: np.ndarray, length: int, tpb: int,
           life_cycles: Sequence[LifeCycle], groups: Sequence[int]) -> int:
    """The longest endpoint ``<= length`` every pruning group can serve."""
    if not groups:
        return length
    candidate = length
    while candidate > 0:
        if _feasible(tree, nodes, candidate, tpb, life_cycles, groups):
            return candidate
        candidate = (candidate - 1) // tpb * tpb  # the previous block boundary
    return 0
