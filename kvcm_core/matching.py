"""Prefix matching: the full-block walk, partial matching, pruning to a fixed point and
backoff (concepts.md §9).

Pruning checks every candidate endpoint from the longest down: SSM life cycles need a
snapshot exactly at the endpoint; constraining attention life cycles need a page for
every block outside their stale range at the endpoint (SINK_REQUIRED_ONLY: its sink
blocks only). Full-attention REQUIRED life cycles are checked during the walk itself, so
the walk stops at the first block they cannot serve.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.radix import Node, PrefixTree, block_keys, encode_tokens

if TYPE_CHECKING:
    from kvcm_core.lifecycle import LifeCycle

__all__ = ["Match", "match_prefix"]

_CHUNK = 32  # blocks encoded at a time during the walk


@attrs.define
class Match:
    """Result of a lookup.

    Attributes:
        length: tokens reused (the endpoint).
        nodes: the node of every block ``[0, ceil(length / tpb))``; the last may be used
            partially (then it is copied into a private page at first resume).
        keys: chain keys of the full blocks walked (reusable for commit).
        data: the prompt's token bytes (reusable for commit hashing).
    """

    length: int
    nodes: list[Node]
    keys: list[bytes]
    data: bytes | None


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
) -> Match:
    """Find the longest reusable prefix of ``tokens`` (see module docstring)."""
    n = len(tokens)
    root = tree.roots.get(root_key)
    if n == 0:
        return Match(0, [], [], None)
    # Encode tokens lazily, a chunk at a time: a short match never pays for a long prompt.
    # The first chunk is encoded even when nothing is cached, so bad tokens fail early.
    data, mm = encode_tokens(tokens[: _CHUNK * tpb])
    if root is None:
        return Match(0, [], [], None)
    nfull = n // tpb
    chain: list[Node] = []
    keys: list[bytes] = []
    node = root
    key = root_key
    # Walk full blocks by key, hashing lazily so a miss costs one hash.
    if mm:
        for b in range(nfull):
            k = block_keys(key, tokens, tpb, b, b + 1)[0]
            child = node.children.get(k)
            if child is None or not _has_all(child.pages, walk_groups):
                break
            keys.append(k)
            chain.append(child)
            node = child
            key = k
    else:
        step = 4 * tpb
        sha = hashlib.sha256
        single = walk_groups[0] if len(walk_groups) == 1 else None
        b = 0
        while b < nfull:
            if b:
                data = encode_tokens(tokens[b * tpb : min(nfull, b + _CHUNK) * tpb])[0]
            stop = min(nfull - b, _CHUNK) * step
            if single is not None:  # the common case, kept free of per-block branching
                for off in range(0, stop, step):
                    k = sha(key + data[off : off + step]).digest()
                    child = node.children.get(k)
                    if child is None or child.pages[single] is None:
                        b = nfull
                        break
                    keys.append(k)
                    chain.append(child)
                    node = child
                    key = k
                else:
                    b += _CHUNK
                continue
            for off in range(0, stop, step):
                k = sha(key + data[off : off + step]).digest()
                child = node.children.get(k)
                if child is None or not _has_all(child.pages, walk_groups):
                    b = nfull
                    break
                keys.append(k)
                chain.append(child)
                node = child
                key = k
            else:
                b += _CHUNK
    length = len(chain) * tpb
    nodes = chain
    if partial and length < n:
        limit = min(tpb, n - length)
        best, plen = tree.best_partial(node, tokens[length : length + limit], limit)
        if best is not None and plen > 0 and _has_all(best.pages, walk_groups):
            nodes = [*chain, best]
            length += plen
    length = _prune(nodes, length, tpb, life_cycles, prune_groups)
    if backoff and length:
        length = max(0, length - backoff)
        if not partial:
            length = length // tpb * tpb  # no partial reuse: block-aligned endpoints only
        length = _prune(nodes, length, tpb, life_cycles, prune_groups)
    nodes = nodes[: -(-length // tpb)]
    return Match(length, nodes, keys[: length // tpb], None)


def _has_all(pages: list, groups: Sequence[int]) -> bool:
    for g in groups:
        if pages[g] is None:
            return False
    return True


def _feasible(nodes: Sequence[Node], end: int, tpb: int,
              life_cycles: Sequence[LifeCycle], groups: Sequence[int]) -> bool:
    nb = -(-end // tpb)
    for g in groups:
        lc = life_cycles[g]
        if lc.is_ssm:
            if end == 0:
                continue
            node = nodes[(end - 1) // tpb]
            if node.pages[g] is None or node.end(tpb) != end:
                return False
            continue
        start, stop = lc.stale_range(end, tpb)
        for b in (*range(0, start), *range(stop, nb)):
            if lc.constrains_block(b) and nodes[b].pages[g] is None:
                return False
    return True


def _prune(nodes: Sequence[Node], length: int, tpb: int,
           life_cycles: Sequence[LifeCycle], groups: Sequence[int]) -> int:
    """The longest endpoint ``<= length`` every pruning group can serve."""
    if not groups:
        return length
    candidate = length
    while candidate > 0:
        if _feasible(nodes, candidate, tpb, life_cycles, groups):
            return candidate
        candidate = (candidate - 1) // tpb * tpb  # the previous block boundary
    return 0
