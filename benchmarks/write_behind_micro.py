"""Host time of one background write of droppable pages to a disk level (the write-behind
path: `DeadlinePool.write` -> `LevelIO.background` -> `DiskPool.write_behind` ->
`aio.NativeWrite`), per call: median and mean over the calls after a warm-up.

    python benchmarks/write_behind_micro.py [SLOT_BYTES] [CALLS]

Each call writes 5-20 rows (half of them in two runs of slots, some in falling order), as
the levels replay does, then the script spins a while (the scheduler's other work), so
that the write has finished when the next call reaps it. A benchmark helper for
side-by-side runs in one sitting, not part of kvcm; the figures are the machine's, not
comparable across machines.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np
from kvcm_tier_disk import DiskTier

from kvcm_core.level_io import DeadlinePool, LevelIO


def main(argv: list[str]) -> str:
    sb = int(argv[0]) if argv else 512
    calls = int(argv[1]) if len(argv) > 1 else 3000
    rng = np.random.default_rng(0)
    work = []
    for _ in range(calls):
        n = int(rng.integers(5, 21))
        slots = np.arange(n) + int(rng.integers(0, 8000))
        if rng.random() < 0.5:
            slots[int(rng.integers(1, n)):] += 50
        if rng.random() < 0.3:
            slots = slots[::-1].copy()
        work.append((slots, rng.integers(0, 256, (n, sb), dtype=np.uint8)))
    tier = DiskTier(None, {"path": tempfile.mkdtemp(prefix="kvcm-write-behind-")})
    io = LevelIO(2, deadline_s=5.0, write_queue_depth=8)
    pool = DeadlinePool(io, tier.create_pool(sb, 8192))
    took = []
    with io.dropping(True):
        for slots, rows in work:
            t0 = time.perf_counter_ns()
            pool.write(slots, rows)
            took.append(time.perf_counter_ns() - t0)
            end = time.perf_counter() + 100e-6
            while time.perf_counter() < end:
                pass
    assert io.wait_idle(5.0)
    stats = io.stats
    io.close([("pool", pool.close)], time.monotonic() + 2.0)
    tier.close()
    us = [t / 1e3 for t in took[len(took) // 10:]]
    return (f"write behind: {statistics.median(us):.1f} us per call median, "
            f"{statistics.mean(us):.1f} mean ({len(us)} calls, {sb}-byte slots); "
            f"on the tier's threads {stats.direct_writes}, dropped (queue full) "
            f"{stats.queue_full_drops}, on the level's thread {stats.operations}")


if __name__ == "__main__":
    print(main(sys.argv[1:]))
