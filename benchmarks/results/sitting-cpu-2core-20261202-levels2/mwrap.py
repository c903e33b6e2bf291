import numpy as np, sys, os
from kvcm_core.frame import FrameBook, FrameFormat
N=int(os.environ['N'])
n=185
rng=np.random.default_rng(0)
book=FrameBook(FrameFormat(1, b'x'*16), 50000, 64)
slots=rng.permutation(50000)[:n].astype(np.int32)
pay=rng.integers(0,255,(n,64),dtype=np.uint8)
keys=rng.integers(0,255,(n,32),dtype=np.uint8)
out=book.wrap(slots,pay,keys); book.check(slots,out)
for _ in range(N):
    book.wrap(slots,pay,keys)
