"""Floor of one request's three-level cascade written as plain NumPy (a prototype, not kvcm).

Per request, ``K`` pages are dropped at the disk level (their keys leave a dict index),
``K`` host pages move into the freed disk slots (framed: a header template, the block
key, the payload, CRC-32C of header and payload; one ``pwrite`` per run of consecutive
slots) and ``K`` GPU pages move into the freed host slots. Pages leave each level oldest
first, so victims are array slices: no eviction queues, events, statistics, several
groups or failure handling, which kvcm has and this floor does not.

    python3 floor.py    # prints the median and minimum microseconds per request
"""

import os
import statistics
import tempfile
import time
from itertools import repeat

import google_crc32c
import numpy as np

K = 172  # pages per request in the levels replay (64-token blocks)
PAGE, HEAD, TAIL = 64, 68, 4  # payload, frame header and CRC bytes
FRAME = HEAD + PAGE + TAIL
GPU_SLOTS, HOST_SLOTS, DISK_SLOTS = 7812, 15625, 46875
PAGES = 200_000
DISK_SLOT_SPAN = 40_000  # disk slots in use: requests' pages land in runs

rng = np.random.default_rng(0)
gpu = np.zeros((GPU_SLOTS, PAGE), np.uint8)
host = np.zeros((HOST_SLOTS, PAGE), np.uint8)
level = np.zeros(PAGES, np.int8)
slot = np.arange(PAGES, dtype=np.int64) % DISK_SLOT_SPAN
keys = rng.integers(0, 255, (PAGES, 32), dtype=np.uint8)
key_objects = np.array([bytes(k) for k in keys], dtype=object)
index = {k: i for i, k in enumerate(key_objects.tolist())}
header = np.zeros(HEAD, np.uint8)
path = os.path.join(tempfile.mkdtemp(), "disk")
fd = os.open(path, os.O_RDWR | os.O_CREAT)
os.ftruncate(fd, DISK_SLOTS * FRAME)


def crcs(frames: np.ndarray, body: int) -> np.ndarray:
    flat, width = frames.tobytes(), frames.shape[1]
    parts = (flat[i * width : i * width + body] for i in range(len(frames)))
    return np.fromiter(map(google_crc32c.value, parts), np.uint32, len(frames))


def request(i: int) -> None:
    victims = np.arange(i * K, (i + 1) * K)  # the same ids stand for each level's oldest
    # The disk level drops its oldest pages.
    freed = slot[victims]
    level[victims] = -1
    list(map(index.pop, key_objects[victims].tolist(), repeat(None)))
    # Host pages into the freed disk slots, framed, one pwrite per run.
    order = np.argsort(freed)
    disk_slots = freed[order]
    frames = np.empty((K, FRAME), np.uint8)
    frames[:, :HEAD] = header
    frames[:, 4:36] = keys[victims][order]
    frames[:, HEAD : HEAD + PAGE] = host[slot[victims][order] % HOST_SLOTS]
    frames[:, HEAD + PAGE :].view(np.uint32)[:, 0] = crcs(frames, HEAD + PAGE)
    cuts = (np.nonzero(disk_slots[1:] != disk_slots[:-1] + 1)[0] + 1).tolist()
    for a, b in zip([0, *cuts], [*cuts, K], strict=True):
        os.pwrite(fd, frames[a:b].data, int(disk_slots[a]) * FRAME)
    level[victims] = 2
    host_slots = slot[victims].copy()
    slot[victims[order]] = disk_slots
    # GPU pages into the freed host slots.
    host[host_slots % HOST_SLOTS] = gpu[slot[victims] % GPU_SLOTS]
    level[victims] = 1
    slot[victims] = host_slots


for i in range(20):  # warm up
    request(i)
times = []
for i in range(20, 800):
    t0 = time.perf_counter_ns()
    request(i)
    times.append(time.perf_counter_ns() - t0)
os.close(fd)
os.remove(path)
print(f"cascade floor: median {statistics.median(times) / 1e3:.1f} us, "
      f"min {min(times) / 1e3:.1f} us per request of {K} pages")
