"""A request's known tokens: an int32 buffer grown by doubling (a list once multimodal
digests appear), so that hashing a range of blocks encodes nothing again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_core.radix import encode_tokens, token_id32

__all__ = ["TokenLog"]


class TokenLog:
    """Tokens ``[0, len)`` of one request.

    Args:
        tokens: the initial tokens (a list or an integer array).
    """

    def __init__(self, tokens: Sequence[Any] | np.ndarray) -> None:
        self._list: list[Any] | None = None
        self._buf = np.empty(max(64, len(tokens)), dtype=np.int32)
        self._n = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n if self._list is None else len(self._list)

    def extend(self, tokens: Sequence[Any] | np.ndarray) -> None:
        """Append tokens (already validated by the caller or by :func:`encode_tokens`)."""
        if self._list is not None:
            self._list.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
            return
        n = len(tokens)
        if not n:
            return
        if isinstance(tokens, np.ndarray):
            arr = tokens
        else:
            data, mm = encode_tokens(tokens)
            if mm:  # digests: keep a list from now on
                self._list = [*self._buf[: self._n].tolist(), *tokens]
                return
            arr = np.frombuffer(data, dtype="<i4")
        if self._n + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self._n + n), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : self._n + n] = arr
        self._n += n

    def truncate(self, n: int) -> None:
        if self._list is not None:
            del self._list[n:]
        else:
            self._n = min(self._n, n)

    def items(self, a: int, b: int | None = None) -> Sequence[Any]:
        """Tokens ``[a, b)``: an int32 array, or a list holding digests."""
        if self._list is not None:
            return self._list[a:b]
        return self._buf[a : self._n if b is None else min(b, self._n)]

    def data(self, a: int, b: int) -> bytes | None:
        """Tokens ``[a, b)`` as 4-byte little-endian ints (None once digests appear)."""
        if self._list is not None:
            return None
        return self._buf[a:b].tobytes()

    def rows(self, a: int, b: int, tpb: int) -> tuple[np.ndarray, bool]:
        """Blocks of tokens ``[a, b)`` as ``[n, tpb]`` int32 (digests by their 32-bit id),
        and whether any digest was among them."""
        if self._list is None:
            return self._buf[a:b].reshape(-1, tpb), False
        items = self._list[a:b]
        ids = [token_id32(t) for t in items]
        mm = any(isinstance(t, bytes | bytearray) for t in items)
        return np.asarray(ids, dtype=np.uint32).view(np.int32).reshape(-1, tpb), mm

    def tail(self, a: int) -> tuple[Any, ...]:
        return tuple(self.items(a).tolist() if self._list is None else self._list[a:])
