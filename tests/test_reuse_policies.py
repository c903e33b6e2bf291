"""Reuse policies (concepts.md §3-5, §9-10): REQUIRED, OPTIONAL, PRIVATE and
SINK_REQUIRED_ONLY, split layers, pool grouping by pool policy, and eviction by the page's
own life cycle. Every data check is fingerprint-verified (FingerprintEngine), with the
engine recomputing what a cache got fresh at its first resume (``recompute_blocks``), on
each level stack where the rule involves moving pages.
"""

from __future__ import annotations

import argparse

import pytest
from policy_helpers import (
    PAGE,
    STACKS,
    TPB,
    Driver,
    P,
    assert_all_free,
    assert_invariants,
    assert_no_private_in_tree,
    att,
    buf,
    cache_pages,
    chain,
    drop,
    every_policy_layers,
    evict_level,
    group_of,
    groups_with,
    make_manager,
    node_page,
    snapshot,
    ssm,
    store_pages,
    tokens,
    tree_nodes,
)

from kvcm_core import CacheStatus, ConfigError
from kvcm_core.backend import BAD_PAGE_INDEX

STACK_IDS = list(STACKS)
COLD_STACK_IDS = ["gpu-host", "gpu-host-disk"]


def manager(layers, stack="gpu", slots=32, tmp_path=None, **kw):
    return make_manager(layers, STACKS[stack], slots, tmp_path, **kw)


def sink_to_bottom(m) -> None:
    """Move every page not locked by an active request to the coldest level."""
    for level in range(len(m.levels) - 1):
        evict_level(m, level)


def table(cache, group) -> list[int]:
    return [int(x) for x in cache.get_base_page_indices(group)]


# -- policies, life cycles and lookups ----------------------------------------------------------


def test_buffer_policy_none_inherits_the_layer_default_and_overrides_split_the_layer():
    m = manager([
        att(0, buf("k"), buf("v"), policy=P.OPTIONAL),  # both inherit OPTIONAL
        att(1, buf("k", policy=P.OPTIONAL), buf("v", policy=P.OPTIONAL)),  # explicit, same
        att(2, buf("k"), buf("v", policy=P.PRIVATE)),  # split: REQUIRED + PRIVATE
        att(3, buf("k", policy=P.REQUIRED), buf("v")),  # explicit default: uniform
    ])
    g = m.buffer_grouping
    assert g[(0, "k")] == g[(0, "v")] == g[(1, "k")] == g[(1, "v")]
    assert m.life_cycles[g[(0, "k")]].policy is P.OPTIONAL
    assert g[(2, "k")] == g[(3, "k")] == g[(3, "v")] != g[(2, "v")]
    assert m.life_cycles[g[(2, "k")]].policy is P.REQUIRED
    assert m.life_cycles[g[(2, "v")]].policy is P.PRIVATE
    assert m.num_cache_groups == 3


def test_effective_policy_is_part_of_the_life_cycle_identity_for_every_layer_kind():
    m = manager([
        att(0, buf("k"), buf("v", policy=P.OPTIONAL)),
        att(1, buf("k"), buf("v", policy=P.OPTIONAL), window=8, sinks=4),
        att(2, buf("k"), buf("v", policy=P.SINK_REQUIRED_ONLY), window=8, sinks=4),
        ssm(3, buf("s", 48), buf("c", 16, P.PRIVATE)),
    ])
    descs = [lc.describe() for lc in m.life_cycles]
    assert descs == [
        "ssm/REQUIRED", "ssm/PRIVATE", "full/REQUIRED", "full/OPTIONAL",
        "window=8,sinks=1b/REQUIRED", "window=8,sinks=1b/OPTIONAL",
        "window=8,sinks=1b/SINK_REQUIRED_ONLY",
    ]
    # Layers 1 and 2 share their REQUIRED windowed buffer's life cycle.
    assert group_of(m, 1, "k") == group_of(m, 2, "k")


def test_buffer_lookups_always_work_layer_lookups_only_for_uniform_layers():
    m = manager([*every_policy_layers(), att(5, buf("k"), buf("v"))])
    for (layer_id, role), g in m.buffer_grouping.items():
        assert m.get_buffer_group_id(layer_id, role) == g
        assert m.buffer_attr(layer_id, role).group == g
    for split in (0, 3):  # full attention K/V split; SSM state/conv/o split
        with pytest.raises(ConfigError, match="split layer"):
            m.get_layer_group_id(split)
    with pytest.raises(ConfigError, match="split layer"):
        _ = m.layer_grouping
    assert m.get_layer_group_id(1) == group_of(m, 1, "k")
    assert m.get_layer_group_id(2) == group_of(m, 2, "k")
    assert m.get_layer_group_id(5) == group_of(m, 0, "k")  # uniform REQUIRED layer
    with pytest.raises(ConfigError):
        m.get_buffer_group_id(0, "nope")


