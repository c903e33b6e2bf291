import numpy as np, os
from kvcm_core.frame import _crcs
N=int(os.environ['N']); P=os.environ['P']
n=185; rng=np.random.default_rng(0)
pay=rng.integers(0,255,(n,64),dtype=np.uint8); keys=rng.integers(0,255,(n,32),dtype=np.uint8)
tmpl=np.zeros(68,np.uint8); seqs=np.arange(n,dtype=np.uint64)
out=np.empty((n,136),np.uint8)
for _ in range(N):
    if P=='assign':
        out[:, :68]=tmpl; out[:, 20:52]=keys; out[:, 56:64].view(np.uint64)[:,0]=seqs; out[:,68:132]=pay
    elif P=='crc':
        out[:,132:].view(np.uint32)[:,0]=_crcs(out,132)
