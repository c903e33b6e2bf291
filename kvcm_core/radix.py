"""The prefix tree: hash-chained block keys and the nodes that hold committed pages.

Keys form a chain rooted in the :class:`~kvcm_core.types.ReuseScope`:
``root = H(scope)``, ``key(block) = H(key(parent) || tokens)`` with H = SHA-256 and tokens
as 4-byte little-endian ints (multimodal items as 32-byte digests). Matching compares
digests only, so H must be cryptographic; keys are deterministic across processes.

Each node is one block and holds, per life cycle, at most one committed page. Full blocks
are children of their parent by key; partial blocks (fewer than ``tokens_per_block``
tokens) are leaves kept in their parent's ``partials`` list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvcm_core.types import ReuseScope

__all__ = ["Node", "PrefixTree", "TokenSeq", "block_keys", "encode_tokens", "scope_root_key"]

TokenSeq = Sequence[Any] | np.ndarray
_MM_MARK = b"\xffkvcm-mm\x00"
_sha256 = hashlib.sha256


def scope_root_key(scope: ReuseScope | None) -> bytes:
    """The chain root of a scope (``None`` is the default scope)."""
    return _sha256((scope or ReuseScope()).encode()).digest()


def encode_tokens(tokens: TokenSeq) -> tuple[bytes, bool]:
    """Tokens as 4-byte little-endian ints; returns ``(data, has_multimodal)``.

    Multimodal items (32-byte digests) are not encoded here: a sequence holding any is
    hashed block by block with :func:`_encode_mm_block`.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.size and tokens.dtype.kind in "iu" and (
                int(tokens.min()) < _I32_MIN or int(tokens.max()) > _I32_MAX):
            raise ValueError("token ids must fit a 32-bit signed int; got values in "
                             f"{int(tokens.min())}..{int(tokens.max())}")
        return tokens.astype("<i4", copy=False).tobytes(), False
    try:
        arr = array("i", tokens)  # type: ignore[arg-type]  # ints, checked by array
    except TypeError:
        check_tokens(tokens)
        return b"", True
    except OverflowError:
        check_tokens(tokens)
        raise
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        return np.asarray(tokens, dtype="<i4").tobytes(), False
    return arr.tobytes(), False


_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_INDEX_FANOUT = 8  # children scanned directly before a first-token index is kept
_NO_CHILDREN: dict = {}  # shared, never mutated: a node's children until its first one
_NO_PARTIALS: list = []  # likewise for partial children


def check_tokens(tokens: Sequence[Any]) -> None:
    """Raise ValueError naming the first item that is neither a 32-bit int token nor a
    32-byte multimodal digest."""
    for i, item in enumerate(tokens):
        if isinstance(item, bytes | bytearray):
            if len(item) != 32:
                raise ValueError(f"token {i}: a multimodal item must be a 32-byte digest, got "
                                 f"{len(item)} bytes")
        elif isinstance(item, bool) or not isinstance(item, int | np.integer):
            raise ValueError(f"token {i}={item!r}: must be an int token id or a 32-byte "
                             "digest")
        elif not _I32_MIN <= int(item) <= _I32_MAX:
            raise ValueError(f"token {i}={item!r}: token ids must fit a 32-bit signed int")


def _encode_mm_block(items: Sequence[int | bytes]) -> bytes:
    """A block holding digests: a marker, a bitmap of digest positions, then the items."""
    bitmap = 0
    parts = []
    for i, item in enumerate(items):
        if isinstance(item, bytes | bytearray):
            if len(item) != 32:
                raise ValueError(f"multimodal item at position {i}: must be a 32-byte digest, "
                                 f"got {len(item)} bytes")
            bitmap |= 1 << i
            parts.append(bytes(item))
        else:
            parts.append(int(item).to_bytes(4, "little", signed=True))
    nbytes = (len(items) + 7) // 8
    return _MM_MARK + bitmap.to_bytes(nbytes, "little") + b"".join(parts)


def block_keys(
    parent: bytes, tokens: TokenSeq, tpb: int, start_block: int, end_block: int,
    data: bytes | None = None,
) -> list[bytes]:
    """Chain keys of full blocks ``[start_block, end_block)`` given the key before them."""
    keys = []
    if data is None:
        data, mm = encode_tokens(tokens)
    else:
        mm = False
    if not mm:
        step = 4 * tpb
        mv = memoryview(data)
        key = parent
        for b in range(start_block, end_block):
            h = _sha256(key)
            h.update(mv[b * step : (b + 1) * step])
            key = h.digest()
            keys.append(key)
        return keys
    key = parent
    for b in range(start_block, end_block):
        chunk = list(tokens[b * tpb : (b + 1) * tpb])
        key = _sha256(key + _encode_mm_block(chunk)).digest()
        keys.append(key)
    return keys


def token_id32(item: int | bytes) -> int:
    """A 32-bit id for a token or digest (for fingerprints and first-token indexes)."""
    if isinstance(item, bytes | bytearray):
        return int.from_bytes(item[:4], "little")
    return int(item) & 0xFFFFFFFF