def test_ssm_life_cycles_are_deduplicated_by_effective_policy_at_most_three():
    layers = [
        ssm(10 + i, buf("a", 48, pol), buf("b", 16, P.PRIVATE), buf("c", 32),
            policy=layer_pol)
        for i, (pol, layer_pol) in enumerate([
            (None, P.REQUIRED), (P.OPTIONAL, P.REQUIRED), (None, P.OPTIONAL),
            (P.REQUIRED, P.PRIVATE), (None, P.PRIVATE)])
    ] + [att(0)]
    m = manager(layers)
    ssm_lcs = [lc for lc in m.life_cycles if lc.is_ssm]
    assert [lc.policy for lc in ssm_lcs] == [P.REQUIRED, P.OPTIONAL, P.PRIVATE]
    for layer in layers[:-1]:
        for b in layer.buffers:
            g = group_of(m, layer.layer_id, b.role)
            assert m.life_cycles[g].policy is layer.effective_policy(b)
    # Layer 10: a and c REQUIRED, b PRIVATE; layer 13: a REQUIRED, b and c PRIVATE.
    assert group_of(m, 10, "a") == group_of(m, 13, "a") == group_of(m, 10, "c")
    assert group_of(m, 13, "c") == group_of(m, 10, "b")


@pytest.mark.parametrize("where", ["layer", "buffer"])
def test_sink_required_only_is_refused_for_ssm(where):
    with pytest.raises(ConfigError, match="SINK_REQUIRED_ONLY"):
        if where == "layer":
            ssm(0, policy=P.SINK_REQUIRED_ONLY)
        else:
            ssm(0, buf("state", 48, P.SINK_REQUIRED_ONLY))


def test_zero_size_buffers_register_nothing_but_the_layer_keeps_its_policy():
    m = manager([
        att(0),
        att(1, buf("k", 0), buf("v", 0), policy=P.OPTIONAL),
        att(2, buf("k"), buf("scale", 0, P.PRIVATE)),
        ssm(3, buf("state", 0), policy=P.PRIVATE),
    ])
    assert [lc.describe() for lc in m.life_cycles] == ["full/REQUIRED"]
    assert set(m.buffer_grouping) == {(0, "k"), (2, "k")}
    assert m.get_layer_group_id(2) == m.get_layer_group_id(0)  # not split by a 0 buffer
    for layer_id in (1, 3):
        with pytest.raises(ConfigError):
            m.get_layer_group_id(layer_id)
    with pytest.raises(ConfigError):
        m.get_buffer_group_id(2, "scale")
    assert m.registry.layer_policies == {0: P.REQUIRED, 1: P.OPTIONAL, 2: P.REQUIRED,
                                         3: P.PRIVATE}
    d = Driver(m)
    d.write(tokens(13))
    assert m.probe_reuse(None, tokens(13)[:12]) == 12
    m.shutdown()


# -- pool grouping ------------------------------------------------------------------------------


def test_sink_required_only_pools_with_required_of_same_shape_optional_private_apart(tmp_path):
    m = manager([
        att(0, buf("k"), buf("v")),  # full REQUIRED, two 64-byte buffers: slot [128]
        att(1, buf("k"), buf("v"), window=8, sinks=4, policy=P.SINK_REQUIRED_ONLY),
        att(2, buf("k"), buf("v"), policy=P.OPTIONAL),
        att(3, buf("k"), buf("v"), policy=P.PRIVATE),
        att(4, buf("k", 96), buf("v", 32), window=16),  # pools [96, 32]: 128-byte pages
        att(5, buf("k", 96), buf("v", 32), window=8, sinks=8, policy=P.SINK_REQUIRED_ONLY),
    ], "gpu-host-disk", 8, tmp_path)
    req, sro = group_of(m, 0, "k"), group_of(m, 1, "k")
    opt, priv = group_of(m, 2, "k"), group_of(m, 3, "k")
    req_wide, sro_wide = group_of(m, 4, "k"), group_of(m, 5, "k")
    assert len({req, sro, opt, priv, req_wide, sro_wide}) == 6
    pg = m.layout.group_to_pool_group
    descs = {d["id"]: d for d in m.pool_group_descs}
    assert pg[req] == pg[sro] and descs[pg[req]]["policy"] == "REQUIRED"
    assert set(descs[pg[req]]["cache_groups"]) == {req, sro}
    assert pg[req_wide] == pg[sro_wide] != pg[req]  # same pool policy, other slot layout
    assert descs[pg[req_wide]]["slot_sizes"] == [96, 32]
    assert descs[pg[opt]]["policy"] == "OPTIONAL" and descs[pg[opt]]["cache_groups"] == [opt]
    assert descs[pg[priv]]["policy"] == "PRIVATE" and descs[pg[priv]]["cache_groups"] == [priv]
    assert len(descs) == 4
    # Cold levels: key (pool policy, cold page size). Every life cycle here has 128-byte
    # cold pages, so REQUIRED and SINK_REQUIRED_ONLY of both GPU shapes share one cold
    # group; OPTIONAL and PRIVATE keep their own.
    for g in (req, sro, req_wide, sro_wide):
        assert m.storage_levels.cold_key_of[g] == (P.REQUIRED, 2 * PAGE)
    assert m.storage_levels.cold_key_of[opt] == (P.OPTIONAL, 2 * PAGE)
    assert m.storage_levels.cold_key_of[priv] == (P.PRIVATE, 2 * PAGE)
    for level in (1, 2):
        stores = [m.storage_levels.cold_store(level, g) for g in range(m.num_cache_groups)]
        assert stores[req] is stores[sro] is stores[req_wide] is stores[sro_wide]
        assert len({id(stores[req]), id(stores[opt]), id(stores[priv])}) == 3
    m.shutdown()


