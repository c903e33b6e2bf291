"""A request's known tokens: an int32 buffer grown by doubling (a list once multimodal
digests appear), so that hashing a range of blocks encodes nothing again. Decode steps
append to a short Python list that is moved into the buffer only when a block is read."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError
from kvcm_core.radix import encode_tokens, token_id32

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1

__all__ = ["TokenLog", "check_token_range", "encode_token_ids", "frozen_items"]

#: Up to this many tokens a list is scanned for bools by type (about 20 ns a token); a
#: longer one has only its tokens encoded as 0 or 1 looked at (about 2 us and 0.2 ns a token).
_SCAN_BY_TYPE = 128


def encode_token_ids(tokens: Sequence[Any] | np.ndarray, start: int = 0,
                     name: str = "tokens") -> tuple[bytes, bool]:
    """:func:`~kvcm_core.radix.encode_tokens`, bools refused: ``struct`` and ``array``
    take ``True`` as the token 1, but a bool is not a token id (``ArgumentTypeError``
    naming ``name``, the token's position counted from ``start``, and the rule). An array's
    dtype is checked once; a list of plain ints pays one pass at C speed."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind == "b":
            raise ArgumentTypeError(f"{name}: a token array must have an integer dtype, got "
                                    f"{tokens.dtype} (a bool is not a token id)")
        return encode_tokens(tokens)
    data, mm = encode_tokens(tokens)  # digests: every item was checked, bools refused
    if not mm and data:
        i = _first_bool(tokens, data)
        if i >= 0:
            raise ArgumentTypeError(f"{name}: token {start + i}={tokens[i]!r}: a bool is not "
                                    "a token id (token ids are ints)")
    return data, mm


def check_token_range(tokens: np.ndarray) -> None:
    """An integer token array's values fit int32 (one min and one max; nothing for an
    int32 array): ``InvalidArgumentError`` naming the first token out of range."""
    if tokens.dtype == np.int32 or not tokens.size:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < _I32_MIN or hi > _I32_MAX:
        i = int(np.flatnonzero((tokens < _I32_MIN) | (tokens > _I32_MAX))[0])
        raise InvalidArgumentError(f"token {i}={int(tokens[i])}: token ids must fit a 32-bit "
                                   f"signed int (got values in {lo}..{hi})")


def _first_bool(tokens: Sequence[Any], data: bytes) -> int:
    """The position of the first bool among ``tokens`` (encoded as ``data``), or -1."""
    if len(tokens) <= _SCAN_BY_TYPE:
        if bool not in map(type, tokens):
            return -1
        candidates: Any = range(len(tokens))
    else:  # a bool was encoded as 0 or 1: look only at those tokens
        candidates = np.flatnonzero(np.frombuffer(data, dtype="<u4") < 2).tolist()
    for i in candidates:
        if type(tokens[i]) is bool:
            return int(i)
    return -1


def sliceable(tokens: Any) -> Any:
    """``tokens`` as a sequence that can be sliced: a :class:`collections.deque` (a
    sequence that cannot) as a list, anything else as it is (checked where it is used)."""
    return list(tokens) if isinstance(tokens, collections.deque) else tokens


def frozen_items(tokens: Sequence[Any]) -> list[Any]:
    """A checked token list (with digests) as the log keeps it: every ``bytearray`` (or
    ``bytes`` subclass, as ``numpy.bytes_``) digest copied into ``bytes``, so that what
    the log and the prefix tree keep does not change when the caller reuses its buffer (a
    cached block would then match another image's digest), and NumPy integers as ints (a
    trailing partial block of ints is shared)."""
    return [t if type(t) is int or type(t) is bytes else
            bytes(t) if isinstance(t, bytes | bytearray) else int(t) for t in tokens]


class TokenLog:
    """Tokens ``[0, n)`` of one request (``n`` is public and always current).

    Args:
        tokens: the initial tokens (a list or an integer array).
        capacity: tokens to make room for up front (e.g. the whole prompt).
    """

    def __init__(self, tokens: Sequence[Any] | np.ndarray, capacity: int = 0) -> None:
        self._list: list[Any] | None = None
        self._buf = np.empty(max(64, len(tokens), capacity), dtype=np.int32)
        self._nbuf = 0  # tokens in the buffer
        self._tail: list[int] = []  # validated int tokens after the buffer
        self.n = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self.n

    def _flush(self) -> None:
        tail = self._tail
        if not tail:
            return
        k = len(tail)
        self._reserve(k)
        self._buf[self._nbuf : self._nbuf + k] = tail
        self._nbuf += k
        tail.clear()

    def _reserve(self, k: int) -> None:
        if self._nbuf + k > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self._nbuf + k), dtype=np.int32)
            grown[: self._nbuf] = self._buf[: self._nbuf]
            self._buf = grown

    def extend(self, tokens: Sequence[Any] | np.ndarray) -> None:
        """Append tokens (validated here, by :func:`encode_tokens`)."""
        n = len(tokens)
        if not n:
            return
        if self._list is not None:
            items = tokens.tolist() if isinstance(tokens, np.ndarray) else \
                frozen_items(tokens)
            self._list.extend(items)
            self.n += n
            return
        self._flush()
        if isinstance(tokens, np.ndarray):
            arr = tokens
        else:
            data, mm = encode_tokens(tokens)
            if mm:  # digests: keep a list from now on
                items = frozen_items(tokens)
                self._list = [*self._buf[: self._nbuf].tolist(), *items]
                self.n += n
                return
            arr = np.frombuffer(data, dtype="<i4")
        self._reserve(n)
        self._buf[self._nbuf : self._nbuf + n] = arr
        self._nbuf += n
        self.n += n

    def extend_ints(self, tokens: Sequence[int]) -> None:
        """Append a few int tokens the caller has validated (the decode step)."""
        if self._list is not None:
            self._list.extend(tokens)
        else:
            self._tail.extend(tokens)
        self.n += len(tokens)

    def truncate(self, n: int) -> None:
        if self._list is not None:
            del self._list[n:]
        else:
            self._flush()
            self._nbuf = min(self._nbuf, n)
        self.n = min(self.n, n)

    def items(self, a: int, b: int | None = None) -> Any:
        """Tokens ``[a, b)``: an int32 array, or a list holding digests."""
        if self._list is not None:
            return self._list[a:b]
        self._flush()
        return self._buf[a : self._nbuf if b is None else min(b, self._nbuf)]

    def rows(self, a: int, b: int, tpb: int) -> tuple[np.ndarray, bool]:
        """Blocks of tokens ``[a, b)`` as ``[n, tpb]`` int32 (digests by their 32-bit id),
        and whether any digest was among them."""
        if self._list is None:
            self._flush()
            return self._buf[a:b].reshape(-1, tpb), False
        items = self._list[a:b]
        ids = [token_id32(t) for t in items]
        mm = any(isinstance(t, bytes | bytearray) for t in items)
        return np.asarray(ids, dtype=np.uint32).view(np.int32).reshape(-1, tpb), mm

    def tail(self, a: int) -> tuple[Any, ...]:
        if self._list is not None:
            return tuple(self._list[a:])
        return tuple(self.items(a).tolist())

    @property
    def has_digests(self) -> bool:
        return self._list is not None
