"""simsteps with the disk option native_writes on or off. argv: on|off"""
import sys, attrs
on = sys.argv[1] == "on"
import kvcm_core.simulate as S
orig = S.load_config
def lc(*a, **k):
    sim = orig(*a, **k)
    kv = dict(sim.kvcm)
    kv["levels"] = [dict(l, options={**l.get("options", {}), "native_writes": on}) if l["tier"] == "disk" else l for l in kv["levels"]]
    return attrs.evolve(sim, kvcm=kv)
S.load_config = lc
sys.argv = sys.argv[:1]
exec(open("wip/simsteps.py").read())
