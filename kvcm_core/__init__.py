"""kvcm: a paged KV-cache manager for LLM inference engines.

The core manages the paged KV cache of every running request; storage tiers, kernel
backends, codecs, eviction policies and event sinks are plugins found through the ``kvcm``
entry-point group. Everything public is importable from here.
"""

from __future__ import annotations

from kvcm_core.backend import (
    BAD_PAGE_INDEX,
    Buffer,
    CopyTask,
    Event,
    FingerprintPages,
    KernelBackend,
    PageRegion,
    Stream,
    TableConversion,
)
from kvcm_core.codec import BlobCodec, BufferPlace, PageCodec, PageLayout
from kvcm_core.config import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManagerConfig,
    LevelConfig,
    SparseConfig,
    SsmLayerConfig,
    SwaScratchConfig,
)
from kvcm_core.errors import (
    ArgumentTypeError,
    ConfigError,
    CorruptPageError,
    InvalidArgumentError,
    InvalidStateError,
    KvcmError,
    OutOfPagesError,
    PluginError,
    TierIOError,
)
from kvcm_core.events import BlockEvent, EventKind, EventSink
from kvcm_core.eviction import DEFAULT_PRIORITY, EvictionPolicy
from kvcm_core.hookspecs import hookimpl
from kvcm_core.plugins import KvcmPluginManager, get_plugin_manager, reset_plugin_manager
from kvcm_core.records import (
    Availability,
    CodecCapabilities,
    CodecKind,
    CodecSpec,
    EvictionPolicyCapabilities,
    EvictionPolicySpec,
    KernelBackendCapabilities,
    KernelBackendSpec,
    Medium,
    TierCapabilities,
    TierSpec,
)
from kvcm_core.tier import BlobPool, DevicePool, IOHandle, Pool, StoragePool, Tier
from kvcm_core.types import (
    CacheGroupId,
    LayerGroupId,
    ReusePolicy,
    ReuseScope,
)
from kvcm_core.units import parse_size

__version__ = "0.1.0"

__all__ = [
    "BAD_PAGE_INDEX",
    "DEFAULT_PRIORITY",
    "ArgumentTypeError",
    "AttentionLayerConfig",
    "Availability",
    "BlobCodec",
    "BlobPool",
    "BlockEvent",
    "Buffer",
    "BufferConfig",
    "BufferPlace",
    "CacheGroupId",
    "CodecCapabilities",
    "CodecKind",
    "CodecSpec",
    "ConfigError",
    "CopyTask",
    "CorruptPageError",
    "DevicePool",
    "Event",
    "EventKind",
    "EventSink",
    "EvictionPolicy",
    "EvictionPolicyCapabilities",
    "EvictionPolicySpec",
    "FingerprintPages",
    "IOHandle",
    "InvalidArgumentError",
    "InvalidStateError",
    "KVCacheManagerConfig",
    "KernelBackend",
    "KernelBackendCapabilities",
    "KernelBackendSpec",
    "KvcmError",
    "KvcmPluginManager",
    "LayerGroupId",
    "LevelConfig",
    "Medium",
    "OutOfPagesError",
    "PageCodec",
    "PageLayout",
    "PageRegion",
    "PluginError",
    "Pool",
    "ReusePolicy",
    "ReuseScope",
    "SparseConfig",
    "SsmLayerConfig",
    "StoragePool",
    "Stream",
    "SwaScratchConfig",
    "TableConversion",
    "Tier",
    "TierCapabilities",
    "TierIOError",
    "TierSpec",
    "get_plugin_manager",
    "hookimpl",
    "parse_size",
    "reset_plugin_manager",
]

from kvcm_core.batch import Batch, IndexMode
from kvcm_core.cache import CacheStatus, KVCache
from kvcm_core.manager import KVCacheManager

__all__ += ["Batch", "CacheStatus", "IndexMode", "KVCache", "KVCacheManager"]
