"""The prefix tree: block keys and the nodes that hold committed pages.

Block keys (the one place that knows the rule; docs/semantics.md "Block keys" states it
for routers). With ``H`` = SHA-256, ``root = H(scope.encode())`` for the
:class:`~kvcm_core.types.ReuseScope`, ``enc(i)`` the tokens of full block ``i`` as 4-byte
little-endian ints (a block holding multimodal items, 32-byte digests: :func:`_encode_mm_block`)
and ``f`` the first full block holding a multimodal item (none: infinity):

- ``key(i) = H(root || enc(0) || ... || enc(i))`` for ``i < f`` (the running prefix hash:
  one hashlib object updated by each block, its digest taken after each);
- ``key(i) = H(key(i - 1) || enc(i))`` for ``i >= f`` (a chain; ``key(-1) = root``).

Plain blocks have a fixed length (``4 * tokens_per_block`` bytes), so a running input
determines the scope's root and blocks; a chained input starts with a digest and equals a
running input only if that digest equals a scope root (a SHA-256 preimage or collision);
plain and multimodal encodings differ in length. So a key identifies its block's whole
prefix and scope. Matching compares digests only, so H must be cryptographic; keys are
deterministic across processes.

Continuing keys (a commit after a match, decode adding a block at a time) needs a *cursor*:
the running hashlib object positioned after the blocks keyed so far, or, in the chained
part, the last key (``bytes``). Without one (``None``) it is rebuilt from the tokens with
one C call (:func:`key_cursor`).

Each node is one block and holds, per life cycle, at most one committed page. Nodes are
integer ids into arrays (parent, links, pages, tokens); full blocks are found by their
key in one dict, partial blocks (fewer than ``tokens_per_block`` tokens) are leaves
found through their parent's child list.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError
from kvcm_core.idstack import IdStack, blank_rows, grown_rows
from kvcm_core.types import ReuseScope

__all__ = ["KEY_HASH", "NO_NODE", "PrefixTree", "TokenSeq", "block_keys", "encode_tokens",
           "extend_keys", "key_cursor", "scope_root_key"]

#: The block-key rule's name where stored data depends on it (the layout fingerprint of
#: framed levels and of the remote level): data keyed under another rule is never read.
KEY_HASH = "sha256-prefix"
_KEY_BYTES = 32  # a block key (and a scope root key): one SHA-256 digest

TokenSeq = Sequence[Any] | np.ndarray
_MM_MARK = b"\xffkvcm-mm\x00"
_sha256 = hashlib.sha256
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _packer(n: int) -> Callable[..., bytes]:
    """The ``pack`` of a compiled ``struct.Struct`` of ``n`` little-endian int32 (kept per
    length: ``Struct.pack(*tokens)`` copies the tokens once, ``struct.pack(fmt, *tokens)``
    twice)."""
    pack = _PACKERS.get(n)
    if pack is None:
        if len(_PACKERS) >= 1024:
            _PACKERS.clear()
        pack = _PACKERS[n] = struct.Struct(f"<{n}i").pack
    return pack


@functools.lru_cache(maxsize=4096)
def scope_root_key(scope: ReuseScope | None) -> bytes:
    """The chain root of a scope (``None`` is the default scope); cached per scope."""
    return _sha256((scope or ReuseScope()).encode()).digest()


def encode_tokens(tokens: TokenSeq) -> tuple[bytes, bool]:
    """Tokens as 4-byte little-endian ints; returns ``(data, has_multimodal)``.

    Multimodal items (32-byte digests) are not encoded here: a sequence holding any is
    hashed block by block with :func:`_encode_mm_block`.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.int32:
            return tokens.astype("<i4", copy=False).tobytes(), False
        if tokens.size and tokens.dtype.kind in "iu":
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < _I32_MIN or hi > _I32_MAX:  # named by the first token out of range
                i = int(np.flatnonzero((tokens < _I32_MIN) | (tokens > _I32_MAX))[0])
                raise InvalidArgumentError(
                    f"token {i}={int(tokens[i])}: token ids must fit a 32-bit signed int "
                    f"(got values in {lo}..{hi})")
        return tokens.astype("<i4", copy=False).tobytes(), False
    try:  # the fastest encoding of a list of ints (about 6 ns a token, array's 17)
        return _packer(len(tokens))(*tokens), False
    except struct.error:
        pass  # not all 32-bit ints: the array below tells digests from bad tokens
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


