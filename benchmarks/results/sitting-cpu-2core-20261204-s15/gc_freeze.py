import gc, time, sys
import kvcm_core.simulate.runner as R
log = []; t = {}
def cb(phase, info):
    if phase == "start": t["s"] = time.perf_counter()
    else: log.append((info["generation"], (time.perf_counter() - t["s"]) * 1e3))
gc.callbacks.append(cb)
o = R._SimLoop.step
n = [0]
def step(self):
    n[0] += 1
    if n[0] == 1: gc.collect(); gc.freeze()
    return o(self)
R._SimLoop.step = step
sys.argv = ["x"]
exec(open("benchmarks/simulate_profile.py").read().replace('if __name__ == "__main__":\n    run(sys.argv[1:])', 'run([])').replace("_step = runner._SimLoop.step", "_step = R._SimLoop.step"))
print("gc", len(log), "gen2 ms", [round(ms, 1) for g, ms in log if g == 2], "gen1 max ms", round(max([ms for g, ms in log if g == 1] or [0]), 1))
