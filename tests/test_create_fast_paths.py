"""Fast paths of ``create_kv_cache`` against the code they replaced, over random trees and
workloads.

- kvcm_core/matching.py: ``_feasible`` checks two slices of blocks instead of one
  ``np.r_`` index array; ``with_partial_block`` reads the tail from the walk's encoded
  tokens and appends the partial node without ``np.append``. The references below are
  the previous versions, verbatim but for names; ``match_prefix`` must return exactly the
  same :class:`Match` with either, and ``_feasible`` the same answer at every endpoint.
- kvcm_core/cache.py: a new cache claims every attention group's pages in one
  ``Levels.claim``. The reference manager splits each claim by group, in group order
  (what one claim per group did); both must make the same ``Store.change`` calls, in the
  same order, and end with the same counts, queues and statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import policy_helpers as ph
from conftest import full_layers, hybrid_layers
from conftest import make_manager as make_gpu_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gallop_walk import IMAGES, cursor_state

from kvcm_core import ReusePolicy
from kvcm_core import matching as matching_mod
from kvcm_core.matching import match_prefix, token_array
from kvcm_core.radix import NO_NODE, PrefixTree, scope_root_key

# -- the previous versions -----------------------------------------------------------------


def ref_with_partial_block(tree: PrefixTree, root: int, tokens: Sequence[Any] | np.ndarray,
                           nodes: np.ndarray, tpb: int, walk_groups: Sequence[int],
                           encoded: bytes | None = None) -> tuple[np.ndarray, int]:
    length = len(nodes) * tpb
    parent = int(nodes[-1]) if len(nodes) else root
    limit = min(tpb, len(tokens) - length)
    tail: Any = token_array(tokens[length : length + limit])
    if tail is None:  # multimodal digests: compared item by item
        tail = list(tokens[length : length + limit])
    best, plen = tree.best_partial(parent, tail, walk_groups)
    if best != NO_NODE:
        return np.append(nodes, np.int64(best)), length + plen
    return nodes, length


def ref_feasible(tree: PrefixTree, nodes: np.ndarray, end: int, tpb: int,
                 life_cycles: Sequence[Any], groups: Sequence[int]) -> bool:
    nb = -(-end // tpb)
    for g in groups:
        lc = life_cycles[g]
        if lc.is_ssm:
            if end == 0:
                continue
            node = int(nodes[(end - 1) // tpb])
            if tree.pages[node, g] < 0 or tree.end(node) != end:
                return False
            continue
        start, stop = lc.stale_range(end, tpb)
        need = np.r_[0:start, stop:nb]
        if lc.policy is ReusePolicy.SINK_REQUIRED_ONLY:
            need = need[need < lc.num_sink_blocks]
        elif lc.policy is not ReusePolicy.REQUIRED:
            continue
        if len(need) and (tree.pages[nodes[need], g] < 0).any():
            return False
    return True


@contextlib.contextmanager
def reference_matching() -> Iterator[None]:
    saved = matching_mod.with_partial_block, matching_mod._feasible
    matching_mod.with_partial_block = ref_with_partial_block  # type: ignore[assignment]
    matching_mod._feasible = ref_feasible
    try:
        yield
    finally:
        matching_mod.with_partial_block, matching_mod._feasible = saved


# -- random workloads --------------------------------------------------------------------

PREFIXES = [[int(t) for t in np.random.default_rng(70 + i).integers(0, 4, 160)]
            for i in range(3)]

item = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                 st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                 st.sampled_from(IMAGES))
prompts = st.tuples(st.integers(0, 2), st.integers(0, 160),
                    st.lists(st.integers(0, 3), max_size=24) | st.lists(item, max_size=24))


def prompt_of(spec: tuple[int, int, list[Any]]) -> list[Any]:
    pfx, cut, tail = spec
    return PREFIXES[pfx][:cut] + list(tail)


def forms(toks: list[Any]) -> list[Any]:
    if any(isinstance(t, bytes) for t in toks):
        return [toks, tuple(toks)]
    return [toks, tuple(toks), np.asarray(toks, dtype=np.int32),
            np.asarray(toks, dtype=np.int64)]


def store_prompt(m: Any, toks: list[Any], keep: list[Any], close: bool) -> None:
    c = m.create_kv_cache(None, toks)
    if toks and c.resume() and c.resize(len(toks)):
        c.commit(toks[c.history_length:])
    if close or len(keep) >= 3:
        c.close()
    else:
        keep.append(c)


def same_match(got: Any, ref: Any) -> None:
    assert got.length == ref.length
    assert got.nodes.dtype == ref.nodes.dtype or not len(got.nodes)
    assert got.nodes.tolist() == ref.nodes.tolist()
    assert got.keys == ref.keys
    assert got.data == ref.data
    assert cursor_state(got.cursor) == cursor_state(ref.cursor)


def check_matches(m: Any, toks: list[Any]) -> None:
    tree, tpb, lcs = m.tree, m.tokens_per_block, m.life_cycles
    ngroups = len(lcs)
    root_key = scope_root_key(None)
    for f in forms(toks):
        for walk in (list(m._walk_groups), [], list(range(ngroups))):
            for prune in (list(m._prune_groups), list(range(ngroups)), []):
                for partial, backoff, probe in ((True, 0, False), (False, 0, False),
                                                (True, 3, False), (True, 0, True)):
                    kw = dict(walk_groups=walk, prune_groups=prune, partial=partial,
                              backoff=backoff, probe=probe)
                    got = match_prefix(tree, root_key, f, tpb, lcs, **kw)
                    with reference_matching():
                        ref = match_prefix(tree, root_key, f, tpb, lcs, **kw)
                    same_match(got, ref)
    # _feasible at every endpoint of the longest full-block walk, for every group subset.
    full = match_prefix(tree, root_key, toks, tpb, lcs, walk_groups=[], prune_groups=[],
                        partial=True, backoff=0)
    nodes = full.nodes
    for end in range(0, len(nodes) * tpb + 1):
        for groups in ([g] for g in range(ngroups)):
            assert matching_mod._feasible(tree, nodes, end, tpb, lcs, groups) == \
                ref_feasible(tree, nodes, end, tpb, lcs, groups)
        everything = list(range(ngroups))
        assert matching_mod._feasible(tree, nodes, end, tpb, lcs, everything) == \
            ref_feasible(tree, nodes, end, tpb, lcs, everything)


LAYOUTS = ["full", "hybrid", "every-policy"]


def make(layout: str, tpb_choice: int) -> Any:
    if layout == "full":
        return make_gpu_manager(full_layers(tpb_choice), slots=48, tpb=tpb_choice)
    if layout == "hybrid":
        return make_gpu_manager(hybrid_layers(window=2 * tpb_choice, sinks=tpb_choice,
                                              tpb=tpb_choice), slots=48, tpb=tpb_choice,
                                commit_min_snapshot=True)
    return ph.make_manager(ph.every_policy_layers(), slots=48)


def drop_some(m: Any, pick: int) -> None:
    """Evict a few droppable pages (of any group), leaving holes in the tree's pages."""
    levels = m.storage_levels
    for store in levels.all_stores:
        victims = [p for p in store.pages().tolist() if p in store.droppable]
        for k in range(min(3, len(victims))):
            pid = victims[(pick + 7 * k) % len(victims)]
            if pid in store.droppable:
                levels.drop(store, np.array([pid], dtype=np.int64), queued=True)
        pick //= 3


