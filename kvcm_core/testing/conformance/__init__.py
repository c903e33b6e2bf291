"""Conformance base classes, one per plugin kind.

Each class sets ``kvcm_kind``; a subclass may set ``plugin_name`` to test one plugin,
otherwise the kvcm pytest plugin parametrises it over every registered plugin of that kind
(or those named with ``--kvcm-plugin``). Tests receive the plugin's record through the
``kvcm_plugin_spec`` fixture; unavailable plugins are skipped with their reason. Tests gate
on declared capabilities, never on names.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

__all__ = [
    "CodecConformance",
    "ConformanceBase",
    "EvictionPolicyConformance",
    "KernelBackendConformance",
    "KeyedTierConformance",
    "SparseKernelConformance",
    "TierConformance",
]

# Suite classes, imported on first access: importing this package stays cheap (no pytest or
# hypothesis), since the pytest plugin and every suite import ConformanceBase from here.
_LAZY = {
    "CodecConformance": "codec",
    "EvictionPolicyConformance": "eviction",
    "KernelBackendConformance": "kernels",
    "KeyedTierConformance": "keyed",
    "SparseKernelConformance": "sparse",
    "TierConformance": "tier",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


class ConformanceBase:
    """Common base: which plugin kind the class tests, and optionally which plugin."""

    kvcm_kind: ClassVar[str] = ""
    plugin_name: ClassVar[str | None] = None

    @classmethod
    def applies_to(cls, spec: Any) -> bool:
        """Whether this suite tests the plugin ``spec`` (all of its kind by default)."""
        return True
