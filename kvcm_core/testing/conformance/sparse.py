"""Conformance of a kernel backend's sparse kernels (``sparse_resolve``, ``sparse_copy``).

Resolve is checked against the exact LRU model of :mod:`kvcm_core.testing.sparse_oracle`
(plain Python, recency as an ordered list), on random sequences drawn by hypothesis:
all-hit and all-miss steps, duplicates, ``-1`` and out-of-range padding, empty rows,
in-flight (pinned) units, leases moved between rows. Every output and every state table is
compared byte for byte (the stamps included), so two backends that pass agree bit for bit.
Copies are checked against byte slicing of the expected units. Inputs go in through
``write`` and results come back through ``read``.

Subclass to run it for one backend::

    class TestMySparse(SparseKernelConformance):
        plugin_name = "mine"
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core.backend import KernelBackend, PageRegion, SparseBufferCells, SparseCopy
from kvcm_core.testing.conformance import ConformanceBase
from kvcm_core.testing.conformance.kernels import KernelBackendConformance
from kvcm_core.testing.sparse_oracle import ResolveRig, device_array, drifting_topk

__all__ = ["ResolveRig", "SparseKernelConformance", "check_copy", "drifting_topk",
           "random_case", "run_case"]

_SETTINGS = settings(max_examples=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.differing_executors])


def random_case(rng: np.random.Generator, steps: int = 12) -> dict[str, Any]:
    """A case like the hypothesis strategy's, from a NumPy generator (for device tests
    that replay many seeds)."""
    rows, ns = int(rng.integers(1, 9)), int(rng.integers(1, 33))
    wsu, ut = ns + int(rng.integers(0, 40)), int(rng.choice([1, 2, 4, 8]))
    mu = int(rng.integers(1, 200))
    ops: list[tuple[str, Any]] = []
    for _ in range(steps):
        kind = str(rng.choice(["resolve", "resolve", "resolve", "pin", "seat"]))
        if kind == "resolve":
            sel = rng.integers(-2, min(mu + 2, 3 * ns + 4), (rows, ns))
            ops.append((kind, sel))
        elif kind == "pin":
            h = rng.integers(0, mu * ut + 1, rows)
            room = np.maximum(0, (wsu - ns) * ut - h % ut)
            ops.append((kind, np.stack([h, h + rng.integers(0, room + 1)], 1)))
        else:
            perm = rng.permutation(rows)
            ops.append((kind, np.where(rng.random(rows) < 0.3, -1, perm)))
    return {"rows": rows, "ns": ns, "wsu": wsu, "ut": ut, "mu": mu, "ops": ops}


def run_case(rig: ResolveRig, case: dict[str, Any]) -> None:
    """Replay a case's operations on a rig (each checks itself against the oracle)."""
    for kind, arg in case["ops"]:
        getattr(rig, kind)(arg)


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    rows = draw(st.integers(1, 4))
    ns = draw(st.integers(1, 6))
    wsu = draw(st.integers(ns, ns + 8))
    ut = draw(st.sampled_from([1, 2, 4]))
    mu = draw(st.integers(1, 24))
    ops: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["resolve", "resolve", "resolve", "pin", "seat"]))
        if kind == "resolve":
            sel = draw(st.lists(st.integers(-2, mu + 1), min_size=rows * ns,
                                max_size=rows * ns))
            ops.append((kind, np.asarray(sel).reshape(rows, ns)))
        elif kind == "pin":
            marks = []
            for _ in range(rows):
                h = draw(st.integers(0, mu * ut))
                room = (wsu - ns) * ut - (h % ut)
                c = h + draw(st.integers(0, max(0, room)))
                marks.append((h, c))
            ops.append((kind, np.asarray(marks)))
        else:
            perm = draw(st.permutations(list(range(rows))))
            holes = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
            ops.append((kind, np.where(holes, -1, perm)))
    return {"rows": rows, "ns": ns, "wsu": wsu, "ut": ut, "mu": mu, "ops": ops}


class SparseKernelConformance(ConformanceBase):
    """Checks ``sparse_resolve`` and ``sparse_copy`` of a kernel backend."""

    kvcm_kind = "kernel_backend"
    backend = KernelBackendConformance.backend  # the backend under test, default options

    @staticmethod
    def _rig(backend: KernelBackend, *args: int) -> ResolveRig:
        if type(backend).sparse_resolve is KernelBackend.sparse_resolve:
            pytest.skip("the backend has no sparse kernels")
        return ResolveRig(backend, *args)

    @_SETTINGS
    @given(case=_cases())
    def test_resolve_is_the_exact_lru_on_random_selections(
            self, backend: KernelBackend, case: dict[str, Any]) -> None:
        rig = self._rig(backend, case["rows"], case["ns"], case["wsu"], case["mu"], case["ut"])
        try:
            run_case(rig, case)
        finally:
            rig.close()

    def test_all_hit_then_all_miss_steps(self, backend: KernelBackend) -> None:
        rig = self._rig(backend, 2, 4, 8, 64, 4)
        try:
            sel = np.array([[0, 1, 2, 3], [10, 11, 12, 13]])
            rig.resolve(sel)  # all miss: free entries 0..3 in slot order
            np.testing.assert_array_equal(rig.read("miss_entry")[:, :4], [[0, 1, 2, 3]] * 2)
            rig.resolve(sel[:, ::-1])  # all hit
            assert (rig.read("miss_count") == 0).all()
            rig.resolve(sel + 20)
            rig.resolve(sel + 40)  # evicts the least recent: 20.. were newer than 0..
        finally:
            rig.close()

    @pytest.mark.parametrize("wsu", [4096, 4100])
    def test_resolve_of_large_working_sets_on_a_drifting_top_k(
            self, backend: KernelBackend, wsu: int) -> None:
        """2048 selected of 4096 and of 4100 entries (the second past a 4096-entry
        shared-memory sort)."""
        rng = np.random.default_rng(wsu)
        rig = self._rig(backend, 2, 2048, wsu, 16384, 4)
        try:
            for sel in drifting_topk(rng, 2, 2048, 6000, 4, 0.5):
                rig.resolve(sel)
        finally:
            rig.close()

    @pytest.mark.parametrize("flush", [False, True])
    def test_copy_moves_each_unit_between_its_host_page_and_its_entry(
            self, backend: KernelBackend, flush: bool) -> None:
        if type(backend).sparse_copy is KernelBackend.sparse_copy:
            pytest.skip("the backend has no sparse kernels")
        check_copy(backend, flush, np.random.default_rng(int(flush)))


