"""``cache.page_table_version`` changes whenever one of an active cache's page tables
changes (what a Batch reads to find dirty rows), and stays put on a decode step that
changes no table."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import full_layers, hybrid_layers, tokens, windowed_layers


def _tables(cache, m) -> list[np.ndarray]:
    return [np.array(cache.get_base_page_indices(g)) for g in range(m.num_cache_groups)]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.shape == y.shape and (x == y).all() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layers", [full_layers, windowed_layers, hybrid_layers],
                         ids=["full", "windowed", "hybrid"])
@pytest.mark.parametrize("seed", range(4))
def test_a_changed_page_table_always_comes_with_a_new_version(managers, layers, seed):
    rng = random.Random(seed)
    m = managers(layers(), slots=48)
    tpb = m.tokens_per_block
    shared = tokens(3 * tpb, seed=100)
    caches = []
    for i in range(3):
        prompt = shared[: rng.randrange(tpb, 3 * tpb)] + tokens(rng.randrange(1, 2 * tpb),
                                                               seed=seed * 10 + i)
        c = m.create_kv_cache(None, prompt[:-1])
        assert c.resume()
        caches.append((c, prompt))
    changed = 0
    for _ in range(60):
        c, prompt = rng.choice(caches)
        before, version = _tables(c, m), c.page_table_version
        op = rng.random()
        if op < 0.5:  # a step: room for some tokens, then commit them
            n = rng.choice([1, 1, 1, rng.randrange(1, 2 * tpb)])
            if not c.resize(c.history_length + n):
                continue
            after, mid = _tables(c, m), c.page_table_version
            assert _same(before, after) or mid != version
            before, version = after, mid
            c.commit(tokens(n, seed=rng.randrange(1 << 30)))
        elif op < 0.7:  # a larger allocation
            if not c.resize(c.capacity + rng.randrange(1, 3 * tpb)):
                continue
        else:  # suspend and resume (pages may move; tables are read while active)
            c.suspend()
            if not c.resume():
                c.resume()
                continue
        after = _tables(c, m)
        if not _same(before, after):
            changed += 1
            assert c.page_table_version != version, (before, after)
    assert changed > 5  # the run did change tables


def test_a_decode_step_inside_a_block_keeps_the_version(managers):
    m = managers(full_layers(), slots=16)
    tpb = m.tokens_per_block
    prompt = tokens(2 * tpb + 1)
    c = m.create_kv_cache(None, prompt[:-1])
    assert c.resume() and c.resize(len(prompt))
    c.commit(prompt[c.history_length:])
    # Capacity and history now sit inside block 2: the next tokens stay in it.
    version = c.page_table_version
    for _ in range(tpb - 2):
        assert c.resize(c.capacity + 1)
        c.commit([7])
        assert c.page_table_version == version
    assert c.resize(c.capacity + tpb)  # a new block: the table grows
    assert c.page_table_version != version


def test_a_new_block_count_moves_the_version_even_when_no_page_is_taken(managers):
    """An SSM group's table is ``num_blocks`` long although it holds one state page: a
    resize that adds a block changes it (found by a Batch test: a model whose attention
    buffers are all empty takes no page per block)."""
    from kvcm_core import AttentionLayerConfig, BufferConfig, SsmLayerConfig

    layers = [AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="b0", size=0)]),
              SsmLayerConfig(layer_id=1, buffers=[BufferConfig(role="s", size=16)])]
    m = managers(layers, slots=9)
    tpb = m.tokens_per_block
    c = m.create_kv_cache(None, tokens(2))
    assert c.resume() and c.resize(2)
    before, version = _tables(c, m), c.page_table_version
    assert c.resize(tpb + 1)
    assert not _same(before, _tables(c, m))
    assert c.page_table_version != version
