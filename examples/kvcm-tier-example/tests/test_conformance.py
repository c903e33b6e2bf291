"""Run kvcm's tier conformance suite against this plugin (found through its entry point)."""

from __future__ import annotations

from kvcm_core.testing.conformance.tier import TierConformance


class TestMmapTier(TierConformance):
    plugin_name = "mmap"