match_steps = st.lists(st.one_of(
    st.tuples(st.just("store"), prompts, st.booleans()),
    st.tuples(st.just("store"), prompts, st.booleans()),
    st.tuples(st.just("store"), prompts, st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 1 << 16), st.booleans()),
    st.tuples(st.just("match"), prompts, st.booleans()),
), min_size=2, max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(LAYOUTS), tpb=st.sampled_from([1, 2, 4]), steps=match_steps)
def test_matching_equals_the_previous_partial_block_and_pruning(layout, tpb, steps):
    m = make(layout, tpb)
    keep: list[Any] = []
    try:
        for op, arg, close in steps:
            if op == "drop":
                drop_some(m, arg)
                continue
            toks = prompt_of(arg)
            if op == "store":
                store_prompt(m, toks, keep, close)
            check_matches(m, toks)
    finally:
        for c in keep:
            c.close()
        m.shutdown()


def test_partial_tail_with_several_chunks():
    """Prompts longer than two encoding chunks (the walk encodes several: the partial
    block's tail is encoded again) and shorter ones (read from the one chunk)."""
    m = make_gpu_manager(full_layers(2), slots=400, tpb=2)
    saved = matching_mod._CHUNK, matching_mod._ARRAY_CHUNK
    matching_mod._CHUNK, matching_mod._ARRAY_CHUNK = 3, 5
    try:
        base = [int(t) for t in np.random.default_rng(3).integers(0, 5, 301)]
        c = m.create_kv_cache(None, base)
        assert c.resume() and c.resize(len(base))
        c.commit(base)
        c.close()
        for cut in (0, 1, 5, 6, 7, 12, 13, 60, 61, 299, 300, 301):
            for extra in ([], [9], [9, 8, 7]):
                check_matches(m, base[:cut] + extra)
    finally:
        matching_mod._CHUNK, matching_mod._ARRAY_CHUNK = saved
        m.shutdown()


# -- one claim for every group -------------------------------------------------------------


