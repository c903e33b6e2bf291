"""Prototype: make room once per step (running growth + suspended cold pages [+ admissions])."""
import sys, math, time
import numpy as np
import kvcm_core.testing.engine as E
MODE = sys.argv[1]  # off | run | all
def room(self):
    t0 = time.perf_counter_ns()
    if MODE != "off":
        m = self.manager; ctx = m._ctx; L = ctx.levels; a = L.arena
        tpb = m.config.tokens_per_block
        need = {}
        def add(g, n):
            pg = L.pool_group_of(g); need[pg] = need.get(pg, 0) + n
        slots = self.max_batch - len(self.running)
        for req in self.running:
            c = req.cache; hist = c.history_length
            want = self.chunk_tokens if hist < req.prompt_len else 1
            new = min(len(req.tokens), hist + want)
            grow = -(-new // tpb) - -(-hist // tpb)
            if grow > 0:
                for g in ctx.attn_groups: add(g, grow)
        for req in []:
            for p in req.cache._all_pages():
                if a.level[p] > 0: add(int(a.group[p]), 1)
        for pg, n in need.items():
            st = L.stores[0][pg]
            target = L.capacity(st, st.num_free + n)
            if target > st.num_free:
                try: L.make_room(st, target)
                except Exception: pass
    sp.current['ahead'] += time.perf_counter_ns() - t0
    sp.current['ahead#'] += 1
if MODE != 'off': E.EngineLoop.room_ahead = room
def admit(self):
    t0 = time.perf_counter_ns()
    m = self.manager; ctx = m._ctx; L = ctx.levels; a = L.arena
    tpb = m.config.tokens_per_block
    k = min(len(self.waiting), self.max_batch - len(self.running))
    need = {}
    for req in list(self.waiting)[:k]:
        if req.cache is None:
            match_len = max(0, req.prompt_len - 1)
            req.cache = m.create_kv_cache(req.scope, req.tokens[:match_len], id=req.id,
                                          priority_callback=req.priority_callback)
            req.reused = req.cache.history_length
        for p in req.cache._all_pages():
            if a.level[p] != 0:
                pg = L.pool_group_of(int(a.group[p])); need[pg] = need.get(pg, 0) + 1
    for pg, n in need.items():
        st = L.stores[0][pg]
        target = L.capacity(st, st.num_free + n)
        if target > st.num_free:
            try: L.make_room(st, target)
            except Exception: pass
    sp.current['adm'] += time.perf_counter_ns() - t0
    sp.current['adm#'] += 1
if MODE == 'all': E.EngineLoop.admit_ahead = admit
sys.path.insert(0, "benchmarks")
import simulate_profile as sp
sp.run(["--out", "/tmp/ahead_" + MODE])
