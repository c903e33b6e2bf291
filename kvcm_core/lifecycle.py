"""Life cycles (cache groups): classes of pages allocated, kept and freed together.

Every buffer of size > 0 belongs to exactly one life cycle, identified by
``(sliding_window_size, num_sink_blocks, reuse_policy, sparse)`` for attention and
``(reuse_policy,)`` for SSM, where the policy is the buffer's *effective* policy. Life
cycles are numbered in a deterministic order: SSM first, then full attention, then
increasing window, then increasing sink count, then policy order, then dense before sparse.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from kvcm_core.config import AttentionLayerConfig, KVCacheManagerConfig, SsmLayerConfig
from kvcm_core.errors import ArgumentTypeError, ConfigError
from kvcm_core.types import CacheGroupId, ReusePolicy

__all__ = ["BufferKey", "LifeCycle", "LifeCycleRegistry"]

BufferKey = tuple[int, str]  # (layer_id, role)


@attrs.frozen
class LifeCycle:
    """One life cycle's identity and rules.

    Attributes:
        is_ssm: recurrent state (one live page per request) rather than attention.
        window: sliding window in tokens, ``None`` for full attention (and SSM).
        num_sink_blocks: ``ceil(num_sink_tokens / tokens_per_block)``.
        policy: the effective reuse policy shared by its buffers.
        sparse: buffers whose history lives in host memory (sparse attention).
    """

    is_ssm: bool
    window: int | None
    num_sink_blocks: int
    policy: ReusePolicy
    sparse: bool = False

    def sort_key(self) -> tuple[int, ...]:
        return (
            0 if self.is_ssm else 1,
            0 if self.window is None else 1,
            self.window or 0,
            self.num_sink_blocks,
            self.policy.order,
            int(self.sparse),
        )

    @property
    def is_windowed(self) -> bool:
        return self.window is not None

    def stale_range(self, history: int, tpb: int) -> tuple[int, int]:
        """Blocks ``[start, end)`` whose KV no read at position ``history`` needs."""
        if self.is_ssm:
            return 0, history // tpb
        if self.window is None:
            return 0, 0
        start = min(-(-history // tpb), self.num_sink_blocks)
        end = max(start, (history + 1 - self.window) // tpb)
        return start, end

    @property
    def publishes(self) -> bool:
        """Pages of this life cycle go into the prefix tree."""
        return self.policy is not ReusePolicy.PRIVATE

    @property
    def constrains(self) -> bool:
        """Some of its pages constrain a prefix match."""
        return self.policy in (ReusePolicy.REQUIRED, ReusePolicy.SINK_REQUIRED_ONLY)

    def constrains_block(self, block: int) -> bool:
        """Whether block ``block``'s page constrains a match (when it is needed at all)."""
        if self.policy is ReusePolicy.REQUIRED:
            return True
        if self.policy is ReusePolicy.SINK_REQUIRED_ONLY:
            return block < self.num_sink_blocks
        return False

    def describe(self) -> str:
        if self.is_ssm:
            kind = "ssm"
        elif self.window is None:
            kind = "full"
        else:
            kind = f"window={self.window},sinks={self.num_sink_blocks}b"
        return f"{kind}/{self.policy.name}{'/sparse' if self.sparse else ''}"


@attrs.frozen
class _BufferEntry:
    layer_id: int
    role: str
    size: int
    group: CacheGroupId


