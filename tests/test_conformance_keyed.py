"""Every keyed tier through the keyed-tier conformance suite: the redis tier on a
standalone server and on a Redis Cluster (real servers on loopback)."""

from __future__ import annotations

from typing import Any

from kvcm_core.testing.conformance.keyed import KeyedTierConformance


class TestKeyedTiers(KeyedTierConformance):
    """Every keyed tier registered through the ``kvcm`` entry points (standalone server)."""


class TestRedisClusterTier(KeyedTierConformance):
    """The redis tier on a six-node Redis Cluster (three primaries, one replica each)."""

    plugin_name = "redis"

    def tier_options(self) -> dict[str, Any]:
        from redis_fixtures import session_cluster

        return {"url": session_cluster().url, "cluster": True}