@pytest.mark.parametrize("stack", COLD_STACK_IDS)
def test_pages_of_pooled_sink_required_only_and_required_move_down_and_back_intact(
        stack, tmp_path):
    m = manager([
        att(0, buf("k"), buf("v")),
        att(1, buf("k"), buf("v"), window=8, sinks=4, policy=P.SINK_REQUIRED_ONLY),
        att(2, buf("k"), buf("v"), policy=P.OPTIONAL),
        att(3, buf("k"), buf("v"), policy=P.PRIVATE),
    ], stack, 8, tmp_path)
    req, sro = group_of(m, 0, "k"), group_of(m, 1, "k")
    assert m.storage_levels.cold_store(1, req) is m.storage_levels.cold_store(1, sro)
    d = Driver(m)
    t = tokens(26, 3)
    c = d.write(t, 22, close=False)
    c.suspend()
    sink_to_bottom(m)
    assert {p.level for p in cache_pages(c)} == {len(m.levels) - 1}
    assert d.resume(c)
    d.run_to(c)
    c.close()
    b = d.create(t, 24)
    assert b.history_length == 24
    d.run_to(b, optional=groups_with(m, P.OPTIONAL))
    b.close()
    assert_all_free(m)


@pytest.mark.parametrize("stack", COLD_STACK_IDS)
def test_cold_group_merging_two_gpu_pool_groups_onboards_each_page_to_its_own_pool(
        stack, tmp_path):
    m = manager([
        att(0, buf("k"), buf("v")),  # GPU pools [128]
        att(1, buf("k", 96), buf("v", 32), window=16),  # GPU pools [96, 32]
    ], stack, 16, tmp_path)
    full, win = group_of(m, 0, "k"), group_of(m, 1, "k")
    assert m.layout.group_to_pool_group[full] != m.layout.group_to_pool_group[win]
    # Both (REQUIRED, 128).
    assert m.storage_levels.cold_store(1, full) is m.storage_levels.cold_store(1, win)
    d = Driver(m)
    t = tokens(26, 3)
    c = d.write(t, 22, close=False)
    c.suspend()
    sink_to_bottom(m)
    assert d.resume(c)
    for p in cache_pages(c):
        assert p.store is m.storage_levels.gpu_store(p.group), p
    d.check(c)
    c.close()


# -- REQUIRED and OPTIONAL in the match -----------------------------------------------------------


def split_kv_layers():
    """Full attention: K REQUIRED, V OPTIONAL (one split layer)."""
    return [att(0, buf("k"), buf("v", policy=P.OPTIONAL))]


@pytest.mark.parametrize("stack", STACK_IDS)
def test_missing_required_page_shortens_the_match_missing_optional_page_does_not(
        stack, tmp_path):
    m = manager(split_kv_layers(), stack, 16, tmp_path)
    k, v = group_of(m, 0, "k"), group_of(m, 0, "v")
    d = Driver(m)
    t = tokens(30, 1)
    d.write(t[:24])
    sink_to_bottom(m)
    nodes = chain(m, t[:24])
    assert len(nodes) == 6
    drop(m, nodes[3], v)  # OPTIONAL page of block 3 gone
    assert m.probe_reuse(None, t[:24]) == 24
    assert len(chain(m, t[:24])) == 6  # nothing below it was invalidated
    drop(m, nodes[4], k)  # REQUIRED page of block 4 gone
    assert m.probe_reuse(None, t[:24]) == 16
    assert m.probe_reuse(None, t[:18]) == 16
    c = d.create(t, 24)
    assert c.history_length == 16
    st = c.reuse_status[v]
    assert (st.complete, st.endpoint, st.coverage) == (False, 16, ((0, 12),))
    d.run_to(c, optional=[])
    assert c.recompute_blocks(v) == [0, 1, 2, 3] and c.recompute_blocks(k) == []
    c.close()
    assert_all_free(m)


def test_reuse_status_is_exact_for_complete_optional_groups():
    m = manager([
        att(0, buf("k"), buf("v", policy=P.OPTIONAL)),
        att(1, buf("k", policy=P.OPTIONAL), window=8, sinks=4),
        ssm(2, buf("s", 48), buf("o", 32, P.OPTIONAL)),
    ], commit_min_snapshot=True)
    full_opt, win_opt = group_of(m, 0, "v"), group_of(m, 1, "k")
    ssm_opt = group_of(m, 2, "o")
    d = Driver(m)
    t = tokens(30, 2)
    d.write(t[:22], chunk=4)  # a partial block of 2 tokens; snapshots at every boundary
    for end, win_cov in [(22, ((0, 4), (12, 22))), (20, ((0, 4), (12, 20))),
                         (8, ((0, 8),))]:
        c = d.create(t, end)
        assert c.history_length == end
        rs = c.reuse_status
        assert set(rs) == {full_opt, win_opt, ssm_opt}
        assert rs[full_opt] == type(rs[full_opt])(P.OPTIONAL, True, end, ((0, end),))
        assert rs[win_opt].policy is P.OPTIONAL and rs[win_opt].complete
        assert rs[win_opt].endpoint == end and rs[win_opt].coverage == win_cov
        assert rs[ssm_opt].policy is P.OPTIONAL and rs[ssm_opt].complete
        assert (rs[ssm_opt].endpoint, rs[ssm_opt].coverage) == (end, ((0, end),))
        d.run_to(c, end + 3, optional=[full_opt, win_opt, ssm_opt])
        assert all(c.recompute_blocks(g) == [] for g in range(m.num_cache_groups))
        c.close()
    assert_all_free(m)


