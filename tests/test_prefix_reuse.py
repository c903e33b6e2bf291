"""Prefix reuse on one (GPU) level, fingerprint-verified (concepts.md §9, scenarios.md
"Prefix reuse" and "Hybrid models").

Every request is driven through the fingerprint engine, so a reused page that does not hold
exactly the KV of its tokens (for every layer and buffer) fails the step that reads it.
"""

from __future__ import annotations

import pytest
from conftest import (
    PAGE,
    TPB,
    Driver,
    assert_invariants,
    bytes_per_slot_round,
    drop_page,
    full_layers,
    hybrid_layers,
    kv,
    page_holds,
    slot_of,
    table,
    tokens,
    tree_node,
    tree_page,
    windowed_layers,
)

from kvcm_core import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    ReusePolicy,
    ReuseScope,
    SsmLayerConfig,
)
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.testing.fingerprint import StepWork

# -- full attention ---------------------------------------------------------------------


def test_full_attention_reuse_holds_the_kv_of_its_tokens(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(23)
    d.run(t, chunk=7)
    assert m.probe_reuse(None, t[:22]) == 22
    b = d.create(t[:22] + tokens(9, seed=1))
    assert b.history_length == b.capacity == b.num_committed_tokens == 22
    d.run_to(b, 31, chunk=3)  # every step re-checks the reused pages
    b.close()


def test_probe_reuse_equals_what_create_kv_cache_reuses(managers):
    m = managers(hybrid_layers(), slots=64, commit_min_snapshot=True)
    d = Driver(m)
    base = tokens(30)
    d.run(base, end=30, chunk=6)
    for n in range(0, 31):
        probe = m.probe_reuse(None, base[:n])
        c = m.create_kv_cache(None, base[:n])
        assert c.history_length == probe, n
        c.close()
    assert_invariants(m)


def test_reuse_of_a_whole_block_prompt_reuses_every_block(managers):
    m = managers(full_layers(), slots=32)
    d = Driver(m)
    t = tokens(16)
    d.run(t)
    c = d.create([*t, 7], match_len=16)
    assert c.history_length == 16
    assert c.resume()
    assert table(c, 0) == [slot_of(m, tree_page(m, t, b, 0)) for b in range(4)]
    d.run_to(c, 17)


# -- sliding window with sinks ------------------------------------------------------------


def test_windowed_reuse_needs_only_sinks_and_window_at_the_endpoint(managers):
    m = managers(windowed_layers(window=8, sinks=4), slots=64)
    d = Driver(m)
    t = tokens(32)
    d.run(t)
    b = d.create(t[:25] + tokens(6, seed=3))
    assert b.history_length == 25
    assert b.resume()
    # At history 25 the window needs blocks [(25 + 1 - 8) // 4, 7) = [4, 7), plus sink 0.
    tab = table(b, 0)
    assert tab[1:4] == [BAD_PAGE_INDEX] * 3
    assert all(x != BAD_PAGE_INDEX for x in (tab[0], tab[4], tab[5], tab[6]))
    d.run_to(b, 31, chunk=2)
    b.close()


def test_windowed_match_is_not_cut_by_missing_stale_pages(managers):
    """A request that could only ever commit sink and window pages is still reusable."""
    m = managers(windowed_layers(window=8, sinks=4), slots=64)
    d = Driver(m)
    t = tokens(40)
    d.run(t)
    # Drop the committed pages of stale blocks 1..5: no match endpoint past 28 needs them.
    for b in range(1, 6):
        page = tree_page(m, t, b, 0)
        drop_page(m, page)
    assert_invariants(m)
    assert m.probe_reuse(None, t[:39]) == 39  # needs sink 0 and window blocks 8, 9
    # Endpoints 8..27 need one of the dropped blocks in their window; 4 needs only sink 0.
    assert m.probe_reuse(None, t[:27]) == 4
    c = d.create([*t, 5, 6], match_len=39)
    assert c.history_length == 39
    d.run_to(c, 42, chunk=1)
    c.close()


def test_window_pages_kept_for_a_commit_are_released_when_committing_stops(managers):
    # Stale window pages kept for the commit that would publish them (history moved
    # forward first) have no reason to stay once no commit will come.
    m = managers(windowed_layers(window=8, sinks=0), max_rewind_len=0)
    d = Driver(m)
    t = tokens(60, seed=1)
    c = d.create(t, match_len=0)
    assert c.resume() and c.resize(40)
    d.engine.step([StepWork(c, t)])
    assert c.resize(40, history_length=40)  # no commit yet: all 10 blocks kept
    assert len(set(c.page_ids())) == 10
    c.stop_committing()
    assert len(set(c.page_ids())) == 2  # the window's blocks only (tokens 32..39)
    assert_invariants(m)
    d.check(c)
    c.close()


@pytest.mark.parametrize("forward", [False, True], ids=["commit", "history-first"])
def test_window_pages_stale_at_a_history_move_stay_until_the_commit_publishes_them(
        managers, forward):
    # docs/semantics.md: stale window pages are released after publishing, so committed
    # window pages stay reusable; also when the engine moves history forward with resize
    # before the commit that gives the tokens.
    layers = [AttentionLayerConfig(layer_id=0, buffers=kv()),
              AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=128)],
                                   sliding_window_size=8)]
    m = managers(layers)
    d = Driver(m)
    t = tokens(40)
    c = d.create(t, match_len=0)
    assert c.resume()
    assert c.resize(32)
    d.engine.step([StepWork(c, t)])
    win = m.get_layer_group_id(1)
    if forward:
        assert c.resize(32, history_length=32)
        assert list(table(c, win)[:6]) == [BAD_PAGE_INDEX] * 6  # stale, shown as such
    c.commit(t[:32])
    # Released once published: 8 full-attention pages and the window's 2 are left.
    assert len(set(c.page_ids())) == 8 + 2
    assert_invariants(m)
    c.close()
    assert [m.probe_reuse(None, t[:n]) for n in (12, 20, 28, 32)] == [12, 20, 28, 32]
    b = d.create(t[:20] + tokens(6, seed=5), match_len=20)
    assert b.history_length == 20
    d.run_to(b, 26, chunk=3)
    b.close()


