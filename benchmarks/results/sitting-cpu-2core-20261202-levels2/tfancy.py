import numpy as np, timeit
rng=np.random.default_rng(0)
src=rng.integers(0,255,(20000,64),dtype=np.uint8); dst=np.zeros((20000,64),np.uint8)
pairs=np.stack([rng.permutation(20000)[:185], rng.permutation(20000)[:185]],1).astype(np.int32)
vt=np.dtype((np.void,64)); sv=src.view(vt).reshape(-1); dv=dst.view(vt).reshape(-1)
def a(): dst[pairs[:,0]]=src[pairs[:,1]]
def b(): dv[pairs[:,0]]=sv[pairs[:,1]]
for _ in range(3):
    print('2d', min(timeit.repeat(a,number=2000,repeat=5))/2000*1e6, 'void', min(timeit.repeat(b,number=2000,repeat=5))/2000*1e6)
