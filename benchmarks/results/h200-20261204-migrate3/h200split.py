# session 12: host-time breakdown of a 2 GiB swap's resume on the real backends (not committed)
import sys, time, statistics, functools, gc
import kvcm_core.levels as LV, kvcm_core.migration as MG, kvcm_core.fences as FE, kvcm_core.storage as ST
from kvcm_core.bench.migrate import _Rig
acc = {}
def wrap(cls, name):
    f = getattr(cls, name); label = f"{cls.__name__}.{name}"
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] = acc.get(label, 0) + time.perf_counter() - t
    setattr(cls, name, g)
def run(backend, timed, nogc, reps=40):
    rig = _Rig(backend, 32, 32 << 10, 512, 1024)
    a, b = rig.new(), rig.new()
    rig.grow(a); a.suspend(); rig.grow(b); b.suspend()
    ts = []
    for rep in range(reps):
        if rep == 5: acc.clear()
        c = [a, b][rep % 2]
        rig.be.synchronize()
        if nogc: gc.disable()
        t0 = time.perf_counter(); c.resume(rig.stream); ts.append(time.perf_counter() - t0)
        if nogc: gc.enable()
        rig.be.synchronize(); c.suspend()
    rig.close()
    ts = ts[5:]
    print(f"[{backend}] timed={timed} nogc={nogc}: host ms median {statistics.median(ts)*1e3:.3f} "
          f"min {min(ts)*1e3:.3f} max {max(ts)*1e3:.3f} all {[round(t*1e3,2) for t in ts[:12]]}")
    if timed:
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"   {k:28s} {v/len(ts)*1e6:8.1f} us/resume")
for be in sys.argv[1:] or ["cuda", "cupy"]:
    run(be, False, False); run(be, False, True)
for cls, names in [(LV.Levels, ["make_room", "_move", "onboard", "change"]), (MG.Mover, ["issue"]),
                   (FE.Fences, ["prune", "record_batch", "wait_batches", "batch_waits", "join_op", "end"]),
                   (ST.Store, ["vacate", "settle"])]:
    for n in names: wrap(cls, n)
for be in sys.argv[1:] or ["cuda", "cupy"]:
    run(be, True, False)
