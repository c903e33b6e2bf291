"""kvcm's benchmarks, run as ``kvcm bench NAME``; none of them is a timed test.

- :mod:`kvcm_core.bench.kernels`: page copies, index conversion and launch cost of every
  available kernel backend, as ratios to the physical limits measured in the same run.
- :mod:`kvcm_core.bench.manager`: the manager's host overhead, beside vLLM's.

Each module has ``main(argv) -> int`` and writes JSON (machine, versions, date) that is
committed under ``benchmarks/results/``.
"""

from __future__ import annotations

__all__: list[str] = []
