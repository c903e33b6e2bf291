"""Python heap of the prefix tree per cached block (issue 9: at most 300 bytes at 1M cached
blocks), measured with tracemalloc on a manager with one full-attention layer, one tiny
buffer and 16-token blocks, filled with 1M distinct cached blocks (prompts of 256 blocks,
each committed and closed). Prints the tree's parts (its arrays, the key index, the keys,
the ints the index maps to) and what the rest of the manager holds.

Usage: python benchmarks/tree_memory.py [--blocks N]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc

import numpy as np

from kvcm_core.bench.manager import fill_cache
from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.manager import KVCacheManager

ap = argparse.ArgumentParser()
ap.add_argument("--blocks", type=int, default=1_000_000)
args = ap.parse_args()
TPB, PER = 16, 256
tracemalloc.start()
t0 = tracemalloc.get_traced_memory()[0]
m = KVCacheManager(KVCacheManagerConfig(
    tokens_per_block=TPB,
    layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=4)])],
    levels=[LevelConfig(tier="gpu", quota=(args.blocks + PER) * 4)], kernel_backend="numpy"))
t1 = tracemalloc.get_traced_memory()[0]
start = time.time()
i = fill_cache(m, random.Random(0), args.blocks, TPB, PER)
gc.collect()
t2 = tracemalloc.get_traced_memory()[0]
tree = m.tree
nodes = tree.num_nodes
arrays = {k: v.nbytes for k, v in vars(tree).items() if isinstance(v, np.ndarray)}
index = sys.getsizeof(tree.index)
keys = sum(sys.getsizeof(k) for k in tree.index)
ints = sum(sys.getsizeof(v) for v in tree.index.values() if not -5 <= v <= 256)
tree_total = sum(arrays.values()) + index + keys + ints
print(f"python {sys.version.split()[0]}, numpy {np.__version__}; filled {i} prompts in "
      f"{time.time() - start:.0f} s; cached blocks (tree.num_nodes) {nodes:,}")
print(f"traced: manager built {t1 - t0:,} B, after the fill {t2 - t0:,} B: "
      f"{(t2 - t0) / nodes:.1f} B per cached block in all")
parts = ", ".join(f"{k} {v / nodes:.1f}" for k, v in sorted(arrays.items(), key=lambda x: -x[1]))
print(f"tree arrays {sum(arrays.values()) / nodes:.1f} B/block ({parts})")
print(f"key index (dict) {index / nodes:.1f}, keys (bytes objects) {keys / nodes:.1f}, "
      f"node ids it maps to (ints) {ints / nodes:.1f} B/block")
print(f"PREFIX TREE {tree_total / nodes:.1f} B per cached block; the rest of the manager "
      f"{(t2 - t0 - tree_total) / nodes:.1f}")
m.shutdown()
