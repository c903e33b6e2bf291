"""A tiny transformer served through kvcm: an example for engine developers.

- :mod:`~kvcm_tiny_engine.model`: the model (GQA, RoPE, sliding windows with sinks).
- :mod:`~kvcm_tiny_engine.kv`: its layers declared to kvcm, its K/V in kvcm's pages.
- :mod:`~kvcm_tiny_engine.engine`: continuous batching with prefix reuse, chunked
  prefill, decode and preemption, all through kvcm.
- :mod:`~kvcm_tiny_engine.ops`: NumPy, or torch (optional) reading pages through DLPack.
- :mod:`~kvcm_tiny_engine.demo`: the demonstration run and its check against the model
  without a cache (``python -m kvcm_tiny_engine``).
"""

from __future__ import annotations

from kvcm_tiny_engine.demo import Comparison, compare_with_reference, demo_levels, run_demo
from kvcm_tiny_engine.engine import EngineError, EngineStats, Request, TinyEngine
from kvcm_tiny_engine.kv import LevelMoves, PagedKV, kvcm_config, kvcm_layers, make_manager
from kvcm_tiny_engine.model import ModelConfig, TinyModel
from kvcm_tiny_engine.ops import NumpyOps, Ops, TorchOps
from kvcm_tiny_engine.workload import chat_mix

__all__ = [
    "Comparison", "EngineError", "EngineStats", "LevelMoves", "ModelConfig", "NumpyOps",
    "Ops", "PagedKV", "Request", "TinyEngine", "TinyModel", "TorchOps", "chat_mix",
    "compare_with_reference", "demo_levels", "kvcm_config", "kvcm_layers", "make_manager",
    "run_demo",
]
