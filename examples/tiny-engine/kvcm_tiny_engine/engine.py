"""A continuous-batching engine whose KV lives in kvcm.

Each step (:meth:`TinyEngine.step`):

1. **Resume** suspended requests, oldest first (``cache.resume()``: their pages come back
   to the GPU level from host or disk), then **admit** waiting ones:
   ``manager.create_kv_cache(scope, prompt[:-1])`` matches the longest cached prefix (the
   last prompt token is always computed: its logits give the first output token), and
   ``resume()`` locks the pages on the GPU. A refused admission keeps its cache and
   retries ``resume()`` at the next step (with a level below the GPU).
2. **Schedule**: every running request asks for its next tokens, a prefill chunk or one
   decode token, within the token budget: ``cache.resize(history + n)`` gives pages for
   them. When the GPU level is full, the newest running request is **preempted** with
   ``cache.suspend()`` (its pages may then move down to host and disk) and the resize is
   tried again. With the GPU level alone, suspended pages could not move anywhere: the
   preempted request's cache is closed instead, and it is queued again (recomputed); so
   is the youngest suspended request when the colder levels cannot take its pages.
3. **Run the model** on all scheduled tokens at once: per layer, K/V of the step's tokens
   go into the pages of each request's page table (``cache.get_base_page_indices``), and
   each request's queries attend over the pages its table shows.
4. **Commit** the step's tokens (``cache.commit``: full blocks become reusable by later
   requests, stale window pages are released), sample greedily, and **close** finished
   requests (their trailing partial block is published too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from kvcm_core import CacheStatus, ConfigError, KVCacheManager, ReuseScope
from kvcm_tiny_engine.kv import LevelMoves, PagedKV, StepTables
from kvcm_tiny_engine.model import VOCAB, TinyModel

__all__ = ["EngineError", "EngineStats", "Request", "TinyEngine"]


class EngineError(RuntimeError):
    """The engine cannot make progress (a request larger than the GPU level, ...)."""


def _token_ids(prompt: Any) -> list[int]:
    ids = list(prompt.encode() if isinstance(prompt, str) else prompt)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int | np.integer)
           or not 0 <= t < VOCAB]
    if bad:
        raise ValueError(f"Request.prompt: token ids must be ints in 0..{VOCAB - 1} "
                         f"(bytes); got {bad[:5]}")
    if not ids:
        raise ValueError("Request.prompt: must hold at least one token")
    return [int(t) for t in ids]


def _count(field: str, low: int) -> Any:
    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(field.format(attr.name), value, f"must be an int >= {low}")
    return check


@attrs.define(eq=False)
class Request:
    """A generation request.

    Attributes:
        id: its name.
        prompt: bytes of text (a ``str`` is UTF-8 encoded) or token ids in 0..255.
        max_new_tokens: tokens to generate greedily.
        arrival_step: engine step at which it arrives.
        scope: kvcm reuse scope (tenant, adapter); None is the default scope.
        output: generated tokens; ``logits[i]`` gave ``output[i]``.
        reused_tokens: prompt tokens whose KV came from kvcm's prefix tree (at its first
            admission).
        preemptions: times it was preempted to make room (suspended; closed, with the GPU
            level alone).
        recomputes: times its cache was closed and the request queued again, to be
            matched again and to compute what kvcm no longer holds (see
            :meth:`TinyEngine.step`).
    """

    id: str
    prompt: list[int] = attrs.field(converter=_token_ids)
    max_new_tokens: int = attrs.field(default=8, validator=_count("Request.{}", 1))
    arrival_step: int = attrs.field(default=0, validator=_count("Request.{}", 0))
    scope: ReuseScope | None = None
    output: list[int] = attrs.field(factory=list)
    logits: list[np.ndarray] = attrs.field(factory=list)
    reused_tokens: int = 0
    preemptions: int = 0
    recomputes: int = 0
    cache: Any = None
    order: int = -1

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@attrs.define
class EngineStats:
    """What a run did.

    Attributes:
        steps: engine steps.
        prompt_tokens: prompt tokens of the admitted requests.
        reused_prompt_tokens: of those, tokens kvcm held already (spared the model).
        computed_tokens: tokens the model ran (prefill and decode).
        preemptions: requests preempted to make room: suspended, or, with the GPU level
            alone (where a suspended cache's pages cannot go anywhere), closed and queued
            again (also counted in ``recomputes``); ``resumes`` of suspended requests.
        kept_at_preemption: history tokens the suspended requests kept (a preemption that
            drops the cache would compute them again).
        recomputes: caches closed to queue their request again (``Request.recomputes``);
            ``dropped_at_recompute``: the history tokens they had (what kvcm still holds
            of them is matched again).
        shortened_matches: admissions whose matched prefix was cut, because its resume
            was refused with nothing else running (see :meth:`TinyEngine.step`).
        onboarded_by_level: blocks brought up to the GPU level, by the level they left
            (level 2 is the disk level of :func:`~kvcm_tiny_engine.demo.demo_levels`).
    """

    steps: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    computed_tokens: int = 0
    preemptions: int = 0
    resumes: int = 0
    kept_at_preemption: int = 0
    recomputes: int = 0
    dropped_at_recompute: int = 0
    shortened_matches: int = 0
    onboarded_by_level: dict[int, int] = attrs.Factory(dict)

    def summary(self) -> str:
        share = self.reused_prompt_tokens / max(1, self.prompt_tokens)
        return (f"{self.steps} steps; prompt tokens {self.prompt_tokens}, of which kvcm "
                f"spared the model {self.reused_prompt_tokens} ({share:.0%}); computed "
                f"{self.computed_tokens} tokens; {self.preemptions} preemptions "
                f"({self.kept_at_preemption} tokens kept), {self.resumes} resumes; "
                + (f"{self.recomputes} recomputes ({self.dropped_at_recompute} tokens "
                   f"dropped); " if self.recomputes else "")
                + (f"{self.shortened_matches} matches cut to fit; "
                   if self.shortened_matches else "")
                + f"blocks brought back to the GPU by level they left "
                f"{dict(sorted(self.onboarded_by_level.items()))}")


class TinyEngine:
    """Continuous batching over kvcm.

    Args:
        model: the model (its ops decide NumPy or torch).
        manager: a manager configured with :func:`~kvcm_tiny_engine.kv.kvcm_config`.
        moves: the level-move counter of :func:`~kvcm_tiny_engine.kv.make_manager`.
        chunk_tokens: prefill chunk size.
        max_batch: requests running at once.
        token_budget: tokens per step (prefill chunks shrink to fit).
    """

    def __init__(self, model: TinyModel, manager: KVCacheManager,
                 moves: LevelMoves | None = None, *, chunk_tokens: int = 32,
                 max_batch: int = 4, token_budget: int = 64) -> None:
        for field, value in (("chunk_tokens", chunk_tokens), ("max_batch", max_batch),
                             ("token_budget", token_budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TinyEngine.{field}", value, "must be an int >= 1")
        self.model = model
        self.manager = manager
        self.moves = moves
        self.kv = PagedKV(manager, model.config, model.ops)
        self.chunk_tokens = chunk_tokens
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.future: list[Request] = []
        self.waiting: list[Request] = []
        self.suspended: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = EngineStats()
        self._orders = 0

    # -- queues ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        request.order = self._orders
        self._orders += 1
        self.future.append(request)

    @property
    def idle(self) -> bool:
        return not (self.future or self.waiting or self.suspended or self.running)

    def _arrive(self) -> None:
        now = self.stats.steps
        if not (self.waiting or self.suspended or self.running) and self.future:
            now = max(now, min(r.arrival_step for r in self.future))  # skip idle steps
            self.stats.steps = now
        arrived = [r for r in self.future if r.arrival_step <= now]
        self.future = [r for r in self.future if r.arrival_step > now]
        self.waiting.extend(sorted(arrived, key=lambda r: r.order))

    def _resume_and_admit(self) -> None:
        while self.suspended and len(self.running) < self.max_batch:
            req = self.suspended[0]
            if not req.cache.resume():
                return  # not enough room yet; admit nobody ahead of it
            self.suspended.pop(0)
            self.running.append(req)
            self.stats.resumes += 1
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            cache = req.cache  # kept from a refused admission (see below), or None
            if cache is None:
                # Every known token but the last is matched (its logits give the next
                # token); a request queued again after a recompute matches its output too.
                cache = self.manager.create_kv_cache(req.scope, req.tokens[:-1], id=req.id)
            if not cache.resume():
                if self.running or self.suspended:
                    if len(self.manager.levels) == 1:
                        # Give the claims back while it waits (held pages could fill the
                        # GPU level, which they cannot leave); matched again later.
                        cache.close()
                        req.cache = None
                    else:
                        # Keep the cache and retry its resume only: a refused resume is
                        # decided before any per-page work, while creating and closing a
                        # cache every step costs far more (docs/semantics.md, "Waiting
                        # for room, cheaply"); its held pages can still move down.
                        req.cache = cache
                    return
                req.cache = None
                # Nothing else holds the GPU level, so this refusal would come back at
                # every retry (last_refusal says why: typically the matched prefix alone
                # is over max_util_for_resume). Reuse less and compute the rest.
                cache = self._shorter_match(req, cache)
            for group in range(self.manager.num_cache_groups):
                blocks = cache.recompute_blocks(group)
                if blocks:  # only with reuse policies other than REQUIRED
                    cache.close()
                    raise EngineError(
                        f"request {req.id}: kvcm asks to recompute blocks {blocks} of "
                        f"group {group}; this engine uses REQUIRED reuse only and does "
                        "not recompute")
            req.cache = cache
            if not req.recomputes:  # counted at the first admission only
                req.reused_tokens = cache.history_length
                self.stats.prompt_tokens += len(req.prompt)
                self.stats.reused_prompt_tokens += req.reused_tokens
            self.waiting.pop(0)
            self.running.append(req)

    def _shorter_match(self, req: Request, refused: Any) -> Any:
        """A resumed cache for ``req`` whose matched prefix is cut (halved, in whole blocks,
        down to none) until its ``resume`` succeeds; ``refused`` (closed here) is the cache
        whose resume was refused with nothing else running.

        Raises:
            EngineError: even without reuse the resume is refused (with the refusals'
                ``last_refusal``).
        """
        first = refused.last_refusal
        length = refused.history_length
        refused.close()
        tpb = self.manager.tokens_per_block
        while True:
            length = length // 2 // tpb * tpb
            cache = self.manager.create_kv_cache(req.scope, req.tokens[:length], id=req.id)
            if cache.resume():
                self.stats.shortened_matches += 1
                return cache
            last = cache.last_refusal
            cache.close()
            if not length:
                raise EngineError(f"request {req.id} cannot be admitted with nothing else "
                                  f"running: {first}; without reuse: {last}")

    def _recompute(self, req: Request) -> None:
        """Close ``req``'s cache and queue it first, to be admitted again: its committed
        blocks stay cached and are matched again; the rest is computed again."""
        self.stats.recomputes += 1
        self.stats.dropped_at_recompute += req.cache.history_length
        req.recomputes += 1
        req.cache.close()
        req.cache = None
        self._release_kept()  # only the head of the queue, retried, may keep a cache
        self.waiting.insert(0, req)

    def _release_kept(self) -> bool:
        """Close the cache the head of the queue kept after a refused admission, if any
        (whether one was closed): before anything is preempted for a running request, or
        before another request is put in front of it. It is matched again when retried."""
        if self.waiting and self.waiting[0].cache is not None:
            self.waiting[0].cache.close()
            self.waiting[0].cache = None
            return True
        return False

    def _preempt(self, req: Request) -> None:
        """Suspend ``req``: its pages may then move down to a colder level. With the GPU
        level alone, a suspended cache's pages could go nowhere and suspending would free
        nothing: close the cache instead and queue the request again (recompute)."""
        req.preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(req)
        if len(self.manager.levels) == 1:
            self._recompute(req)
            return
        req.cache.suspend()
        self.stats.kept_at_preemption += req.cache.history_length
        self.suspended.append(req)
        self.suspended.sort(key=lambda r: r.order)

    def _schedule(self) -> list[tuple[Request, int, int]]:
        """Resize every running request for its next tokens, preempting the newest when
        the GPU level is full. Returns ``(request, start, end)`` per scheduled request."""
        self.running.sort(key=lambda r: r.order)
        budget = self.token_budget
        plan = []
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue  # preempted for an older request this step / no budget left
            cache = req.cache
            start = cache.history_length
            known = len(req.prompt) + len(req.output)
            n = min(self.chunk_tokens, len(req.prompt) - start) if start < len(req.prompt) \
                else known - start
            n = min(n, budget)
            while not cache.resize(start + n):
                if self._release_kept():
                    continue  # its held claims may hold the very pages this one needs
                newer = [r for r in self.running if r.order > req.order]
                if newer:
                    self._preempt(max(newer, key=lambda r: r.order))
                    continue
                if len(self.running) == 1 and not plan and self.suspended:
                    # Suspending freed too little: the colder levels cannot take the
                    # suspended requests' held pages (last_refusal: "no colder level can
                    # take the held pages"). Recompute the youngest of them and this one.
                    victim = max((*self.suspended, req), key=lambda r: r.order)
                    if victim is req:
                        self.running.remove(req)
                        self._recompute(req)
                        break
                    self.suspended.remove(victim)
                    self._recompute(victim)
                    continue
                if len(self.running) == 1 and not plan:
                    raise EngineError(
                        f"request {req.id} needs {start + n} tokens of pages and the GPU "
                        "level cannot provide them even with every other request "
                        f"preempted: {cache.last_refusal}")
                self._preempt(req)
                break
            else:
                plan.append((req, start, start + n))
                budget -= n
        return plan

    # -- the model step -------------------------------------------------------------------

    def _forward(self, plan: list[tuple[Request, int, int]]) -> list[np.ndarray | None]:
        """Run the model on every scheduled token; logits for requests whose step reaches
        the end of their known tokens (the next token is due)."""
        model, kv, ops = self.model, self.kv, self.model.ops
        tpb = self.manager.tokens_per_block
        # Page lookups per request and cache group: where K/V go, which pages are read.
        tables = [{g: StepTables(req.cache.get_base_page_indices(g), a, b, tpb)
                   for g in set(kv.group)} for req, a, b in plan]
        writes = {}
        for g in set(kv.group):
            writes[g] = (ops.index(np.concatenate([t[g].write_slots for t in tables])),
                         ops.index(np.concatenate([t[g].write_rows for t in tables])))
        reads = [{g: (ops.index(t[g].read_slots), ops.index(t[g].read_keep),
                      t[g].read_positions) for g in t} for t in tables]
        positions = [np.arange(a, b) for _, a, b in plan]
        tokens = np.concatenate([req.tokens[a:b] for req, a, b in plan])
        bounds = np.cumsum([0] + [b - a for _, a, b in plan]).tolist()
        # kvcm's copies (pages brought back, partial blocks copied) must be done first.
        self.manager.backend.synchronize()
        step_positions = np.concatenate(positions)
        x = model.embed(tokens)
        for layer, g in enumerate(kv.group):
            q, k, v = model.qkv(layer, x, step_positions)
            kv.write(layer, *writes[g], k, v)
            outs = []
            for i, pos in enumerate(positions):
                slots, keep, k_pos = reads[i][g]
                keys, values = kv.read(layer, slots, keep)
                outs.append(model.attend(layer, q[bounds[i]:bounds[i + 1]], pos, keys, values,
                                         k_pos))
            x = model.finish_layer(layer, x, ops.cat(outs, axis=0))
        due = [i for i, (req, _, b) in enumerate(plan) if b == len(req.tokens)]
        out: list[np.ndarray | None] = [None] * len(plan)
        if due:
            rows = ops.index(np.asarray([bounds[i + 1] - 1 for i in due]))
            for i, row in zip(due, ops.to_numpy(model.logits(x[rows])), strict=True):
                out[i] = row
        ops.sync()  # the pages are written before kvcm may move them
        return out

    def step(self) -> int:
        """One engine step; returns the tokens it computed."""
        self._arrive()
        self._resume_and_admit()
        recomputes = self.stats.recomputes
        plan = self._schedule()
        if not plan and self.suspended and not self.running:
            # The oldest suspended request cannot resume with nothing else running, so its
            # refusal would come back at every step (last_refusal says why: typically it
            # grew past max_util_for_resume of the GPU level while it ran, which resize
            # allows). Close it and queue it again: it is matched again (less, if need
            # be) and computes the rest. Unless the schedule just closed one to make
            # room: the resume is tried again first.
            if self.stats.recomputes == recomputes:
                self._recompute(self.suspended.pop(0))
            return 0
        if not plan:
            if self.running or self.suspended or self.waiting:
                stuck = [r.id for r in (*self.running, *self.suspended, *self.waiting)]
                raise EngineError(f"no request could run at step {self.stats.steps}; "
                                  f"waiting: {stuck[:8]}")
            return 0
        logits = self._forward(plan)
        for (req, _, b), row in zip(plan, logits, strict=True):
            cache = req.cache
            cache.commit(req.tokens[cache.history_length:b])
            if row is not None:
                req.logits.append(row)
                req.output.append(int(np.argmax(row)))
            if req.finished:
                cache.close()
                self.running.remove(req)
                self.finished.append(req)
        self._collect_stats()
        self.stats.steps += 1
        self.stats.computed_tokens += sum(b - a for _, a, b in plan)
        return sum(b - a for _, a, b in plan)

    def _collect_stats(self) -> None:
        self.manager.flush_events()  # deliver this step's events to the sinks
        if self.moves is not None:
            self.stats.onboarded_by_level = {
                src: n for (src, dst), n in self.moves.moves.items() if dst == 0}

    def run(self, requests: Iterable[Request] = (), max_steps: int = 100_000) -> EngineStats:
        """Submit ``requests`` and step until all finished."""
        for req in requests:
            self.submit(req)
        for _ in range(max_steps):
            if self.idle:
                return self.stats
            self.step()
        raise EngineError(f"not finished after {max_steps} steps")

    def close(self) -> None:
        """Close every cache still open (the manager stays up)."""
        for req in (*self.running, *self.suspended, *self.waiting):
            if req.cache is not None and req.cache.status is not CacheStatus.CLOSED:
                req.cache.close()
        for req in self.waiting:  # a cache kept while waiting: created again if retried
            req.cache = None
        self.running.clear()
        self.suspended.clear()
