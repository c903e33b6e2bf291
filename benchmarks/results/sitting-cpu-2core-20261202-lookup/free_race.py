"""vLLM's ``free`` against kvcm's ``close``, request by request in one process.

The workload shapes of ``vllm_host_overhead.py`` and ``kvcm bench manager`` (decode: 256
requests of 2048 tokens after 128 decode steps; prefill: 512 requests of 4096 tokens sharing
a 2048-token prefix), at 16 and 32 tokens per block. vLLM's requests are freed and kvcm's
caches closed in turn, one request of each side after the other (the order rotating), so
both see the same load on a shared machine. kvcm runs twice: with the ``close`` and
``Store.unlock_all`` of ``--base`` (the code before) and with the working tree's (after),
each on its own manager. Per request: microseconds per block held; reported: the median
request of each repetition (robust to preemption), then the median over repetitions, and
the mean (sum over sum) in brackets.

Run with vLLM's venv (``../../../shared/peer_bench/README.md``), with kvcm importable too:
``PYTHONPATH=<kvcm checkout>:<pluggy, google_crc32c> vllm-venv/bin/python free_race.py``.
"""

from __future__ import annotations

import argparse
import ast
import gc
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--peer-bench", default="/work/shared/peer_bench",
                    help="folder of vllm_host_overhead.py")
parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[3]),
                    help="kvcm checkout (for git show of --base)")
parser.add_argument("--base", default="cd426c3", help="commit of the 'before' close")
parser.add_argument("--reps", type=int, default=3)
args = parser.parse_args()
sys.path.insert(0, args.peer_bench)

import vllm_host_overhead as V  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import kvcm_core.cache as C  # noqa: E402
import kvcm_core.storage as S  # noqa: E402
from kvcm_core.bench.manager import make_manager, rand_tokens  # noqa: E402

ns = time.perf_counter_ns
SLOTS = 131072


def base_method(path: str, mod: Any, cls: str, name: str) -> Any:
    """Method ``cls.name`` as it was at ``--base``, bound to the current module's names."""
    src = subprocess.check_output(["git", "-C", args.repo, "show", f"{args.base}:{path}"],
                                  text=True)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    scope = dict(vars(mod))
                    exec(textwrap.dedent(ast.get_source_segment(src, f) or ""), scope)
                    return scope[name]
    raise LookupError(f"{cls}.{name} not found at {args.base}")


IMPL = {"kvcm_before": (base_method("kvcm_core/cache.py", C, "KVCache", "close"),
                        base_method("kvcm_core/storage.py", S, "Store", "unlock_all")),
        "kvcm_after": (C.KVCache.close, S.Store.unlock_all)}


def kvcm_decode(tpb: int, seed: int, batch: int = 256, ctx: int = 2048,
                steps: int = 128) -> list[Any]:
    rng = random.Random(seed)
    m = make_manager(tpb, SLOTS)
    caches = []
    for i in range(batch):
        prompt = rand_tokens(rng, ctx)
        c = m.create_kv_cache(None, prompt[:-1], id=i)
        assert c.resume() and c.resize(ctx)
        c.commit(prompt[c.history_length:])
        caches.append(c)
    for _ in range(steps):
        for c in caches:
            assert c.resize(c.capacity + 1)
            c.commit((rng.randrange(128_000),))
    return caches


def kvcm_prefill(tpb: int, seed: int, n: int = 512, length: int = 4096,
                 prefix: int = 2048) -> list[Any]:
    rng = random.Random(seed + 1_000_003)
    m = make_manager(tpb, SLOTS)
    system = rand_tokens(rng, prefix)
    caches = []
    for i in range(n):
        p = system + rand_tokens(rng, length - prefix)
        c = m.create_kv_cache(None, p, id=i)
        assert c.resume() and c.resize(length)
        c.commit(p[c.history_length:])
        caches.append(c)
    return caches


HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)


