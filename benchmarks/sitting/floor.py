"""The VM's speed now: the bare lookup floor (one SHA-256 update, one digest and one dict
lookup per 64-byte block, 64 blocks, 20 walks per timing, 50 timings), us per block.

    python floor.py            print min / median / max
    python floor.py --wait X   return once the median is at most X us (or after 120 s),
                               printing each reading: sit.sh calls it before every timed run
"""
import hashlib
import os
import sys
import time

blocks = [os.urandom(64) for _ in range(64)]
d: dict = {}


def walk() -> None:
    h = hashlib.sha256(b"r")
    u, g = h.update, h.digest
    for b in blocks:
        u(b)
        d.get(g())


def reading() -> tuple[float, float, float]:
    out = []
    for _ in range(50):
        t0 = time.perf_counter_ns()
        for _ in range(20):
            walk()
        out.append((time.perf_counter_ns() - t0) / 20 / 64 / 1e3)
    out.sort()
    return out[0], out[25], out[-1]


if len(sys.argv) == 3 and sys.argv[1] == "--wait":
    bar, t_end = float(sys.argv[2]), time.monotonic() + 120
    while True:
        lo, mid, hi = reading()
        print(f"floor {mid:.3f} (min {lo:.3f}, max {hi:.3f})", flush=True)
        if mid <= bar or time.monotonic() > t_end:
            break
        time.sleep(2)
else:
    lo, mid, hi = reading()
    print(f"floor us/block: min {lo:.3f} median {mid:.3f} max {hi:.3f}")
