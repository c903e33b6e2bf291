"""A tiny decoder-only transformer with seeded random fp32 weights.

Byte-level vocabulary (256 tokens), RMSNorm, grouped-query attention with rotary position
embeddings (RoPE), some sliding-window layers with attention sinks, a SiLU-gated MLP. The
weights are random, so the text it writes is noise; what matters is that the arithmetic is
that of a real model: every logit depends on the K/V of every token it attends to.

:meth:`TinyModel.reference_logits` runs a whole sequence at once without any cache: the
ground truth the cached engine is compared with.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from kvcm_core import ConfigError
from kvcm_tiny_engine.ops import NumpyOps, Ops

__all__ = ["ModelConfig", "TinyModel", "attention_mask"]

VOCAB = 256  # bytes


def _int_at_least(low: int) -> Any:
    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"ModelConfig.{attr.name}", value, f"must be an int >= {low}")
    return check


_positive = _int_at_least(1)


def _layer_ids(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"ModelConfig.{attr.name}", value, "must be a tuple of layer ids")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The model's shape.

    Attributes:
        num_layers: decoder layers.
        hidden: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention: divides ``num_heads``).
        head_dim: width of one head (even, for RoPE).
        mlp_hidden: width of the gated MLP.
        window_layers: ids of the sliding-window layers (the others attend to everything).
        window: tokens a windowed layer's query sees, itself included.
        sink_tokens: leading tokens a windowed layer always sees (attention sinks).
        rope_base: RoPE frequency base.
        seed: seed of the random weights.
    """

    num_layers: int = attrs.field(default=4, validator=_positive)
    hidden: int = attrs.field(default=64, validator=_positive)
    num_heads: int = attrs.field(default=4, validator=_positive)
    num_kv_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=16, validator=_positive)
    mlp_hidden: int = attrs.field(default=128, validator=_positive)
    window_layers: tuple[int, ...] = attrs.field(default=(1, 3), converter=tuple,
                                                 validator=_layer_ids)
    window: int = attrs.field(default=40, validator=_positive)
    sink_tokens: int = attrs.field(default=4, validator=_int_at_least(0))
    rope_base: float = 10000.0
    seed: int = attrs.field(default=0, validator=_int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("ModelConfig.num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ConfigError("ModelConfig.head_dim", self.head_dim, "must be even (RoPE)")
        bad = [i for i in self.window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError("ModelConfig.window_layers", self.window_layers,
                              f"ids must be in 0..{self.num_layers - 1}; {bad} are not")
        if self.sink_tokens >= self.window:
            raise ConfigError("ModelConfig.sink_tokens", self.sink_tokens,
                              f"must be < window ({self.window})")

    def window_of(self, layer: int) -> int | None:
        """The layer's window, or None for full attention."""
        return self.window if layer in self.window_layers else None


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None,
                   sinks: int) -> np.ndarray:
    """``bool [queries, keys]``: causal, and within a window layer only the last ``window``
    positions (the query's own included) plus the first ``sinks`` positions."""
    q = q_pos[:, None]
    k = k_pos[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k < window) | (k < sinks)
    return allowed


class TinyModel:
    """The weights and the layer functions, on one :class:`~kvcm_tiny_engine.ops.Ops`.

    A step of the engine calls, for each layer, :meth:`qkv` (this step's tokens), writes
    K/V into kvcm's pages, gathers the K/V the queries attend to, then :meth:`attend` and
    :meth:`finish_layer`; :meth:`logits` at the end.

    Args:
        config: the model's shape and seed.
        ops: the array library (default NumPy).
    """

    def __init__(self, config: ModelConfig, ops: Ops | None = None) -> None:
        self.config = config
        self.ops = ops or NumpyOps()
        c = config
        rng = np.random.default_rng(c.seed)

        def w(*shape: int) -> Any:
            return self.ops.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]))

        def norm(n: int) -> Any:
            return self.ops.asarray(1.0 + 0.1 * rng.standard_normal(n))

        self.embedding = self.ops.asarray(rng.standard_normal((VOCAB, c.hidden)))
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append({
                "attn_norm": norm(c.hidden),
                "wq": w(c.hidden, c.num_heads * c.head_dim),
                "wk": w(c.hidden, c.num_kv_heads * c.head_dim),
                "wv": w(c.hidden, c.num_kv_heads * c.head_dim),
                "wo": w(c.num_heads * c.head_dim, c.hidden),
                "mlp_norm": norm(c.hidden),
                "w_gate": w(c.hidden, c.mlp_hidden),
                "w_up": w(c.hidden, c.mlp_hidden),
                "w_down": w(c.mlp_hidden, c.hidden),
            })
        self.final_norm = norm(c.hidden)
        self.lm_head = w(c.hidden, VOCAB)
        half = c.head_dim // 2
        self._inv_freq = 1.0 / (c.rope_base ** (np.arange(half, dtype=np.float64) / half))

    # -- the pieces of a layer ----------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> Any:
        return self.embedding[self.ops.index(tokens)]

    def _norm(self, x: Any, weight: Any) -> Any:
        return x * self.ops.rsqrt_mean_square(x, 1e-6) * weight

    def _rope(self, x: Any, positions: np.ndarray) -> Any:
        """Rotate pairs ``(i, i + head_dim/2)`` by ``position * inv_freq[i]``."""
        angles = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        cos = self.ops.asarray(np.cos(angles))[:, None, :]
        sin = self.ops.asarray(np.sin(angles))[:, None, :]
        half = self.config.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.ops.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def qkv(self, layer: int, x: Any, positions: np.ndarray) -> tuple[Any, Any, Any]:
        """Queries ``[T, heads, dim]``, keys and values ``[T, kv_heads, dim]`` (RoPE applied)
        of tokens at ``positions`` whose hidden states are ``x`` ``[T, hidden]``."""
        c = self.config
        p = self.layers[layer]
        h = self._norm(x, p["attn_norm"])
        t = len(positions)
        q = (h @ p["wq"]).reshape(t, c.num_heads, c.head_dim)
        k = (h @ p["wk"]).reshape(t, c.num_kv_heads, c.head_dim)
        v = (h @ p["wv"]).reshape(t, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def attend(self, layer: int, q: Any, q_pos: np.ndarray, k: Any, v: Any,
               k_pos: np.ndarray) -> Any:
        """Grouped-query attention of queries ``q`` at ``q_pos`` over keys/values at
        ``k_pos`` (the layer's mask applied); returns ``[Tq, heads * dim]``."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        tq = len(q_pos)
        qg = q.reshape(tq, c.num_kv_heads, group, c.head_dim)
        scores = self.ops.einsum("qgrd,kgd->grqk", qg, k) * np.float32(c.head_dim ** -0.5)
        mask = attention_mask(q_pos, k_pos, c.window_of(layer), c.sink_tokens)
        weights = self.ops.softmax(self.ops.where(mask, scores, -np.inf))
        out = self.ops.einsum("grqk,kgd->qgrd", weights, v)
        return out.reshape(tq, c.num_heads * c.head_dim)

    def finish_layer(self, layer: int, x: Any, attn: Any) -> Any:
        """Output projection, residual, gated MLP, residual."""
        p = self.layers[layer]
        x = x + attn @ p["wo"]
        h = self._norm(x, p["mlp_norm"])
        return x + (self.ops.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    def logits(self, x: Any) -> Any:
        return self._norm(x, self.final_norm) @ self.lm_head

    # -- without a cache ------------------------------------------------------------------

    def reference_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits after the last token of ``tokens``, computed from scratch: every layer
        attends over K/V computed right here, no cache, no pages."""
        positions = np.arange(len(tokens))
        x = self.embed(np.asarray(tokens))
        for layer in range(self.config.num_layers):
            q, k, v = self.qkv(layer, x, positions)
            x = self.finish_layer(layer, x, self.attend(layer, q, positions, k, v, positions))
        return self.ops.to_numpy(self.logits(x[-1:]))[0]
