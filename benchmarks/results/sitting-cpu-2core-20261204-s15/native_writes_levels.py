"""Levels replay with the disk option native_writes on or off. argv: on|off reps"""
import sys, time, attrs
import kvcm_core.bench.trace as t
on = sys.argv[1] == "on"
o = t.make_config
t.make_config = lambda a, d: (lambda c: attrs.evolve(c, levels=[attrs.evolve(l, options={**l.options, "native_writes": on}) if l.tier == "disk" else l for l in c.levels]))(o(a, d))
T = "/work/shared/traces/mooncake_synthetic.jsonl"
t.main([T, "--limit", "1000", "--block-size", "64", "--reps", sys.argv[2], "--gpu-tokens", "500000", "--host-tokens", "1000000", "--disk-tokens", "3000000", "--out", f"/tmp/nat{time.time()}.json"])
