import numpy as np, os, array
import google_crc32c
from kvcm_core.frame import _row_slices
v=google_crc32c.value
N=int(os.environ['N']); P=os.environ['P']
n=185; rng=np.random.default_rng(0)
out=rng.integers(0,255,(n,136),dtype=np.uint8)
for _ in range(N):
    flat=out.tobytes(); sl=_row_slices(n,136,132)
    if P=='fromiter':
        r=np.fromiter(map(v, map(flat.__getitem__, sl)), np.uint32, n)
    elif P=='array':
        r=np.frombuffer(array.array('I', map(v, map(flat.__getitem__, sl[:n]))), dtype=np.uint32)
    elif P=='list':
        r=list(map(v, map(flat.__getitem__, sl[:n])))
assert P=='list' or N==0 or (r==np.fromiter(map(v, map(flat.__getitem__, sl)), np.uint32, n)).all()