def test_reuse_status_is_exact_for_incomplete_optional_groups():
    m = manager([
        att(0, buf("k"), buf("v", policy=P.OPTIONAL)),
        att(1, buf("k", policy=P.OPTIONAL), window=8, sinks=4),
        ssm(2, buf("s", 48), buf("o", 32, P.OPTIONAL)),
    ], commit_min_snapshot=True)
    full_opt, win_opt = group_of(m, 0, "v"), group_of(m, 1, "k")
    ssm_opt = group_of(m, 2, "o")
    d = Driver(m)
    t = tokens(30, 2)
    d.write(t[:24])
    nodes = chain(m, t[:24])
    drop(m, nodes[2], full_opt)  # a hole in the middle
    drop(m, nodes[5], win_opt)  # the last window block
    drop(m, nodes[5], ssm_opt)  # the snapshot at 24
    assert m.probe_reuse(None, t[:24]) == 24
    c = d.create(t, 24)
    rs = c.reuse_status
    assert rs[full_opt] == type(rs[full_opt])(P.OPTIONAL, False, 24, ((0, 8), (12, 24)))
    assert rs[win_opt] == type(rs[win_opt])(P.OPTIONAL, False, 24, ((0, 4), (16, 20)))
    assert rs[ssm_opt] == type(rs[ssm_opt])(P.OPTIONAL, False, 24, ())
    for g in (full_opt, win_opt, ssm_opt):
        with pytest.raises(ValueError, match="incomplete"):
            c.resume(optional_reuse_groups=[g])
    assert d.resume(c, optional=[])
    assert c.recompute_blocks(full_opt) == list(range(6))
    assert c.recompute_blocks(win_opt) == [0, 4, 5]
    assert c.recompute_blocks(ssm_opt) == [-1]
    d.run_to(c)
    # Block 4 left the window as history moved on: it has no page, so nothing to redo.
    assert c.get_base_page_indices(win_opt)[4] < 0
    assert c.recompute_blocks(win_opt) == [0, 5]
    assert c.recompute_blocks(full_opt) == list(range(6))
    c.close()
    assert_all_free(m)


@pytest.mark.parametrize("bad", ["required", "unknown", "negative", "bool", "incomplete",
                                 "private", "sink_required_only", "one_bad_of_two"])
def test_resume_naming_a_non_optional_unknown_or_incomplete_group_raises_and_changes_nothing(
        bad):
    m = manager(every_policy_layers())
    d = Driver(m)
    t = tokens(30, 4)
    d.write(t[:24])
    opt_full = group_of(m, 0, "v")
    opt_ssm = group_of(m, 3, "o")
    if bad == "incomplete":
        drop(m, chain(m, t[:24])[1], opt_full)
    m.get_and_reset_iteration_stats()
    c = d.create(t, 24)
    choice = {
        "required": [group_of(m, 0, "k")], "unknown": [m.num_cache_groups],
        "negative": [-1], "bool": [True], "incomplete": [opt_full],
        "private": [group_of(m, 2, "k")], "sink_required_only": [group_of(m, 1, "k")],
        "one_bad_of_two": [opt_ssm, group_of(m, 3, "state")],
    }[bad]
    before = snapshot(m, c)
    status = c.reuse_status
    with pytest.raises(ValueError):
        c.resume(optional_reuse_groups=choice)
    assert c.status is CacheStatus.SUSPENDED
    assert snapshot(m, c) == before and c.reuse_status == status
    assert all(c.recompute_blocks(g) == [] for g in range(m.num_cache_groups))
    st = m.get_and_reset_iteration_stats()
    assert st.groups[opt_full].reused_full_blocks == 0
    assert st.groups[opt_ssm].reused_full_blocks == 0
    # The choice was not made: a valid one is still accepted.
    good = [opt_ssm] + ([] if bad == "incomplete" else [opt_full])
    d.run_to(c, optional=good)
    assert c.recompute_blocks(opt_full) == ([] if bad != "incomplete" else list(range(6)))
    c.close()
    assert_all_free(m)