def claim_per_group(levels: Any) -> None:
    """The reference: ``levels.claim`` split by cache group, one claim each in the order
    a cache's loop visits them (``levels.claim_order``), as before."""
    orig = levels.claim
    order = {g: i for i, g in enumerate(levels.claim_order)}

    def claim(pids: np.ndarray, *counts: int) -> None:
        groups = levels.arena.group[pids]
        for g in sorted(set(groups.tolist()), key=order.__getitem__):
            orig(pids[groups == g], *counts)

    levels.claim = claim


def record_changes(levels: Any, log: list[Any]) -> None:
    for i, store in enumerate(levels.all_stores):
        def change(pids: np.ndarray, dlocks: int, dholds: int, _i: int = i,
                   _orig: Any = store.change) -> None:
            log.append((_i, pids.tolist(), dlocks, dholds))
            _orig(pids, dlocks, dholds)
        store.change = change


def final_state(m: Any) -> Any:
    levels = m.storage_levels
    a = levels.arena
    out: list[Any] = [a.locks.tolist(), a.holds.tolist(), a.priority.tolist(),
                      a.reused.tolist(), a.level.tolist(), a.demoted.tolist(), levels.stats]
    for store in levels.all_stores:
        out.append([int(p) for p in store.held.pop_victims(len(store.held))])
        out.append([int(p) for p in store.droppable.pop_victims(len(store.droppable))])
    return out


ops = st.lists(st.one_of(
    st.tuples(st.just("create"), prompts, st.integers(0, 3)),
    st.tuples(st.just("create"), prompts, st.integers(0, 3)),
    st.tuples(st.just("close"), st.integers(0, 1 << 16), st.integers(0, 0)),
), min_size=3, max_size=25)


def two_level_manager(layout: str) -> Any:
    """GPU and host, the GPU small enough that matched pages are found on both."""
    return ph.make_manager(ph.every_policy_layers() if layout == "every-policy" else
                           hybrid_layers(window=8, sinks=4, tpb=ph.TPB),
                           stack=("gpu", "host"), slots=[30, 200], commit_min_snapshot=True)


def drive(layout: str, steps: list[Any], reference: bool) -> tuple[list[Any], Any]:
    m = two_level_manager(layout)
    levels = m.storage_levels
    log: list[Any] = []
    if reference:
        levels.claim_order = list(m._ctx.attn_groups)  # the order of the cache's loop
        claim_per_group(levels)
    record_changes(levels, log)
    caches: list[Any] = []
    seen: list[Any] = []
    try:
        for op, arg, how in steps:
            if op == "close":
                if caches:
                    caches.pop(arg % len(caches)).close()
                continue
            toks = prompt_of(arg)
            cb = (lambda b: (b * 37) % 101) if how & 1 else None
            c = m.create_kv_cache(None, toks, priority_callback=cb)
            seen.append((c.history_length, [list(p) for p in c._pages], list(c._pending),
                         c.stats))
            if how & 2 and toks and c.resume() and c.resize(len(toks)):
                c.commit(toks[c.history_length:])
            caches.append(c)
            if len(caches) > 4:
                caches.pop(0).close()
        for c in caches:
            c.close()
        seen.append(m.get_statistics() if hasattr(m, "get_statistics") else None)
        return [log, seen], final_state(m)
    finally:
        m.shutdown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(["hybrid", "every-policy"]), steps=ops)
def test_one_claim_for_all_groups_equals_one_claim_per_group(layout, steps):
    got = drive(layout, steps, reference=False)
    ref = drive(layout, steps, reference=True)
    assert got[0][0] == ref[0][0]  # the same Store.change calls, in the same order
    assert got[0][1] == ref[0][1]
    assert got[1] == ref[1]


def test_claims_span_groups_and_levels():
    """The managers above do claim pages of several groups at once, on both levels
    (a check of the test itself)."""
    for layout in ("hybrid", "every-policy"):
        m = two_level_manager(layout)
        levels = m.storage_levels
        spans: list[tuple[int, int]] = []
        orig = levels.claim

        def claim(pids: np.ndarray, *counts: int, _orig: Any = orig, _levels: Any = levels,
                  _spans: list[Any] = spans) -> None:
            a = _levels.arena
            _spans.append((len(set(a.group[pids].tolist())), len(set(a.level[pids].tolist()))))
            _orig(pids, *counts)

        levels.claim = claim
        try:
            for i in range(30):
                toks = [*PREFIXES[i % 3][: 20 + 5 * i], i % 4]
                c = m.create_kv_cache(None, toks)
                if c.resume() and c.resize(len(toks)):
                    c.commit(toks[c.history_length:])
                c.close()
            assert any(g > 1 for g, _ in spans), layout
            assert any(lv > 1 for _, lv in spans), layout
        finally:
            m.shutdown()
