"""Prefix matching: the full-block walk, partial matching, pruning to a fixed point and
backoff (docs/semantics.md).

The walk hashes the prompt block by block (the running prefix hash of kvcm_core/radix.py)
and looks each block key up in the tree's one index; then the nodes found are checked at
once (arrays) for the pages of the life cycles that constrain every block (full-attention
REQUIRED), and the match ends at the first block one of them cannot serve. Pruning then
checks candidate endpoints from the longest down: SSM life cycles need a snapshot exactly at
the endpoint; windowed constraining life cycles need a page for every block outside their
stale range at the endpoint (SINK_REQUIRED_ONLY: its sink blocks only).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.radix import NO_NODE, PrefixTree, encode_tokens, extend_keys
from kvcm_core.types import ReusePolicy

if TYPE_CHECKING:
    from kvcm_core.lifecycle import LifeCycle

__all__ = ["Match", "match_prefix", "token_array"]

_CHUNK = 64  # blocks encoded at a time during the walk
_ARRAY_CHUNK = 1024  # the same for int32 arrays (encoding is one copy)
_FIRST_CUT = 16  # blocks listed before the walk's first lookup (then 4x as many each time)
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
    data, mm = encode_tokens(tokens)
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
    n = len(tokens)
    if n == 0:
        return Match(0, _EMPTY, [])
    # Encode a chunk at a time: a short match never pays for a long prompt (an int32
    # array is one copy, so its chunks are larger). A prompt of up to two chunks is
    # encoded at once (a list is then not sliced: slicing copies it). The first chunk is
    # encoded even when nothing is cached, so bad tokens fail early.
    chunk = _ARRAY_CHUNK if isinstance(tokens, np.ndarray) else _CHUNK
    data, mm = encode_tokens(tokens if n <= 2 * chunk * tpb else tokens[: chunk * tpb])
    root = tree.index.get(root_key)
    if root is None:
        return Match(0, _EMPTY, [])
    nfull = n // tpb
    keys: list[bytes] = []
    found: list[int] = []  # node ids of the blocks walked
    cursor: Any = hashlib.sha256(root_key)  # the running hash, after len(found) blocks
    chunks: list[bytes] = []
    stop = _MM
    if not mm:
        chunks.append(data)
        stop = _walk(tree.index, cursor, tokens, data, tpb, nfull, chunk, found,
                     None if probe else keys, chunks)
    if stop == _MM:  # multimodal digests from block len(found) on: block by block
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
    # The candidates' pages, checked once for all the blocks walked.
    nodes = np.fromiter(found, np.int64, len(found)) if found else _EMPTY
    if walk_groups and len(nodes):
        ok: Any
        if len(walk_groups) == 1:
            ok = tree.pages[:, walk_groups[0]][nodes] >= 0  # (a column view: one 1-D gather)
        else:
            ok = (tree.pages[nodes][:, walk_groups] >= 0).all(axis=1)
        if np.count_nonzero(ok) != len(ok):
            cut = int(ok.argmin())
            nodes = nodes[:cut]
            del keys[cut:]
    length = len(nodes) * tpb
    if partial and length < n:
        parent = int(nodes[-1]) if len(nodes) else root
        limit = min(tpb, n - length)
        tail: Any = token_array(tokens[length : length + limit])
        if tail is None:  # multimodal digests: compared item by item
            tail = list(tokens[length : length + limit])
        best, plen = tree.best_partial(parent, tail)
        if best != NO_NODE and all(tree.pages[best, g] >= 0 for g in walk_groups):
            nodes = np.append(nodes, np.int64(best))
            length += plen
    if probe and not prune_groups and not backoff:
        return Match(length, _EMPTY, [])
    length = _prune(tree, nodes, length, tpb, life_cycles, prune_groups)
    if backoff and length:
        length = max(0, length - backoff)
        if not partial:
            length = length // tpb * tpb  # no partial reuse: block-aligned endpoints only
        length = _prune(tree, nodes, length, tpb, life_cycles, prune_groups)
    nb = -(-length // tpb)
    encoded = None if mm else (chunks[0] if len(chunks) == 1 else b"".join(chunks))
    if probe or stop == _MISS or length // tpb != len(found):
        cursor = None  # the hash went past the match: the cache rebuilds it if it commits
    return Match(length, nodes[:nb], keys[: length // tpb], encoded, cursor)


@functools.lru_cache(maxsize=64)
def _block_dtype(step: int) -> np.dtype:
    """The NumPy dtype of one block's bytes (``V{step}``)."""
    return np.dtype(f"V{step}")


def _walk(index: dict[bytes, int], running: Any, tokens: Sequence[Any] | np.ndarray,
          data: bytes, tpb: int, nfull: int, chunk: int, found: list[int],
          keys: list[bytes] | None, chunks: list[bytes]) -> int:
    """The full-block walk: advance the running hash ``running`` (a hashlib object
    started as ``sha256(scope root)``) by each block, look its digest (the block's key)
    up in ``index``, in one loop, until the first key not cached (or ``nfull`` blocks).
    ``data`` holds the first blocks' tokens encoded (4-byte little-endian; a chunk or
    more); later chunks of ``chunk`` blocks are encoded as the walk reaches them and
    appended to ``chunks``. Appends
    the node ids to ``found`` and, unless ``keys`` is None (a probe), the keys to
    ``keys``. Returns ``_DONE`` (``running`` is then after the ``nfull`` blocks),
    ``_MISS`` (after the block missed) or ``_MM`` (a later chunk holds multimodal digests:
    ``running`` is after the blocks found, which the caller continues from).

    Each chunk's bytes are cut into one ``bytes`` object per block by NumPy (a view as
    ``V{4 * tpb}`` items, listed 16 blocks first, then four times as many each time, so
    a miss early on a long prompt lists few): the loop body is then one update of the
    running hash by the block, one digest, one dict lookup, one append; no slicing, no
    index arithmetic, no new hash object."""
    update = running.update
    digest = running.digest
    get = index.get
    add = found.append
    step = 4 * tpb
    vdt = _block_dtype(step)
    append = None if keys is None else keys.append
    b = 0
    cut = _FIRST_CUT
    while True:
        nblk = min(nfull - b, len(data) // step)
        view = np.frombuffer(data, dtype=vdt, count=nblk)
        i = 0
        while i < nblk:  # listed a growing batch at a time: a miss early lists few blocks
            blocks = view[i : i + cut].tolist()
            i += cut
            cut *= 4
            if append is None:  # a probe: the node ids only
                for block in blocks:
                    update(block)
                    nid = get(digest())
                    if nid is None:
                        return _MISS
                    add(nid)
            else:
                for block in blocks:
                    update(block)
                    key = digest()
                    nid = get(key)
                    if nid is None:
                        return _MISS
                    append(key)
                    add(nid)
        b += nblk
        if b >= nfull:
            return _DONE
        data, mm = encode_tokens(tokens[b * tpb : min(nfull, b + chunk) * tpb])
        if mm:
            return _MM
        chunks.append(data)


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
        start, stop = lc.stale_range(end, tpb)
        need = np.r_[0:start, stop:nb]
        if lc.policy is ReusePolicy.SINK_REQUIRED_ONLY:
            need = need[need < lc.num_sink_blocks]
        elif lc.policy is not ReusePolicy.REQUIRED:
            continue
        if len(need) and (tree.pages[nodes[need], g] < 0).any():
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