def check_copy(backend: KernelBackend, flush: bool, rng: np.random.Generator) -> None:
    """Two buffers (unit sizes 16 and 12 bytes, 4 units per page) in one host pool, three
    rows on moved leases, one empty; random miss lists or flush ranges."""
    rows, ns, upp, blocks, wsu = 3, 5, 4, 6, 8
    mu = blocks * upp
    sizes = (64, 48)
    slot_bytes = sum(sizes)
    nslots = 20
    host = backend.alloc_host(slot_bytes * nslots)
    host_img = rng.integers(0, 256, slot_bytes * nslots, dtype=np.uint8)
    backend.write(host, 0, host_img)
    leases = np.array([2, -1, 0], dtype=np.int32)
    table = np.full((rows, blocks), -1, dtype=np.int32)
    for r in range(rows):
        table[r, : blocks - 1] = rng.choice(nslots, blocks - 1, replace=False)
    cells_per_buffer = wsu // upp
    lease_cells = 2 * cells_per_buffer
    arena_bytes = 3 * lease_cells * max(sizes)
    arena = backend.alloc_device(arena_bytes)
    arena_img = rng.integers(0, 256, arena_bytes, dtype=np.uint8)
    backend.write(arena, 0, arena_img)
    cells = []
    for k, size in enumerate(sizes):
        cells.append(SparseBufferCells(
            PageRegion(host, sum(sizes[:k]), slot_bytes),
            PageRegion(arena, k * cells_per_buffer * max(sizes), max(sizes)),
            size // upp, upp, lease_cells))
    miss_unit = np.full((rows, ns), -1, dtype=np.int32)
    miss_entry = np.full((rows, ns), -1, dtype=np.int32)
    count = np.zeros(rows, dtype=np.int32)
    entry_of = np.full((3, mu), -1, dtype=np.int32)
    ranges = np.zeros((rows, 2), dtype=np.int32)
    items: list[tuple[int, int, int]] = []  # (row, unit, entry) expected to move
    for r in range(rows):
        units = rng.choice(mu, ns, replace=False)
        ents = rng.choice(wsu, ns, replace=False)
        if flush:
            lo = int(rng.integers(0, mu - ns))
            ranges[r] = (lo, lo + ns)
            units = np.arange(lo, lo + ns)
            entry_of[max(leases[r], 0), units] = ents
            entry_of[max(leases[r], 0), units[0]] = -1  # a unit without an entry: skipped
        else:
            k = int(rng.integers(0, ns + 1))
            count[r] = k
            miss_unit[r, :k], miss_entry[r, :k] = units[:k], ents[:k]
            units, ents = units[:k], ents[:k]
        if leases[r] >= 0:
            items += [(r, int(u), int(e)) for u, e in zip(units, ents, strict=True)
                      if (not flush or entry_of[leases[r], u] >= 0) and
                      table[r, u // upp] >= 0]
    bufs = [device_array(backend, a)
            for a in (table, leases, miss_unit, miss_entry, count, entry_of, ranges)]
    job = SparseCopy(flush=flush, rows=rows, num_selected=ns, max_units=mu, row_elems=blocks,
                     buffers=tuple(cells), page_table=bufs[0], lease_of_row=bufs[1],
                     miss_unit=bufs[2], miss_entry=bufs[3], miss_count=bufs[4],
                     entry_of=bufs[5], ranges=bufs[6])
    backend.sparse_copy(job)
    want_host, want_arena = host_img.copy(), arena_img.copy()
    for r, u, e in items:
        lease = int(leases[r])
        for c in cells:
            ub = c.unit_bytes
            h = c.host.offset + int(table[r, u // upp]) * c.host.stride + (u % upp) * ub
            q = (c.cells.offset + (lease * c.lease_cells + e // upp) * c.cells.stride
                 + (e % upp) * ub)
            if flush:
                want_host[h: h + ub] = arena_img[q: q + ub]
            else:
                want_arena[q: q + ub] = host_img[h: h + ub]
    try:
        np.testing.assert_array_equal(backend.read(host, 0, host.nbytes), want_host)
        np.testing.assert_array_equal(backend.read(arena, 0, arena.nbytes), want_arena)
    finally:
        for b in (host, arena, *bufs):
            b.free()