def check_token_array(tokens: Any, name: str = "tokens") -> None:
    """A token argument is a sequence (list, tuple) or a 1-D integer NumPy array: float,
    bool and object arrays are refused (``ArgumentTypeError``) rather than truncated or
    guessed at, and so is anything without a length, a mapping (its keys are no token
    list), a set and a string."""
    if type(tokens) is list or type(tokens) is tuple:
        return
    if not isinstance(tokens, np.ndarray):
        if not hasattr(tokens, "__len__") or not hasattr(tokens, "__getitem__") or \
                isinstance(tokens, Mapping | str | bytes | bytearray):
            raise ArgumentTypeError(f"{name}: must be a sequence of token ids or a 1-D "
                                    f"integer array, got {type(tokens).__name__}")
        return
    if tokens.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name}: a token array must have an integer dtype, got "
                                f"{tokens.dtype}")
    if tokens.ndim != 1:
        raise InvalidArgumentError(f"{name}: a token array must be 1-D, got shape "
                                   f"{tokens.shape}")


def check_tokens(tokens: Sequence[Any]) -> None:
    """Raise ValueError naming the first item that is neither a 32-bit int token nor a
    32-byte multimodal digest."""
    for i, item in enumerate(tokens):
        if isinstance(item, bytes | bytearray):
            if len(item) != 32:
                raise InvalidArgumentError(f"token {i}: a multimodal item must be a 32-byte "
                                           "digest, got "
                                 f"{len(item)} bytes")
        elif isinstance(item, bool) or not isinstance(item, int | np.integer):
            raise ArgumentTypeError(f"token {i}={item!r}: must be an int token id or a 32-byte "
                             "digest")
        elif not _I32_MIN <= int(item) <= _I32_MAX:
            raise InvalidArgumentError(f"token {i}={item!r}: token ids must fit a 32-bit signed "
                                       "int")


def _encode_mm_block(items: Sequence[int | bytes]) -> bytes:
    """A block holding digests: a marker, a bitmap of digest positions, then the items."""
    bitmap = 0
    parts = []
    for i, item in enumerate(items):
        if isinstance(item, bytes | bytearray):
            if len(item) != 32:
                raise InvalidArgumentError(f"multimodal item at position {i}: must be a 32-byte "
                                           "digest, "
                                 f"got {len(item)} bytes")
            bitmap |= 1 << i
            parts.append(bytes(item))
        else:
            parts.append(int(item).to_bytes(4, "little", signed=True))
    nbytes = (len(items) + 7) // 8
    return _MM_MARK + bitmap.to_bytes(nbytes, "little") + b"".join(parts)


def _is_digest(item: Any) -> bool:
    return isinstance(item, bytes | bytearray)


def _plain_data(tokens: TokenSeq) -> tuple[Any, bool]:
    """``tokens`` encoded for hashing (a buffer: bytes, or a contiguous int32 array hashed
    in place on a little-endian machine) and whether they hold multimodal digests (then
    the buffer is empty)."""
    if np.little_endian and isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 \
            and tokens.flags.c_contiguous:
        return tokens, False
    return encode_tokens(tokens)


def key_cursor(root: bytes, tokens: TokenSeq, tpb: int, nblocks: int,
               last: bytes | None = None) -> Any:
    """The cursor after full blocks ``[0, nblocks)`` of ``tokens`` (the sequence from its
    first token), rebuilt: without multimodal items among them, the running hash of
    ``root`` and their encoding, in one C call; with some, the key of block
    ``nblocks - 1`` (``last`` when the caller knows it, else computed)."""
    h = _sha256(root)
    if nblocks <= 0:
        return h
    data, mm = _plain_data(tokens[: nblocks * tpb])
    if not mm:
        h.update(data)
        return h
    if last is not None:
        return last
    return extend_keys([], root, tokens[: nblocks * tpb], tpb, 0, h)