@pytest.mark.parametrize("decision", ["chosen", "declined"])
@pytest.mark.parametrize("stack", STACK_IDS)
def test_optional_claims_are_held_from_creation_until_the_decision_under_pressure(
        stack, decision, tmp_path):
    single = stack == "gpu"
    m = manager(every_policy_layers(), stack, 12, tmp_path, commit_min_snapshot=True)
    opt = groups_with(m, P.OPTIONAL)
    full_opt, ssm_opt = group_of(m, 0, "v"), group_of(m, 3, "o")
    d = Driver(m)
    t = tokens(30, 5)
    d.write(t[:24])  # 6 blocks
    b = d.create(t, 24)
    status = b.reuse_status
    assert all(status[g].complete for g in opt)
    claimed = {g: cache_pages(b, g) for g in opt}
    assert all(claimed.values())
    # Another prefix fills the tree and then a third request needs the space back: on one
    # level the claimed pages cannot go anywhere, on several they move down, and in both
    # cases they must stay (droppable pages of the other prefix are dropped instead).
    other = tokens(30, 6)
    d.write(other[:24] if single else other[:28])
    c = d.create(tokens(60, 7), 0)
    d.run_to(c, 24 if single else 44)
    c.close()
    assert_invariants(m)
    for g, pages in claimed.items():
        assert cache_pages(b, g) == pages
        assert all(p.level >= 0 and p.holds for p in pages), pages
    if not single:
        assert any(p.level > 0 for ps in claimed.values() for p in ps)
    assert b.reuse_status == status
    if decision == "chosen":
        d.run_to(b, optional=opt)
        assert all(b.recompute_blocks(g) == [] for g in opt)
        # The claimed pages, not copies.
        assert b.pages(full_opt)[:6] == [p.pid for p in claimed[full_opt]]
    else:  # claims given up where they are (on a cold level too), fresh pages recomputed
        # Page ids are recycled once a page is freed: a claimed page is still "the claimed
        # page" while it is published at its tree node (a claim given up either stays
        # there or is freed; fresh pages are not published before the next commit).
        where = {p.pid: p.node for p in claimed[full_opt]}
        assert all(n >= 0 for n in where.values()), claimed[full_opt]
        assert d.resume(b, optional=[])
        live = {pid for pid, n in where.items() if m.tree.page(n, full_opt) == pid}
        assert not set(b.pages(full_opt)) & live  # fresh pages, not the claimed ones
        d.run_to(b)
        assert b.recompute_blocks(full_opt) == list(range(6))
        assert b.recompute_blocks(ssm_opt) == [-1]
        assert all(not p.holds for ps in claimed.values() for p in ps)
    b.close()
    assert_all_free(m)


def test_declining_frees_the_claim_before_allocating_replacements():
    # The OPTIONAL pool has exactly the 6 slots the claim holds: declining is the only
    # way to find room for 6 fresh pages.
    m = manager(split_kv_layers(), gpu_slots=[16, 6])
    k, v = group_of(m, 0, "k"), group_of(m, 0, "v")
    assert m.stores[0][m.layout.group_to_pool_group[v]].num_slots == 6
    d = Driver(m)
    t = tokens(30, 8)
    d.write(t[:24])
    c = d.create(t, 24)
    claim = cache_pages(c, v)
    assert len(claim) == 6
    assert d.resume(c, optional=[])
    assert c.recompute_blocks(v) == list(range(6)) and c.recompute_blocks(k) == []
    assert all(p.level < 0 or p.slot < 0 or not p.holds for p in claim)
    assert all(node_page(m, n, v) is None for n in chain(m, t[:24]))  # dropped to make room
    d.check(c)
    c.close()
    assert_all_free(m)


@pytest.mark.parametrize("first", ["chosen", "declined"])
@pytest.mark.parametrize("stack", ["gpu", "gpu-host"])
def test_a_later_plain_resume_keeps_the_first_choice(first, stack, tmp_path):
    m = manager(every_policy_layers(), stack, 16, tmp_path)
    opt = groups_with(m, P.OPTIONAL)
    d = Driver(m)
    t = tokens(40, 9)
    d.write(t[:24])
    c = d.create(t, 24)
    choice = opt if first == "chosen" else []
    d.run_to(c, 27, optional=choice)
    recompute = {g: c.recompute_blocks(g) for g in range(m.num_cache_groups)}
    pages = {g: cache_pages(c, g) for g in opt}
    c.suspend()
    if stack != "gpu":
        sink_to_bottom(m)
    other = [] if first == "chosen" else opt
    for bad in (other, [opt[0]]):
        with pytest.raises(ValueError, match="first resume"):
            c.resume(optional_reuse_groups=bad)
        assert c.status is CacheStatus.SUSPENDED
    assert c.resume()  # plain: keeps the first choice
    assert {g: cache_pages(c, g) for g in opt} == pages
    assert {g: c.recompute_blocks(g) for g in range(m.num_cache_groups)} == recompute
    d.check(c)
    c.suspend()
    assert c.resume(optional_reuse_groups=choice)  # the same list is accepted
    d.run_to(c)
    c.close()
    assert_all_free(m)


