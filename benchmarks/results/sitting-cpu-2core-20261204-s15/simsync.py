"""simsteps with the disk level's I/O on the scheduler thread (io_deadline_s None)."""
import sys, attrs
import kvcm_core.simulate as S
orig = S.load_config
def lc(*a, **k):
    sim = orig(*a, **k)
    kv = dict(sim.kvcm)
    kv["levels"] = [dict(l, io_deadline_s=None) if l["tier"] == "disk" else l for l in kv["levels"]]
    return attrs.evolve(sim, kvcm=kv)
S.load_config = lc
exec(open("wip/simsteps.py").read())