class Node:
    """One block of the tree.

    Attributes:
        key: chain key (full blocks) or ``None`` (partial blocks, the root).
        parent: parent node (``None`` for a root).
        ordinal: block index (root: -1).
        tokens: the block's tokens (a tuple; empty for a root).
        pages: per life cycle, the committed page or ``None``.
        children: full child blocks by key.
        partials: partial child blocks.
    """

    __slots__ = ("by_first", "children", "key", "ordinal", "pages", "parent", "partials",
                 "tokens")

    def __init__(self, key: bytes | None, parent: Node | None, ordinal: int,
                 tokens: tuple, num_groups: int) -> None:
        self.key = key
        self.parent = parent
        self.ordinal = ordinal
        self.tokens = tokens
        self.pages: list[Any] = [None] * num_groups
        # Shared empty containers until the first child: most nodes are leaves or have one
        # child, and fewer container objects mean less allocation and garbage collection.
        self.children: dict[bytes, Node] = _NO_CHILDREN
        self.partials: list[Node] = _NO_PARTIALS
        # Children by first token, so partial matching never scans a wide fan-out.
        self.by_first: dict[Any, list[Node]] | None = None

    @property
    def is_full(self) -> bool:
        return self.key is not None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def end(self, tpb: int) -> int:
        """Token count up to the end of this block."""
        return self.ordinal * tpb + len(self.tokens)

    def has_pages(self) -> bool:
        return any(p is not None for p in self.pages)

    def iter_children(self) -> Iterator[Node]:
        yield from self.children.values()
        yield from self.partials

    def subtree(self) -> Iterator[Node]:
        """Every node below this one (not itself), depth first."""
        stack = list(self.iter_children())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.iter_children())

    def __repr__(self) -> str:
        kind = "full" if self.is_full else "partial"
        return f"Node({kind} #{self.ordinal}, {len(self.tokens)} tokens)"


def common_prefix(a: Sequence[Any], b: TokenSeq) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """Roots per scope, node counting, and removal of nodes."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.roots: dict[bytes, Node] = {}
        self.num_nodes = 0

    def root(self, root_key: bytes, create: bool = True) -> Node | None:
        node = self.roots.get(root_key)
        if node is None and create:
            node = Node(root_key, None, -1, (), self.num_groups)
            self.roots[root_key] = node
        return node

    @staticmethod
    def _index(parent: Node, node: Node) -> None:
        # Most nodes have one child: index a parent only once its fan-out is wide enough
        # that scanning its children would cost more than keeping the index.
        by_first = parent.by_first
        if by_first is None:
            if len(parent.children) + len(parent.partials) <= _INDEX_FANOUT:
                return
            by_first = parent.by_first = {}
            for child in parent.iter_children():
                by_first.setdefault(child.tokens[0], []).append(child)
            return
        by_first.setdefault(node.tokens[0], []).append(node)

    @staticmethod
    def _unindex(parent: Node, node: Node) -> None:
        if parent.by_first is not None:
            bucket = parent.by_first.get(node.tokens[0])
            if bucket is not None and node in bucket:
                bucket.remove(node)
                if not bucket:
                    del parent.by_first[node.tokens[0]]

    def add_full(self, parent: Node, key: bytes, tokens: tuple) -> Node:
        node = Node(key, parent, parent.ordinal + 1, tokens, self.num_groups)
        if parent.children is _NO_CHILDREN:
            parent.children = {key: node}
        else:
            parent.children[key] = node
        self._index(parent, node)
        self.num_nodes += 1
        return node

    def add_partial(self, parent: Node, tokens: tuple) -> Node:
        node = Node(None, parent, parent.ordinal + 1, tokens, self.num_groups)
        if parent.partials is _NO_PARTIALS:
            parent.partials = [node]
        else:
            parent.partials.append(node)
        self._index(parent, node)
        self.num_nodes += 1
        return node

    def detach(self, node: Node) -> None:
        """Remove a node (and so its subtree) from its parent."""
        parent = node.parent
        if parent is None:
            return
        if node.key is not None and parent.children.get(node.key) is node:
            del parent.children[node.key]
            self.num_nodes -= 1
        elif node in parent.partials:
            parent.partials.remove(node)
            self.num_nodes -= 1
        self._unindex(parent, node)
        node.parent = None

    def best_partial(self, parent: Node, tokens: TokenSeq,
                     limit: int) -> tuple[Node | None, int]:
        """The child of ``parent`` sharing the longest prefix with ``tokens[:limit]``."""
        best, best_len = None, 0
        want = tokens[:limit]
        if len(want) == 0:
            return None, 0
        if parent.by_first is None:
            candidates: Iterable[Node] = parent.iter_children()
        else:
            candidates = parent.by_first.get(want[0], ())
        for child in candidates:
            n = common_prefix(child.tokens, want)
            if n > best_len:
                best, best_len = child, n
        return best, best_len
