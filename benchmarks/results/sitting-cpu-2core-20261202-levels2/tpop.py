import numpy as np, timeit, os
from kvcm_eviction_lru.segments import SegmentLruPolicy
def run():
    pol=SegmentLruPolicy(); nid=0
    for _ in range(40):
        for _ in range(3):
            pol.insert_many_checked_by_caller(np.arange(nid, nid+150, dtype=np.int64), 35); nid+=150
            pol.insert_many_checked_by_caller(np.arange(nid, nid+1, dtype=np.int64), 1); nid+=1
            pol.insert_many_checked_by_caller(np.arange(nid, nid+1, dtype=np.int64), 0); nid+=1
        pol.pop_victims(400)
print(os.environ['TAG'], 'fill+pop x40 us', round(min(timeit.repeat(run,number=20,repeat=7))/20*1e6,1))