def extend_keys(out: list[bytes], root: bytes, tokens: TokenSeq, tpb: int, start: int,
                cursor: Any) -> Any:
    """Append to ``out`` the keys of the full blocks of ``tokens``, which are blocks
    ``start``, ``start + 1``, ... of a sequence, and return the cursor after them.

    ``cursor`` is where the rule stands after ``start`` blocks (from :func:`key_cursor`,
    a match, or an earlier call): the running hashlib object (advanced in place: pass a
    copy to keep it) or, once the chained part began, the key of block ``start - 1``."""
    n = len(tokens) // tpb
    if not n:
        return cursor
    data, mm = _plain_data(tokens if len(tokens) == n * tpb else tokens[: n * tpb])
    append = out.append
    if not mm:
        if n == 1:  # the decode step: one block
            if type(cursor) is bytes:
                cursor = _sha256(cursor + bytes(data)).digest()
                append(cursor)
                return cursor
            cursor.update(data)
            append(cursor.digest())
            return cursor
        blocks = np.frombuffer(data, dtype=f"V{4 * tpb}").tolist()
        if type(cursor) is bytes:
            key = cursor
            for block in blocks:
                key = _sha256(key + block).digest()
                append(key)
            return key
        update = cursor.update
        digest = cursor.digest
        for block in blocks:
            update(block)
            append(digest())
        return cursor
    # Multimodal items among them: block by block, the chain from the first such block on.
    pack = _packer(tpb)
    for j in range(n):
        items = list(tokens[j * tpb : (j + 1) * tpb])
        digests = any(map(_is_digest, items))
        if type(cursor) is not bytes:
            if not digests:
                cursor.update(pack(*items))
                append(cursor.digest())
                continue
            cursor = cursor.digest() if start + j else root  # the chain begins
        cursor = _sha256(cursor + (_encode_mm_block(items) if digests else pack(*items))
                         ).digest()
        append(cursor)
    return cursor


def block_keys(root: bytes, tokens: TokenSeq, tpb: int, start: int, end: int) -> list[bytes]:
    """Keys of full blocks ``[start, end)`` of ``tokens`` (the sequence from its first
    token) under the scope root ``root`` (see module docstring)."""
    keys: list[bytes] = []
    extend_keys(keys, root, tokens[start * tpb : end * tpb], tpb, start,
                key_cursor(root, tokens, tpb, start))
    return keys


def token_id32(item: int | bytes) -> int:
    """A 32-bit id for a token or digest (for fingerprints and first-token indexes)."""
    if isinstance(item, bytes | bytearray):
        return int.from_bytes(item[:4], "little")
    return int(item) & 0xFFFFFFFF


NO_NODE = -1
_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # an iterator, run in C
_INDEX_FANOUT = 8  # children scanned directly before a first-token index is kept
_FREED = -2  # ordinal of a free node id
_RUN = 48  # PrefixTree.path_to guesses runs of consecutive ids on paths this long


