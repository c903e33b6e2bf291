"""Configuration as frozen attrs values, built in Python, from a dict or from TOML.

Every rule that can be checked before running is checked on construction and raises
:class:`~kvcm_core.errors.ConfigError` naming the field, the value and the rule. Rules that
need the installed plugins (tier media, codec names) are checked when the manager is built.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

from kvcm_core.errors import ConfigError
from kvcm_core.types import ReusePolicy
from kvcm_core.units import parse_size

__all__ = [
    "DEFAULT_WRITE_QUEUE_DEPTH",
    "DTYPES",
    "DTYPE_SIZES",
    "NONE_SPELLING",
    "AttentionLayerConfig",
    "BufferConfig",
    "KVCacheManagerConfig",
    "LayerConfig",
    "LevelConfig",
    "SparseConfig",
    "SsmLayerConfig",
    "SwaScratchConfig",
]

T = TypeVar("T")


# -- field validators -------------------------------------------------------------------


def _where(inst: object, attr: attrs.Attribute[Any]) -> str:
    # Top-level fields are named bare ("tokens_per_block"), as in a TOML file; nested
    # records by class, which from_dict re-anchors to their place ("levels[1].quota").
    if isinstance(inst, KVCacheManagerConfig):
        return attr.name
    return f"{type(inst).__name__}.{attr.name}"


def _plain_int(value: Any) -> Any:
    """An integer of another type (a NumPy integer: engines compute sizes with NumPy) as an
    int; anything else as given, for the validator to judge (a bool stays a bool)."""
    if not isinstance(value, int) and isinstance(value, numbers.Integral):
        return int(value)
    return value


def _int(minimum: int | None = None, *, optional: bool = False) -> Callable[..., None]:
    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(_where(inst, attr), value, "must be an int")
        if minimum is not None and value < minimum:
            raise ConfigError(_where(inst, attr), value, f"must be >= {minimum}")

    return check


def _bool(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(_where(inst, attr), value, "must be true or false")


def _str(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(_where(inst, attr), value, "must be a non-empty string")


_PLUGIN_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]{0,63}$")


def _plugin_name(optional: bool = False) -> Callable[..., None]:
    """A plugin name as records accept it; whether it is installed is checked later."""

    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, str) or not _PLUGIN_NAME_RE.match(value):
            raise ConfigError(
                _where(inst, attr),
                value,
                "must be a plugin name: lower case letters, digits, '_' or '-', starting "
                "with a letter (see `kvcm plugins`)",
            )

    return check


def _policy(optional: bool) -> Callable[..., None]:
    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, ReusePolicy):
            allowed = ", ".join(p.name for p in ReusePolicy)
            raise ConfigError(_where(inst, attr), value, f"must be a ReusePolicy ({allowed})")

    return check


def _to_policy(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return ReusePolicy[value.strip().upper()]
        except KeyError:
            return value  # the validator reports it
    return value


def _to_size(value: Any, field: str) -> Any:
    if value is None:
        return None
    try:
        return parse_size(value, field)
    except ConfigError:
        return value  # the validator reports it, naming the field


def _buffer_size(value: Any) -> Any:
    return _to_size(value, "BufferConfig.size")


def _quota(value: Any) -> Any:
    return _to_size(value, "LevelConfig.quota")


def _sparse_quota(value: Any) -> Any:
    return _to_size(value, "sparse_host_quota")


def _size(minimum: int, *, optional: bool = False) -> Callable[..., None]:
    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        # Raises with the size rule for a value that is not a size, or is one above
        # 8 EiB (an int the converter left as given).
        parse_size(value, _where(inst, attr))
        if value < minimum:
            raise ConfigError(_where(inst, attr), value, f"must be >= {minimum} bytes")

    return check


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


#: Element types a buffer may declare, with their size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "bytes": 1, "bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "int8": 1,
}
DTYPES = tuple(DTYPE_SIZES)


def _dtype(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value not in DTYPE_SIZES:
        raise ConfigError(_where(inst, attr), value, f"must be one of {', '.join(DTYPES)}")


def _optional_bool(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _bool(inst, attr, value)


# -- leaf records -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class BufferConfig:
    """One buffer of a layer: ``size`` bytes per block (a page).

    Attributes:
        role: unique within its layer (``"key"``, ``"value"``, ``"ssm_state"``...).
        size: bytes one block needs (0: the buffer does not exist).
        reuse_policy: overrides the layer's default; ``None`` inherits it.
        is_sparse: the buffer's history lives in host memory (sparse attention).
        dtype: element type of the page (:data:`DTYPES`); ``"bytes"``: opaque.
        group_size: values per scale group of lossy page codecs.
        exact: never encoded lossily (cold pages hold its bytes unchanged); ``None``:
            True for SSM state and for ``"bytes"`` buffers, else False
            (``LayerConfig.effective_exact``).
    """

    role: str = attrs.field(validator=_str)
    size: int = attrs.field(converter=_buffer_size, validator=_size(0))
    reuse_policy: ReusePolicy | None = attrs.field(
        default=None, converter=_to_policy, validator=_policy(optional=True)
    )
    is_sparse: bool = attrs.field(default=False, validator=_bool)
    dtype: str = attrs.field(default="bytes", validator=_dtype)
    group_size: int = attrs.field(converter=_plain_int, default=128, validator=_int(1))
    exact: bool | None = attrs.field(default=None, validator=_optional_bool)

    def __attrs_post_init__(self) -> None:
        item = DTYPE_SIZES[self.dtype]
        if self.size % item:
            raise ConfigError(
                "BufferConfig.size", self.size,
                f"must be a whole number of {self.dtype} elements ({item} bytes each)")


def _pow2(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    _int(1)(inst, attr, value)
    if not _is_pow2(value):
        raise ConfigError(_where(inst, attr), value, "must be a power of two")


def _selection_id(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ConfigError(
            _where(inst, attr), value, "must be a non-empty string, an int, or None (no sharing)"
        )


@attrs.frozen(kw_only=True)
class SparseConfig:
    """Sparse attention of one layer.

    Attributes:
        unit_tokens: tokens per unit (power of two dividing ``tokens_per_block``).
        num_selected: units the indexer selects per step.
        working_set_units: units each request keeps on the GPU (>= ``num_selected``).
        selection_id: layers with the same id share one selection; ``None`` never shares.
    """

    unit_tokens: int = attrs.field(converter=_plain_int, validator=_pow2)
    num_selected: int = attrs.field(converter=_plain_int, validator=_int(1))
    working_set_units: int = attrs.field(converter=_plain_int, validator=_int(1))
    selection_id: str | int | None = attrs.field(default=None, validator=_selection_id)

    def __attrs_post_init__(self) -> None:
        if self.working_set_units < self.num_selected:
            raise ConfigError(
                "SparseConfig.working_set_units",
                self.working_set_units,
                f"must be >= num_selected ({self.num_selected})",
            )


def _buffers(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not value:
        raise ConfigError(_where(inst, attr), value, "must be a non-empty list of BufferConfig")
    seen: set[str] = set()
    for i, buf in enumerate(value):
        if not isinstance(buf, BufferConfig):
            raise ConfigError(f"{_where(inst, attr)}[{i}]", buf, "must be a BufferConfig")
        if buf.role in seen:
            raise ConfigError(
                f"{_where(inst, attr)}[{i}].role", buf.role, "roles must be unique in a layer"
            )
        seen.add(buf.role)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


@attrs.frozen(kw_only=True)
class AttentionLayerConfig:
    """An attention layer: full (``sliding_window_size=None``) or windowed, with sinks.

    Attributes:
        layer_id: unique across the model.
        buffers: the layer's buffers (K, V, scales, indexer keys ...).
        sliding_window_size: tokens in the window, or ``None`` for full attention.
        num_sink_tokens: leading tokens always kept (needs a window).
        reuse_policy: default policy of the layer's buffers.
        sparse: sparse attention settings, or ``None``.
    """

    layer_id: int = attrs.field(converter=_plain_int, validator=_int(0))
    buffers: tuple[BufferConfig, ...] = attrs.field(converter=_tuple, validator=_buffers)
    sliding_window_size: int | None = attrs.field(converter=_plain_int, default=None,
                                                  validator=_int(1, optional=True))
    num_sink_tokens: int = attrs.field(converter=_plain_int, default=0, validator=_int(0))
    reuse_policy: ReusePolicy = attrs.field(
        default=ReusePolicy.REQUIRED, converter=_to_policy, validator=_policy(optional=False)
    )
    sparse: SparseConfig | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        where = f"AttentionLayerConfig(layer_id={self.layer_id})"
        if self.num_sink_tokens and self.sliding_window_size is None:
            raise ConfigError(
                f"{where}.num_sink_tokens",
                self.num_sink_tokens,
                "sink tokens need a sliding window (full attention keeps every token)",
            )
        if self.sparse is not None and not isinstance(self.sparse, SparseConfig):
            raise ConfigError(f"{where}.sparse", self.sparse, "must be a SparseConfig or None")
        for i, buf in enumerate(self.buffers):
            policy = self.effective_policy(buf)
            if policy is ReusePolicy.SINK_REQUIRED_ONLY and (
                self.sliding_window_size is None or self.num_sink_tokens == 0
            ):
                raise ConfigError(
                    f"{where}.buffers[{i}].reuse_policy",
                    policy,
                    "SINK_REQUIRED_ONLY needs a sliding window with sink tokens",
                )
            if buf.is_sparse and self.sparse is None:
                raise ConfigError(
                    f"{where}.buffers[{i}].is_sparse",
                    True,
                    "sparse buffers need the layer's sparse=SparseConfig(...)",
                )
        if self.sparse is not None and not any(b.is_sparse for b in self.buffers):
            raise ConfigError(
                f"{where}.sparse", self.sparse, "a sparse layer needs at least one sparse buffer"
            )

    def effective_policy(self, buffer: BufferConfig) -> ReusePolicy:
        """The buffer's own policy, or the layer's when it has none."""
        return buffer.reuse_policy or self.reuse_policy

    def effective_exact(self, buffer: BufferConfig) -> bool:
        """The buffer's ``exact``, or by default: True for ``"bytes"`` buffers."""
        return buffer.exact if buffer.exact is not None else buffer.dtype == "bytes"