def test_unselected_optional_groups_count_in_no_group_statistic():
    m = manager(every_policy_layers())
    full_opt, ssm_opt = group_of(m, 0, "v"), group_of(m, 3, "o")
    d = Driver(m)
    t = tokens(30, 10)
    d.write(t[:20])
    for chosen in ([], [full_opt], [ssm_opt], [full_opt, ssm_opt]):
        m.get_and_reset_iteration_stats()
        c = d.create(t, 20)
        d.run_to(c, 23, optional=chosen)
        st = m.get_and_reset_iteration_stats()
        assert (st.lookups, st.lookup_tokens, st.hit_tokens) == (1, 20, 20)
        for g in (full_opt, ssm_opt):
            gs = st.groups[g]
            counted = (gs.reused_full_blocks, gs.reused_partial_blocks, gs.missed_blocks)
            if g in chosen:
                assert sum(counted) > 0 and gs.missed_blocks == 0
            else:
                assert counted == (0, 0, 0), (g, counted)
        c.close()


def test_unselected_optional_groups_count_in_no_hit_statistic():
    m = manager(split_kv_layers())
    k, v = group_of(m, 0, "k"), group_of(m, 0, "v")
    d = Driver(m)
    t = tokens(30, 11)
    d.write(t[:24])
    m.get_and_reset_iteration_stats()
    c = d.create(t, 24)
    d.run_to(c, optional=[])
    st = m.get_and_reset_iteration_stats()
    assert st.groups[v].reused_full_blocks == 0
    assert st.reused_blocks_by_level[0] == st.groups[k].reused_full_blocks == 6
    assert c.stats.reused_blocks == 6
    c.close()


@pytest.mark.parametrize("stack", STACK_IDS)
def test_chosen_optional_pages_come_back_bit_exact_from_any_level(stack, tmp_path):
    m = manager(every_policy_layers(), stack, 16, tmp_path, commit_min_snapshot=True)
    opt = groups_with(m, P.OPTIONAL)
    d = Driver(m)
    t = tokens(40, 12)
    d.write(t[:26], chunk=4)  # snapshots at every block boundary and at 26
    sink_to_bottom(m)  # the tree's pages (OPTIONAL ones included) on the last level
    for end in (26, 24, 20):
        c = d.create(t, end)
        assert c.history_length == end
        assert all(c.reuse_status[g].complete for g in opt)
        d.run_to(c, optional=opt)
        assert all(c.recompute_blocks(g) == [] for g in opt)
        c.suspend()
        sink_to_bottom(m)  # this request's OPTIONAL pages too
        assert d.resume(c)
        d.check(c)
        c.close()
    assert_all_free(m)


def test_optional_ssm_state_at_the_endpoint_is_reused_elsewhere_incomplete():
    m = manager([att(0), ssm(1, buf("s", 48, P.OPTIONAL))])
    g = group_of(m, 1, "s")
    d = Driver(m)
    t = tokens(30, 13)
    d.write(t[:20])  # snapshot at 20 only
    c = d.create(t, 20)
    assert c.reuse_status[g] == type(c.reuse_status[g])(P.OPTIONAL, True, 20, ((0, 20),))
    d.run_to(c, 23, optional=[g])
    assert c.recompute_blocks(g) == []
    c.close()  # snapshot at 23 now too
    fork = t[:16] + tokens(10, 14)
    c = d.create(fork, 16)  # block boundary without a snapshot
    assert c.history_length == 16
    assert c.reuse_status[g] == type(c.reuse_status[g])(P.OPTIONAL, False, 16, ())
    with pytest.raises(ValueError, match="incomplete"):
        c.resume(optional_reuse_groups=[g])
    d.run_to(c, optional=[])
    assert c.recompute_blocks(g) == [-1]
    c.close()
    assert_all_free(m)


def test_optional_ssm_state_is_not_reused_by_a_fork_inside_its_block():
    m = manager([att(0), ssm(1, buf("s", 48, P.OPTIONAL))])
    g = group_of(m, 1, "s")
    d = Driver(m)
    t = tokens(30, 13)
    d.write(t[:20])  # snapshot at 20 in the full block [16, 20)
    fork = t[:18] + tokens(10, 15)
    c = d.create(fork, 18)
    assert c.history_length == 18  # partial reuse of block 4 up to 18
    st = c.reuse_status[g]
    choice = [g] if st.complete else []
    d.run_to(c, optional=choice)  # the state at 18 must be the state of fork[:18]
    c.close()


# -- PRIVATE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACK_IDS)
def test_private_pages_are_never_published(stack, tmp_path):
    m = manager(every_policy_layers(), stack, 16, tmp_path, commit_min_snapshot=True)
    private = groups_with(m, P.PRIVATE)
    assert len(private) == 2
    d = Driver(m)
    t = tokens(40, 16)
    d.write(t[:22])  # full blocks, a partial tail and an SSM snapshot at close
    assert_no_private_in_tree(m)
    c = d.create(t, 22)
    d.run_to(c, 32, optional=groups_with(m, P.OPTIONAL))  # snapshots at each boundary
    assert_no_private_in_tree(m)
    c.suspend()
    sink_to_bottom(m)
    assert_no_private_in_tree(m)
    c.close()
    assert_no_private_in_tree(m)
    assert len(list(tree_nodes(m))) >= 8
    # Closed PRIVATE pages are freed at once (nothing keeps them).
    for g in private:
        for level in range(len(m.levels)):
            store = (m.storage_levels.gpu_store(g) if level == 0
                     else m.storage_levels.cold_store(level, g))
            assert not [p for p in store_pages(m, store) if p.group == g]
    assert_all_free(m)


