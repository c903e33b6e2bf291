import sys, attrs
import kvcm_core.bench.trace as t
orig = t.make_config
def mk(args, disk):
    c = orig(args, disk)
    return attrs.evolve(c, levels=[attrs.evolve(l, io_deadline_s=None) if l.tier == "disk" else l for l in c.levels])
t.make_config = mk
sys.exit(t.main(sys.argv[1:]))
