"""Usage: python ab.py MODE  -> prints 'wall cpu hit' for one replay of the first 1000 requests."""
import sys, numpy as np, tempfile, time, gc, shutil
from kvcm_core.simulate.mooncake import read_trace, prompt_tokens
from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.manager import KVCacheManager
mode = sys.argv[1]
import os
if os.environ.get("NOLEAF"):
    from kvcm_core.cache_publish import PublishMixin
    PublishMixin._demote_leaf = lambda self: None
recs = read_trace('/work/shared/traces/mooncake_synthetic.jsonl', 1000)
prompts=[prompt_tokens(r) for r in recs]
bs=64; P=64; F=72
if os.environ.get("NOFRAMES"):
    import kvcm_core.frame as _fr
    _fr.framed = lambda tier: False
    F = 0
if mode == 'gpu':
    levels=[LevelConfig(tier='gpu', quota=4500000//bs*P)]
else:
    d = tempfile.mkdtemp()
    levels=[LevelConfig(tier='gpu', quota=500000//bs*P), LevelConfig(tier='host', quota=1000000//bs*P),
            LevelConfig(tier='disk', quota=3000000//bs*(P+F), options={'path': d})]
cfg = KVCacheManagerConfig(tokens_per_block=bs, layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role='kv', size=P)])],
                           levels=levels, kernel_backend='numpy')
m = KVCacheManager(cfg)
gc.collect()
hit=tot=0
w0=time.perf_counter(); c0=time.process_time()
import os
for p in prompts[:int(os.environ.get("K", "1000"))]:
    c = m.create_kv_cache(None, p); ok = c.resume() and c.resize(len(p)); r=c.history_length; c.commit(p[r:]); c.close(); hit+=r; tot+=len(p)
w=time.perf_counter()-w0; cpu=time.process_time()-c0
nb = tot/bs
nb = nb or 1
print(f"{w/nb*1e6:.3f} {cpu/nb*1e6:.3f} {hit/tot:.5f}")
m.shutdown()