def test_private_state_is_always_fresh_on_reuse():
    m = manager(every_policy_layers())
    priv_attn, priv_ssm = group_of(m, 2, "k"), group_of(m, 3, "conv")
    d = Driver(m)
    t = tokens(40, 17)
    a = d.write(t[:24], close=False)
    a_private = set(table(a, priv_attn))
    a.close()
    c = d.create(t, 24)
    assert c.history_length == 24
    st = c.reuse_status[priv_attn]
    assert (st.policy, st.complete, st.endpoint, st.coverage) == (P.PRIVATE, False, 24, ())
    assert c.reuse_status[priv_ssm].coverage == ()
    for g in (priv_attn, priv_ssm):
        with pytest.raises(ValueError):
            c.resume(optional_reuse_groups=[g])
    d.run_to(c, 24, optional=groups_with(m, P.OPTIONAL))
    assert c.recompute_blocks(priv_attn) == list(range(6))
    assert c.recompute_blocks(priv_ssm) == [-1]
    tab = table(c, priv_attn)
    assert BAD_PAGE_INDEX not in tab and len(set(tab)) == 6
    assert a_private.isdisjoint(set(tab)) or all(
        node_page(m, n, priv_attn) is None for n in tree_nodes(m))
    d.run_to(c)
    c.close()
    assert_all_free(m)


@pytest.mark.parametrize("stack", COLD_STACK_IDS)
def test_private_state_is_suspended_offloaded_and_brought_back_bit_exact(stack, tmp_path):
    m = manager(every_policy_layers(), stack, 16, tmp_path)
    private = groups_with(m, P.PRIVATE)
    d = Driver(m)
    t = tokens(40, 18)
    c = d.write(t, 22, close=False)
    c.suspend()
    sink_to_bottom(m)
    bottom = len(m.levels) - 1
    for g in private:
        pages = cache_pages(c, g)
        assert pages and all(p.level == bottom and p.holds for p in pages), pages
    assert d.resume(c)
    assert all(p.level == 0 for p in cache_pages(c))
    assert all(c.recompute_blocks(g) == [] for g in private)  # nothing recomputed
    d.check(c)  # PRIVATE attention pages and the PRIVATE SSM state, bit-exact
    d.run_to(c, 30)
    c.suspend()
    sink_to_bottom(m)
    assert d.resume(c)
    d.run_to(c)
    c.close()
    assert_no_private_in_tree(m)
    assert_all_free(m)


def test_a_model_with_only_private_state_publishes_and_reuses_nothing():
    m = manager([att(0, buf("k", policy=P.PRIVATE)), ssm(1, buf("s", 48, P.PRIVATE))])
    d = Driver(m)
    for seed in range(5):
        d.write(tokens(24, seed))
    assert [n for n in tree_nodes(m)
            if not m.tree.has_pages(n) and not m.tree.subtree(n)] == []
    assert m.probe_reuse(None, tokens(24, 3)) == 0
    m.get_and_reset_iteration_stats()
    c = d.create(tokens(30, 3), 24)
    assert c.history_length == 0
    assert m.get_and_reset_iteration_stats().hit_tokens == 0
    c.close()


# -- SINK_REQUIRED_ONLY ---------------------------------------------------------------------------


def companion_layers():
    """Low-precision full attention plus a SINK_REQUIRED_ONLY companion with window 8 and
    4 sink tokens (1 sink block)."""
    return [att(0, buf("k8"), buf("v8")),
            att(1, buf("kv16", 2 * PAGE), window=8, sinks=4, policy=P.SINK_REQUIRED_ONLY)]


@pytest.mark.parametrize("stack", STACK_IDS)
def test_sink_required_only_missing_window_pages_are_fresh_and_do_not_shorten_the_match(
        stack, tmp_path):
    m = manager(companion_layers(), stack, 16, tmp_path)
    sro = group_of(m, 1, "kv16")
    d = Driver(m)
    t = tokens(40, 19)
    d.write(t[:24])
    sink_to_bottom(m)
    nodes = chain(m, t[:24])
    drop(m, nodes[4], sro)  # a window page the endpoint 24 needs (needed: 0, 4, 5)
    assert m.probe_reuse(None, t[:24]) == 24
    assert len(chain(m, t[:24])) == 6  # the subtree stays
    c = d.create(t, 24)
    assert c.history_length == 24
    st = c.reuse_status[sro]
    assert (st.policy, st.complete, st.endpoint, st.coverage) == (
        P.SINK_REQUIRED_ONLY, False, 24, ((0, 4), (20, 24)))
    with pytest.raises(ValueError):
        c.resume(optional_reuse_groups=[sro])  # not OPTIONAL: nothing to choose
    d.run_to(c, 24, optional=[])
    assert c.recompute_blocks(sro) == [4]
    assert c.pages(sro)[5] == m.tree.page(nodes[5], sro) >= 0  # present window page reused
    assert c.pages(sro)[0] == m.tree.page(nodes[0], sro) >= 0  # sink page reused
    d.run_to(c)
    c.close()
    assert_all_free(m)


