"""Issue 9's acceptance figures from one sit.sh sitting: python summary.py OUTDIR."""
import json
import statistics
import sys
from pathlib import Path

OUT = Path(sys.argv[1])
load = lambda p: json.loads(p.read_text())  # noqa: E731
med = statistics.median

print("== race: kvcm bench trace beside vllm_trace_replay.py (GPU 3M tokens, medians of 3)")
for r in range(1, 6):
    try:
        v, k = load(OUT / f"race/vllm{r}.json"), load(OUT / f"race/kvcm{r}.json")["results"]
    except FileNotFoundError:
        continue
    print(f"  round {r}: vLLM {v['us_per_request_median']:.1f} us/req, hit {v['hit_rate']:.5f} | "
          f"kvcm {k['us_per_request_median']:.1f} us/req, hit {k['hit_rate']:.5f} | kvcm faster "
          f"{v['us_per_request_median'] / k['us_per_request_median']:.2f}x | hit rate within "
          f"{abs(k['hit_rate'] - v['hit_rate']) / v['hit_rate'] * 100:.2f}%")

rv = [load(p)["us_per_request_median"] for p in sorted(OUT.glob("race/vllm*.json"))]
rk = [load(p)["results"]["us_per_request_median"] for p in sorted(OUT.glob("race/kvcm*.json"))]
if rv and rk:
    print(f"  all rounds: vLLM median {med(rv):.1f} us/req, kvcm median {med(rk):.1f}: "
          f"{med(rv) / med(rk):.2f}x")

print("== manager: kvcm bench manager beside vllm_host_overhead.py")
for r in (1, 2, 3):
    try:
        v, k = load(OUT / f"manager/vllm{r}.json"), load(OUT / f"manager/kvcm{r}.json")
    except FileNotFoundError:
        continue
    for bs in ("16", "32"):
        kb, vb = k["results"][f"block_size_{bs}"], v["results"][f"block_size_{bs}"]
        kd, vd = kb["decode"]["median"], vb["decode"]["median"]
        kp, vp = kb["prefill_prefix_reuse"]["median"], vb["prefill_prefix_reuse"]["median"]
        dk, dv = kd["resize_commit_us_per_req_step"], vd["alloc_plus_append_us_per_req_step"]
        print(f"  round {r} tpb {bs}: decode {dk:.2f} / {dv:.2f} us ({dv / dk:.2f}x) | close "
              f"per block, decode {kd['close_us_per_block']:.3f} / {vd['free_us_per_block']:.3f}"
              f", prefill {kp['close_us_per_block']:.3f} / {vp['free_us_per_block']:.3f}")
    vp = v["results"]["block_size_16"]["prefill_prefix_reuse"]["median"]
    print(f"  round {r} vLLM at 16 tokens a block (its prefill): lookup "
          f"{vp['get_computed_blocks_us_per_matched_block']:.3f} us per matched block, hashing "
          f"{vp['request_init_block_hash_us_per_request'] / (4096 // 16):.3f} us per block")
    ls = k["results"]["lookup_scaling"]
    sizes = [s for s in ls if s.isdigit()]

    def cell(f: str, ls: dict = ls, sizes: list = sizes) -> str:
        return ", ".join(f"{ls[s][f]:.3f}" for s in sizes)

    print(f"  round {r} probe_reuse us/matched block at {'/'.join(sizes)} cached: list "
          f"{cell('us_per_matched_block_median')} (flat "
          f"{ls['ratio_largest_to_smallest_median']:.2f}); int32 array "
          f"{cell('int32_array_us_per_matched_block_median')} (flat "
          f"{ls['int32_array_ratio_largest_to_smallest_median']:.2f}); floor "
          f"{cell('bare_us_per_matched_block_median')}")

print("== levels: GPU 0.5M + host 1M + disk 3M against GPU-only 4.5M")
# Round r's levels run and the GPU-only run right after it, paired by round number.
rounds = sorted(r for r in (int(p.stem.removeprefix("levels_r"))
                            for p in OUT.glob("levels/levels_r*.json"))
                if (OUT / f"levels/gpu_r{r}.json").exists())
lv = [load(OUT / f"levels/levels_r{r}.json")["results"] for r in rounds]
gp = [load(OUT / f"levels/gpu_r{r}.json")["results"] for r in rounds]
if lv and gp:
    ml = med([x["us_per_request_median"] for x in lv])
    mg = med([x["us_per_request_median"] for x in gp])
    mb = med([x["us_per_block_median"] for x in lv]) / med([x["us_per_block_median"] for x in gp])
    mins = min(x["us_per_request_min"] for x in lv) / min(x["us_per_request_min"] for x in gp)
    rr = sorted(a["us_per_request_median"] / b["us_per_request_median"]
                for a, b in zip(lv, gp, strict=True))
    print(f"  {len(lv)} rounds: levels {ml:.1f} us/req, GPU-only {mg:.1f} us/req: ratio "
          f"{ml / mg:.3f} (per block {mb:.3f}; min-of-mins {mins:.3f}; rounds' own ratios "
          f"{rr[0]:.2f}-{rr[-1]:.2f}, their median {med(rr):.3f}, under 1.5 in "
          f"{sum(x <= 1.5 for x in rr)} of {len(rr)})")
    x = lv[0]
    print(f"  hit rate {x['hit_rate']:.5f}; exact LRU over 512-token blocks, 4.5M tokens: "
          f"{x['lru512_hit_rate']:.5f} ({x['hit_rate'] / x['lru512_hit_rate']:.4f}x)")
sim = OUT / "simulate-trace/sim.log"
if sim.exists():
    lines = sim.read_text().strip().splitlines()
    keep = [t[:110] for t in lines if t.startswith(("verified", "real", "rc="))]
    print("== simulate --trace (300 requests):", " | ".join(keep))
