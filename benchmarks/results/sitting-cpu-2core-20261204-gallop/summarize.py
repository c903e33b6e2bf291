"""One line per round (before and after), then the median and the minimum of each figure
over the rounds: python summarize.py [DIR]."""
import glob
import json
import statistics
import sys
from pathlib import Path

where = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
SIZES = ("10000", "100000", "1000000")
FIELDS = [(f"{kind} {s}", s, key) for s in SIZES for kind, key in (
    ("list", "us_per_matched_block_median"), ("int32", "int32_array_us_per_matched_block_median"),
    ("bare", "bare_us_per_matched_block_median"))]
PREFILL = [("create/req", "create_us_per_request"),
           ("lookup/blk(med req)", "lookup_us_per_matched_block_median_request"),
           ("commit/newblk", "commit_us_per_new_block"), ("close/req", "close_us_per_request")]


def figures(path: Path) -> dict[str, float]:
    res = json.loads(path.read_text())["results"]
    out = {name: res["lookup_scaling"][s][key] for name, s, key in FIELDS}
    pre = res["block_size_16"]["prefill_prefix_reuse"]["median"]
    out.update({name: pre[key] for name, key in PREFILL})
    out["decode/req-step"] = res["block_size_16"]["decode"]["median"][
        "resize_commit_us_per_req_step"]
    return out


runs: dict[str, dict[str, dict[str, float]]] = {"base": {}, "wt": {}}
for f in sorted(glob.glob(str(where / "host_overhead-*.json"))):
    tag = f.rsplit("-", 2)
    runs[tag[-2]][tag[-1][:-5]] = figures(Path(f))
names = list(next(iter(runs["base"].values())))
print("round  " + "  ".join(f"{n:>12s}" for n in names))
for code in ("base", "wt"):
    for r in sorted(runs[code], key=lambda x: int(x[1:])):
        print(f"{code}-{r:3s} " + "  ".join(f"{runs[code][r][n]:12.3f}" for n in names))
for code in ("base", "wt"):
    vals = runs[code].values()
    print(f"{code} median " + "  ".join(f"{statistics.median(v[n] for v in vals):12.3f}"
                                       for n in names))
    print(f"{code} min    " + "  ".join(f"{min(v[n] for v in vals):12.3f}" for n in names))
print("after/before, per round (median, min):")
for n in names:
    ratios = [runs["wt"][r][n] / runs["base"][r][n] for r in runs["wt"] if r in runs["base"]]
    print(f"  {n:22s} {statistics.median(ratios):.3f} {min(ratios):.3f}")