@pytest.mark.parametrize("stack", STACK_IDS)
def test_sink_required_only_sink_pages_constrain_the_match_and_their_drop_invalidates(
        stack, tmp_path):
    m = manager(companion_layers(), stack, 16, tmp_path)
    full, sro = group_of(m, 0, "k8"), group_of(m, 1, "kv16")
    d = Driver(m)
    t = tokens(40, 20)
    d.write(t[:24])
    sink_to_bottom(m)
    before = m.get_storage_statistics(len(m.levels) - 1).free
    drop(m, chain(m, t[:24])[0], sro)
    assert m.probe_reuse(None, t[:24]) == 0
    nodes = chain(m, t[:24])
    assert len(nodes) == 1 and not m.tree.subtree(nodes[0])  # block 0 keeps its full page
    # Every page below it was freed: 5 full-attention and 5 companion pages, plus the sink.
    freed = m.get_storage_statistics(len(m.levels) - 1).free - before
    assert freed == 11
    c = d.create(t, 24)
    assert c.history_length == 0
    d.run_to(c)
    assert c.recompute_blocks(full) == [] and c.recompute_blocks(sro) == []
    c.close()
    assert_all_free(m)


# -- eviction by the page's own life cycle ----------------------------------------------------


def evict_layers():
    return [att(0, buf("k"), buf("v")),
            att(1, buf("k", 2 * PAGE), window=8, sinks=4),
            att(2, buf("k", PAGE // 2), window=8, sinks=4, policy=P.SINK_REQUIRED_ONLY)]


@pytest.mark.parametrize("stack", STACK_IDS)
@pytest.mark.parametrize("victim", ["full", "windowed_sink", "sro_sink"])
def test_dropping_a_page_every_longer_match_needs_invalidates_the_subtree_below_it(
        victim, stack, tmp_path):
    m = manager(evict_layers(), stack, 16, tmp_path)
    group = {"full": group_of(m, 0, "k"), "windowed_sink": group_of(m, 1, "k"),
             "sro_sink": group_of(m, 2, "k")}[victim]
    block = 2 if victim == "full" else 0
    d = Driver(m)
    t = tokens(40, 21)
    d.write(t[:24])
    sink_to_bottom(m)
    drop(m, chain(m, t[:24])[block], group)
    nodes = chain(m, t[:24])
    assert len(nodes) == block + 1  # its other groups keep the block itself
    for n in nodes:
        assert not m.tree.subtree(n) or m.tree.ordinal[n] < block
    assert m.probe_reuse(None, t[:24]) == block * TPB
    c = d.create(t, 24)
    d.run_to(c)
    c.close()
    assert m.probe_reuse(None, t[:24]) == 24  # republished
    assert_all_free(m)


@pytest.mark.parametrize("stack", STACK_IDS)
def test_dropping_a_window_page_of_a_windowed_life_cycle_keeps_the_prefix_reusable(
        stack, tmp_path):
    m = manager(evict_layers(), stack, 16, tmp_path)
    win, sro = group_of(m, 1, "k"), group_of(m, 2, "k")
    d = Driver(m)
    t = tokens(40, 22)
    d.write(t[:24])
    sink_to_bottom(m)
    nodes = chain(m, t[:24])
    drop(m, nodes[2], win)  # not needed at 24 (stale there), needed at 12
    drop(m, nodes[2], sro)
    assert len(chain(m, t[:24])) == 6
    assert m.probe_reuse(None, t[:24]) == 24
    assert m.probe_reuse(None, t[:12]) == 8
    drop(m, nodes[5], win)  # needed at 24: the match backs off to 20, not further
    assert len(chain(m, t[:24])) == 6
    assert m.probe_reuse(None, t[:24]) == 20
    assert m.probe_reuse(None, t[:20]) == 20  # a shorter prefix still works
    for end in (20, 8):
        c = d.create(t, end)
        assert c.history_length == end
        d.run_to(c, end + 4, optional=[])
        assert c.recompute_blocks(win) == []
        c.close()
    assert_all_free(m)


# -- the mixed-precision scenario --------------------------------------------------------------


def test_mixed_precision_companion_sink_required_only_keeps_the_hit_rate():
    from kvcm_core.bench.mixed import run

    args = argparse.Namespace(
        layers=1, page_bytes=PAGE, tokens_per_block=TPB, window=16, prefix_len=48,
        question_len=24, output_len=8, sessions=6, turns=3, batch=2, chunk=32,
        gpu_blocks=512, companion_margin=1.3, seed=0)
    required = run(P.REQUIRED, args)
    sro = run(P.SINK_REQUIRED_ONLY, args)
    unbounded = run(P.REQUIRED, argparse.Namespace(**{
        **vars(args), "gpu_blocks": args.gpu_blocks * 64,
        "companion_margin": args.companion_margin * 64}))
    assert required["checked_pages"] and sro["checked_pages"]  # fingerprint-verified
    assert sro["lookup_tokens"] == required["lookup_tokens"] == unbounded["lookup_tokens"]
    assert sro["hit_rate"] >= required["hit_rate"]
    assert sro["hit_rate"] > required["hit_rate"] + 0.1, (required, sro)
    assert sro["hit_rate"] >= unbounded["hit_rate"] - 0.05, (sro, unbounded)
