"""cProfile of the manager calls of kvcm simulate's slow steps (manager time > ARG ms)."""
import sys, time, cProfile, pstats, collections
import kvcm_core.simulate.runner as runner
from kvcm_core.cli import main
TH = float(sys.argv[1]) * 1e3 if len(sys.argv) > 1 else 3000
_wrap = runner._Timers.wrap
cur = {"p": None, "ns": 0}
agg = None
nslow = [0, 0]
def wrap(self, name, fn, owner):
    inner = _wrap(self, name, fn, owner)
    def timed(*a, **k):
        p = cur["p"]
        t0 = time.perf_counter_ns()
        p.enable()
        try:
            return inner(*a, **k)
        finally:
            p.disable()
            cur["ns"] += time.perf_counter_ns() - t0
    return timed
runner._Timers.wrap = wrap
_step = runner._SimLoop.step
def step(self):
    global agg
    cur["p"] = cProfile.Profile(); cur["ns"] = 0
    try:
        return _step(self)
    finally:
        if cur["ns"] / 1e3 > TH:
            nslow[0] += 1; nslow[1] += cur["ns"]
            if agg is None: agg = pstats.Stats(cur["p"])
            else: agg.add(cur["p"])
runner._SimLoop.step = step
main(["simulate", "--no-plots", "--quiet", "--no-compare", "--out", "/tmp/stepprof"])
print("slow steps", nslow[0], "profiled ms", nslow[1] / 1e6)
agg.sort_stats(sys.argv[2] if len(sys.argv) > 2 else "tottime").print_stats(45)
