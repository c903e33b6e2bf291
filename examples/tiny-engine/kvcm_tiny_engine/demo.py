"""The demonstration run and its check against the model without a cache.

:func:`run_demo` serves :func:`~kvcm_tiny_engine.workload.chat_mix` on a tight GPU level
with host and disk levels below it; :func:`compare_with_reference` recomputes every
generated token's logits from scratch and measures the difference.
``python -m kvcm_tiny_engine`` does both and prints the figures.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from kvcm_core import LevelConfig
from kvcm_tiny_engine.engine import EngineStats, Request, TinyEngine
from kvcm_tiny_engine.kv import kvcm_config, make_manager
from kvcm_tiny_engine.model import ModelConfig, TinyModel
from kvcm_tiny_engine.ops import Ops
from kvcm_tiny_engine.workload import chat_mix

__all__ = ["Comparison", "DemoRun", "compare_with_reference", "demo_levels",
           "requirements_unmet", "run_demo"]

#: Logits must agree within this fraction of their scale (the largest reference logit).
TOLERANCE = 1e-4


def demo_levels(gpu: str = "256KiB", host: str = "192KiB",
                disk: str = "4MiB") -> list[LevelConfig]:
    """GPU, host and disk levels: the GPU level holds about a third of the workload's
    blocks and the host level less, so requests are preempted and pages reach the disk."""
    return [LevelConfig(tier="gpu", quota=gpu), LevelConfig(tier="host", quota=host),
            LevelConfig(tier="disk", quota=disk)]


@attrs.define
class DemoRun:
    model: TinyModel
    engine: TinyEngine
    requests: list[Request]

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats


def run_demo(ops: Ops | None = None, *, kernel_backend: str = "numpy",
             model_config: ModelConfig | None = None, **engine_kw: Any) -> DemoRun:
    """Serve the chat mix to completion; the manager is shut down afterwards (the
    requests keep their outputs and logits)."""
    config = model_config or ModelConfig()
    model = TinyModel(config, ops)
    # max_util_for_resume < 1 keeps room on the GPU for the steps after a resume, so a
    # resumed request is not preempted again at once.
    manager, moves = make_manager(kvcm_config(config, tokens_per_block=8,
                                              levels=demo_levels(),
                                              kernel_backend=kernel_backend,
                                              max_util_for_resume=0.9))
    kw = {"chunk_tokens": 32, "max_batch": 4, "token_budget": 64, **engine_kw}
    engine = TinyEngine(model, manager, moves, **kw)
    requests = chat_mix()
    try:
        engine.run(requests)
    finally:
        engine.close()
        manager.shutdown()
    return DemoRun(model, engine, requests)


@attrs.define
class Comparison:
    """Cached generation against recomputation from scratch.

    Attributes:
        steps: generation steps compared (one per generated token).
        worst_error: the largest ``max |engine - reference| / max |reference|``.
        decided: steps whose reference top-2 margin exceeds the tolerance.
        token_mismatches: ``(request id, step)`` where such a step chose another token.
        close_calls: steps whose margin is within the tolerance (either token is right).
    """

    steps: int = 0
    worst_error: float = 0.0
    decided: int = 0
    token_mismatches: list[tuple[str, int]] = attrs.Factory(list)
    close_calls: int = 0


def compare_with_reference(reference: TinyModel, requests: list[Request],
                           tolerance: float = TOLERANCE) -> Comparison:
    """For every generated token, the logits ``reference`` computes without a cache for
    the same tokens, against the engine's; ``reference`` must have the same weights."""
    out = Comparison()
    for req in requests:
        for i, got in enumerate(req.logits):
            want = reference.reference_logits(np.asarray(req.prompt + req.output[:i]))
            scale = float(np.abs(want).max())
            out.steps += 1
            out.worst_error = max(out.worst_error,
                                  float(np.abs(np.asarray(got) - want).max()) / scale)
            top2 = np.sort(want)[-2:]
            if top2[1] - top2[0] > tolerance * scale:
                out.decided += 1
                if req.output[i] != int(np.argmax(want)):
                    out.token_mismatches.append((req.id, i))
            else:
                out.close_calls += 1
    return out


def requirements_unmet(run: DemoRun, cmp: Comparison, tolerance: float = TOLERANCE) -> list[str]:
    """What the run fails of its requirements (empty: all met): logits within
    ``tolerance`` of their scale, the same token wherever the top-2 margin exceeds it,
    prompt tokens reused, a request preempted, pages brought back from the disk level."""
    st = run.stats
    unmet = []
    if cmp.worst_error > tolerance:
        unmet.append(f"logits differ by {cmp.worst_error:.2e} of their scale "
                     f"(> {tolerance:.0e})")
    if cmp.token_mismatches:
        unmet.append(f"tokens differ at (request, step) {cmp.token_mismatches[:5]}")
    if st.reused_prompt_tokens == 0:
        unmet.append("no prompt token was reused")
    if st.preemptions == 0:
        unmet.append("no request was preempted")
    disk = len(run.engine.manager.levels) - 1
    if st.onboarded_by_level.get(disk, 0) == 0:
        unmet.append(f"no page came back from the disk level (level {disk})")
    return unmet
