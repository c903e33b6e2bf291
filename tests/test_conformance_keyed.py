"""Every keyed tier through the keyed-tier conformance suite: the redis tier on a
standalone server and on a Redis Cluster (real servers on loopback)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcm_core.records import Medium, TierCapabilities
from kvcm_core.testing.conformance.keyed import KeyedTierConformance
from kvcm_core.tier import KeyedTier


class TestKeyedTiers(KeyedTierConformance):
    """Every keyed tier registered through the ``kvcm`` entry points (standalone server)."""


class TestRedisClusterTier(KeyedTierConformance):
    """The redis tier on a six-node Redis Cluster (three primaries, one replica each)."""

    plugin_name = "redis"

    def tier_options(self) -> dict[str, Any]:
        from redis_fixtures import session_cluster

        return {"url": session_cluster().url, "cluster": True}


class _ViewKeepingTier(KeyedTier):
    """Broken on purpose: stores the caller's values as given (views included) and turns
    them into bytes only when they are read."""

    capabilities = TierCapabilities(device_accessible=False, medium=Medium.REMOTE, keyed=True)

    def __init__(self, backend: Any = None, options: Any = None) -> None:
        super().__init__(backend, options or {})
        self.store: dict[bytes, Any] = {}

    def put_many(self, keys, values, *, deadline):  # type: ignore[no-untyped-def]
        self.store.update(zip(keys, values, strict=True))
        return np.ones(len(keys), dtype=bool)

    def get_many(self, keys, *, deadline):  # type: ignore[no-untyped-def]
        return [bytes(self.store[k]) if k in self.store else None for k in keys]

    def exists_many(self, keys, *, deadline):  # type: ignore[no-untyped-def]
        return np.array([k in self.store for k in keys], dtype=bool)

    def delete_many(self, keys, *, deadline):  # type: ignore[no-untyped-def]
        return sum(self.store.pop(k, None) is not None for k in keys)


def test_the_suite_fails_a_keyed_tier_that_keeps_the_values_it_was_handed() -> None:
    suite = KeyedTierConformance()
    tier = _ViewKeepingTier()
    with pytest.raises(AssertionError):
        suite.test_put_reads_its_values_only_until_it_returns(tier)
