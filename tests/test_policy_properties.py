"""Property tests of the reuse policies (concepts.md §3-4, §9-10): random policy assignments
per layer and buffer, random workloads over tiny quotas, on one level and on three
(gpu/host/disk). After every step of the engine loop:

- no page a running request needs is missing: every non-stale block of every group within
  history (REQUIRED ones above all) has a level-0 page in the table while ACTIVE;
- no PRIVATE page is ever in the prefix tree;
- the accounting identity holds (``manager.check_invariants()``);
- fingerprints verify (the loop checks every step; the engine recomputes fresh pages).

At the end every request finished, and after closing and ``clear_reusable_blocks()``
every slot of every level is free.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_helpers import (
    STACKS,
    TPB,
    P,
    PageView,
    assert_all_free,
    assert_invariants,
    assert_no_private_in_tree,
    att,
    buf,
    make_manager,
    ssm,
)

from kvcm_core.backend import BAD_PAGE_INDEX
from kvcm_core.cache import CacheStatus
from kvcm_core.testing.engine import EngineLoop, Request

PLAIN = [P.REQUIRED, P.OPTIONAL, P.PRIVATE]
MAX_TOKENS = 28  # 7 blocks: every request fits the tiny GPU level alone


@st.composite
def models(draw: Any) -> list[Any]:
    """2-4 layers of random kinds; random layer policies and per-buffer overrides
    (``None`` inherits); some zero-size buffers. SINK_REQUIRED_ONLY only where allowed."""
    layers = []
    for layer_id in range(draw(st.integers(2, 4))):
        kind = draw(st.sampled_from(["full", "window", "sinks", "ssm"]))
        allowed = PLAIN + ([P.SINK_REQUIRED_ONLY] if kind == "sinks" else [])
        layer_policy = draw(st.sampled_from(allowed))
        bufs = []
        for k in range(draw(st.integers(1, 2))):
            policy = draw(st.sampled_from([None, *allowed]))
            sizes = [0, 16, 48] if kind == "ssm" else [0, 64, 128]
            bufs.append(buf(f"b{k}", draw(st.sampled_from(sizes)), policy))
        if kind == "ssm":
            layers.append(ssm(layer_id, *bufs, policy=layer_policy))
        else:
            window = None if kind == "full" else draw(st.sampled_from([8, 12]))
            sinks = draw(st.sampled_from([4, 6])) if kind == "sinks" else 0
            layers.append(att(layer_id, *bufs, window=window, sinks=sinks,
                              policy=layer_policy))
    if not any(b.size for layer in layers for b in layer.buffers):
        layers.append(att(len(layers)))
    return layers


@st.composite
def workloads(draw: Any) -> list[tuple[list[int], int]]:
    """Requests over a few shared prefixes, some continuing earlier ones: (tokens,
    prompt_len)."""
    bases = [[draw(st.integers(1, 50)) for _ in range(MAX_TOKENS)] for _ in range(2)]
    out: list[tuple[list[int], int]] = []
    for _ in range(draw(st.integers(3, 8))):
        if out and draw(st.booleans()):
            prev = draw(st.sampled_from(out))[0]
            head = prev[: draw(st.integers(1, len(prev)))]
        else:
            base = draw(st.sampled_from(bases))
            head = base[: draw(st.integers(0, MAX_TOKENS))]
        n = draw(st.integers(max(len(head), 2), MAX_TOKENS))
        toks = head + [draw(st.integers(1, 50)) for _ in range(n - len(head))]
        prompt_len = draw(st.integers(1, len(toks)))
        out.append((toks, prompt_len))
    return out


class PolicyLoop(EngineLoop):
    """Chooses a random subset of the complete OPTIONAL groups at each first resume;
    closes the cache of a request it could not admit (its claims would otherwise stay
    held while it waits: see test_engine_loop_waiting_claims_do_not_deadlock_one_level);
    and preempts by arrival order, so the oldest running request always progresses (with
    nothing reusable, e.g. PRIVATE-only models, newest-admitted preemption can livelock).
    """

    def __init__(self, manager: Any, rnd: random.Random, **kw: Any) -> None:
        super().__init__(manager, **kw)
        self.rnd = rnd

    def _preempt(self, exclude: Request) -> Request | None:
        younger = [r for r in self.running if r is not exclude and r.id > exclude.id
                   and r.cache.status is CacheStatus.ACTIVE]
        if not younger:
            return None  # the growing request is the youngest: it yields itself
        victim = max(younger, key=lambda r: r.id)
        self._preempt_one(victim)
        return victim

    def _admit(self, req: Request, report: Any = None) -> bool:
        if super()._admit(req, report):
            return True
        if req.cache is not None:
            req.cache.close()
            req.cache = None
        return False

    def choose_optional(self, cache: Any) -> list[int]:
        return [g for g in super().choose_optional(cache) if self.rnd.random() < 0.5]


def check_step(m: Any, loop: EngineLoop) -> None:
    assert_invariants(m)
    assert_no_private_in_tree(m)
    for req in loop.running:
        cache = req.cache
        assert cache.status is CacheStatus.ACTIVE
        hist, nb = cache.history_length, cache.num_blocks
        for g, lc in enumerate(m.life_cycles):
            table = cache.get_base_page_indices(g)
            if lc.is_ssm:
                needed = [hist // TPB] if hist // TPB < nb else []
            else:
                start, stop = lc.stale_range(hist, TPB)
                needed = [b for b in range(-(-hist // TPB)) if not start <= b < stop]
            for b in needed:
                assert table[b] != BAD_PAGE_INDEX, (
                    f"{cache!r}: group {g} ({lc.describe()}) block {b} has no page")
        for g, lc in enumerate(m.life_cycles):
            if lc.is_ssm:
                continue  # attention pages only (the live SSM state is checked above)
            for page in (PageView(m, p) for p in cache.pages(g) if p >= 0):
                assert page.level == 0 and page.locks, page


def run_workload(m: Any, work: list[tuple[list[int], int]], seed: int, chunk: int,
                 batch: int) -> None:
    loop = PolicyLoop(m, random.Random(seed), chunk_tokens=chunk, max_batch=batch)
    reqs = [Request(i, toks, plen) for i, (toks, plen) in enumerate(work)]
    half = len(reqs) // 2
    for part in (reqs[:half], reqs[half:]):  # the second half reuses the first's tree
        loop.run(part, max_steps=2000, on_step=lambda _r: check_step(m, loop))
        check_step(m, loop)
    assert all(r.done for r in reqs)
    assert_no_private_in_tree(m)
    assert_all_free(m)
    m.shutdown()


# KVCM_POLICY_EXAMPLES raises the bound for a longer hunt.
SETTINGS = settings(max_examples=int(os.environ.get("KVCM_POLICY_EXAMPLES", "25")),
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@SETTINGS
@given(layers=models(), work=workloads(), slots=st.integers(9, 11),
       snapshots=st.booleans(), chunk=st.integers(3, 9), batch=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_random_policies_one_level_keep_every_rule(layers, work, slots, snapshots, chunk,
                                                   batch, seed):
    m = make_manager(layers, STACKS["gpu"], slots, commit_min_snapshot=snapshots)
    run_workload(m, work, seed, chunk, batch)


@SETTINGS
@given(layers=models(), work=workloads(), slots=st.integers(9, 11),
       host=st.integers(1, 4), snapshots=st.booleans(), chunk=st.integers(3, 9),
       batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_random_policies_three_levels_keep_every_rule(layers, work, slots, host, snapshots,
                                                      chunk, batch, seed):
    with tempfile.TemporaryDirectory() as tmp:
        m = make_manager(layers, STACKS["gpu-host-disk"], [slots, host, 64], Path(tmp),
                         commit_min_snapshot=snapshots)
        run_workload(m, work, seed, chunk, batch)


def test_engine_loop_waiting_claims_do_not_deadlock_one_level():
    # Found by test_random_policies_one_level_keep_every_rule (one REQUIRED buffer): the
    # loop kept the cache of a request it failed to admit, its claims stayed held (on one
    # level held pages never move), and with a preempted request queued ahead of it
    # nothing could run.
    prefix = [40, 18, 29, 19, 12, 10, 35, 46]
    mid = [26, 28, 24, 11, 40, 28, 29, 1, 49, 32]
    work = [
        ([*prefix, *mid, 31, 6, 13, 45, 29, 13, 44, 8, 17, 28], 15),
        ([*prefix, 49, 45, 22, 7, 13, 45, 1, 27, 7, 18, 38, 15, 43, 18], 8),
        ([*prefix, *mid, 37, 50, 22, 7, 47, 21, 24, 30], 1),
        ([23, 39, 5, 7, 31, 32, 28, 25, 10, 13, 28, 50, 18, 45, 17, 7, 27, 48, 20], 10),
        ([*prefix, *mid, 31, 6, 13, 45, 29, 13, 44, 8, 32, 2], 27),
    ]
    m = make_manager([att(0, buf("k", 64))], STACKS["gpu"], 9)
    loop = EngineLoop(m, chunk_tokens=7, max_batch=3)
    reqs = [Request(i, toks, plen) for i, (toks, plen) in enumerate(work)]
    loop.run(reqs[:2])
    loop.run(reqs[2:])  # every request alone fits the level (7 blocks of 9)
    assert all(r.done for r in reqs)
    assert_all_free(m)


def test_a_snapshot_whose_node_went_while_making_room_for_it_is_not_published():
    # Found by test_random_policies_one_level_keep_every_rule at a few thousand examples
    # (a REQUIRED SSM state, attention buffers of size 0, snapshots at every commit on a
    # block boundary): taking the snapshot's page evicted the node's last page, the node
    # went with it, and the snapshot was published into the freed node (its id was then
    # handed to a new node while the page still pointed at it).
    ones = [1] * 28
    work = [([*ones[:19], 2, *ones[:8]], 1), (ones[:2], 1), (ones[:24], 1),
            ([*ones[:19], 2, *ones[:4]], 1), (ones[:25], 1)]
    m = make_manager([ssm(0, buf("b0", 16)), att(1, buf("b0", 0))], STACKS["gpu"], 9,
                     commit_min_snapshot=True)
    run_workload(m, work, seed=0, chunk=3, batch=1)
