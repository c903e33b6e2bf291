"""Integer-id bookkeeping shared by the page arena, the tree and the stores: a stack of free
ids (lowest handed out first) and growable rows.

Kept as an int64 array and a count, so that taking or giving back many ids is one slice.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IdStack", "blank_rows", "grown_rows"]


class IdStack:
    """Free ids among ``0..capacity-1``; initially all, popped in increasing order.

    Args:
        capacity: the number of ids.
    """

    def __init__(self, capacity: int) -> None:
        self._ids = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.count = capacity

    def __len__(self) -> int:
        return self.count

    def grow(self, old: int, new: int) -> None:
        """Ids ``old..new-1`` become free, below every id already free (the lower ones are
        still handed out first)."""
        ids = np.empty(new, dtype=np.int64)
        added = np.arange(new - 1, old - 1, -1, dtype=np.int64)
        ids[: len(added)] = added
        ids[len(added) : len(added) + self.count] = self._ids[: self.count]
        self._ids = ids
        self.count += len(added)

    def pop(self, n: int) -> np.ndarray:
        """``n`` ids (the caller checked that enough are free), lowest first."""
        top = self.count
        out = self._ids[top - n : top][::-1].copy()
        self.count = top - n
        return out

    def pop_one(self) -> int:
        self.count -= 1
        return int(self._ids[self.count])

    def push(self, ids: np.ndarray) -> None:
        """Give ids back; the first of ``ids`` is the next one handed out."""
        n = len(ids)
        top = self.count
        if top + n > len(self._ids):  # pragma: no cover - sized to the capacity
            self._ids = np.resize(self._ids, top + n)
        self._ids[top : top + n] = ids[::-1]
        self.count = top + n

    def values(self) -> np.ndarray:
        """The free ids (a copy), next one out last."""
        return self._ids[: self.count].copy()

    def discard(self, value: int) -> None:
        """Take one given id out of the free ones."""
        free = self._ids[: self.count]
        free = free[free != value]
        self.count = len(free)
        self._ids[: self.count] = free

    def keep_below(self, new: int) -> None:
        """Forget the free ids ``>= new`` (a shrink to ``new`` ids)."""
        free = self._ids[: self.count]
        free = free[free < new]
        self._ids = np.empty(max(new, 1), dtype=np.int64)
        self._ids[: len(free)] = free
        self.count = len(free)


def blank_rows(blank: tuple[int, ...], n: int) -> np.ndarray:
    """``n`` int32 rows, each ``blank``."""
    return np.tile(np.asarray(blank, dtype=np.int32), (n, 1))


def grown_rows(rows: np.ndarray, blank: tuple[int, ...], need: int) -> np.ndarray:
    """``rows`` with room for ``need`` more (at least doubled), new rows ``blank``."""
    old = len(rows)
    out = blank_rows(blank, max(2 * old, old + need))
    out[:old] = rows
    return out
