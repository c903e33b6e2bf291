"""A NumPy model of the second and third GPU resolve kernels (``kvcm_sparse_resolve_v2``,
``_v3``), phase by phase, so that their way of finding the entries that misses take can be
checked against :func:`kvcm_core.sparse.reference.resolve_reference` on the host
(tests/test_sparse_resolve_model.py).

The kernel does not sort the eviction keys. After the hits protect their entries:

1. free candidates (stamp ``-1``) take ranks ``0, 1, ...`` by index;
2. the other candidates rank by stamp a window at a time: those with stamps in
   ``[m, m + window)`` (``m`` the smallest stamp not ranked yet) set one bit each of a
   bitmap, and a candidate's rank is the windows' earlier count plus the set bits below its
   own. Stamps are distinct within a row, so a bit is never set twice; if it is (or a stamp
   is below ``-1``, or more than ``max_windows`` windows are needed), the row falls back to
   sorting ``(stamp, index)`` like the first kernel.

The third kernel (``kvcm_sparse_resolve_v3_*``) finds the same order with one change of
schedule (:func:`miss_order_v3`): its first window starts at the smallest stamp of the
unpinned entries, found while the row is loaded (before the hits protect their entries), so
that the free candidates and the first window are ranked in one pass.

The model returns which way each row went, so tests can check that both are exercised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcm_core.sparse.reference import in_flight, pin_selection

__all__ = ["miss_order", "miss_order_v3", "resolve_model"]


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


def miss_order_v3(stamp: np.ndarray, unpinned: np.ndarray, candidate: np.ndarray, k: int,
                  window: int, max_windows: int) -> tuple[np.ndarray, str]:
    """The third kernel's way to the same order as :func:`miss_order`: the first window
    starts at the smallest stamp of the *unpinned* entries (known before the hits protect
    theirs), and free candidates are ranked in the same pass as that window. A stamp below
    ``-1`` on an unpinned entry, equal stamps in a window, or a row needing more than
    ``max_windows`` windows (any window, when it is 0) fall back to the sort."""
    order = np.full(k, -1, dtype=np.int64)
    up = stamp[unpinned].astype(np.int64)
    ok = not (up < -1).any()
    nonfree = up[up >= 0]
    m = int(nonfree.min()) if len(nonfree) else None
    cand = np.flatnonzero(candidate)
    st = stamp[cand].astype(np.int64)
    free = cand[st == -1]
    rest, rst = cand[st >= 0], st[st >= 0]
    taken, it, ranked = 0, 0, 0
    while ok:
        win = it < max_windows and m is not None
        w = window if win else 0
        base = taken
        if it == 0:
            n = min(len(free), k)
            order[:n] = free[:n]
            base += len(free)
        if m is None:
            inside = np.zeros(len(rst), dtype=bool)
            beyond = inside
        else:
            inside = (rst >= m) & (rst - m < w)
            beyond = rst >= m + w
        bits = rst[inside] - (m or 0)
        if len(np.unique(bits)) != len(bits):  # a bit set twice: equal stamps
            ok = False
            break
        rank = base + np.argsort(np.argsort(bits))  # set bits below each one
        keep = rank < k
        order[rank[keep]] = rest[inside][keep]
        ranked += len(bits)
        taken = base + len(bits)
        nxt = int(rst[beyond].min()) if beyond.any() else None
        if taken >= k or nxt is None:
            break
        if not win or it + 1 >= max_windows:
            ok = False
            break
        m, it = nxt, it + 1
    if ok:
        return order, "windows" if ranked else "free"
    keys = np.lexsort((cand, st))
    srt = cand[keys]
    order[:] = -1
    n = min(k, len(srt))
    order[:n] = srt[:n]
    return order, "sort"


def resolve_model(v: dict[str, Any], rows: int, num_selected: int, wsu: int, max_units: int,
                  unit_tokens: int, window: int, max_windows: int,
                  variant: str = "v2") -> list[str]:
    """Resolve in place over the views of :func:`~kvcm_core.sparse.reference.resolve_views`
    (like :func:`~kvcm_core.sparse.reference.resolve_reference`) with the order of the
    second kernel (``variant="v2"``: :func:`miss_order`) or the third (``"v3"``:
    :func:`miss_order_v3`); the way each row found its order (``"empty"``, ``"none"`` (no
    miss), ``"free"``, ``"windows"``, ``"sort"``).

    Raises:
        ValueError: ``variant`` is neither ``"v2"`` nor ``"v3"``.
    """
    if variant not in ("v2", "v3"):
        raise ValueError(f"variant={variant!r}: must be 'v2' or 'v3'")
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
        ways.append(_row(v, r, lease, sel, wsu, unit_tokens, pin, window, max_windows,
                         variant))
    return ways


def _row(v: dict[str, Any], r: int, lease: int, sel: np.ndarray, wsu: int, unit_tokens: int,
         pin: bool, window: int, max_windows: int, variant: str) -> str:
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
    unpinned = ~prot
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
    if not k:
        order, way = np.zeros(0, dtype=np.int64), "none"
    elif variant == "v3":
        order, way = miss_order_v3(stamp, unpinned, ~prot, k, window, max_windows)
    else:
        order, way = miss_order(stamp, ~prot, k, window, max_windows)
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
