"""The conformance suite that ``kvcm conformance`` runs: every registered plugin of every
kind through its base class.

The kvcm pytest plugin parametrises each class by plugin name (restricted with
``--kvcm-plugin NAME``), skips unavailable plugins with their reason and runs declared
``known_gaps`` as strict xfail. To run it by hand::

    python -m pytest --pyargs kvcm_core.testing.suite --kvcm-plugin numpy
"""

from __future__ import annotations

import sys

import pytest

# Assertions in the base classes get pytest's detailed messages when they are imported
# here first (``kvcm conformance`` runs this module in a fresh pytest session).
_SUITES = ("tier", "keyed", "kernels", "sparse", "codec", "eviction")
pytest.register_assert_rewrite(
    *[
        name
        for name in (f"kvcm_core.testing.conformance.{s}" for s in _SUITES)
        if name not in sys.modules
    ]
)

from kvcm_core.testing.conformance.codec import CodecConformance  # noqa: E402
from kvcm_core.testing.conformance.eviction import EvictionPolicyConformance  # noqa: E402
from kvcm_core.testing.conformance.kernels import KernelBackendConformance  # noqa: E402
from kvcm_core.testing.conformance.keyed import KeyedTierConformance  # noqa: E402
from kvcm_core.testing.conformance.sparse import SparseKernelConformance  # noqa: E402
from kvcm_core.testing.conformance.tier import TierConformance  # noqa: E402

__all__ = [
    "TestCodecs", "TestEvictionPolicies", "TestKernelBackends", "TestKeyedTiers",
    "TestSparseKernels", "TestTiers",
]


class TestTiers(TierConformance):
    """Every registered storage tier."""


class TestKeyedTiers(KeyedTierConformance):
    """Every registered keyed tier (a server is started for it where it needs one)."""


class TestKernelBackends(KernelBackendConformance):
    """Every registered kernel backend."""


class TestSparseKernels(SparseKernelConformance):
    """Every registered kernel backend's sparse kernels."""


class TestCodecs(CodecConformance):
    """Every registered codec."""


class TestEvictionPolicies(EvictionPolicyConformance):
    """Every registered eviction policy."""
