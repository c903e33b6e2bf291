"""Prototype (not kvcm): the disk level's background writes submitted with glibc's POSIX
AIO (lio_listio, native worker threads: no Python thread, no GIL) from the scheduler's
thread. Reads, sync writes, resizes and closes first wait for every pending write.
    python wip/glibcaio.py REPS"""
import ctypes, errno, sys, time
import numpy as np
import kvcm_core.level_io as L
import kvcm_tier_disk as D
from kvcm_core.tier import CompletedIO, check_slots
libc = ctypes.CDLL(None, use_errno=True)
AIOCB = np.dtype({"names": ["fildes", "opcode", "buf", "nbytes", "sigev_notify", "error", "ret", "offset"],
                  "formats": ["<i4", "<i4", "<u8", "<u8", "<i4", "<i4", "<i8", "<i8"],
                  "offsets": [0, 4, 16, 24, 44, 112, 120, 128], "itemsize": 168})
LIO_WRITE, LIO_NOWAIT, SIGEV_NONE = 1, 1, 1
pending = []  # (cbs, ptrs, rows)
keep = []
stats = [0, 0]
def drain():
    while pending:
        cbs = pending[0][0]
        if (cbs["error"] == errno.EINPROGRESS).any():
            time.sleep(0)
            continue
        if (cbs["error"] != 0).any(): raise RuntimeError("aio write failed")
        pending.pop(0)
def reap():
    while pending and not (pending[0][0]["error"] == errno.EINPROGRESS).any():
        pending.pop(0)
o_write, o_read, o_resize, o_close = L.DeadlinePool.write, L.DeadlinePool.read, L.DeadlinePool.resize, L.DeadlinePool.close
def write(self, slots, source):
    io, inner = self.io, self.inner_pool
    if not (io.write_queue_depth and io.droppable and isinstance(inner, D.DiskPool)):
        drain(); return o_write(self, slots, source)
    reap()
    if len(pending) >= io.write_queue_depth:
        stats[1] += 1
        from kvcm_core.level_io import WriteQueueFull
        raise WriteQueueFull("full")
    arr = check_slots(self, slots)
    o = np.argsort(arr, kind="stable"); s = arr[o]
    rows = np.ascontiguousarray(source[o]); n, sb = rows.shape
    cuts = np.flatnonzero(s[1:] != s[:-1] + 1) + 1
    starts = np.concatenate(([0], cuts)); ends = np.append(cuts, n)
    k = len(starts)
    cbs = np.zeros(k, dtype=AIOCB)
    cbs["fildes"] = inner._fd; cbs["opcode"] = LIO_WRITE; cbs["sigev_notify"] = SIGEV_NONE
    cbs["buf"] = rows.ctypes.data + starts * sb; cbs["nbytes"] = (ends - starts) * sb
    cbs["offset"] = inner.data_offset + s[starts] * sb
    ptrs = np.uint64(cbs.ctypes.data) + np.arange(k, dtype=np.uint64) * np.uint64(168)
    if libc.lio_listio(LIO_NOWAIT, ctypes.c_void_p(ptrs.ctypes.data), k, None) != 0:
        raise OSError(ctypes.get_errno(), "lio_listio")
    pending.append((cbs, ptrs, rows)); stats[0] += 1
    return CompletedIO()
def read(self, slots, dest): drain(); return o_read(self, slots, dest)
def resize(self, n): drain(); return o_resize(self, n)
def close(self): drain(); return o_close(self)
L.DeadlinePool.write, L.DeadlinePool.read, L.DeadlinePool.resize, L.DeadlinePool.close = write, read, resize, close
if __name__ == "__main__":
    import kvcm_core.bench.trace as t
    T = "/work/shared/traces/mooncake_synthetic.jsonl"
    t.main([T, "--limit", "1000", "--block-size", "64", "--reps", sys.argv[1], "--gpu-tokens", "500000", "--host-tokens", "1000000", "--disk-tokens", "3000000", "--out", f"/tmp/gaio{time.time()}.json"])
    print("aio writes", stats)
