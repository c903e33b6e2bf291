"""A page handed out to be (re)computed is published only after a commit covers the step
that writes it: a request that is closed before its first step publishes none of its
recompute pages, so no later request can reuse state that was never written."""

from __future__ import annotations

from conftest import make_manager, tokens

from kvcm_core import AttentionLayerConfig, BufferConfig, ReusePolicy, SsmLayerConfig
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4


def _layers() -> list:
    return [AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64),
                                                      BufferConfig(role="v", size=64)]),
            SsmLayerConfig(layer_id=1, buffers=[BufferConfig(role="state", size=48)],
                           reuse_policy=ReusePolicy.OPTIONAL)]


def test_an_unwritten_recompute_state_is_not_published_when_the_request_closes_early(
        ) -> None:
    m = make_manager(_layers(), slots=32)
    fp = FingerprintEngine(m)
    ssm = m.get_layer_group_id(1)
    p = tokens(10, seed=4)
    # A writes 10 tokens: its state is published where its partial block ends (10).
    a = m.create_kv_cache(None, p[:9])
    assert a.resume() and a.resize(10)
    fp.step([StepWork(a, p)])
    a.commit(p[a.history_length:10])
    a.close()
    # B reuses the first two full blocks (8 tokens) but declines the SSM snapshot: its
    # state page is handed out to be recomputed; B is closed before its first step.
    b = m.create_kv_cache(None, p[:8])
    assert b.resume(optional_reuse_groups=[])
    assert b.history_length == 8 and b.recompute_blocks(ssm)
    b.close()
    # C matches 8 tokens too. It must not be offered B's unwritten state.
    c = m.create_kv_cache(None, p[:8] + tokens(3, seed=9))
    offered = [g for g, st in c.reuse_status.items() if st.complete]
    assert c.resume(optional_reuse_groups=offered)  # takes whatever state is offered
    assert c.resize(11)
    fp.recompute([StepWork(c, p[:8] + tokens(3, seed=9))])
    fp.check([StepWork(c, p[:8] + tokens(3, seed=9))])  # raises on a never-written state
    c.close()
    m.check_invariants()
