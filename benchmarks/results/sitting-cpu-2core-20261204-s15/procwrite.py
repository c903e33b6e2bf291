"""Prototype (not kvcm): the disk level's background writes handed straight from the
scheduler thread to a writer process (rows in a shared-memory ring, run list through a
pipe), no I/O thread involved. Reads, sync writes, resizes and closes first wait for the
process to finish everything submitted (correct, not clever). Levels replay figures.

    python wip/procwrite.py REPS [sync]
"""
import atexit, mmap, os, struct, subprocess, sys, time
import numpy as np
import kvcm_core.level_io as L
import kvcm_tier_disk as D
from kvcm_core.tier import CompletedIO, check_slots

CHILD = r"""
import os, sys, mmap, struct
fd, mfd, rfd, size = map(int, sys.argv[1:5])
ring = mmap.mmap(mfd, size)
mv = memoryview(ring)
ctr = mv[0:8].cast('Q')
def readn(n):
    out = b''
    while len(out) < n:
        got = os.read(rfd, n - len(out))
        if not got:
            sys.exit(0)
        out += got
    return out
while True:
    seq, nruns = struct.unpack('<QI', readn(12))
    body = readn(24 * nruns)
    for fo, ro, sz in struct.iter_unpack('<QQQ', body):
        os.pwrite(fd, mv[ro:ro + sz], fo)
    ctr[0] = seq
"""
RUN = np.dtype([("fo", "<u8"), ("ro", "<u8"), ("sz", "<u8")])
SIZE = 64 << 20
writers = {}


class Writer:
    def __init__(self, pool):
        self.pool = pool
        mfd = os.memfd_create("kvcm-ring")
        os.ftruncate(mfd, SIZE)
        self.ring = mmap.mmap(mfd, SIZE)
        self.arr = np.frombuffer(self.ring, np.uint8)
        self.ctr = self.arr[:8].view(np.uint64)
        r, w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(pool._fd), str(mfd), str(r),
                                      str(SIZE)], pass_fds=(pool._fd, mfd, r))
        os.close(r)
        os.close(mfd)
        self.w, self.head, self.seq = w, 64, 0
        atexit.register(self.stop)

    def submit(self, slots, rows):
        n, sb = rows.shape
        nb = n * sb
        if self.head + nb > SIZE:
            self.drain()
            self.head = 64
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        self.arr[self.head:self.head + nb].reshape(n, sb)[:] = rows[order]
        cuts = np.flatnonzero(s[1:] != s[:-1] + 1) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.append(cuts, n)
        msg = np.empty(len(starts), dtype=RUN)
        msg["fo"] = self.pool.data_offset + s[starts] * sb
        msg["ro"] = self.head + starts * sb
        msg["sz"] = (ends - starts) * sb
        self.seq += 1
        os.write(self.w, struct.pack("<QI", self.seq, len(msg)) + msg.tobytes())
        self.head += nb

    def drain(self):
        while int(self.ctr[0]) != self.seq:
            time.sleep(0)

    def stop(self):
        try:
            os.close(self.w)
        except OSError:
            pass
        self.proc.wait(5)


def drain(pool):
    w = writers.get(id(pool))
    if w is not None:
        w.drain()


o_write, o_read = L.DeadlinePool.write, L.DeadlinePool.read
o_resize, o_close = L.DeadlinePool.resize, L.DeadlinePool.close


def write(self, slots, source):
    io, inner = self.io, self.inner_pool
    if io.write_queue_depth and io.droppable and isinstance(inner, D.DiskPool):
        w = writers.get(id(inner))
        if w is None:
            w = writers[id(inner)] = Writer(inner)
        w.submit(check_slots(self, slots), source)
        return CompletedIO()
    drain(inner)
    return o_write(self, slots, source)


def read(self, slots, dest):
    drain(self.inner_pool)
    return o_read(self, slots, dest)


def resize(self, n):
    drain(self.inner_pool)
    return o_resize(self, n)


def close(self):
    w = writers.pop(id(self.inner_pool), None)
    if w is not None:
        w.drain()
        w.stop()
    return o_close(self)


L.DeadlinePool.write, L.DeadlinePool.read = write, read
L.DeadlinePool.resize, L.DeadlinePool.close = resize, close

if __name__ == "__main__":
    import attrs
    import kvcm_core.bench.trace as t
    if len(sys.argv) > 2 and sys.argv[2] == "sync":
        orig = t.make_config
        t.make_config = lambda a, d: (lambda c: attrs.evolve(c, levels=[attrs.evolve(
            lv, io_deadline_s=None) if lv.tier == "disk" else lv for lv in c.levels]))(orig(a, d))
    T = "/work/shared/traces/mooncake_synthetic.jsonl"
    t.main([T, "--limit", "1000", "--block-size", "64", "--reps", sys.argv[1], "--gpu-tokens",
            "500000", "--host-tokens", "1000000", "--disk-tokens", "3000000", "--out",
            f"/tmp/procwrite{time.time()}.json"])
