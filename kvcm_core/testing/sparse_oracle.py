"""An exact LRU model of sparse residency, in plain Python: the oracle of the sparse tests.

One :class:`LruOracle` is the working set of one lease in one selection group. Recency is an
ordered list of entries (least recent first), not stamps; the stamps the kernels keep are
computed alongside only so that tests can compare the device state byte for byte.
:class:`ResolveRig` holds one selection group's device state on a backend and checks every
resolve and pin it runs against an oracle per lease; :func:`drifting_topk` makes the
selections of a top-k indexer whose choice drifts from step to step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import Buffer, KernelBackend, SparseResolve
from kvcm_core.sparse.reference import INT32_MAX, keys_width
from kvcm_core.sparse.state import resolve_job

__all__ = ["LruOracle", "ResolveResult", "ResolveRig", "device_array", "drifting_topk"]


class ResolveResult:
    """What one resolve of one row gives: entry map, miss list, distinct hits."""

    def __init__(self, entry_map: list[int], misses: list[tuple[int, int]], hits: int) -> None:
        self.entry_map = entry_map
        self.misses = misses
        self.hits = hits


class LruOracle:
    """The working set of one lease (see module docstring).

    Args:
        working_set_units: entries.
        max_units: unit ids at or past it are unused slots.
    """

    def __init__(self, working_set_units: int, max_units: int) -> None:
        self.wsu = working_set_units
        self.max_units = max_units
        self.resident = [-1] * working_set_units
        self.where: dict[int, int] = {}
        self.recency: OrderedDict[int, None] = OrderedDict()  # used entries, LRU first
        self.stamp = [-1] * working_set_units
        self.tick = 0

    def resolve(self, selected: Sequence[int], in_flight: range) -> ResolveResult:
        """Resolve one row's selection; entries holding a unit of ``in_flight`` are
        pinned."""
        firsts: dict[int, int] = {}
        for s, u in enumerate(selected):
            if 0 <= u < self.max_units and u not in firsts:
                firsts[u] = s
        pinned = {e for e, u in enumerate(self.resident) if u in in_flight}
        hit_entries = {self.where[u] for u in firsts if u in self.where}
        free = [e for e in range(self.wsu) if self.resident[e] == -1]
        victims = iter([*free, *(e for e in self.recency
                                 if e not in pinned and e not in hit_entries)])
        misses: list[tuple[int, int]] = []
        hits = 0
        for u, s in sorted(firsts.items(), key=lambda kv: kv[1]):
            if u in self.where:
                e = self.where[u]
                hits += 1
            else:
                e = next(victims)
                old = self.resident[e]
                if old >= 0:
                    del self.where[old]
                self.resident[e] = u
                self.where[u] = e
                misses.append((u, e))
            self.recency.pop(e, None)
            self.recency[e] = None  # most recent, in slot order
            self.stamp[e] = self.tick * self.wsu + s
        self.tick += 1
        entry_map = [self.where[u] if 0 <= u < self.max_units else -1 for u in selected]
        return ResolveResult(entry_map, misses, hits)

    def pin(self, history: int, capacity: int, unit_tokens: int) -> ResolveResult:
        """Give every in-flight unit an entry (a resolve of those units); the result's
        entry map is the write map (``working_set_units`` slots)."""
        lo = history // unit_tokens
        hi = -(-capacity // unit_tokens) if capacity > history else lo
        sel = [u if u < min(hi, self.max_units) else -1 for u in range(lo, lo + self.wsu)]
        return self.resolve(sel, range(lo, hi))


def device_array(backend: KernelBackend, arr: np.ndarray) -> Buffer:
    """A device buffer holding ``arr``'s bytes."""
    buf = backend.alloc_device(max(arr.nbytes, 1))
    backend.write(buf, 0, np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
    return buf


def _get(backend: KernelBackend, buf: Buffer, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return backend.read(buf, 0, n).view(dtype).reshape(shape)


class ResolveRig:
    """Device state of one selection group for ``rows`` rows (one lease each), driven like a
    batch drives it, with an :class:`LruOracle` per lease alongside."""

    def __init__(self, backend: KernelBackend, rows: int, ns: int, wsu: int, max_units: int,
                 unit_tokens: int) -> None:
        self.backend = backend
        self.rows, self.ns, self.wsu, self.mu, self.ut = rows, ns, wsu, max_units, unit_tokens
        self.lease_of_row = np.arange(rows, dtype=np.int32)
        self.marks = np.zeros((rows, 2), dtype=np.int32)
        i32, i64 = np.int32, np.int64
        fills = {"resident": (i32, (rows, wsu), -1), "stamp": (i64, (rows, wsu), -1),
                 "tick": (i64, (rows,), 0), "entry_of": (i32, (rows, max_units), -1),
                 "first": (i32, (rows, max_units), INT32_MAX),
                 "selected": (i32, (rows, ns), -1), "entry_map": (i32, (rows, ns), -1),
                 "write_map": (i32, (rows, wsu), -1), "miss_unit": (i32, (rows, ns), -1),
                 "miss_entry": (i32, (rows, ns), -1), "miss_count": (i32, (rows,), 0),
                 "pin_unit": (i32, (rows, wsu), -1), "pin_entry": (i32, (rows, wsu), -1),
                 "pin_count": (i32, (rows,), 0),
                 "counters": (i64, (rows, 2), 0),
                 "keys": (np.uint64, (rows, keys_width(wsu)), 0)}
        self.shapes = {k: (d, s) for k, (d, s, _) in fills.items()}
        self.bufs = {k: device_array(backend, np.full(s, f, dtype=d))
                     for k, (d, s, f) in fills.items()}
        self.bufs["lease_of_row"] = device_array(backend, self.lease_of_row)
        self.bufs["marks"] = device_array(backend, self.marks)
        self.oracles = [LruOracle(wsu, max_units) for _ in range(rows)]
        self.counters = np.zeros((rows, 2), dtype=np.int64)

    def close(self) -> None:
        for b in self.bufs.values():
            b.free()

    def read(self, name: str) -> np.ndarray:
        dtype, shape = self.shapes[name]
        return _get(self.backend, self.bufs[name], dtype, shape)

    def job(self, pin: bool = False) -> SparseResolve:
        """The backend job over the rig's buffers (the pin step's, or a resolve's)."""
        return resolve_job(self.bufs, self.bufs["lease_of_row"], self.bufs["marks"],
                           rows=self.rows, leases=self.rows, num_selected=self.ns,
                           working_set_units=self.wsu, max_units=self.mu,
                           unit_tokens=self.ut, pin=pin)

    def in_flight(self, lease: int) -> range:
        h, c = (int(x) for x in self.marks[lease])
        return range(h // self.ut, -(-c // self.ut) if c > h else 0)

    def seat(self, lease_of_row: np.ndarray) -> None:
        """Rows name these leases (``-1``: empty); leases keep their state."""
        self.lease_of_row = np.asarray(lease_of_row, dtype=np.int32)
        self.backend.write(self.bufs["lease_of_row"], 0, self.lease_of_row.view(np.uint8))

    def pin(self, marks: np.ndarray) -> None:
        """New marks per lease, then the pin step; checks the write maps."""
        self.marks = np.asarray(marks, dtype=np.int32).reshape(self.rows, 2)
        self.backend.write(self.bufs["marks"], 0, self.marks.view(np.uint8))
        self._run(True, lambda r, lease: self.oracles[lease].pin(
            int(self.marks[lease][0]), int(self.marks[lease][1]), self.ut))

    def resolve(self, selected: np.ndarray) -> None:
        """One resolve; checks entry map, miss lists and counters against the oracle."""
        sel = np.asarray(selected, dtype=np.int32).reshape(self.rows, self.ns)
        self.backend.write(self.bufs["selected"], 0, sel.view(np.uint8))
        self._run(False, lambda r, lease: self.oracles[lease].resolve(
            sel[r].tolist(), self.in_flight(lease)))

    def _run(self, pin: bool, oracle: Callable[[int, int], ResolveResult]) -> None:
        """Run the job; every row's map and miss list (and the counters) against the
        oracle's result for that row."""
        self.backend.sparse_resolve(self.job(pin))
        names = ("write_map", "pin_count", "pin_unit", "pin_entry") if pin else \
            ("entry_map", "miss_count", "miss_unit", "miss_entry")
        emap, count, units, ents = (self.read(n) for n in names)
        for r, lease in enumerate(self.lease_of_row.tolist()):
            if lease < 0:
                assert (emap[r] == -1).all() and count[r] == 0, f"empty row {r}"
                continue
            res = oracle(r, lease)
            np.testing.assert_array_equal(emap[r], res.entry_map, err_msg=f"{names[0]} row {r}")
            k = len(res.misses)
            assert int(count[r]) == k, f"row {r}: {int(count[r])} misses, oracle {k}"
            np.testing.assert_array_equal(units[r, :k], [u for u, _ in res.misses])
            np.testing.assert_array_equal(ents[r, :k], [e for _, e in res.misses])
            if not pin:  # pins are not counted
                self.counters[r] += (res.hits, k)
        np.testing.assert_array_equal(self.read("counters"), self.counters)
        self.check_state()

    def check_state(self) -> None:
        """Residency, stamps, ticks and the unit map of every lease equal the oracle's."""
        resident, stamp = self.read("resident"), self.read("stamp")
        entry_of, tick = self.read("entry_of"), self.read("tick")
        for lease, o in enumerate(self.oracles):
            np.testing.assert_array_equal(resident[lease], o.resident)
            np.testing.assert_array_equal(stamp[lease], o.stamp)
            assert int(tick[lease]) == o.tick
            want = np.full(self.mu, -1, dtype=np.int32)
            for u, e in o.where.items():
                want[u] = e
            np.testing.assert_array_equal(entry_of[lease], want)
        assert (self.read("first") == INT32_MAX).all(), "the dedup scratch was not restored"


def drifting_topk(rng: np.random.Generator, rows: int, ns: int, universe: int, steps: int,
                  keep: float) -> Iterator[np.ndarray]:
    """Top-k selections that drift: each step keeps about ``keep`` of the last one."""
    cur = np.stack([rng.choice(universe, ns, replace=False) for _ in range(rows)])
    for _ in range(steps):
        yield cur.astype(np.int32)
        for r in range(rows):
            fresh = rng.random(ns) >= keep
            pool = np.setdiff1d(np.arange(universe), cur[r])
            n = min(int(fresh.sum()), len(pool))
            cur[r, np.flatnonzero(fresh)[:n]] = rng.choice(pool, n, replace=False)
