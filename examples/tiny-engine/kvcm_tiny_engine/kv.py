"""kvcm's side of the model: its configuration, and the model's K/V in kvcm's pages.

- :func:`kvcm_config` declares the model's layers to kvcm: a ``key`` and a ``value`` buffer
  per layer, each page holding ``tokens_per_block`` tokens of ``[kv_heads, head_dim]``
  float32 (``BufferConfig.size`` is bytes per page); windowed layers carry their window and
  sinks, so kvcm releases their stale pages and reuses them by its own rules.
- :class:`PagedKV` views every buffer's level-0 pool as ``[slots, tokens_per_block,
  kv_heads, head_dim]`` float32, zero-copy, and turns a request's page table (slot ids per
  block) into the slots and rows where this step's K/V go and the pages the queries read.
- :func:`make_manager` builds the manager with an event sink that counts pages moved
  between levels (how the run shows pages brought back from disk).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_core import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BlockEvent,
    BufferConfig,
    ConfigError,
    EventKind,
    EventSink,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmPluginManager,
    LevelConfig,
    hookimpl,
)
from kvcm_tiny_engine.model import ModelConfig
from kvcm_tiny_engine.ops import F32, Ops

__all__ = ["LevelMoves", "PagedKV", "StepTables", "kvcm_config", "kvcm_layers", "make_manager"]

ROLES = ("key", "value")


def page_bytes(model: ModelConfig, tokens_per_block: int) -> int:
    """Bytes of one K (or V) page: ``tokens_per_block x kv_heads x head_dim`` float32."""
    return tokens_per_block * model.num_kv_heads * model.head_dim * F32


def kvcm_layers(model: ModelConfig, tokens_per_block: int) -> list[AttentionLayerConfig]:
    """One kvcm attention layer per model layer, with the model's window and sinks."""
    size = page_bytes(model, tokens_per_block)
    layers = []
    for i in range(model.num_layers):
        window = model.window_of(i)
        layers.append(AttentionLayerConfig(
            layer_id=i, buffers=[BufferConfig(role=r, size=size) for r in ROLES],
            sliding_window_size=window,
            num_sink_tokens=model.sink_tokens if window is not None else 0))
    return layers


def kvcm_config(model: ModelConfig, *, tokens_per_block: int = 8,
                levels: Sequence[LevelConfig], kernel_backend: str = "numpy",
                **kw: Any) -> KVCacheManagerConfig:
    """The manager configuration for ``model`` on ``levels`` (warm to cold)."""
    return KVCacheManagerConfig(tokens_per_block=tokens_per_block,
                                layers=kvcm_layers(model, tokens_per_block),
                                levels=list(levels), kernel_backend=kernel_backend, **kw)


class LevelMoves(EventSink):
    """Counts blocks kvcm moved between levels, by ``(from_level, to_level)``, from its
    ``moved`` events (the events a KV-aware router would read)."""

    def __init__(self) -> None:
        self.moves: Counter[tuple[int, int]] = Counter()

    def on_events(self, events: Sequence[BlockEvent]) -> None:
        for e in events:
            if e.kind is EventKind.MOVED and e.from_level is not None:
                self.moves[(e.from_level, e.level)] += 1

    def onboarded_from(self, level: int) -> int:
        """Blocks brought from ``level`` up to the GPU level."""
        return self.moves[(level, 0)]


class _Sinks:
    def __init__(self, sink: EventSink) -> None:
        self.sink = sink

    @hookimpl
    def kvcm_event_sinks(self, config: Any) -> Any:
        yield self.sink


def make_manager(config: KVCacheManagerConfig) -> tuple[KVCacheManager, LevelMoves]:
    """A manager whose level moves are counted (a plugin registered on a private plugin
    manager: the process-wide one is left alone)."""
    moves = LevelMoves()
    plugins = KvcmPluginManager()
    plugins.register(_Sinks(moves), name="tiny-engine-level-moves",
                     distribution="kvcm-tiny-engine")
    return KVCacheManager(config, plugin_manager=plugins), moves


