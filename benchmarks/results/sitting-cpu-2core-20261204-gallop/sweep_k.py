"""In-process A/B of the lookup walk by match length: main's block-by-block walk (the
reference kept in tests/test_gallop_walk.py) against the gallop, swapped in turn inside
one process (the manager's ``match_prefix``), so both see the same tree, the same prompts
and the same machine phase; the minimum over ``SWEEPS`` interleaved samples of 20 calls.

Tree: a 128-block (16-token) shared prefix under 32 requests' own 128 blocks. For each k:
``diverge``, a list prompt of the prefix's first k blocks then k blocks of its own
(``create_kv_cache`` + ``close``, and ``probe_reuse``); ``tail``, an int32 prompt of the
first k blocks and one block more (``probe_reuse``; the lookup-scaling shape).

Run from the repository root, pinned: PYTHONPATH=. taskset -c 1 python <this file> [SWEEPS]
"""
import gc
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path("tests").resolve()))
from test_gallop_walk import linear_match_prefix

from kvcm_core import manager as manager_mod
from kvcm_core.bench.manager import make_manager, rand_tokens

TPB = 16
KS = [1, 3, 6, 8, 11, 16, 21, 32, 45, 64, 100, 128]


def timed(call, inner=20, reps=2):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            call()
        out.append((time.perf_counter_ns() - t0) / inner)
    return min(out) / 1e3


def main() -> None:
    sweeps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rng = random.Random(11)
    m = make_manager(TPB, 16384)
    system = rand_tokens(rng, 128 * TPB)
    for _ in range(32):
        p = system + rand_tokens(rng, 128 * TPB)
        c = m.create_kv_cache(None, p)
        c.resume()
        c.resize(len(p))
        c.commit(p[c.history_length:])
        c.close()
    gc.collect()
    gc.freeze()
    gallop = manager_mod.match_prefix
    diverge = {k: system[: k * TPB] + rand_tokens(random.Random(k), k * TPB) for k in KS}
    tail = {k: np.asarray(system[: k * TPB] + rand_tokens(random.Random(-k), TPB),
                          dtype=np.int32) for k in KS}
    res: dict[str, list[float]] = {}
    for sweep in range(sweeps):
        order = [("linear", linear_match_prefix), ("gallop", gallop)]
        for k in KS:
            for name, fn in order if sweep % 2 else order[::-1]:
                manager_mod.match_prefix = fn
                res.setdefault(f"{name} diverge create {k}", []).append(
                    timed(lambda k=k: m.create_kv_cache(None, diverge[k]).close()))
                res.setdefault(f"{name} diverge probe {k}", []).append(
                    timed(lambda k=k: m.probe_reuse(None, diverge[k])))
                res.setdefault(f"{name} tail probe {k}", []).append(
                    timed(lambda k=k: m.probe_reuse(None, tail[k])))
    manager_mod.match_prefix = gallop
    best = {key: min(v) for key, v in res.items()}
    for what in ("diverge create", "diverge probe", "tail probe"):
        print(f"{what} (us; linear, gallop, difference)")
        for k in KS:
            a, b = best[f"linear {what} {k}"], best[f"gallop {what} {k}"]
            print(f"  k={k:4d} {a:8.2f} {b:8.2f} {b - a:+7.2f}")
    print(json.dumps({"sweeps": sweeps, "tpb": TPB, "us_min": best}))


if __name__ == "__main__":
    main()
