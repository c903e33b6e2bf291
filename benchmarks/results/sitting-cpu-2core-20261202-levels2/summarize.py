"""Usage: python summarize.py LOG -> medians of CPU us/block per configuration and ratios
(per round and of the medians). LOG lines: 'rN before|after CONFIG wall cpu hit'."""
import statistics
import sys
from collections import defaultdict

cpu = defaultdict(dict)
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) != 6:
        continue
    r, who, cfg, _wall, c, _hit = parts
    cpu[(who, cfg)][r] = float(c)
for key in sorted(cpu):
    vals = list(cpu[key].values())
    print(f"{key[0]:6s} {key[1]:16s} median {statistics.median(vals):.3f}  "
          f"min {min(vals):.3f}  max {max(vals):.3f}  ({len(vals)} rounds)")
for who in ("before", "after"):
    g, lv = cpu.get((who, "gpu4.5M")), cpu.get((who, "levels"))
    if not g or not lv:
        continue
    rounds = sorted(set(g) & set(lv), key=lambda r: int(r[1:]))
    per = [lv[r] / g[r] for r in rounds]
    print(f"{who}: levels/GPU per round {' '.join(f'{x:.2f}' for x in per)}; "
          f"ratio of medians {statistics.median(lv.values()) / statistics.median(g.values()):.2f}")
    nf = cpu.get((who, "levels-noframes"))
    if nf:
        print(f"{who}: levels without frames / GPU, ratio of medians "
              f"{statistics.median(nf.values()) / statistics.median(g.values()):.2f}")