class PrefixTree:
    """The tree's nodes in arrays, full blocks indexed by block key.

    Node ``n`` has ``parent[n]`` (``-1`` for a scope root), ``ordinal[n]`` (block index,
    ``-1`` for a root), ``ntok[n]`` tokens (``tokens_per_block`` for full blocks, fewer for
    partial ones) stored in ``tokens[n]`` (a partial block's row is zero past them),
    ``pages[n, g]`` (page id per cache group or ``-1``) and its children in a doubly
    linked sibling list. Nothing outside this class writes these arrays; callers use its
    verbs.

    Args:
        num_groups: cache groups (columns of ``pages``).
        tpb: tokens per block.
    """

    def __init__(self, num_groups: int, tpb: int, capacity: int = 1024) -> None:
        self.num_groups = num_groups
        self.tpb = tpb
        self.index: dict[bytes, int] = {}  # block key (and scope root key) -> node
        self.num_nodes = 0  # nodes below the roots
        self._roots: dict[bytes, int] = {}
        self._unlinked: list[int] = []  # parents that lost a child (collect looks at them)
        self._partials: dict[int, list[int]] = {}  # parent -> its partial children
        # Parents with a wide fan-out (scope roots, popular prefixes): first token -> their
        # children, so partial matching never scans every child.
        self._by_first: dict[int, dict[int, list[int]]] = {}
        # Full blocks holding multimodal digests -> their exact items (``tokens`` keeps
        # only 32-bit ids, so partial matching compares these instead).
        self._mm_items: dict[int, tuple[Any, ...]] = {}
        # Each node's key as a row of bytes too, once keep_key_rows is called (framed
        # levels); None until then.
        self._key_rows: np.ndarray | None = None
        self._alloc_arrays(max(16, capacity))

    # One int32 row per node (parent, ordinal, ntok, mm, first_child, next_sib, prev_sib,
    # nchildren): a new node's row is written with one assignment.
    _BLANK = (NO_NODE, _FREED, 0, 0, NO_NODE, NO_NODE, NO_NODE, 0)

    def _bind(self) -> None:
        self._blank_row = np.asarray(self._BLANK, dtype=np.int32)
        rows = self._rows
        self.parent, self.ordinal, self.ntok, self.mm, self.first_child, self.next_sib, \
            self.prev_sib, self.nchildren = (rows[:, i] for i in range(8))
        # The parent column as a memoryview, for path_to: indexing it gives a Python int
        # in about 40 ns, a NumPy scalar index takes twice as long. Rebound with the
        # arrays (it views the rows it was made from).
        self._parent_view = memoryview(self.parent)

    def _alloc_arrays(self, cap: int) -> None:
        self._rows = blank_rows(self._BLANK, cap)
        self._bind()
        self.pages = np.full((cap, self.num_groups), -1, dtype=np.int64)
        self.tokens = np.zeros((cap, self.tpb), dtype=np.int32)
        self._flag = np.zeros(cap, dtype=np.bool_)  # scratch marks (always all False)
        self._aux = np.zeros(cap, dtype=np.bool_)  # node has an entry in a side table
        # Block key per node (None: partial), and one more entry, always None, that
        # NO_NODE (-1) indexes (a gather of keys may name NO_NODE).
        self._keys = np.full(cap + 1, None, dtype=object)
        self._free = IdStack(cap)

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def _grow(self, need: int) -> None:
        old = self.capacity
        self._rows = grown_rows(self._rows, self._BLANK, need)
        new = self.capacity
        self._bind()
        for name in ("pages", "tokens", "_flag", "_aux"):
            arr = getattr(self, name)
            grown = np.full((new, *arr.shape[1:]), -1 if name == "pages" else 0,
                            dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        keys = np.full(new + 1, None, dtype=object)  # (+1: NO_NODE's None, see above)
        keys[:old] = self._keys[:old]
        self._keys = keys
        if self._key_rows is not None:
            rows = np.zeros((new + 1, _KEY_BYTES), dtype=np.uint8)
            rows[:old] = self._key_rows[:old]
            self._key_rows = rows
        self._free.grow(old, new)

    def reserve(self, n: int) -> None:
        """Room for ``n`` nodes without growing (growing copies every array)."""
        if n > self.capacity:
            self._grow(n - self.capacity)

    def _alloc_one(self) -> int:
        if not self._free.count:
            self._grow(1)
        return self._free.pop_one()

    def _alloc(self, n: int) -> np.ndarray:
        if n > self._free.count:
            self._grow(n - self._free.count)
        return self._free.pop(n)

    # -- lookups -----------------------------------------------------------------------------

    def roots(self) -> dict[bytes, int]:
        """Scope root key -> root node."""
        return dict(self._roots)

    def root(self, root_key: bytes, create: bool = True) -> int:
        """The root node of a scope (``NO_NODE`` when absent and not created)."""
        nid = self._roots.get(root_key)
        if nid is None:
            if not create:
                return NO_NODE
            nid = int(self._alloc(1)[0])
            self.parent[nid] = NO_NODE
            self.ordinal[nid] = -1
            self.ntok[nid] = 0
            self._keys[nid] = root_key
            if self._key_rows is not None:
                self._key_rows[nid] = np.frombuffer(root_key, dtype=np.uint8)
            self._roots[root_key] = nid
            self.index[root_key] = nid
        return nid

    def key(self, nid: int) -> bytes | None:
        """Block key of a full block (or a scope root key); ``None`` for a partial block."""
        return self._keys[nid]

    def keys_at(self, nids: np.ndarray) -> list[bytes]:
        """:meth:`key` of many nodes that are all full blocks or roots (such as a
        :meth:`path_to`), in one gather."""
        return self._keys[nids].tolist()

    def keep_key_rows(self) -> None:
        """Keep every node's key also as a row of one ``uint8 [capacity, 32]`` array, read
        by :meth:`key_rows_of`: a framed level reads the keys of a batch of pages from
        it in one gather of rows, where a gather of keys touches each key's object (the
        pages moved down are the least recently used: a cache miss or two per key).
        32 bytes a node, and a row written per node added; called once, by a manager
        with a framed level."""
        if self._key_rows is not None:
            return
        rows = np.zeros((self.capacity + 1, _KEY_BYTES), dtype=np.uint8)
        for nid, key in enumerate(self._keys[:-1].tolist()):  # (none yet, at a build)
            if key is not None:
                rows[nid] = np.frombuffer(key, dtype=np.uint8)
        self._key_rows = rows

    def key_rows_of(self, nids: np.ndarray) -> np.ndarray:
        """The keys of nodes as rows (``uint8 [n, 32]``, a new array), all zeros for a
        partial block or ``NO_NODE`` (no key is: a SHA-256 of all zeros is as likely as
        any collision). Only after :meth:`keep_key_rows`."""
        assert self._key_rows is not None, "keep_key_rows first"
        return self._key_rows.take(nids, axis=0)

    def path_to(self, nid: int, k: int) -> np.ndarray:
        """The nodes of blocks ``0..k-1`` of the path ending at ``nid`` (block ``k - 1``:
        ``ordinal[nid] == k - 1``), in block order, the root excluded: ``nid`` and its
        ``k - 1`` nearest ancestors, read from the parent links (an int64 array).

        A chain added at once has consecutive ids (free ids are handed out lowest first),
        so a path of ``_RUN`` nodes or more is first guessed to be consecutive ids ending
        at ``nid`` and the guess checked in one gather (each guessed node's parent is the
        one before it); the checked tail is kept and the rest guessed again, unless that
        tail was short. What is left is walked link by link (a memoryview of the parent
        column indexed per step: about 40 ns a step, a NumPy scalar index 80-100)."""
        if k < _RUN:
            return np.fromiter(self._links_up(nid, k), np.int64, k)
        out = None
        end = k  # out[end:] is filled
        parent = self.parent
        while end >= _RUN and nid >= end - 1:
            guess = np.arange(nid - end + 1, nid + 1, dtype=np.int64)
            ok = parent[guess[1:]] == guess[:-1]
            if np.count_nonzero(ok) == len(ok):
                if out is None:
                    return guess
                out[:end] = guess
                return out
            j = len(ok) - int(ok[::-1].argmin())  # guess[j:] is a chain, guess[j - 1] not
            if end - j < _RUN // 2:
                break
            if out is None:
                out = np.empty(k, dtype=np.int64)
            out[j:end] = guess[j:]
            nid = int(parent[guess[j]])
            end = j
        if out is None:
            return np.fromiter(self._links_up(nid, k), np.int64, k)
        if end:
            out[:end] = self._links_up(nid, end)
        return out

    def _links_up(self, nid: int, k: int) -> list[int]:
        """:meth:`path_to` link by link, as a list."""
        up = self._parent_view
        out = [nid] * k
        for i in range(k - 2, -1, -1):
            nid = up[nid]
            out[i] = nid
        return out

    def is_full(self, nid: int) -> bool:
        return self.ordinal[nid] >= 0 and int(self.ntok[nid]) == self.tpb

    def end(self, nid: int) -> int:
        """Token count up to the end of this block."""
        return int(self.ordinal[nid]) * self.tpb + int(self.ntok[nid])

    def block_tokens(self, nid: int) -> tuple[int, ...]:
        return tuple(self.tokens[nid, : self.ntok[nid]].tolist())

    def page(self, nid: int, group: int) -> int:
        return int(self.pages[nid, group])

    def has_pages(self, nid: int) -> bool:
        return bool((self.pages[nid] >= 0).any())

    def children(self, nid: int) -> list[int]:
        out = []
        c = int(self.first_child[nid])
        nxt = self.next_sib
        while c != NO_NODE:
            out.append(c)
            c = int(nxt[c])
        return out

    def child(self, parent: int, key: bytes) -> int:
        nid = self.index.get(key, NO_NODE)
        if nid != NO_NODE and int(self.parent[nid]) != parent:
            return NO_NODE
        return nid

    def partial_children(self, nid: int, first: int | None = None) -> list[int]:
        """Partial children of ``nid`` (those that may start with ``first`` if given)."""
        kids = self._partials.get(nid, ())
        if first is not None and len(kids) > _INDEX_FANOUT:
            return [c for c in self.children_starting(nid, first) if self._keys[c] is None]
        return list(kids)

    def subtree(self, nid: int) -> list[int]:
        """Every node below ``nid`` (not itself), depth first."""
        out: list[int] = []
        stack = self.children(nid)
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(self.children(n))
        return out

    def live(self, nids: np.ndarray) -> np.ndarray:
        """Which node ids are in use (not freed)."""
        return self.ordinal[nids] != _FREED

    # -- adding ------------------------------------------------------------------------------

    def _link(self, parent: int, nid: int) -> None:
        head = int(self.first_child[parent])
        self.next_sib[nid] = head
        self.prev_sib[nid] = NO_NODE
        if head != NO_NODE:
            self.prev_sib[head] = nid
        self.first_child[parent] = nid
        self.nchildren[parent] += 1
        if self._keys[nid] is None:
            self._partials.setdefault(parent, []).append(nid)
            self._aux[parent] = True
        index = self._by_first.get(parent)
        if index is not None:
            index.setdefault(int(self.tokens[nid, 0]), []).append(nid)
        elif self.nchildren[parent] > _INDEX_FANOUT:
            index = self._by_first[parent] = {}
            self._aux[parent] = True
            for c in self.children(parent):
                index.setdefault(int(self.tokens[c, 0]), []).append(c)

    def children_starting(self, parent: int, first: int) -> list[int]:
        """Children of ``parent`` whose block may start with token ``first``."""
        index = self._by_first.get(parent)
        if index is None:
            return self.children(parent)
        return list(index.get(first, ()))

    def add_chain(self, parent: int, keys: Sequence[bytes], tokens: np.ndarray,
                  first_ordinal: int, mm: bool = False,
                  items: Sequence[Sequence[Any]] | None = None) -> np.ndarray:
        """New full blocks forming a chain under ``parent`` (each the child of the one
        before): ``keys[i]`` and ``tokens[i]`` (``[n, tpb]`` int32; ``items[i]``: the exact
        tokens and digests of block ``i`` when ``mm``). Returns their ids."""
        n = len(keys)
        nids = self._alloc(n)
        self._rows[nids] = (NO_NODE, 0, self.tpb, int(mm), NO_NODE, NO_NODE, NO_NODE, 0)
        self.parent[nids[0]] = parent
        if n > 1:
            self.parent[nids[1:]] = nids[:-1]
            self.first_child[nids[:-1]] = nids[1:]
            self.nchildren[nids[:-1]] = 1
        self.ordinal[nids] = np.arange(first_ordinal, first_ordinal + n, dtype=np.int32)
        self.pages[nids] = -1
        self.tokens[nids] = tokens
        nl = nids.tolist()
        # An object array made from an iterator first: a list given to the assignment is
        # looked into item by item (for nested sequences) at about twice the cost.
        self._keys[nids] = np.fromiter(keys, dtype=object, count=n)
        if self._key_rows is not None:
            self._key_rows[nids] = np.frombuffer(b"".join(keys), dtype=np.uint8
                                                 ).reshape(n, _KEY_BYTES)
        self.index.update(zip(keys, nl, strict=True))
        if mm and items is not None:
            for nid, its in zip(nids.tolist(), items, strict=True):
                # bytes, not a caller's bytearray (see tokens.frozen_items)
                self._mm_items[nid] = tuple(bytes(t) if type(t) is bytearray else t
                                            for t in its)
                self._aux[nid] = True
        self._link(parent, int(nids[0]))
        self.num_nodes += n
        return nids

    def add_one(self, parent: int, key: bytes, tokens: np.ndarray, ordinal: int) -> int:
        """One new full block under ``parent`` (the decode step's path of
        :meth:`add_chain`)."""
        nid = self._alloc_one()
        self._rows[nid] = (parent, ordinal, self.tpb, 0, NO_NODE, NO_NODE, NO_NODE, 0)
        self.pages[nid] = -1
        self.tokens[nid] = tokens
        self._keys[nid] = key
        if self._key_rows is not None:
            self._key_rows[nid] = np.frombuffer(key, dtype=np.uint8)
        self.index[key] = nid
        self._link(parent, nid)
        self.num_nodes += 1
        return nid

    def has_partial_children(self, nid: int) -> bool:
        return nid in self._partials

    def add_partial(self, parent: int, tokens: Sequence[int]) -> int:
        nid = self._alloc_one()
        self._rows[nid] = (parent, int(self.ordinal[parent]) + 1, len(tokens), 0, NO_NODE,
                           NO_NODE, NO_NODE, 0)
        self.pages[nid] = -1
        row = self.tokens[nid]
        row[: len(tokens)] = tokens
        row[len(tokens) :] = 0  # a recycled id's row keeps no token of the block it was
        self._keys[nid] = None
        if self._key_rows is not None:
            self._key_rows[nid] = 0  # (nor its key)
        self._link(parent, nid)
        self.num_nodes += 1
        return nid

    # -- removing ----------------------------------------------------------------------------

    def _unlink(self, nid: int) -> None:
        p, _, _, _, _, nxt, prev, _ = self._rows[nid].tolist()
        if p == NO_NODE:
            return
        if prev != NO_NODE:
            self.next_sib[prev] = nxt
        else:
            self.first_child[p] = nxt
        if nxt != NO_NODE:
            self.prev_sib[nxt] = prev
        self.nchildren[p] -= 1
        self._unlinked.append(p)
        if self._keys[nid] is None:
            self._partials[p].remove(nid)
            if not self._partials[p]:
                del self._partials[p]
        index = self._by_first.get(p)
        if index is not None:
            bucket = index[int(self.tokens[nid, 0])]
            bucket.remove(nid)
            if not bucket:
                del index[int(self.tokens[nid, 0])]

    def _forget(self, nids: np.ndarray) -> None:
        """Free node ids (already unlinked; their keys leave the index)."""
        keys = self._keys[nids].tolist()  # None for partial blocks, never an index key
        _consume(map(self.index.pop, keys, repeat(None, len(keys))))
        self._keys[nids] = None
        self._release_ids(nids)

    def _release_ids(self, nids: np.ndarray) -> None:
        flagged = nids[self._aux[nids]]
        if len(flagged):  # nodes with an entry in a side table (few)
            self._aux[flagged] = False
            for nid in flagged.tolist():
                self._by_first.pop(nid, None)
                self._partials.pop(nid, None)
                self._mm_items.pop(nid, None)
        self._rows[nids] = self._blank_row
        self.pages[nids] = -1
        self._free.push(nids)

    def detach(self, nid: int) -> list[int]:
        """Remove ``nid`` and its subtree; returns the removed ids (``nid`` first)."""
        gone = [nid, *self.subtree(nid)]
        self._unlink(nid)
        self.num_nodes -= len(gone)
        self._forget(np.asarray(gone, dtype=np.int64))
        return gone

    def collect(self, nids: np.ndarray) -> None:
        """Remove nodes left with no page whose children all go too (a chain's tail goes
        at once), then their parents likewise; a scope root goes once nothing is cached
        under it."""
        self._unlinked.clear()
        flag = self._flag
        one = self.num_groups == 1
        while len(nids):
            bare = self.pages[nids, 0] < 0 if one else (self.pages[nids] < 0).all(axis=1)
            cand = nids[(self.ordinal[nids] >= 0) & bare]
            if not len(cand):
                return
            if len(cand) > 1 and self.num_groups > 1:
                cand = np.unique(cand)  # a node may lose pages of several groups at once
            # Fixed point: a candidate goes when every child of it goes too.
            while True:
                par = self.parent[cand]
                nch = self.nchildren[cand]
                if nch.max() <= 1:
                    flag[par] = True  # candidates with a candidate child
                    ok = nch == flag[cand]
                    flag[par] = False
                else:
                    order = np.sort(cand)
                    inside = np.isin(par, order)
                    kids = np.zeros(len(order), dtype=np.int64)
                    if np.count_nonzero(inside):
                        kids = np.bincount(np.searchsorted(order, par[inside]),
                                           minlength=len(order))
                    ok = nch == kids[np.searchsorted(order, cand)]
                if np.count_nonzero(ok) == len(ok):
                    break
                cand = cand[ok]
                if not len(cand):
                    return
            flag[cand] = True
            tops = cand[~flag[par]]
            flag[cand] = False
            for nid in tops.tolist():
                self._unlink(nid)
            self.num_nodes -= len(cand)
            self._forget(cand)
            up = np.asarray(self._unlinked, dtype=np.int64)
            self._unlinked.clear()
            bare = up[self.nchildren[up] == 0]
            for r in bare[self.parent[bare] == NO_NODE].tolist():
                key = self._keys[r]
                if key is not None and self._roots.get(key) == r:
                    del self._roots[key]
                    del self.index[key]
                    self._keys[r] = None
                    self._release_ids(np.array([r], dtype=np.int64))
            nids = bare[self.parent[bare] != NO_NODE]

    def clear(self) -> None:
        self.index.clear()
        self._roots.clear()
        self._partials.clear()
        self._by_first.clear()
        self._mm_items.clear()
        self._unlinked.clear()
        self.num_nodes = 0
        self._alloc_arrays(16)

    # -- partial matching ----------------------------------------------------------------------

    def best_partial(self, parent: int, tokens: np.ndarray | Sequence[Any],
                     groups: Sequence[int] = ()) -> tuple[int, int]:
        """The child of ``parent`` sharing the longest prefix with ``tokens`` (int32, or a
        sequence holding multimodal digests; at most one block) among those holding a page
        in every one of ``groups``: ``(node, shared tokens)``, ``(NO_NODE, 0)`` when none.
        (A child sharing more tokens but lacking a page does not hide one that has them.)"""
        if not len(tokens):
            return NO_NODE, 0
        if not isinstance(tokens, np.ndarray):
            return self._best_partial_items(parent, tuple(tokens), groups)
        kids = self.children_starting(parent, int(tokens[0]))
        if not kids:
            return NO_NODE, 0
        if len(kids) == 1 and not self.mm[kids[0]]:
            c = kids[0]  # the common case: one candidate, compared on its own
            if not self._has_pages(c, groups):
                return NO_NODE, 0
            m = min(len(tokens), int(self.ntok[c]))
            eq = self.tokens[c, :m] == tokens[:m]
            shared = m if np.count_nonzero(eq) == len(eq) else int(eq.argmin())
            return (c, shared) if shared > 0 else (NO_NODE, 0)
        k = np.asarray(kids, dtype=np.int64)
        if self.mm[k].any():
            return self._best_partial_items(parent, tuple(tokens.tolist()), groups)
        n = len(tokens)
        rows = self.tokens[k, :n]
        eq = rows == tokens[None, :]
        # Shared prefix per child: index of the first mismatch (n if none), capped by ntok.
        mism = np.where(eq.all(axis=1), n, eq.argmin(axis=1))
        shared = np.minimum(mism, self.ntok[k])
        if len(groups):
            shared[(self.pages[k][:, groups] < 0).any(axis=1)] = 0
        best = int(shared.argmax())
        if shared[best] <= 0:
            return NO_NODE, 0
        return int(k[best]), int(shared[best])

    def _has_pages(self, nid: int, groups: Sequence[int]) -> bool:
        pages = self.pages
        return all(pages[nid, g] >= 0 for g in groups)

    def _best_partial_items(self, parent: int, items: tuple[Any, ...],
                            groups: Sequence[int] = ()) -> tuple[int, int]:
        """:meth:`best_partial` compared item by item (digests exactly)."""
        first = token_id32(items[0])
        first = first - (1 << 32) if first >= 1 << 31 else first
        best, best_len = NO_NODE, 0
        for c in self.children_starting(parent, first):
            if not self._has_pages(c, groups):
                continue
            ctoks = self._mm_items.get(c, ()) if self.mm[c] else self.block_tokens(c)
            n = 0
            for x, y in zip(ctoks, items):  # noqa: B905  (the shorter one bounds it)
                if x != y:  # a digest never equals an int token
                    break
                n += 1
            if n > best_len:
                best, best_len = c, n
        return best, best_len
