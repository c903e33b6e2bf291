import numpy as np, os
from kvcm_eviction_lru.segments import SegmentLruPolicy
N=int(os.environ['N'])
pol=SegmentLruPolicy()
nid=0
def fill(m):
    global nid
    # per "request": one big segment at 35 and singles at 1 and 0
    for _ in range(m):
        pol.insert_many_checked_by_caller(np.arange(nid, nid+150, dtype=np.int64), 35); nid+=150
        pol.insert_many_checked_by_caller(np.arange(nid, nid+1, dtype=np.int64), 1); nid+=1
        pol.insert_many_checked_by_caller(np.arange(nid, nid+1, dtype=np.int64), 0); nid+=1
fill(5)
for _ in range(N):
    fill(3)
    pol.pop_victims(400)
