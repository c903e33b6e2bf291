"""Hook specifications of kvcm's plugin system.

Every hook is a *registration* hook: it is called once, when the plugin manager collects
records at start-up, and yields frozen records (:mod:`kvcm_core.records`). Hooks are never
called on the data path. Implementations may take fewer arguments than the spec (pluggy
rule) and are called with keywords. None of these hooks stops at the first result: the
manager collects the records of every plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvcm_core.events import EventSink
    from kvcm_core.records import CodecSpec, EvictionPolicySpec, KernelBackendSpec, TierSpec

PROJECT_NAME = "kvcm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# ---------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------


@hookspec
def kvcm_tiers() -> Iterable[TierSpec]:
    """Register storage tiers (gpu, host, disk, redis, ...).

    Called once when the plugin manager collects records.

    Returns:
        The :class:`~kvcm_core.records.TierSpec` records of this plugin.

    Example::

        @kvcm_core.hookimpl
        def kvcm_tiers():
            yield TierSpec(name="mmap", factory=MmapTier, capabilities=CAPS)
    """
    raise NotImplementedError  # a specification: pluggy never calls it


# ---------------------------------------------------------------------------------------
# Device runtimes and kernels
# ---------------------------------------------------------------------------------------


@hookspec
def kvcm_kernel_backends() -> Iterable[KernelBackendSpec]:
    """Register kernel backends: a device runtime plus every kernel of the contract.

    Called once when the plugin manager collects records. A backend whose package or device
    is missing still registers and reports why through its ``availability`` check.

    Returns:
        The :class:`~kvcm_core.records.KernelBackendSpec` records of this plugin.

    Example::

        @kvcm_core.hookimpl
        def kvcm_kernel_backends():
            yield KernelBackendSpec(name="mine", factory=Mine, capabilities=CAPS, priority=50)
    """
    raise NotImplementedError  # a specification: pluggy never calls it


# ---------------------------------------------------------------------------------------
# Codecs and eviction
# ---------------------------------------------------------------------------------------


@hookspec
def kvcm_codecs() -> Iterable[CodecSpec]:
    """Register cold-page codecs and blob codecs.

    Called once when the plugin manager collects records.

    Returns:
        The :class:`~kvcm_core.records.CodecSpec` records of this plugin.

    Example::

        @kvcm_core.hookimpl
        def kvcm_codecs():
            yield CodecSpec(name="fp8", factory=Fp8Codec, capabilities=FP8_CAPS)
    """
    raise NotImplementedError  # a specification: pluggy never calls it


@hookspec
def kvcm_eviction_policies() -> Iterable[EvictionPolicySpec]:
    """Register eviction orderings (one instance per level and pool group).

    Called once when the plugin manager collects records.

    Returns:
        The :class:`~kvcm_core.records.EvictionPolicySpec` records of this plugin.

    Example::

        @kvcm_core.hookimpl
        def kvcm_eviction_policies():
            yield EvictionPolicySpec(name="lfu", factory=LfuPolicy)
    """
    raise NotImplementedError  # a specification: pluggy never calls it


# ---------------------------------------------------------------------------------------
# Observers
# ---------------------------------------------------------------------------------------


@hookspec
def kvcm_event_sinks(config: Any) -> Iterable[EventSink]:
    """Provide observers of stored, removed and moved blocks for one manager.

    Called once per :class:`~kvcm_core.KVCacheManager`, with its configuration, when the
    manager is built. Sinks receive batches of events and must not block the manager.

    Args:
        config: the manager's :class:`~kvcm_core.config.KVCacheManagerConfig`.

    Returns:
        :class:`~kvcm_core.events.EventSink` objects for this manager.

    Example::

        @kvcm_core.hookimpl
        def kvcm_event_sinks(config):
            yield KafkaSink(topic="kv-events")
    """
    raise NotImplementedError  # a specification: pluggy never calls it