def vllm_decode(tpb: int, seed: int, batch: int = 256, ctx: int = 2048,
                steps: int = 128) -> tuple[Any, list[Any]]:
    rng = random.Random(seed)
    hasher = V.get_request_block_hasher(tpb, HASH)
    mgr = V.make_manager(tpb, SLOTS, 8192)
    reqs = []
    for i in range(batch):
        r = V.make_request(f"d{i}", V.rand_tokens(rng, ctx), hasher)
        cb, n_hit, _ = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, r.num_tokens - n_hit, n_hit, cb) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids(rng.randrange(V.VOCAB))
        reqs.append(r)
    for _ in range(steps):
        mgr.new_step_starts()
        for r in reqs:
            assert mgr.allocate_slots(r, 1) is not None
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(rng.randrange(V.VOCAB))
    return mgr, reqs


def vllm_prefill(tpb: int, seed: int, n: int = 512, length: int = 4096,
                 prefix: int = 2048) -> tuple[Any, list[Any]]:
    rng = random.Random(seed + 1_000_003)
    hasher = V.get_request_block_hasher(tpb, HASH)
    mgr = V.make_manager(tpb, SLOTS, 8192)
    system = V.rand_tokens(rng, prefix)
    reqs = [V.make_request(f"p{i}", system + V.rand_tokens(rng, length - prefix), hasher)
            for i in range(n)]
    for r in reqs:
        cb, n_hit, _ = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, r.num_tokens - n_hit, n_hit, cb) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
    return mgr, reqs


SIDES = ("vllm", "kvcm_before", "kvcm_after")
res: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
for rep in range(args.reps):
    for what, vbuild, kbuild in (("decode", vllm_decode, kvcm_decode),
                                 ("prefill", vllm_prefill, kvcm_prefill)):
        for tpb in (16, 32):
            mgr, reqs = vbuild(tpb, rep)
            caches = {"kvcm_before": kbuild(tpb, rep), "kvcm_after": kbuild(tpb, rep)}
            vblocks = [len(mgr.get_block_ids(r.request_id)[0]) for r in reqs]
            gc.collect()
            gc.freeze()
            per: dict[str, list[float]] = {k: [] for k in SIDES}
            tot = {k: [0, 0] for k in SIDES}
            for i in range(len(reqs)):
                order = list(SIDES[i % 3:] + SIDES[:i % 3])
                for side in order:
                    if side == "vllm":
                        t0 = ns()
                        mgr.free(reqs[i])
                        dt, nb = ns() - t0, vblocks[i]
                    else:
                        C.KVCache.close, S.Store.unlock_all = IMPL[side]
                        c = caches[side][i]
                        nb = c.num_blocks
                        t0 = ns()
                        c.close()
                        dt = ns() - t0
                    per[side].append(dt / nb / 1e3)
                    tot[side][0] += dt
                    tot[side][1] += nb
            C.KVCache.close, S.Store.unlock_all = IMPL["kvcm_after"]
            gc.unfreeze()
            for side in SIDES:
                res.setdefault((what, tpb, side), []).append(
                    (statistics.median(per[side]), tot[side][0] / tot[side][1] / 1e3))
            print(f"rep {rep} {what} tpb {tpb}: " + ", ".join(
                f"{s} {res[(what, tpb, s)][-1][0]:.3f}" for s in SIDES), flush=True)
            del mgr, reqs, caches
            gc.collect()

print("\n| us per block: median request (mean) | vLLM free | kvcm close before "
      "| kvcm close after |")
print("| --- | --- | --- | --- |")
for what in ("decode", "prefill"):
    for tpb in (16, 32):
        cells = []
        for side in SIDES:
            v = res[(what, tpb, side)]
            cells.append(f"{statistics.median(x[0] for x in v):.3f} "
                         f"({statistics.median(x[1] for x in v):.3f})")
        print(f"| {what}, {tpb}-token blocks | " + " | ".join(cells) + " |")
