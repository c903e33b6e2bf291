import gc, time, sys
log = []; t = {}
def cb(phase, info):
    if phase == "start": t["s"] = time.perf_counter()
    else: log.append((info["generation"], (time.perf_counter() - t["s"]) * 1e3, info["collected"]))
gc.callbacks.append(cb)
sys.argv = ["x"]
exec(open("benchmarks/simulate_profile.py").read().replace('if __name__ == "__main__":\n    run(sys.argv[1:])', 'run([])'))
big = sorted(log, key=lambda x: -x[1])[:5]
print("gc collections", len(log), "by gen", {g: sum(1 for x in log if x[0] == g) for g in (0, 1, 2)}, "slowest (gen, ms, collected):", [(g, round(ms, 1), c) for g, ms, c in big])
