"""`kvcm simulate` on the embedded default with one engine-loop variant, printing the
manager's time per step (mean and p99, from the run's report) on one line.

    python benchmarks/simulate_ab.py VARIANT [kvcm simulate arguments...]

VARIANT:
- ``default``: the engine loop as it is;
- ``close-refused``: a refused waiting request's cache is closed and created again at
  its next try (the engine loop before session 17);
- ``no-room-ahead``: no ``make_room`` once per step.

A benchmark helper for side-by-side runs in one sitting, not part of kvcm: the variants
patch `kvcm_core.testing.engine.EngineLoop`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import kvcm_core.testing.engine as engine
from kvcm_core.cli import main


def _close_refused() -> None:
    admit = engine.EngineLoop._admit

    def _admit(self: Any, req: Any, report: Any = None) -> bool:
        if admit(self, req, report):
            return True
        if req.cache is not None:
            req.cache.close()
            req.cache = None
        return False

    engine.EngineLoop._admit = _admit  # type: ignore[method-assign]


def run(argv: list[str]) -> str:
    variant, args = argv[0], argv[1:]
    if variant == "close-refused":
        _close_refused()
    elif variant == "no-room-ahead":
        engine.EngineLoop.room_ahead = lambda self: None  # type: ignore[method-assign]
    elif variant != "default":
        raise SystemExit(f"unknown variant {variant!r}")
    out = tempfile.mkdtemp(prefix="kvcm-simulate-ab-")
    code = main(["simulate", "--no-plots", "--quiet", "--no-compare", "--out", out, *args])
    if code != 0:
        raise SystemExit(code)
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    t = rep["run"]["timing"]
    calls = t["manager_calls"]
    parts = " ".join(f"{k} {v['calls']}x{v['mean_us']:.0f}us"
                     for k, v in sorted(calls.items()) if k in
                     ("create_kv_cache", "close", "resume", "make_room"))
    return (f"{variant}: manager us per step mean {t['manager_us_per_step']['mean']:.0f} "
            f"p99 {t['manager_us_per_step']['p99']:.0f}; hit rate "
            f"{rep['summary']['hit_rate']:.4f}; verified {rep['verification']['ok']}; "
            f"{parts}")


if __name__ == "__main__":
    print(run(sys.argv[1:]))
