"""Review 27: the sliding window with SWA scratch pages (docs/semantics.md "SWA scratch
pages")."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import PAGE, kv, snapshot_state

from kvcm_core import AttentionLayerConfig, SwaScratchConfig

W, SINKS = 8, 4  # window and sink tokens of the windowed layers (TPB = 4)


def swa_model(full: bool = True, sinks: int = SINKS) -> list[Any]:
    """A full-attention layer 0 (optional) and windowed layers 1..3."""
    layers: list[Any] = [AttentionLayerConfig(layer_id=0, buffers=kv(PAGE))] if full else []
    return layers + [AttentionLayerConfig(layer_id=i, buffers=kv(PAGE), sliding_window_size=W,
                                          num_sink_tokens=sinks) for i in (1, 2, 3)]


def scratch_cfg(slots: int = 4) -> SwaScratchConfig:
    return SwaScratchConfig(scratch_pages_per_block=2, max_scratch_slots=slots)


# -- 5. an impossible resize of a model with windowed layers only -------------------------

@pytest.mark.parametrize("scratch", [False, True], ids=["plain", "scratch"])
def test_a_resize_no_level_0_could_hold_is_refused_at_once_with_windowed_layers_only(
        managers: Any, scratch: bool) -> None:
    m = managers(swa_model(full=False), slots=16,
                 swa_scratch=scratch_cfg() if scratch else None)
    c = m.create_kv_cache(None, [])
    assert c.resume()
    before = snapshot_state(m, c)
    t0 = time.perf_counter()
    assert not c.resize(10**12)  # was a list per new block first: MemoryError
    assert time.perf_counter() - t0 < 0.1
    assert "level 0 holds 16 slots in all" in (c.last_refusal or "")
    assert snapshot_state(m, c) == before
    assert c.resize(40)  # a size that fits still does