class StepTables:
    """One request's page lookups for one step (history ``start``, capacity ``end``), per
    cache group: where tokens ``[start, end)`` are written, and which pages the queries
    read (every block the page table shows, up to ``end``).

    Attributes:
        write_slots, write_rows: slot and row in the page of each token of the step.
        read_slots: slot of each page read, in block order.
        read_keep: positions of the read pages' rows that hold tokens below ``end``.
        read_positions: the token position of each kept row.
    """

    def __init__(self, table: np.ndarray, start: int, end: int, tpb: int) -> None:
        table = np.asarray(table, dtype=np.int64)
        positions = np.arange(start, end)
        self.write_slots = table[positions // tpb]
        if np.any(self.write_slots == BAD_PAGE_INDEX):
            raise ValueError(f"page table {table.tolist()} has no page for a token of "
                             f"[{start}, {end})")
        self.write_rows = positions % tpb
        blocks = np.flatnonzero(table != BAD_PAGE_INDEX)
        self.read_slots = table[blocks]
        rows = (blocks[:, None] * tpb + np.arange(tpb)[None, :]).ravel()
        self.read_keep = np.flatnonzero(rows < end)
        self.read_positions = rows[self.read_keep]


class PagedKV:
    """Zero-copy views of the model's K/V pages in kvcm's level-0 pools.

    Args:
        manager: the manager (its level-0 pools must not be reallocated while the views
            live: after ``manager.resize(0, ...)`` build a new ``PagedKV``).
        model: the model's shape (checked against the manager's buffers).
        ops: the array library that views and computes (NumPy, or torch through DLPack).

    Raises:
        ConfigError: the manager's layers do not have this model's K/V buffers.
    """

    def __init__(self, manager: KVCacheManager, model: ModelConfig, ops: Ops) -> None:
        tpb = manager.tokens_per_block
        self.tpb = tpb
        self.ops = ops
        shape = (tpb, model.num_kv_heads, model.head_dim)
        want = page_bytes(model, tpb)
        by_id = {layer.layer_id: layer for layer in manager.config.layers}
        self.group: list[int] = []
        self.pages: list[tuple[Any, Any]] = []
        for i in range(model.num_layers):
            layer = by_id.get(i)
            if layer is None:
                raise ConfigError("layers", sorted(by_id), f"have no layer {i} of the model")
            sizes = {b.role: b.size for b in layer.buffers}
            for role in ROLES:
                if sizes.get(role) != want:
                    raise ConfigError(f"layers[{i}].buffers[{role}].size", sizes.get(role),
                                      f"must be {want} bytes ({tpb} tokens x "
                                      f"{model.num_kv_heads} kv heads x {model.head_dim} "
                                      "float32)")
            if layer.sliding_window_size != model.window_of(i):
                raise ConfigError(f"layers[{i}].sliding_window_size",
                                  layer.sliding_window_size,
                                  f"must be the model's {model.window_of(i)}")
            self.group.append(manager.get_layer_group_id(i))
            self.pages.append(tuple(  # type: ignore[arg-type]
                ops.page_view(manager.backend, manager.get_page_region(i, role), shape)
                for role in ROLES))

    def write(self, layer: int, slots: Any, rows: Any, k: Any, v: Any) -> None:
        """Store this step's K and V (``[T, kv_heads, dim]``) at ``(slot, row)`` each."""
        keys, values = self.pages[layer]
        keys[slots, rows] = k
        values[slots, rows] = v

    def read(self, layer: int, slots: Any, keep: Any) -> tuple[Any, Any]:
        """The K and V of the pages ``slots``, rows ``keep`` (``[n, kv_heads, dim]``)."""
        keys, values = self.pages[layer]
        flat = (-1, *keys.shape[2:])
        return keys[slots].reshape(flat)[keep], values[slots].reshape(flat)[keep]
