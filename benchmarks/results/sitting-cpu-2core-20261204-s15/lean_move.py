"""Experiment: a lean Levels._move for host (device-accessible, host-visible) -> framed
storage moves of droppable victims, synchronous I/O. argv: reps [sync]"""
import sys, time, contextlib, numpy as np, attrs
import kvcm_core.levels as LV
from kvcm_core.tier import DevicePool, StoragePool
from kvcm_core.level_io import WriteQueueFull
from kvcm_core.errors import TierIOError
orig = LV.Levels._move
hits = [0, 0]
def move(self, src, pids, dst, queued=True, stream=None, droppable=False, lock=False):
    if not (droppable and not lock and len(pids) > 1 and src.level >= 1 and dst.frames is not None
            and len(src.pools) == 1 and isinstance(src.pools[0], DevicePool)
            and src.pools[0].region.buffer.host_ptr is not None and not self.mover.fences.events
            and self.mover.codec_of(src.level) is self.mover.codec_of(dst.level)):
        hits[1] += 1
        return orig(self, src, pids, dst, queued, stream, droppable, lock)
    hits[0] += 1
    n = len(pids)
    a = self.arena
    old = a.slot[pids]
    o = np.argsort(old, kind="stable")
    got = dst.reserve_slots(n)
    ds = np.sort(got)
    slots = np.empty_like(ds); slots[o] = ds
    old_s = old[o]
    keys = self.frame_keys(pids[o])
    region = src.pools[0].region
    cold = dst.frames.page_bytes
    base = region.buffer.host_view()
    items = np.ndarray((int(old_s[-1]) + 1,), dtype=np.dtype((np.void, cold)), buffer=base,
                       offset=region.offset, strides=(region.stride,))
    rows = items[old_s].view(np.uint8).reshape(n, cold)
    framed = dst.frames.wrap(ds, rows, keys)
    io = self.io[dst.level]
    try:
        with (io.dropping(True) if io is not None else contextlib.nullcontext()):
            dst.pools[0].write(ds, framed).wait()
    except WriteQueueFull:
        dst.unreserve_slots(got); return pids
    except TierIOError as exc:
        dst.unreserve_slots(got); self.stats.io_failures += 1; self.last_io_error = exc; return pids
    src.vacate(pids, queued=queued, slots=old)
    dst.settle(pids, slots, droppable)
    self.epoch += 1
    self._count_moves(pids, src.level, dst.level)
    return pids[:0]
LV.Levels._move = move
import kvcm_core.bench.trace as t
if len(sys.argv) > 2 and sys.argv[2] == "sync":
    o2 = t.make_config
    t.make_config = lambda a, d: (lambda c: attrs.evolve(c, levels=[attrs.evolve(l, io_deadline_s=None) if l.tier == "disk" else l for l in c.levels]))(o2(a, d))
T = "/work/shared/traces/mooncake_synthetic.jsonl"
t.main([T, "--limit", "1000", "--block-size", "64", "--reps", sys.argv[1], "--gpu-tokens", "500000", "--host-tokens", "1000000", "--disk-tokens", "3000000", "--out", f"/tmp/lean{time.time()}.json"])
print("lean/general", hits)
