"""Tables of this folder's sittings: python summarize.py RUN_DIR [cpu_sitting.log]."""
import glob
import json
import statistics
import sys
from pathlib import Path

run = Path(sys.argv[1])


def res(name):
    return json.loads((run / f"{name}.json").read_text())["results"]


print(f"## {run.name}: kvcm bench trace, us/block (median of 3 reps), per round")
print("| round | before GPU 4.5M | before levels | ratio | after GPU 4.5M | after levels | ratio |")
print("| --- | --- | --- | --- | --- | --- | --- |")
cols = {k: [] for k in ("bg", "bl", "ag", "al")}
for r in range(1, 6):
    v = {k: res(f"{n}_r{r}")["us_per_block_median"] for k, n in
         (("bg", "before_gpu4.5M"), ("bl", "before_levels"), ("ag", "after_gpu4.5M"),
          ("al", "after_levels"))}
    for k in v:
        cols[k].append(v[k])
    print(f"| {r} | {v['bg']:.3f} | {v['bl']:.3f} | {v['bl'] / v['bg']:.2f} | {v['ag']:.3f} "
          f"| {v['al']:.3f} | {v['al'] / v['ag']:.2f} |")
m = {k: statistics.median(c) for k, c in cols.items()}
print(f"| median | {m['bg']:.3f} | {m['bl']:.3f} | {m['bl'] / m['bg']:.2f} | {m['ag']:.3f} "
      f"| {m['al']:.3f} | {m['al'] / m['ag']:.2f} |")
al, ag = res("after_levels_r1"), res("after_gpu4.5M_r1")
bl = res("before_levels_r1")
print(f"\nhit rates: before levels {bl['hit_rate']:.5f} ({bl['hit_rate'] / bl['lru512_hit_rate']:.4f}x"
      f" LRU-512 {bl['lru512_hit_rate']:.5f}), after levels {al['hit_rate']:.5f} "
      f"({al['hit_rate'] / al['lru512_hit_rate']:.4f}x), after GPU 4.5M {ag['hit_rate']:.5f}")
h, g3 = res("after_levels_hint"), res("after_gpu3M")
print(f"after levels --tail-hint: {h['hit_rate']:.5f} ({h['hit_rate'] / h['lru512_hit_rate']:.4f}x), "
      f"{h['us_per_block_median']:.3f} us/block; after GPU 3M: {g3['hit_rate']:.5f}")
if len(sys.argv) > 2:
    cpu = {}
    for line in Path(sys.argv[2]).read_text().splitlines():
        r, tree, cfg, wall, c, hit = line.split()
        cpu.setdefault((tree, cfg), []).append(float(c))
    print("\n## CPU time (process_time) per block, one replay per run, 5 alternating rounds")
    for (tree, cfg), v in sorted(cpu.items()):
        print(f"{tree} {cfg}: median {statistics.median(v):.3f} us/block ({', '.join(f'{x:.2f}' for x in v)})")
    for tree in ("before", "after"):
        print(f"{tree}: levels / GPU 4.5M = "
              f"{statistics.median(cpu[(tree, 'levels')]) / statistics.median(cpu[(tree, 'gpu4.5M')]):.2f}")
