import numpy as np, timeit, os
from kvcm_core.frame import FrameBook, FrameFormat
n=185; rng=np.random.default_rng(0)
book=FrameBook(FrameFormat(1, b'x'*16), 50000, 64)
slots=rng.permutation(50000)[:n].astype(np.int32)
pay=rng.integers(0,255,(n,64),dtype=np.uint8); keys=rng.integers(0,255,(n,32),dtype=np.uint8)
print(os.environ['TAG'], 'wrap us', round(min(timeit.repeat(lambda: book.wrap(slots,pay,keys),number=1000,repeat=7))/1000*1e6,2))