@attrs.frozen(kw_only=True)
class SsmLayerConfig:
    """A recurrent-state layer (Mamba-style): one state page per request and beam."""

    layer_id: int = attrs.field(converter=_plain_int, validator=_int(0))
    buffers: tuple[BufferConfig, ...] = attrs.field(converter=_tuple, validator=_buffers)
    reuse_policy: ReusePolicy = attrs.field(
        default=ReusePolicy.REQUIRED, converter=_to_policy, validator=_policy(optional=False)
    )

    def __attrs_post_init__(self) -> None:
        where = f"SsmLayerConfig(layer_id={self.layer_id})"
        if self.reuse_policy is ReusePolicy.SINK_REQUIRED_ONLY:
            raise ConfigError(
                f"{where}.reuse_policy",
                self.reuse_policy,
                "SINK_REQUIRED_ONLY is for windowed attention; SSM layers cannot use it",
            )
        for i, buf in enumerate(self.buffers):
            if buf.reuse_policy is ReusePolicy.SINK_REQUIRED_ONLY:
                raise ConfigError(
                    f"{where}.buffers[{i}].reuse_policy",
                    buf.reuse_policy,
                    "SINK_REQUIRED_ONLY is for windowed attention; SSM buffers cannot use it",
                )
            if buf.is_sparse:
                raise ConfigError(
                    f"{where}.buffers[{i}].is_sparse", True, "SSM buffers cannot be sparse"
                )

    def effective_policy(self, buffer: BufferConfig) -> ReusePolicy:
        """The buffer's own policy, or the layer's when it has none."""
        return buffer.reuse_policy or self.reuse_policy

    def effective_exact(self, buffer: BufferConfig) -> bool:
        """The buffer's ``exact``, or by default True (SSM state is never encoded lossily)."""
        return buffer.exact if buffer.exact is not None else True


