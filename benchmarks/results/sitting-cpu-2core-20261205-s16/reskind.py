"""Resume time in slow steps: first resumes (admissions) vs resumes of suspended caches."""
import time, collections
import kvcm_core.cache_resume as CR
import kvcm_core.simulate.runner as runner
from kvcm_core.cli import main
f = CR.ResumeMixin.resume
step_acc = collections.defaultdict(int)
tot = collections.defaultdict(int)
def res(self, *a, **k):
    first = not self._first_resume_done
    t0 = time.perf_counter_ns()
    try: return f(self, *a, **k)
    finally:
        step_acc["first" if first else "again"] += time.perf_counter_ns() - t0
        step_acc["n_first" if first else "n_again"] += 1
CR.ResumeMixin.resume = res
_step = runner._SimLoop.step
def step(self):
    step_acc.clear()
    t0 = time.perf_counter_ns()
    try: return _step(self)
    finally:
        if step_acc["first"] + step_acc["again"] > 2e6:
            for k, v in step_acc.items(): tot[k] += v
            tot["steps"] += 1
runner._SimLoop.step = step
main(["simulate", "--no-plots", "--quiet", "--no-compare", "--out", "/tmp/reskind"])
print(dict(tot))
