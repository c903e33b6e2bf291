"""A NumPy model of the second GPU resolve kernel (``kvcm_sparse_resolve_v2``), phase by
phase, so that its way of finding the entries that misses take can be checked against
:func:`kvcm_core.sparse.reference.resolve_reference` on the host (tests/test_sparse_model.py).

The kernel does not sort the eviction keys. After the hits protect their entries:

1. free candidates (stamp ``-1``) take ranks ``0, 1, ...`` by index;
2. the other candidates rank by stamp a window at a time: those with stamps in
   ``[m, m + window)`` (``m`` the smallest stamp not ranked yet) set one bit each of a
   bitmap, and a candidate's rank is the windows' earlier count plus the set bits below its
   own. Stamps are distinct within a row, so a bit is never set twice; if it is (or a stamp
   is below ``-1``, or more than ``max_windows`` windows are needed), the row falls back to
   sorting ``(stamp, index)`` like the first kernel.

The model returns which way each row went, so tests can check that both are exercised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcm_core.sparse.reference import in_flight, pin_selection

__all__ = ["miss_order", "resolve_model"]


def miss_order(stamp: np.ndarray, candidate: np.ndarray, k: int, window: int,
               max_windows: int) -> tuple[np.ndarray, str]:
    """The entries the ``k`` misses of a row take, in order (``-1`` past the candidates),
    and the way they were found (``"free"``: free entries were enough, ``"windows"``,
    ``"sort"``)."""
    order = np.full(k, -1, dtype=np.int64)
    cand = np.flatnonzero(candidate)
    st = stamp[cand].astype(np.int64)
    free = cand[st == -1]  # ascending index: their ranks
    taken = min(len(free), k)
    order[:taken] = free[:taken]
    taken = len(free)
    rest, rst = cand[st >= 0], st[st >= 0]
    ok = not (st < -1).any()
    m = int(rst.min()) if len(rst) else None
    windows = 0
    while ok and taken < k and m is not None:
        if windows >= max_windows:
            ok = False
            break
        inside = (rst >= m) & (rst - m < window)
        bits = rst[inside] - m
        if len(np.unique(bits)) != len(bits):  # a bit set twice: equal stamps
            ok = False
            break
        bitmap = np.zeros(window, dtype=bool)
        bitmap[bits] = True
        below = np.cumsum(bitmap) - bitmap  # set bits below each position
        rank = taken + below[bits]
        keep = rank < k
        order[rank[keep]] = rest[inside][keep]
        taken += len(bits)
        beyond = rst[rst >= m + window]
        m = int(beyond.min()) if len(beyond) else None
        windows += 1
    if ok:
        return order, "windows" if windows else "free"
    keys = np.lexsort((cand, st))  # (stamp, index): the first kernel's sort
    srt = cand[keys]
    order[:] = -1
    n = min(k, len(srt))
    order[:n] = srt[:n]
    return order, "sort"


def resolve_model(v: dict[str, Any], rows: int, num_selected: int, wsu: int, max_units: int,
                  unit_tokens: int, window: int, max_windows: int) -> list[str]:
    """Resolve in place over the views of :func:`~kvcm_core.sparse.reference.resolve_views`
    (like :func:`~kvcm_core.sparse.reference.resolve_reference`); the way each row found
    its order (``"empty"``, ``"none"`` (no miss), ``"free"``, ``"windows"``, ``"sort"``)."""
    pin = v["selected"] is None
    ways = []
    for r in range(rows):
        lease = int(v["lease_of_row"][r])
        if lease < 0:
            v["entry_map"][r] = -1
            v["miss_count"][r] = 0
            ways.append("empty")
            continue
        marks = v["marks"][lease]
        sel = pin_selection(marks, unit_tokens, num_selected, max_units) if pin else \
            v["selected"][r].astype(np.int64)
        sel = np.where((sel >= 0) & (sel < max_units), sel, -1)
        ways.append(_row(v, r, lease, sel, wsu, unit_tokens, pin, window, max_windows))
    return ways


def _row(v: dict[str, Any], r: int, lease: int, sel: np.ndarray, wsu: int, unit_tokens: int,
         pin: bool, window: int, max_windows: int) -> str:
    resident, stamp, entry_of = v["resident"][lease], v["stamp"][lease], v["entry_of"][lease]
    ns = len(sel)
    # phase 0: first slot of each unit (the kernel's atomicMin on first[]); pinned entries
    first = {}
    for s in range(ns):
        u = int(sel[s])
        if u >= 0:
            first[u] = min(first.get(u, ns), s)
    lo, hi = in_flight(v["marks"][lease], unit_tokens)
    prot = (resident >= lo) & (resident < hi)
    # phase 1: a slot's class: entry (hit), -2 (unused or repeated), -3 - i (i-th miss)
    x = np.full(ns, -2, dtype=np.int64)
    hits = k = 0
    for s in range(ns):
        u = int(sel[s])
        if u < 0 or first[u] != s:
            continue
        e = int(entry_of[u])
        if e >= 0:
            x[s] = e
            prot[e] = True
            hits += 1
        else:
            x[s] = -3 - k
            k += 1
    # phase 2: the entries the misses take
    order, way = miss_order(stamp, ~prot, k, window, max_windows) if k else \
        (np.zeros(0, dtype=np.int64), "none")
    # phase 3: misses move in, resolved units are stamped, first slots mapped
    tick = int(v["tick"][lease])
    emap = v["entry_map"][r]
    for s in range(ns):
        u, c = int(sel[s]), int(x[s])
        e = int(order[-3 - c]) if c <= -3 else c
        if c <= -3:
            i = -3 - c
            if e >= 0:
                old = int(resident[e])
                if old >= 0:
                    entry_of[old] = -1
                resident[e] = u
                entry_of[u] = e
            v["miss_unit"][r, i] = u
            v["miss_entry"][r, i] = e
        if c != -2 and e >= 0:
            stamp[e] = tick * wsu + s
        if c != -2 or u < 0:
            emap[s] = -1 if c == -2 else e
    # phase 4: repeated slots take their unit's entry
    for s in range(ns):
        u = int(sel[s])
        if u >= 0 and x[s] == -2:
            emap[s] = entry_of[u]
    v["tick"][lease] = tick + 1
    v["miss_count"][r] = k
    if not pin:
        v["counters"][r, 0] += hits
        v["counters"][r, 1] += k
    return way
