"""Frozen records that plugins yield from their registration hooks.

A record describes a plugin: its validated ``name``, a ``factory`` that builds it, a
one-line ``description``, declared ``capabilities`` (data that tests and the core gate on,
never guessed from names), the ``options_type`` its factory accepts, and an
``availability`` check. The core collects records once at start-up and then calls the
objects they describe directly: hooks are never on the data path.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

__all__ = [
    "Availability",
    "CodecCapabilities",
    "CodecKind",
    "CodecSpec",
    "EvictionPolicyCapabilities",
    "EvictionPolicySpec",
    "KernelBackendCapabilities",
    "KernelBackendSpec",
    "Medium",
    "PluginSpec",
    "TierCapabilities",
    "TierSpec",
    "always_available",
]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]{0,63}$")


def _check_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.name={value!r}: must be lower case letters, digits, "
            "'_' or '-', starting with a letter, at most 64 characters"
        )


@attrs.frozen
class Availability:
    """Whether a plugin can be used here, and if not, why (shown by ``kvcm plugins``)."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


def always_available() -> Availability:
    """Availability check of a plugin that needs nothing beyond kvcm's own dependencies."""
    return Availability(True)


class Medium(enum.Enum):
    """What physically backs a tier's pools."""

    DEVICE = "device"
    HOST = "host"
    FILE = "file"
    REMOTE = "remote"


@attrs.frozen(kw_only=True)
class TierCapabilities:
    """What a tier declares about itself.

    Attributes:
        device_accessible: kernels may read and write its pools directly (device memory,
            pinned device-mapped host memory). Such pools expose a base address; the others
            expose asynchronous ``read``/``write`` through staging buffers.
        medium: the backing medium.
        persistent: data survives the process (files, remote stores).
        shared: several processes or hosts may see the same data.
        file_mode: permission bits of files it creates (file tiers), else ``None``.
        dir_mode: permission bits of directories it creates (file tiers), else ``None``.
        keyed: the tier is a :class:`~kvcm_core.tier.KeyedTier`, addressed by block key
            (``put_many``/``get_many``/``exists_many``/``delete_many``) instead of slots.
        blobs: its storage pools store variable-size blobs by size
            (:class:`~kvcm_core.tier.BlobPool`), so a level on it may take a blob codec.
    """

    device_accessible: bool
    medium: Medium
    persistent: bool = False
    shared: bool = False
    file_mode: int | None = None
    dir_mode: int | None = None
    keyed: bool = False
    blobs: bool = False


@attrs.frozen(kw_only=True)
class KernelBackendCapabilities:
    """What a kernel backend declares.

    Attributes:
        has_device: runs on a real accelerator (asynchronous streams).
        host_mapped: can allocate pinned host memory that its kernels read and write.
        copy_engine: has a copy-engine path for ``copy_pages`` besides its gather kernel.
        compiles_sources: can compile and launch CUDA C source.
        run_copies: ``copy_pages`` costs per run of adjacent pages (a descriptor or a
            call each), so the core pairs a move's slots into runs first (two sorts per
            batch); False where a copy costs the same whatever the order (the numpy
            backend's host gather), and the core skips that pairing.
    """

    has_device: bool
    host_mapped: bool = True
    copy_engine: bool = False
    compiles_sources: bool = False
    run_copies: bool = True


class CodecKind(enum.Enum):
    """A page codec turns GPU pages into cold pages; a blob codec turns bytes into bytes."""

    PAGE = "page"
    BLOB = "blob"


@attrs.frozen(kw_only=True)
class CodecCapabilities:
    """What a codec declares.

    Attributes:
        kind: page or blob codec.
        lossless: decoding gives back exactly what was encoded.
        error_bound: lossy page codecs: largest error per value relative to the largest
            magnitude of its scale group (``BufferPlace.group_size``); else ``None``.
        checksummed: a blob codec that detects corruption (raises ``CorruptPageError``).
        codec_id: the codec's number in cold frames (u16, unique among installed codecs;
            ``raw`` is 0; built-in codecs use 0..255, third-party codecs 256 and above).
    """

    kind: CodecKind
    lossless: bool = True
    error_bound: float | None = None
    checksummed: bool = False
    codec_id: int = attrs.field(default=0)

    @codec_id.validator
    def _check_codec_id(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 16:
            raise ValueError(f"codec_id={value!r}: must be an int in 0..65535 (a u16)")


@attrs.frozen(kw_only=True)
class EvictionPolicyCapabilities:
    """What an eviction policy declares.

    Attributes:
        priorities: honours insertion priorities (0..100, lower is evicted first).
        max_priority: highest priority accepted.
        lru_order: inside one priority, keys are evicted least recently used first
            (insertion, ``touch`` and ``set_priority`` count as uses).
    """

    priorities: bool = True
    max_priority: int = 100
    lru_order: bool = False


@attrs.frozen(kw_only=True)
class PluginSpec:
    """Fields common to every plugin record."""

    name: str = attrs.field(validator=_check_name)
    factory: Callable[..., Any] = attrs.field(validator=attrs.validators.is_callable())
    description: str = ""
    options_type: type | None = None
    availability: Callable[[], Availability] = attrs.field(
        default=always_available, validator=attrs.validators.is_callable()
    )
    #: Conformance tests this plugin is known to fail: test name -> reason. They run as
    #: strict xfail, so a fixed gap is noticed.
    known_gaps: Mapping[str, str] = attrs.field(factory=dict)

    kind: str = attrs.field(default="plugin", init=False)


@attrs.frozen(kw_only=True)
class TierSpec(PluginSpec):
    """A storage tier: ``factory(backend, options) -> Tier``."""

    capabilities: TierCapabilities
    kind: str = attrs.field(default="tier", init=False)


@attrs.frozen(kw_only=True)
class KernelBackendSpec(PluginSpec):
    """A device runtime with kernels: ``factory(options) -> KernelBackend``.

    ``priority`` orders backends for ``kernel_backend="auto"`` (higher wins; GPU backends
    above numpy). Two available backends of equal top priority make ``auto`` refuse to
    guess.
    """

    capabilities: KernelBackendCapabilities
    priority: int = 0
    kind: str = attrs.field(default="kernel_backend", init=False)


@attrs.frozen(kw_only=True)
class CodecSpec(PluginSpec):
    """A codec: ``factory(options) -> PageCodec | BlobCodec`` as ``capabilities.kind`` says."""

    capabilities: CodecCapabilities
    kind: str = attrs.field(default="codec", init=False)


@attrs.frozen(kw_only=True)
class EvictionPolicySpec(PluginSpec):
    """An eviction ordering: ``factory(options) -> EvictionPolicy`` (one per level and pool
    group)."""

    capabilities: EvictionPolicyCapabilities = attrs.field(factory=EvictionPolicyCapabilities)
    kind: str = attrs.field(default="eviction_policy", init=False)
