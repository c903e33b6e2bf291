"""kvcm's benchmarks, run as ``kvcm bench NAME``; none of them is a timed test.

- :mod:`kvcm_core.bench.kernels`: page copies, index conversion and launch cost of every
  available kernel backend, as ratios to the physical limits measured in the same run.
- :mod:`kvcm_core.bench.manager`: the manager's host overhead, beside vLLM's.
- :mod:`kvcm_core.bench.mixed`: a mixed-precision companion, REQUIRED vs SINK_REQUIRED_ONLY.
- :mod:`kvcm_core.bench.eviction`: ns per page of the eviction policies' batch methods.
- :mod:`kvcm_core.bench.trace`: a Mooncake-format serving trace replayed through the
  manager, beside vLLM's replay of the same trace and the trace's own hit-rate bounds.

Each module has ``main(argv) -> int`` and writes JSON (machine, versions, date) that is
committed under ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from typing import Any

__all__ = ["result_header", "write_result"]


def result_header(what: str) -> dict[str, Any]:
    """The common head of a result file: what it measures, versions, machine and date."""
    import kvcm_core

    return {
        "what": what,
        "kvcm_version": kvcm_core.__version__,
        "python_version": platform.python_version(),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_result(doc: dict[str, Any], path: str) -> None:
    """Write a result document as JSON (making its folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {path}")