# -- hybrid: windowed + full + SSM --------------------------------------------------------


def test_hybrid_ssm_reuse_only_at_an_exact_snapshot(managers):
    m = managers(hybrid_layers(), slots=64)
    d = Driver(m)
    t = tokens(20)
    d.run(t, chunk=6)  # closes at 20: the SSM snapshot is published at 20 only
    assert m.probe_reuse(None, t) == 20
    for n in (19, 16, 15, 12, 1):
        assert m.probe_reuse(None, t[:n]) == 0, n
    ext = d.create(t + tokens(5, seed=9), match_len=20)
    assert ext.history_length == 20
    d.run_to(ext, 25)
    ext.close()


def _ssm_only_layers(attention: ReusePolicy | None) -> list:
    """An SSM layer, with (``attention`` not None) a full-attention layer of that policy."""
    layers: list = [SsmLayerConfig(layer_id=0, buffers=[BufferConfig(role="state", size=48)])]
    if attention is not None:
        layers.append(AttentionLayerConfig(layer_id=1, buffers=kv(), reuse_policy=attention))
    return layers


@pytest.mark.parametrize("attention", [None, ReusePolicy.PRIVATE], ids=["pure-ssm", "private-attn"])
@pytest.mark.parametrize("end", [6, 8, 9])
@pytest.mark.parametrize("min_snapshot", [False, True])
def test_close_publishes_the_state_at_its_endpoint_without_a_publishing_attention_group(
        managers, attention, end, min_snapshot):
    # docs/semantics.md "SSM state": at close the live state is the snapshot of the block
    # that ends exactly at the final endpoint, the trailing partial block included, also
    # when no attention group publishes a page (the node then holds the state alone).
    m = managers(_ssm_only_layers(attention), slots=32, commit_min_snapshot=min_snapshot)
    d = Driver(m)
    t = tokens(20)
    d.run(t, end=end, chunk=4)
    assert m.probe_reuse(None, t[:end]) == end
    assert m.tree.num_nodes == -(-end // TPB)  # the chain to the snapshot, nothing more
    ext = t[:end] + tokens(5, seed=3)
    c = d.create(ext, match_len=end)
    assert c.history_length == end  # the state is reused (fingerprint-checked below)
    assert c.resume()
    d.engine.recompute([StepWork(c, ext)])  # PRIVATE attention pages come fresh
    d.run_to(c, end + 5, chunk=2)
    c.close()
    assert_invariants(m)


@pytest.mark.parametrize("attention", [None, ReusePolicy.PRIVATE], ids=["pure-ssm", "private-attn"])
def test_a_cache_that_publishes_no_state_leaves_no_pageless_nodes(managers, attention):
    # A model that publishes only SSM states keys its committed full blocks into nodes
    # with no page; a cache that ends up publishing no snapshot removes them again.
    m = managers(_ssm_only_layers(attention), slots=32)
    d = Driver(m)
    t = tokens(20)
    c = d.run(t, end=9, chunk=4, close=False)
    c.stop_committing()
    c.close()
    assert m.tree.num_nodes == 0
    assert m.probe_reuse(None, t[:8]) == 0
    assert_invariants(m)


def test_a_cache_publishes_its_snapshot_after_a_twin_stopped_committing(managers):
    # Two requests with the same tokens share the pageless nodes of an SSM-only model; the
    # one that stops committing leaves them (the other is open and building on them), so
    # the other's snapshot at close is published.
    m = managers(_ssm_only_layers(None), slots=32)
    d = Driver(m)
    t = tokens(20)
    a = d.create(t, match_len=0)
    b = d.create(t, match_len=0)
    d.run_to(a, 8, chunk=4)
    d.run_to(b, 8, chunk=4)
    a.stop_committing()
    a.close()
    d.run_to(b, 14, chunk=4)
    b.close()
    assert m.probe_reuse(None, t[:14]) == 14
    assert m.tree.num_nodes == 4
    assert_invariants(m)


def test_a_closing_cache_keeps_the_pageless_chain_another_open_cache_builds_on(managers):
    # SSM states only: A and B commit the same prompt into page-less nodes; A closes with
    # no state to publish. B is still open and building on those nodes, so they stay, and
    # B's snapshot at its close is published (removing them lost it).
    m = managers(_ssm_only_layers(None), slots=32)
    d = Driver(m)
    t = tokens(40, seed=1)
    b = d.create(t[:16], match_len=0)
    a = d.create(t, match_len=0)
    d.run_to(a, 24, chunk=8)
    d.run_to(b, 16, chunk=8)
    assert a.resize(30) and a.resize(30, history_length=30)  # history past its tokens
    a.close()  # nothing to publish
    b.close()
    assert m.probe_reuse(None, t[:16]) == 16
    assert_invariants(m)


def test_a_boundary_snapshot_never_goes_into_a_node_id_another_chain_took(managers):
    # commit_min_snapshot: B's boundary snapshot was skipped for want of room; after its
    # chain's ids went to another prompt's chain, B's next commit at that boundary must
    # not publish B's state into the other chain's node (a request with that prompt
    # would be served B's state: the fingerprint check below).
    m = managers(_ssm_only_layers(None), slots=3, commit_min_snapshot=True,
                 max_util_for_resume=1.0)
    d = Driver(m)
    t = tokens(40, seed=1)
    a = d.create(t, match_len=0)
    b = d.create(t[:16], match_len=0)
    filler = d.create(tokens(40, seed=7), match_len=0)
    for c in (a, b, filler):
        assert c.resume()
    assert d.step(a, 24) and d.step(b, 16)  # no free slot: both snapshots skipped
    assert a.resize(30) and a.resize(30, history_length=30)
    a.close()
    ct = tokens(40, seed=3)
    c = d.create(ct, match_len=0)
    assert c.resume() and d.step(c, 16)
    filler.close()  # a free slot for B's snapshot
    b.commit([])
    c.close()
    b.close()
    e = d.create(ct[:17], match_len=16)
    assert e.resume() and e.resize(20)
    d.engine.check([StepWork(e, ct)])  # whatever e reused is C's state
    e.close()
    assert_invariants(m)


def test_hybrid_snapshot_at_20_is_not_reused_by_a_fork_at_15(managers):
    m = managers(hybrid_layers(), slots=64)
    d = Driver(m)
    t = tokens(20)
    d.run(t, chunk=6)
    fork = t[:15] + tokens(10, seed=4)
    assert m.probe_reuse(None, fork[:24]) == 0
    c = d.create(fork)
    assert c.history_length == 0
    d.run_to(c, 25)
    c.close()


def test_hybrid_fork_with_min_snapshots_resumes_at_the_last_snapshot_before_it(managers):
    m = managers(hybrid_layers(), slots=64, commit_min_snapshot=True)
    d = Driver(m)
    t = tokens(20)
    d.run(t, chunk=6)  # commits end at 6, 12, 18, 20: block-boundary snapshots at 12, 20
    fork = t[:15] + tokens(10, seed=4)
    assert m.probe_reuse(None, fork[:24]) == 12
    c = d.create(fork)
    assert c.history_length == 12
    d.run_to(c, 25, chunk=4)
    c.close()


def test_hybrid_match_is_the_minimum_every_constraining_group_can_serve(managers):
    m = managers(hybrid_layers(window=8, sinks=4), slots=64, commit_min_snapshot=True)
    d = Driver(m)
    t = tokens(24)
    d.run(t, chunk=4)  # a snapshot at every block boundary
    full_g, ssm_g = m.get_layer_group_id(0), m.get_layer_group_id(3)
    win_g = m.get_layer_group_id(1)
    assert m.probe_reuse(None, t) == 24
    # SSM: drop the snapshot at 24 -> the match falls back to the one at 20.
    drop_page(m, m.tree.page(tree_node(m, t, 24), ssm_g))
    assert m.probe_reuse(None, t) == 20
    # Window: drop block 4 of the windowed group -> endpoint 20 needs it in its window
    # (blocks 3, 4 and sink 0); 16 needs only blocks 0, 2, 3.
    drop_page(m, tree_page(m, t, 4, win_g))
    assert m.probe_reuse(None, t) == 16
    # Full attention: drop block 2 -> everything from block 2 on is gone.
    drop_page(m, tree_page(m, t, 2, full_g))
    assert m.probe_reuse(None, t) == 8
    assert_invariants(m)
    c = d.create([*t, 3], match_len=24)
    assert c.history_length == 8
    d.run_to(c, 25)
    c.close()


# -- many requests sharing one prefix -------------------------------------------------------


def test_many_requests_reuse_one_system_prompt_at_once(managers):
    m = managers(full_layers(), slots=400)
    d = Driver(m)
    system = tokens(21, seed=1)
    d.run([*system, 9], end=22)
    caches = [d.create(system + tokens(7, seed=100 + i) + tokens(6, seed=200 + i))
              for i in range(20)]
    for c in caches:
        assert c.history_length == 21
        assert c.resume()
    shared = [table(c, 0)[:5] for c in caches]
    assert all(s == shared[0] for s in shared)  # one page per shared full block
    assert len({table(c, 0)[5] for c in caches}) == 20  # private copies of the partial
    for _ in range(4):
        d.steps(caches, 3)
    for c in caches:
        d.check(c)
        c.close()


@pytest.mark.parametrize("layers", [full_layers(), windowed_layers()],
                         ids=["full", "windowed"])
def test_second_pass_over_the_same_20_prompts_hits_everything_reusable(managers, layers):
    m = managers(layers, slots=600)
    system = tokens(21, seed=1)
    prompts = [system + tokens(10 + i % 5, seed=10 + i) for i in range(20)]
    outs = [tokens(5 + i % 3, seed=50 + i) for i in range(20)]
    first = [Request(i, p + o, len(p)) for i, (p, o) in enumerate(zip(prompts, outs,
                                                                        strict=True))]
    loop = EngineLoop(m, chunk_tokens=8, max_batch=6)
    loop.run(first)
    assert_invariants(m)
    for p in prompts:
        assert m.probe_reuse(None, p[:-1]) == len(p) - 1
    second = [Request(100 + i, list(r.tokens), r.prompt_len) for i, r in enumerate(first)]
    EngineLoop(m, chunk_tokens=8, max_batch=6).run(second)
    assert [r.reused for r in second] == [len(p) - 1 for p in prompts]
    assert_invariants(m)


# -- partial blocks -------------------------------------------------------------------------


def test_reused_partial_block_is_copied_into_a_private_page_at_first_resume(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(10)
    d.run(t)  # closes at 10: block 2 is published as a partial block of 2 tokens
    partial = tree_node(m, t, 10)
    assert partial is not None and not m.tree.is_full(partial)
    src = slot_of(m, m.tree.page(partial, 0))
    m.get_and_reset_iteration_stats()
    b = d.create(t + tokens(5, seed=2), match_len=12)
    assert b.history_length == 10
    assert b.resume()
    tab = table(b, 0)
    assert tab[:2] == [slot_of(m, tree_page(m, t, 0, 0)), slot_of(m, tree_page(m, t, 1, 0))]
    assert tab[2] != src
    assert page_holds(m, 0, "k", tab[2], t, 2, 2)  # the copy holds the partial's tokens
    stats = m.get_and_reset_iteration_stats()
    assert stats.groups[0].reused_partial_blocks == 1
    assert stats.groups[0].reused_full_blocks == 2
    assert stats.groups[0].intra_device_copies == 1
    d.run_to(b, 15, chunk=1)
    b.close()


def test_two_requests_writing_after_one_partial_block_do_not_see_each_other(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(10)
    d.run(t)
    src = slot_of(m, m.tree.page(tree_node(m, t, 10), 0))
    x = t + tokens(8, seed=21)
    y = t + tokens(8, seed=22)
    cx, cy = d.create(x, match_len=12), d.create(y, match_len=12)
    assert cx.history_length == cy.history_length == 10
    assert cx.resume() and cy.resume()
    assert table(cx, 0)[2] != table(cy, 0)[2]
    d.steps([cx, cy], 1)  # both write position 10 of block 2, with different tokens
    # The tree's partial page is untouched by either writer.
    for layer in (0, 1):
        for role in ("k", "v"):
            assert page_holds(m, layer, role, src, t, 2, 2)
    d.steps([cx, cy], 1)
    d.steps([cx, cy], 3)  # completes block 2: each commits its own full block
    d.check(cx, cy)
    assert tree_page(m, x, 2, 0) != tree_page(m, y, 2, 0)
    # A third request still reuses the original 10 tokens correctly.
    z = d.create(t + tokens(4, seed=23), match_len=12)
    assert z.history_length == 10
    d.run_to(z, 14, chunk=2)
    for c in (cx, cy, z):
        c.close()


def test_partial_reuse_off_reuses_only_full_blocks(managers):
    for partial, want in ((True, 10), (False, 8)):
        m = managers(full_layers(), slots=64, enable_partial_reuse=partial)
        d = Driver(m)
        t = tokens(10)
        d.run(t)
        follow = t + tokens(6, seed=3)
        assert m.probe_reuse(None, follow[:15]) == want
        c = d.create(follow)
        assert c.history_length == want
        d.run_to(c, 16)
        c.close()


def test_partial_match_inside_a_full_tree_block(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(16)
    d.run(t)
    fork = t[:14] + tokens(4, seed=8)
    assert m.probe_reuse(None, fork[:17]) == 14
    c = d.create(fork)
    assert c.history_length == 14
    d.run_to(c, 18, chunk=1)
    # The tree's full block 3 still holds t[12:16].
    assert page_holds(m, 0, "k", slot_of(m, tree_page(m, t, 3, 0)), t, 3, 4)
    c.close()


# -- rebasing -------------------------------------------------------------------------------


def test_identical_full_blocks_committed_concurrently_end_up_as_one_page(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(19)
    a, b = d.create(t), d.create(t)
    assert a.history_length == b.history_length == 0
    assert a.resume() and b.resume()
    m.get_and_reset_iteration_stats()
    d.steps([a, b], 8)  # a commits first, then b finds identical blocks 0 and 1
    assert table(a, 0)[:2] == table(b, 0)[:2]
    assert m.get_and_reset_iteration_stats().groups[0].rebased_blocks == 2
    st = m.get_storage_statistics(0)
    assert st.total - st.free == 2  # b's own copies were freed
    d.steps([a, b], 2)  # position 10: b's block 2 is partial and stays private
    assert table(a, 0)[2] != table(b, 0)[2]
    d.steps([a, b], 2)  # block 2 full in both: rebased again
    assert table(a, 0)[:3] == table(b, 0)[:3]
    st = m.get_storage_statistics(0)
    assert st.total - st.free == 3
    d.steps([a, b], 7)
    d.check(a, b)
    a.close()
    d.check(b)
    b.close()


def test_a_partial_block_is_never_rebased_onto_a_full_tree_block(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(16)
    b = d.create(t)
    d.run(t, end=16)  # a full copy of t is committed while b waits
    assert b.history_length == 0
    assert b.resume()
    d.run_to(b, 10, chunk=10)  # blocks 0, 1 rebased; block 2 partial
    assert table(b, 0)[:2] == [slot_of(m, tree_page(m, t, k, 0)) for k in range(2)]
    tree2 = slot_of(m, tree_page(m, t, 2, 0))
    assert table(b, 0)[2] != tree2
    d.step(b, 1)  # b writes position 10 into its own page
    assert page_holds(m, 0, "k", tree2, t, 2, 4)
    b.close()


# -- scopes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [
    (ReuseScope(), ReuseScope(lora_id=0)),
    (ReuseScope(lora_id=None), ReuseScope(lora_id=0)),
    (ReuseScope(lora_id=1), ReuseScope(lora_id=2)),
    (ReuseScope(salt="tenant-a"), ReuseScope(salt="tenant-b")),
    (ReuseScope(salt=None), ReuseScope(salt=0)),
    (ReuseScope(salt=0), ReuseScope(salt="0")),
    (ReuseScope(salt="x"), ReuseScope(salt=b"x")),
    (ReuseScope(lora_id=1, salt="s"), ReuseScope(lora_id=1, salt=None)),
])
def test_any_scope_difference_means_no_reuse(managers, first, second):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(13)
    d.run(t, scope=first)
    assert m.probe_reuse(first, t[:12]) == 12
    assert m.probe_reuse(second, t[:12]) == 0
    c = d.create(t, scope=second)
    assert c.history_length == 0
    d.run_to(c, 13)
    c.close()


def test_none_scope_is_the_default_scope(managers):
    m = managers(full_layers(), slots=64)
    d = Driver(m)
    t = tokens(9)
    d.run(t, scope=None)
    assert m.probe_reuse(ReuseScope(), t[:8]) == 8


# -- backoff ----------------------------------------------------------------------------------


def test_backoff_shortens_every_match(managers):
    m = managers(full_layers(), slots=64, reuse_match_backoff=3)
    d = Driver(m)
    t = tokens(20)
    d.run(t)
    for n in (20, 13, 9, 4):
        assert m.probe_reuse(None, t[:n]) == n - 3, n
    c = d.create([*t, 1], match_len=20)
    assert c.history_length == 17
    d.run_to(c, 21)
    c.close()


def test_backoff_longer_than_the_match_reuses_nothing(managers):
    m = managers(full_layers(), slots=64, reuse_match_backoff=5)
    d = Driver(m)
    t = tokens(8)
    d.run(t)
    assert m.probe_reuse(None, t[:5]) == 0
    assert m.probe_reuse(None, t[:4]) == 0
    assert m.probe_reuse(None, t[:8]) == 3
    c = d.create([*t[:4], 1, 2], match_len=4)
    assert c.history_length == 0


def test_backoff_rechecks_pruning_at_the_shortened_endpoint(managers):
    m = managers(hybrid_layers(), slots=64, commit_min_snapshot=True, reuse_match_backoff=3)
    d = Driver(m)
    t = tokens(20)
    d.run(t, chunk=4)  # snapshots at 4, 8, ..., 20
    # 20 - 3 = 17 has no snapshot: the match falls back to 16.
    assert m.probe_reuse(None, t) == 16
    c = d.create([*t, 4], match_len=20)
    assert c.history_length == 16
    d.run_to(c, 21)
    c.close()


# -- multimodal items -------------------------------------------------------------------------


def test_multimodal_digests_take_part_in_matching(managers):
    m = managers(full_layers(), slots=64)
    img_a, img_b = bytes(range(32)), bytes(range(1, 33))
    t = [5, 6, img_a, 7, 8, 9, 10, 11, 12]
    c = m.create_kv_cache(None, t)
    assert c.resume() and c.resize(9)
    c.commit(t)
    c.close()
    assert m.probe_reuse(None, t) == 9
    assert m.probe_reuse(None, [5, 6, img_b, 7, 8, 9, 10, 11, 12]) == 2


def _run_once(m, toks):
    c = m.create_kv_cache(None, toks)
    assert c.resume()
    assert c.resize(len(toks))
    c.commit(toks[c.history_length:])
    c.close()


def test_a_closed_requests_trailing_partial_block_is_evicted_before_any_full_block(managers):
    # Six slots: B (two full blocks), then A (two full blocks and a partial one) fill five;
    # C needs two pages, so one page is evicted. Plain LRU would take B's deepest block (B
    # closed first); the partial block, at the lowest priority, goes instead.
    m = managers(full_layers(), slots=6)
    tpb = m.tokens_per_block
    a = tokens(2 * tpb + 1, seed=1)
    b = tokens(2 * tpb, seed=2)
    _run_once(m, b)
    _run_once(m, a)
    assert m.probe_reuse(None, a) == 2 * tpb + 1  # the partial block is reusable...
    _run_once(m, tokens(tpb + 1, seed=3))
    # ...until room is needed: it is the first victim; A's and B's full blocks stay.
    assert m.probe_reuse(None, a) == 2 * tpb
    assert m.probe_reuse(None, b) == 2 * tpb


def test_a_closed_requests_leaf_block_goes_before_older_requests_blocks(managers):
    # Eight slots: A then B (four full blocks each) fill them; C needs two pages. Plain LRU
    # would take A's two deepest blocks; the two leaf blocks (A's and B's deepest, written
    # by them and used by no other request) go instead, the older first.
    m = managers(full_layers(), slots=8)
    tpb = m.tokens_per_block
    a, b = tokens(4 * tpb, seed=1), tokens(4 * tpb, seed=2)
    _run_once(m, a)
    _run_once(m, b)
    _run_once(m, tokens(tpb + 1, seed=3))  # one full block and a partial one
    assert m.probe_reuse(None, a) == 3 * tpb
    assert m.probe_reuse(None, b) == 3 * tpb


def test_a_leaf_block_another_request_reused_is_no_longer_demoted(managers):
    # A's leaf is demoted at A's close; B repeats A (claims every block, the leaf
    # included): the leaf is shared now and back at the default priority, so under
    # pressure LRU order decides again (A's chain, released after C's, stays).
    m = managers(full_layers(), slots=8)
    tpb = m.tokens_per_block
    a, c = tokens(4 * tpb, seed=1), tokens(4 * tpb, seed=2)
    _run_once(m, a)
    _run_once(m, c)
    _run_once(m, a)  # B: the same prompt, every block reused (c's leaf stays demoted)
    assert m.probe_reuse(None, a) == 4 * tpb
    _run_once(m, tokens(2 * tpb + 1, seed=3))  # three pages: C's leaf, then C's deepest
    assert m.probe_reuse(None, a) == 4 * tpb
    assert m.probe_reuse(None, c) == tpb


def test_a_priority_callback_overrides_the_partial_blocks_low_priority(managers):
    m = managers(full_layers(), slots=6)
    tpb = m.tokens_per_block
    a = tokens(2 * tpb + 1, seed=1)
    b = tokens(2 * tpb, seed=2)
    _run_once(m, b)
    c = m.create_kv_cache(None, a, priority_callback=lambda block: 35)
    assert c.resume() and c.resize(len(a))
    c.commit(a)
    c.close()
    _run_once(m, tokens(tpb + 1, seed=3))
    # The engine's priorities rule: A's partial block kept, B's deepest block evicted.
    assert m.probe_reuse(None, a) == 2 * tpb + 1
    assert m.probe_reuse(None, b) == tpb


def test_closes_in_a_row_keep_their_release_order_for_eviction(managers):
    # Closes queue their pages; the policy must still see them in close order. A, B and C
    # (two full blocks each) close one after the other with nothing in between; then D
    # needs two pages: A's blocks, released first, are the ones evicted.
    m = managers(full_layers(), slots=8)
    tpb = m.tokens_per_block
    prompts = [tokens(2 * tpb, seed=s) for s in (11, 12, 13)]
    caches = []
    for p in prompts:
        c = m.create_kv_cache(None, p)
        assert c.resume() and c.resize(len(p))
        c.commit(p)
        caches.append(c)
    for c in caches:
        c.close()
    stats = m.get_storage_statistics(0)
    assert (stats.free, stats.evictable) == (2, 6)  # queued releases count as evictable
    _run_once(m, tokens(3 * tpb, seed=14))  # three pages: two free, one victim
    assert m.probe_reuse(None, prompts[0]) == tpb  # A's deepest block went first
    assert m.probe_reuse(None, prompts[1]) == 2 * tpb
    assert m.probe_reuse(None, prompts[2]) == 2 * tpb


def test_pages_are_released_deepest_block_first_even_a_pending_partial_source(managers):
    # A request whose match ends inside a block holds that block's page as the source of
    # its pending partial copy; closed before its first resume, it must release that page
    # (its deepest) first, else the leaf is newer than its parents and the next eviction
    # takes a parent and cuts the chain.
    m = managers(full_layers(), slots=4, enable_partial_reuse=True, max_util_for_resume=1.0)
    tpb = m.tokens_per_block
    p = tokens(3 * tpb, seed=21)
    _run_once(m, p)  # three blocks cached, one slot free
    r = m.create_kv_cache(None, [*p[:2 * tpb + 2], 7])
    assert r.history_length == 2 * tpb + 2  # two blocks and two tokens of the third
    r.close()  # before any resume
    assert m.probe_reuse(None, p) == 3 * tpb
    _run_once(m, tokens(2 * tpb, seed=22))  # two pages: one free, one victim
    assert m.probe_reuse(None, p) == 2 * tpb  # the leaf went, not a parent


def test_a_leaf_block_a_rebase_shares_is_no_longer_demoted(managers):
    # A and B are admitted before anything is cached; B extends A. A commits and closes:
    # its leaf (block 1) is demoted. B commits the same two blocks (it rebases onto A's)
    # and two more: A's leaf is shared now and the parent of B's blocks, so it gets the
    # default priority back; under pressure B's own leaf goes first, then LRU order
    # takes the chain from its tail, never block 1 before its child.
    m = managers(full_layers(), slots=6, max_util_for_resume=1.0)
    tpb = m.tokens_per_block
    p = tokens(2 * tpb, seed=31)
    q = p + tokens(2 * tpb, seed=32)
    a = m.create_kv_cache(None, p)
    b = m.create_kv_cache(None, q)
    assert a.resume() and b.resume() and a.resize(len(p)) and b.resize(len(q))
    a.commit(p)
    a.close()
    b.commit(q)
    assert m.get_and_reset_iteration_stats().groups[0].rebased_blocks == 2
    b.close()
    assert m.probe_reuse(None, q) == 4 * tpb
    _run_once(m, tokens(4 * tpb, seed=33))  # four pages: two free, two victims
    assert m.probe_reuse(None, q) == 2 * tpb


def test_a_recycled_page_keeps_the_priority_it_was_given(managers):
    # A's leaf page is demoted, then evicted; its page id is recycled for a block whose
    # priority callback says 1 (the leaf priority). A request claiming that block must
    # not "restore" a default priority the engine never gave it.
    m = managers(full_layers(), slots=2, max_util_for_resume=1.0)
    tpb = m.tokens_per_block
    a = tokens(tpb, seed=41)
    _run_once(m, a)
    arena = m.storage_levels.arena
    leaf = int(tree_page(m, a, 0, 0))
    assert arena.priority[leaf] == 1
    _run_once(m, tokens(tpb, seed=42))  # the other slot
    assert m.probe_reuse(None, a) == tpb
    b = tokens(tpb, seed=43)
    c = m.create_kv_cache(None, b, priority_callback=lambda block: 1)
    assert c.resume() and c.resize(len(b))
    c.commit(b)
    c.close()
    assert m.probe_reuse(None, a) == 0  # A's leaf, the older, was evicted for B
    pid = int(tree_page(m, b, 0, 0))
    assert arena.priority[pid] == 1
    d = m.create_kv_cache(None, b)  # claims the block
    assert pid == leaf  # the recycled id (else this test proves nothing)
    assert arena.priority[pid] == 1
    d.close()


def test_a_partial_child_without_pages_does_not_hide_a_sibling_with_them(managers):
    # Two children of block 0: the partial [4, 9] (priority 50, every page) and the full
    # [4, 5, 6, 7] (the leaf: its REQUIRED group's page is evicted, the OPTIONAL one
    # stays). A prompt [0..7] shares 4 tokens with the full child, which cannot serve
    # the REQUIRED group, and 1 with the partial one, which can: the match takes it.
    layers = [AttentionLayerConfig(layer_id=0, buffers=kv()),
              AttentionLayerConfig(layer_id=1, buffers=kv(policy=ReusePolicy.OPTIONAL))]
    m = managers(layers, quota=12 * 2 * PAGE + PAGE, pool_group_ratios=(1, 3),
                 max_util_for_resume=1.0)
    assert m.tokens_per_block == 4

    def run(p, cb=None):
        c = m.create_kv_cache(None, p, priority_callback=cb)
        assert c.resume(optional_reuse_groups=[]) and c.resize(len(p))
        c.commit(p[c.history_length:])
        c.close()

    run([0, 1, 2, 3, 4, 9], cb=lambda block: 50)
    run([0, 1, 2, 3, 4, 5, 6, 7])
    assert m.probe_reuse(None, [0, 1, 2, 3, 4, 5, 6, 7]) == 8
    run([50, 51, 52, 53])  # the REQUIRED pool is full: block [4, 5, 6, 7]'s page goes
    assert m.probe_reuse(None, [0, 1, 2, 3, 4, 9, 9]) == 6
    assert m.probe_reuse(None, [0, 1, 2, 3, 4, 5, 6, 7]) == 5  # block 0 and [4] of [4, 9]
    c = m.create_kv_cache(None, [0, 1, 2, 3, 4, 5, 6, 7])
    assert c.history_length == 5
    c.close()


# -- a partial block serves at most the tokens it holds --------------------------------------


@pytest.mark.parametrize("tail", ["the evicted block's tokens", "zeros"])
def test_a_partial_block_on_a_recycled_node_id_serves_only_its_own_tokens(managers, tail):
    """A full block is evicted (its node id freed), then a prompt ending 5 tokens into
    that block publishes a partial block, which takes the freed id (ids are handed out
    last freed first). A lookup of the whole block must match the parent's end plus 5
    tokens, never the block's 8: the tokens past the partial block's 5 are not its KV
    (the tree's token row past them held the evicted block's tokens; with ``zeros``
    the block's own tokens there are 0, as a cleared row would read)."""
    tpb = 8
    m = managers(full_layers(tpb), slots=2, tpb=tpb)
    d = Driver(m)
    block = tokens(tpb, seed=92)
    if tail == "zeros":
        block[5:] = [0] * (tpb - 5)
    full = tokens(tpb, seed=91) + block
    d.run(full, chunk=tpb)
    gone = tree_node(m, full, 2 * tpb)
    assert gone is not None and m.tree.is_full(gone)
    # Two GPU slots: the second request's page for its last 5 tokens evicts the closed
    # full block (it matches only block 0: a longer match would reuse that block).
    short = full[: tpb + 5]
    c = d.create(short, match_len=tpb)
    assert c.history_length == tpb
    d.run_to(c, len(short))
    assert tree_node(m, full, 2 * tpb) is None  # evicted, its node id freed
    c.close()
    partial = tree_node(m, full, tpb + 5)
    assert partial == gone  # the partial block took the freed id
    assert int(m.tree.ntok[partial]) == 5
    assert m.probe_reuse(None, full) == tpb + 5
    # Room for the reused partial block's private copy at resume.
    unit = bytes_per_slot_round(full_layers(tpb), tpb=tpb)
    assert m.resize(0, 4 * unit + unit // 2)
    r = d.create(full, match_len=len(full))
    assert r.history_length == tpb + 5
    assert r.resume()
    d.check(r)  # the KV of every reused token is that token's
    d.run_to(r, len(full), chunk=1)
    d.check(r)
    r.close()


def test_best_partial_never_shares_more_tokens_than_the_partial_block_holds():
    """The tree alone: a full block under ``parent`` is detached, a partial block of 5 of
    its tokens added under the same parent on the recycled id; ``best_partial`` of the
    whole block says 5. Likewise for a fresh partial block whose lookup continues with
    zeros (what an unwritten token row holds)."""
    import numpy as np

    from kvcm_core.radix import PrefixTree, block_keys, scope_root_key

    tpb = 8
    tree = PrefixTree(1, tpb)
    rk = scope_root_key(None)
    root = tree.root(rk)
    toks = tokens(2 * tpb, seed=93)
    keys = block_keys(rk, toks, tpb, 0, 2)
    nids = tree.add_chain(root, keys, np.asarray(toks, np.int32).reshape(2, tpb), 0)
    parent, old = int(nids[0]), int(nids[1])
    tree.detach(old)
    nid = tree.add_partial(parent, toks[tpb : tpb + 5])
    assert nid == old  # the id of the detached full block, recycled
    assert not tree.tokens[nid, 5:].any()  # its row keeps none of the old block's tokens
    whole = np.asarray(toks[tpb:], dtype=np.int32)
    assert tree.best_partial(parent, whole) == (nid, 5)
    assert tree.best_partial(parent, list(toks[tpb:])) == (nid, 5)  # item by item
    assert tree.best_partial(parent, whole[:3]) == (nid, 3)
    # A partial block, the only child of its parent; the lookup's tokens past its 5 are
    # zeros.
    top = tree.root(scope_root_key(ReuseScope(salt="zeros")))
    other = tree.add_partial(top, [7, 7, 7, 7, 7])
    assert tree.best_partial(top, np.asarray([7] * 5 + [0] * 3, np.int32)) == (other, 5)