class LifeCycleRegistry:
    """Life cycles of one model, and which buffer belongs to which.

    Args:
        config: the manager configuration.
    """

    def __init__(self, config: KVCacheManagerConfig) -> None:
        tpb = config.tokens_per_block
        found: dict[LifeCycle, list[tuple[int, str, int]]] = {}
        self.layer_policies: dict[int, ReusePolicy] = {}
        #: ``(layer_id, role) -> (dtype, group_size, exact)``: what page codecs see.
        self.buffer_types: dict[BufferKey, tuple[str, int, bool]] = {}
        for layer in config.layers:
            self.layer_policies[layer.layer_id] = layer.reuse_policy
            for buf in layer.buffers:
                if buf.size == 0:
                    continue  # a zero-size buffer registers nothing
                policy = layer.effective_policy(buf)
                self.buffer_types[(layer.layer_id, buf.role)] = (
                    buf.dtype, buf.group_size, layer.effective_exact(buf))
                if isinstance(layer, SsmLayerConfig):
                    lc = LifeCycle(True, None, 0, policy)
                else:
                    assert isinstance(layer, AttentionLayerConfig)
                    lc = LifeCycle(
                        False,
                        layer.sliding_window_size,
                        -(-layer.num_sink_tokens // tpb),
                        policy,
                        buf.is_sparse,
                    )
                found.setdefault(lc, []).append((layer.layer_id, buf.role, buf.size))
        self.life_cycles: tuple[LifeCycle, ...] = tuple(sorted(found, key=LifeCycle.sort_key))
        self._buffers: dict[BufferKey, _BufferEntry] = {}
        self.members: dict[CacheGroupId, tuple[tuple[int, str, int], ...]] = {}
        for gid, lc in enumerate(self.life_cycles):
            group = CacheGroupId(gid)
            self.members[group] = tuple(found[lc])
            for layer_id, role, size in found[lc]:
                self._buffers[(layer_id, role)] = _BufferEntry(layer_id, role, size, group)
        self._layer_groups: dict[int, set[CacheGroupId]] = {}
        for (layer_id, _), entry in self._buffers.items():
            self._layer_groups.setdefault(layer_id, set()).add(entry.group)

    def __len__(self) -> int:
        return len(self.life_cycles)

    def __getitem__(self, group: int) -> LifeCycle:
        return self.life_cycles[group]

    @property
    def buffer_grouping(self) -> Mapping[BufferKey, CacheGroupId]:
        """``(layer_id, role) -> cache group`` for every buffer of size > 0."""
        return {k: e.group for k, e in self._buffers.items()}

    def get_buffer_group_id(self, layer_id: int, role: str) -> CacheGroupId:
        layer_id = _layer_id(layer_id)
        if not isinstance(role, str):
            raise ArgumentTypeError(f"role={role!r}: must be a buffer role (a str)")
        entry = self._buffers.get((layer_id, role))
        if entry is None:
            raise KeyErrorAsConfig.buffer(layer_id, role, self._buffers)
        return entry.group

    def get_layer_group_id(self, layer_id: int) -> CacheGroupId:
        layer_id = _layer_id(layer_id)
        groups = self._layer_groups.get(layer_id)
        if not groups:
            raise ConfigError(
                "layer_id", layer_id,
                "no buffer of size > 0 in this layer (or no such layer); known layers: "
                + ", ".join(map(str, sorted(self._layer_groups))),
            )
        if len(groups) > 1:
            raise ConfigError(
                "layer_id", layer_id,
                f"this layer's buffers fall into several cache groups {sorted(groups)} "
                "(a split layer); use get_buffer_group_id(layer_id, role)",
            )
        return next(iter(groups))

    @property
    def layer_grouping(self) -> Mapping[int, CacheGroupId]:
        """``layer_id -> cache group``; raises for split layers (see buffer_grouping)."""
        return {layer: self.get_layer_group_id(layer) for layer in sorted(self._layer_groups)}

    def buffer_size(self, layer_id: int, role: str) -> int:
        self.get_buffer_group_id(layer_id, role)
        return self._buffers[(layer_id, role)].size


class KeyErrorAsConfig:
    """Builds the error for an unknown buffer (never a bare KeyError)."""

    @staticmethod
    def buffer(layer_id: int, role: str, known: Mapping[BufferKey, object]) -> ConfigError:
        roles = sorted(r for (lid, r) in known if lid == layer_id)
        if roles:
            rule = f"layer {layer_id} has no buffer of size > 0 with this role; roles: {roles}"
        else:
            rule = f"no layer {layer_id} with buffers of size > 0"
        return ConfigError("(layer_id, role)", (layer_id, role), rule)


def _layer_id(layer_id: object) -> int:
    """A layer id argument as an int (NumPy integers too), or the typed error naming it."""
    if isinstance(layer_id, bool) or not isinstance(layer_id, int | np.integer):
        raise ArgumentTypeError(f"layer_id={layer_id!r}: must be an int")
    return int(layer_id)