LayerConfig = AttentionLayerConfig | SsmLayerConfig


def _to_options(value: Any) -> Any:
    # Plain data (tuples become lists) so that a config equals its to_dict() round trip.
    return _plain(value) if isinstance(value, Mapping) else value


def _options(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(_where(inst, attr), value, "must be a mapping with string keys")


#: How a ``None`` that is not a field's default is written in TOML (which has no null) and
#: by ``to_dict``: ``io_deadline_s = "none"``.
NONE_SPELLING = "none"


def _to_deadline(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == NONE_SPELLING:
        return None
    return value  # the validator judges it


def _deadline(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not 0 < value <= 3600 or value != value:
        raise ConfigError(_where(inst, attr), value,
                          "must be a number of seconds in (0, 3600], or None (no deadline; "
                          f"{NONE_SPELLING!r} in TOML)")


#: Background write batches a storage level keeps in flight unless told otherwise.
DEFAULT_WRITE_QUEUE_DEPTH = 8
#: Bytes of small background writes a storage level holds back, to write them as one,
#: unless told otherwise.
DEFAULT_WRITE_COMBINE_BYTES = 1 << 20


@attrs.frozen(kw_only=True)
class LevelConfig:
    """One storage level, warm to cold.

    Attributes:
        tier: the tier plugin's name (``"gpu"``, ``"host"``, ``"disk"``...).
        quota: bytes (int) or a size such as ``"8GiB"``.
        codec: page codec of a cold level (``None``: the lossless ``"raw"``); cold levels
            may use different codecs (moves between them transcode).
        blob_codec: lossless blob codec (e.g. ``"zstd"``) applied to the cold pages of a
            tier that stores blobs by size; ``None``: none.
        options: passed to the tier's factory (e.g. ``{"path": ...}`` for disk).
        io_deadline_s: seconds every read or write batch of a storage level (disk, or
            any tier whose pools are not device memory) may take, default 5.0 (a keyed
            remote level such as ``redis`` refuses it and the two settings below: its
            deadlines are its ``options``, see docs/remote.md). Its
            I/O runs on one thread of its own; a write past the deadline is dropped (the
            block is not cached on this level), a read past it loses the blocks (they
            leave the prefix tree; a ``resume`` that needed them raises ``TierIOError``).
            ``None`` (``"none"`` in TOML, which has no null; ``to_dict`` writes it so):
            no deadline, I/O on the scheduler thread (a frozen file system then stalls
            every request). Ignored on device-accessible levels (no I/O).
        write_queue_depth: storage write batches that may be in flight in the
            background. ``None`` (the default): :data:`DEFAULT_WRITE_QUEUE_DEPTH` on a
            level with an I/O thread, ``0`` without one. With ``N > 0`` a write's rows
            are copied into a bounded queue of ``N`` batches and the step goes on; a
            write that later fails makes its blocks unreadable (a read of them is a lost
            block, never wrong KV). When the queue is full, victims that are only cached
            copies are dropped at once rather than offloaded (nothing waits for the
            level), while held pages (a suspended request's) wait for the oldest write,
            within the deadline. ``0``: each write completes before the step goes on.
            ``N > 0`` needs ``io_deadline_s``.
        write_combine_bytes: background writes (of droppable pages) smaller than this
            are held back, their rows copied, until this many bytes are held; then each
            pool's held writes go out as one write: one hand-over to the I/O threads
            instead of one per eviction, which is most of a small write's cost. ``None``
            (the default): :data:`DEFAULT_WRITE_COMBINE_BYTES` (1 MiB) where there are
            background writes, ``0`` elsewhere; ``0``: each write on its own. A read of
            held blocks only is served from the held rows; a read of held and other
            blocks, any write that is not held, a resize or a close writes what is held
            first, so nothing reads stale bytes. The held rows are host memory on top of
            the levels' quotas (a buffer of twice this per pool). ``N > 0`` needs
            background writes.
        evict_ahead: pages a level that has a level below moves down beyond those it
            needs whenever it must make room (per pool group), so that the next small
            allocations find free slots and pages go down in fewer, larger batches (one
            move's fixed cost, and one write to a storage level, for several requests).
            It costs at most that many slots of cached blocks. ``None`` (the default):
            1/256 of the level's slots, at most 32 (none below 256 slots); ``0``: only
            what is needed. Ignored on the last level, whose victims are dropped, never
            ahead of need.
    """

    tier: str = attrs.field(validator=_plugin_name())
    quota: int = attrs.field(converter=_quota, validator=_size(1))
    codec: str | None = attrs.field(default=None, validator=_plugin_name(optional=True))
    blob_codec: str | None = attrs.field(default=None, validator=_plugin_name(optional=True))
    options: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_to_options, validator=_options
    )
    io_deadline_s: float | None = attrs.field(default=5.0, converter=_to_deadline,
                                              validator=_deadline)
    write_queue_depth: int | None = attrs.field(default=None,
                                                validator=_int(0, optional=True))
    write_combine_bytes: int | None = attrs.field(default=None,
                                                  validator=_int(0, optional=True))
    evict_ahead: int | None = attrs.field(default=None, validator=_int(0, optional=True))

    def __attrs_post_init__(self) -> None:
        if self.write_queue_depth and self.io_deadline_s is None:
            raise ConfigError("LevelConfig.write_queue_depth", self.write_queue_depth,
                              "background writes need io_deadline_s (an I/O thread)")
        if self.write_combine_bytes and not self.background_write_depth:
            raise ConfigError("LevelConfig.write_combine_bytes", self.write_combine_bytes,
                              "combining needs background writes (io_deadline_s and a "
                              "write_queue_depth above 0)")

    @property
    def background_write_depth(self) -> int:
        """The write queue's depth in effect: ``write_queue_depth``, or its default."""
        if self.write_queue_depth is not None:
            return self.write_queue_depth
        return DEFAULT_WRITE_QUEUE_DEPTH if self.io_deadline_s is not None else 0

    @property
    def background_combine_bytes(self) -> int:
        """The held-back bytes in effect: ``write_combine_bytes``, or its default."""
        if self.write_combine_bytes is not None:
            return self.write_combine_bytes
        return DEFAULT_WRITE_COMBINE_BYTES if self.background_write_depth else 0


@attrs.frozen(kw_only=True)
class SwaScratchConfig:
    """SWA scratch pages for chunked prefill (docs/semantics.md).

    Attributes:
        scratch_pages_per_block: sub-pages per block in a scratch slot (power of two).
        max_scratch_slots: scratch slots a request may use at once.
    """

    scratch_pages_per_block: int = attrs.field(converter=_plain_int, validator=_pow2)
    max_scratch_slots: int = attrs.field(converter=_plain_int, default=4, validator=_int(1))


def _layers(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not value:
        raise ConfigError("layers", value, "must be a non-empty list of layer configs")
    seen: set[int] = set()
    for i, layer in enumerate(value):
        if not isinstance(layer, AttentionLayerConfig | SsmLayerConfig):
            raise ConfigError(
                f"layers[{i}]", layer, "must be an AttentionLayerConfig or SsmLayerConfig"
            )
        if layer.layer_id in seen:
            raise ConfigError(f"layers[{i}].layer_id", layer.layer_id, "layer ids must be unique")
        seen.add(layer.layer_id)


def _levels(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not value:
        raise ConfigError("levels", value, "must be a non-empty list of LevelConfig")
    for i, level in enumerate(value):
        if not isinstance(level, LevelConfig):
            raise ConfigError(f"levels[{i}]", level, "must be a LevelConfig")
    if value[0].codec is not None:
        raise ConfigError(
            "levels[0].codec", value[0].codec, "level 0 holds GPU pages and takes no codec"
        )
    if value[0].blob_codec is not None:
        raise ConfigError(
            "levels[0].blob_codec", value[0].blob_codec,
            "level 0 holds GPU pages and takes no blob codec"
        )


def _unit_interval(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(attr.name, value, "must be a number in (0, 1]")


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The tables of a TOML file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, is not TOML, nests too
            deeply or holds a number too long to be read (each named, with the file).
    """
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("toml", str(path), f"is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("toml", str(path), f"is not UTF-8 text (byte {exc.start}): a "
                                             "TOML file must be UTF-8") from None
    except RecursionError:
        raise ConfigError("toml", str(path), "nests arrays or tables too deeply to be "
                                             "read") from None
    except ValueError as exc:  # a number of more digits than Python converts (4300)
        raise ConfigError("toml", str(path), f"cannot be read: {exc}") from None
    except OSError as exc:
        raise ConfigError("toml", str(path), f"cannot be read: {exc.strerror or exc}") \
            from exc


@attrs.frozen(kw_only=True)
class KVCacheManagerConfig:
    """Everything a :class:`~kvcm_core.KVCacheManager` needs.

    Attributes:
        tokens_per_block: tokens per block, a power of two (e.g. 16, 32, 64).
        layers: the model's layers.
        levels: storage levels, warm to cold; level 0 must be device memory.
        kernel_backend: ``"auto"`` or a backend name (env ``KVCM_KERNEL_BACKEND``).
        eviction_policy: eviction policy plugin used on every level.
        max_util_for_resume: ``resume`` refuses when GPU utilisation would exceed this.
        enable_partial_reuse: reuse the best partial block after the full-block walk.
        reuse_match_backoff: tokens trimmed from every match (then re-pruned).
        commit_min_snapshot: keep an SSM snapshot at each committed endpoint.
        max_rewind_len: tokens ``resize`` may rewind history by.
        max_beam_width: widest beam a request may use.
        swa_scratch: SWA scratch pages for chunked prefill, or ``None``.
        sparse_host_quota: host bytes for sparse pools (needed with sparse buffers).
        pool_group_ratios: share of each level's quota per pool group (by pool group
            index), or ``None`` to split by bytes per block.
        check_thread: refuse (``InvalidStateError``) a mutating call from a thread other
            than the one driving the manager (see ``KVCacheManager.bind_thread``).
    """

    tokens_per_block: int = attrs.field(converter=_plain_int, validator=_pow2)
    layers: tuple[LayerConfig, ...] = attrs.field(converter=_tuple, validator=_layers)
    levels: tuple[LevelConfig, ...] = attrs.field(converter=_tuple, validator=_levels)
    kernel_backend: str = attrs.field(default="auto", validator=_plugin_name())
    eviction_policy: str = attrs.field(default="lru", validator=_plugin_name())
    max_util_for_resume: float = attrs.field(default=0.97, validator=_unit_interval)
    enable_partial_reuse: bool = attrs.field(default=True, validator=_bool)
    reuse_match_backoff: int = attrs.field(converter=_plain_int, default=0, validator=_int(0))
    commit_min_snapshot: bool = attrs.field(default=False, validator=_bool)
    max_rewind_len: int = attrs.field(converter=_plain_int, default=0, validator=_int(0))
    max_beam_width: int = attrs.field(converter=_plain_int, default=1, validator=_int(1))
    swa_scratch: SwaScratchConfig | None = attrs.field(default=None)
    sparse_host_quota: int | None = attrs.field(
        default=None, converter=_sparse_quota, validator=_size(1, optional=True)
    )
    pool_group_ratios: tuple[float, ...] | None = attrs.field(default=None, converter=_tuple)
    check_thread: bool = attrs.field(default=True, validator=_bool)

    def __attrs_post_init__(self) -> None:
        tpb = self.tokens_per_block
        if tpb > 65536:
            raise ConfigError("tokens_per_block", tpb, "must be <= 65536")
        if self.swa_scratch is not None:
            if not isinstance(self.swa_scratch, SwaScratchConfig):
                raise ConfigError("swa_scratch", self.swa_scratch, "must be a SwaScratchConfig")
            if self.swa_scratch.scratch_pages_per_block > tpb:
                raise ConfigError(
                    "swa_scratch.scratch_pages_per_block",
                    self.swa_scratch.scratch_pages_per_block,
                    f"must be <= tokens_per_block ({tpb})",
                )
            if not any(
                isinstance(layer, AttentionLayerConfig) and layer.sliding_window_size is not None
                for layer in self.layers
            ):
                raise ConfigError(
                    "swa_scratch",
                    self.swa_scratch,
                    "SWA scratch pages serve sliding-window layers; the model has none",
                )
        if self.pool_group_ratios is not None:
            ratios = self.pool_group_ratios
            if (
                not isinstance(ratios, tuple)
                or not ratios
                or not all(
                    isinstance(r, int | float)
                    and not isinstance(r, bool)
                    and r > 0
                    and math.isfinite(r)
                    for r in ratios
                )
            ):
                raise ConfigError(
                    "pool_group_ratios", ratios, "must be a non-empty list of numbers > 0"
                )
        if all(b.size == 0 for layer in self.layers for b in layer.buffers):
            raise ConfigError(
                "layers",
                [layer.layer_id for layer in self.layers],
                "every buffer has size 0; at least one buffer needs size > 0",
            )
        self._check_sparse()

    def _check_sparse(self) -> None:
        tpb = self.tokens_per_block
        # selection id -> (layer index, sparse settings, life cycle of its sparse buffers)
        selections: dict[object, tuple[int, tuple[int, int, int], tuple[Any, ...]]] = {}
        any_sparse = False
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, AttentionLayerConfig) or layer.sparse is None:
                continue
            sp = layer.sparse
            any_sparse = True
            if tpb % sp.unit_tokens:
                raise ConfigError(
                    f"layers[{i}].sparse.unit_tokens",
                    sp.unit_tokens,
                    f"must divide tokens_per_block ({tpb})",
                )
            units_per_page = tpb // sp.unit_tokens
            policies = set()
            for j, buf in enumerate(layer.buffers):
                if not buf.is_sparse:
                    continue
                if buf.size % units_per_page:
                    raise ConfigError(
                        f"layers[{i}].buffers[{j}].size",
                        buf.size,
                        "a sparse buffer's size must be a multiple of units per page "
                        f"(tokens_per_block // unit_tokens = {units_per_page})",
                    )
                policies.add(layer.effective_policy(buf))
                if len(policies) > 1:
                    raise ConfigError(
                        f"layers[{i}].buffers[{j}].reuse_policy",
                        layer.effective_policy(buf),
                        "the sparse buffers of a layer share one selection, so they must "
                        "share one life cycle (one effective reuse policy)",
                    )
            # Life cycle identity: window, sink blocks, policy.
            cycle = (
                layer.sliding_window_size,
                -(-layer.num_sink_tokens // tpb),
                policies.pop() if policies else None,
            )
            settings = (sp.unit_tokens, sp.num_selected, sp.working_set_units)
            if sp.selection_id is None:
                continue  # silence is never shared
            if sp.selection_id not in selections:
                selections[sp.selection_id] = (i, settings, cycle)
                continue
            j, other_settings, other_cycle = selections[sp.selection_id]
            if settings != other_settings:
                raise ConfigError(
                    f"layers[{i}].sparse.selection_id",
                    sp.selection_id,
                    f"layers sharing a selection must agree with layers[{j}] on "
                    f"(unit_tokens, num_selected, working_set_units): {settings} != "
                    f"{other_settings}",
                )
            if cycle != other_cycle:
                raise ConfigError(
                    f"layers[{i}].sparse.selection_id",
                    sp.selection_id,
                    f"layers sharing a selection must be in one life cycle with layers[{j}] "
                    "(same sliding window, sink blocks and reuse policy of sparse buffers)",
                )
        if any_sparse and self.sparse_host_quota is None:
            raise ConfigError(
                "sparse_host_quota",
                None,
                "sparse buffers need a host quota for their pools (e.g. '16GiB')",
            )

    # -- named constructors ------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCacheManagerConfig:
        """Build from plain data (as read from TOML or JSON); unknown keys are rejected.

        Layers are tables with ``type = "attention"`` (default) or ``"ssm"``; policies are
        names (``"optional"``); sizes may be strings (``"8GiB"``). Errors name the field by
        its place in the document (``"layers[2].buffers[0].size"``).

        Args:
            data: a mapping with the fields of :class:`KVCacheManagerConfig`.

        Raises:
            ConfigError: naming the field, the value and the rule broken.
        """
        raw = _check_keys(data, cls, "")
        raw["layers"] = [
            _layer_from_dict(x, f"layers[{i}]")
            for i, x in enumerate(_list(raw["layers"], "layers"))
        ]
        raw["levels"] = [
            _build(LevelConfig, x, f"levels[{i}]")
            for i, x in enumerate(_list(raw["levels"], "levels"))
        ]
        if raw.get("swa_scratch") is not None:
            raw["swa_scratch"] = _build(SwaScratchConfig, raw["swa_scratch"], "swa_scratch")
        return cls(**raw)

    @classmethod
    def from_toml(cls, path: str | Path) -> KVCacheManagerConfig:
        """Read a TOML file: its top-level table, or its ``[kvcm]`` table if that is all.

        Args:
            path: the file to read.

        Raises:
            ConfigError: the file cannot be read, is not TOML, or breaks a rule.
        """
        if not isinstance(path, str | os.PathLike):
            raise ConfigError("toml", path, "must be a path to a TOML file (a str or Path)")
        data = read_toml(path)
        if "kvcm" in data and isinstance(data["kvcm"], dict) and len(data) == 1:
            data = data["kvcm"]
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float, bool) that :meth:`from_dict` reads
        back to an equal config; fields left at ``None`` are omitted, so it can be written
        as JSON or TOML, and a ``None`` that is not the field's default (``io_deadline_s``)
        is written ``"none"`` (:data:`NONE_SPELLING`)."""
        return _plain(self)


def _plain(value: Any) -> Any:
    """JSON/TOML-friendly data of a config record (lists, not tuples; no ``None`` fields)."""
    if attrs.has(type(value)):
        out: dict[str, Any] = {}
        if isinstance(value, AttentionLayerConfig | SsmLayerConfig):
            out["type"] = "ssm" if isinstance(value, SsmLayerConfig) else "attention"
        for field in attrs.fields(type(value)):
            item = getattr(value, field.name)
            if field.init and item is not None:
                out[field.name] = _plain(item)
            elif field.init and field.default is not None:
                # (omitted, it would read back as the default: TOML has no null)
                out[field.name] = NONE_SPELLING
        return out
    if isinstance(value, ReusePolicy):
        return value.name.lower()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ConfigError(field, value, "must be a list")
    return list(value)


def _check_keys(data: Any, cls: type, where: str) -> dict[str, Any]:
    """``data`` as a dict after refusing unknown keys and reporting missing required ones."""
    label = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(label, data, f"must be a table of {cls.__name__} fields")
    fields = [a for a in attrs.fields(cls) if a.init]
    names = {a.alias for a in fields}
    for key in data:
        if key not in names:
            raise ConfigError(
                f"{where}.{key}" if where else str(key),
                data[key],
                f"unknown key for {cls.__name__}; allowed: {', '.join(sorted(names))}",
            )
    for a in fields:
        if a.default is attrs.NOTHING and a.alias not in data:
            raise ConfigError(
                f"{where}.{a.alias}" if where else a.alias,
                None,
                f"is required by {cls.__name__}",
            )
    return dict(data)


def _build(cls: type[T], data: Any, where: str) -> T:
    raw = _check_keys(data, cls, where)
    try:
        return cls(**raw)
    except ConfigError as exc:
        # Re-anchor the field at its place in the document.
        field = exc.field.split(".", 1)[1] if "." in exc.field else exc.field
        raise ConfigError(f"{where}.{field}", exc.value, exc.rule) from None


def _layer_from_dict(data: Any, where: str) -> LayerConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(where, data, "must be a table describing a layer")
    raw = dict(data)
    kind = raw.pop("type", "attention")
    if kind not in ("attention", "ssm"):
        raise ConfigError(f"{where}.type", kind, "must be 'attention' or 'ssm'")
    cls: type[LayerConfig] = AttentionLayerConfig if kind == "attention" else SsmLayerConfig
    raw = _check_keys(raw, cls, where)
    raw["buffers"] = [
        _build(BufferConfig, b, f"{where}.buffers[{j}]")
        for j, b in enumerate(_list(raw["buffers"], f"{where}.buffers"))
    ]
    if raw.get("sparse") is not None:
        raw["sparse"] = _build(SparseConfig, raw["sparse"], f"{where}.sparse")
    return _build(cls, raw, where)
