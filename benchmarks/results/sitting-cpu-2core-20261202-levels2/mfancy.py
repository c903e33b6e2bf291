import numpy as np, os
N=int(os.environ['N'])
rng=np.random.default_rng(0)
src=rng.integers(0,255,(20000,64),dtype=np.uint8); dst=np.zeros((20000,64),np.uint8)
pairs=np.stack([rng.permutation(20000)[:185], rng.permutation(20000)[:185]],1).astype(np.int32)
V=os.environ.get('V')
if V:
    vt=np.dtype((np.void,64)); sv=src.view(vt).reshape(-1); dv=dst.view(vt).reshape(-1)
for _ in range(N):
    if V: dv[pairs[:,0]]=sv[pairs[:,1]]
    else: dst[pairs[:,0]]=src[pairs[:,1]]
if V: assert (dst[pairs[:,0]]==src[pairs[:,1]]).all()
