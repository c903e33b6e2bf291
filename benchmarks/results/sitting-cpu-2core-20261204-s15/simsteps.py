"""Per-step breakdown of the manager's time in kvcm simulate (the default preset)."""
import sys, collections, numpy as np
import kvcm_core.simulate.runner as R
steps = []
cur = collections.defaultdict(int)
orig_wrap = R._Timers.wrap
def wrap(self, name, fn, owner):
    inner = orig_wrap(self, name, fn, owner)
    def t(*a, **k):
        t0 = R._ns()
        try: return inner(*a, **k)
        finally: cur[name] += R._ns() - t0; cur[name+"#"] += 1
    return t
R._Timers.wrap = wrap
orig_step = R._SimLoop.step
def step(self):
    cur.clear()
    out = orig_step(self)
    steps.append(dict(cur))
    return out
R._SimLoop.step = step
from kvcm_core.cli import main
rc = main(["simulate", "--no-plots", "--quiet", "--no-compare", "--out", "/tmp/simsteps"] + sys.argv[1:])
tot = [sum(v for k, v in s.items() if not k.endswith("#")) for s in steps]
order = np.argsort(tot)[::-1]
print("steps", len(steps), "mean us", np.mean(tot)/1e3, "p99", np.percentile(tot, 99)/1e3)
for i in order[:15]:
    s = steps[i]
    print(i, round(tot[i]/1e3), {k: (round(v/1e3) if not k.endswith('#') else v) for k, v in sorted(s.items())})
