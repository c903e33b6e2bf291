"""Count the C and Python calls inside Levels._move by (src, dst) level, in the levels
replay (sync): which functions, how many per move."""
import sys, collections, attrs, os, time
import kvcm_core.levels as LV
import kvcm_core.bench.trace as t
counts = {}; moves = collections.Counter()
orig = LV.Levels._move
def mv(self, src, pids, dst, *a, **k):
    key = (src.level, dst.level)
    moves[key] += 1
    c = counts.setdefault(key, collections.Counter())
    def prof(frame, event, arg):
        if event == "c_call":
            c["C " + getattr(arg, "__qualname__", str(arg))] += 1
        elif event == "call":
            c["py " + frame.f_code.co_name + " " + os.path.basename(frame.f_code.co_filename)] += 1
    sys.setprofile(prof)
    try: return orig(self, src, pids, dst, *a, **k)
    finally: sys.setprofile(None)
LV.Levels._move = mv
o = t.make_config
t.make_config = lambda a, d: (lambda c: attrs.evolve(c, levels=[attrs.evolve(l, io_deadline_s=None) if l.tier == "disk" else l for l in c.levels]))(o(a, d))
T = "/work/shared/traces/mooncake_synthetic.jsonl"
t.main([T, "--limit", "300", "--block-size", "64", "--reps", "1", "--gpu-tokens", "500000", "--host-tokens", "1000000", "--disk-tokens", "3000000", "--out", f"/tmp/mc{time.time()}.json"])
for key, c in counts.items():
    n = moves[key]
    tot_c = sum(v for k, v in c.items() if k.startswith("C ")) / n
    tot_p = sum(v for k, v in c.items() if k.startswith("py ")) / n
    print(key, "moves", n, "C calls/move", round(tot_c, 1), "py calls/move", round(tot_p, 1))
    for k, v in c.most_common(40):
        print("   ", k, round(v / n, 2))
