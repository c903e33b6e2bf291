"""An engine loop around the fingerprint engine: admit, prefill in chunks, decode, commit,
preempt by suspend, finish. Tests and ``kvcm simulate`` share it.

A :class:`Request` knows all its tokens in advance (prompt then output), so that every
step's KV can be written and checked; ``prompt_len`` tokens are prefilled in chunks, the
rest are decoded one per step.

Two optional behaviours of a real engine (off by default):

- ``batch_ops``: the running rows grow for the step with one
  :meth:`Batch.resize <kvcm_core.batch.Batch.resize>` (a row it cannot grow falls back to
  its own ``resize`` and preemption), and a request leaving the batch has the last seated
  row moved into its hole with :meth:`Batch.move <kvcm_core.batch.Batch.move>` (rows stay
  dense). After each step's publish the batch's tables (every row, every group, block
  counts) are checked against each seated cache's own page tables
  (:meth:`FingerprintEngine.check_batch`), and the fingerprint check reads every page
  through the batch's tables.
- ``rewind_every`` / ``rewind_draft``: speculative decoding. On some decode steps (every
  ``rewind_every``-th on average, chosen by a hash of the request and its history) a
  request drafts ``k <= rewind_draft`` tokens past its next one: capacity grows by
  ``1 + k``, the step writes the KV of the true next token and of the drafts (draft token
  ids that differ from the request's true tokens wherever a draft is rejected), history is
  moved over all of them (``resize(capacity, history_length=capacity)``), then rewound to
  the accepted ones (``resize(h, history_length=h)``, at most ``max_rewind_len`` back) and
  the accepted tokens committed. A rejected draft's KV left visible to a later read is
  wrong KV the fingerprint check finds. Needs ``max_rewind_len >= 1``; refused for models
  with SSM layers (they cannot rewind: docs/semantics.md).
"""

from __future__ import annotations

import itertools
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.batch import Batch
from kvcm_core.cache import CacheStatus
from kvcm_core.config import AttentionLayerConfig
from kvcm_core.errors import CorruptPageError, TierIOError
from kvcm_core.radix import token_id32
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork
from kvcm_core.testing.sparse_engine import SparseSteps
from kvcm_core.types import ReuseScope

__all__ = ["EngineLoop", "Request", "chat_requests"]


@attrs.define(eq=False)
class Request:
    """A request whose tokens are known in advance.

    Attributes:
        id: identifier.
        tokens: prompt followed by the output tokens.
        prompt_len: tokens prefilled (in chunks) before decoding starts.
        scope: reuse scope.
        priority_callback: passed to ``create_kv_cache``.
    """

    id: Any
    tokens: list[Any]
    prompt_len: int
    scope: ReuseScope | None = None
    priority_callback: Callable[[int], int] | None = None
    cache: Any = None
    reused: int = 0
    preemptions: int = 0
    arrival: int = 0  # submission order: earlier requests are preempted last

    @property
    def done(self) -> bool:
        return self.cache is not None and self.cache.history_length >= len(self.tokens)


@attrs.define
class StepReport:
    """What one :meth:`EngineLoop.step` did."""

    stepped: int = 0
    tokens: int = 0
    finished: list[Request] = attrs.Factory(list)
    preempted: list[Request] = attrs.Factory(list)
    resumed: list[Request] = attrs.Factory(list)
    recomputed: list[Request] = attrs.Factory(list)  # suspended ones given back to recompute


class EngineLoop:
    """A small continuous-batching scheduler driving the manager through the fingerprint
    engine.

    Args:
        manager: the KV-cache manager.
        chunk_tokens: prefill chunk size.
        max_batch: most requests running at once.
        token_budget: most tokens processed per step (prefill chunks shrink to fit).
        check: run the fingerprint check every step (on by default).
        close_finished: close requests when they finish (else the caller does).
        preempt_mode: ``"suspend"``, ``"recompute"`` (close and queue again) or ``"auto"``
            (recompute when there is a single level, where suspending frees no GPU page).
        use_batch: seat running requests in a :class:`~kvcm_core.batch.Batch` of
            ``max_batch`` rows and read every page table through its published device
            tables (on by default); rows are as wide as the GPU level has slots.
        index_tables: also register every attention buffer's index table in the batch;
            the fingerprint engine then addresses the pages of layer-by-layer (SWA
            scratch) steps through the batch's converted tables.
        stream: the engine's stream (None: the backend's default stream).
        recompute_lost: a ``resume`` that raises ``TierIOError`` (cold pages lost to a
            storage failure or a missed I/O deadline) or ``CorruptPageError`` (a cold page
            failed its frame check) closes the cache and queues the request again to be
            recomputed from what is still cached, as an engine should; off by default
            (the error propagates).
        batch_ops: grow rows with ``Batch.resize`` and compact them with ``Batch.move``
            (see the module docstring); needs ``use_batch``, no sparse layers.
        rewind_every, rewind_draft: speculative decoding with rewinds (module docstring);
            0: off.
    """

    def __init__(self, manager: Any, *, chunk_tokens: int = 64, max_batch: int = 64,
                 token_budget: int | None = None, check: bool = True,
                 close_finished: bool = True, preempt_mode: str = "auto",
                 use_batch: bool = True, index_tables: bool = False,
                 recompute_lost: bool = False, sparse_seed: int = 0,
                 stream: Any = None, room_ahead: bool = True, batch_ops: bool = False,
                 rewind_every: int = 0, rewind_draft: int = 0) -> None:
        if preempt_mode not in ("auto", "suspend", "recompute"):
            raise ValueError(f"preempt_mode={preempt_mode!r}: must be auto, suspend or "
                             "recompute")
        if batch_ops and (not use_batch or _has_sparse(manager)):
            raise ValueError("batch_ops=True needs use_batch=True and a model without "
                             "sparse layers")
        self.rewind_every = rewind_every if rewind_draft > 0 else 0
        self.rewind_draft = rewind_draft
        if self.rewind_every:
            if any(not isinstance(layer, AttentionLayerConfig)
                   for layer in manager.config.layers):
                raise ValueError("rewinds: a model with SSM layers cannot rewind history "
                                 "(docs/semantics.md)")
            if manager.config.max_rewind_len < 1:
                raise ValueError("rewinds need max_rewind_len >= 1")
        self.batch_ops = batch_ops
        #: What the optional behaviours did: Batch.resize calls and the rows they grew,
        #: Batch.move calls, speculative steps, rewinds (steps that rewound history) and
        #: the draft tokens rewound, checks of the batch's tables.
        self.counters = {"batch_resize_calls": 0, "batch_resize_rows": 0,
                         "batch_resize_refused_rows": 0, "batch_moves": 0,
                         "speculative_steps": 0, "rewinds": 0, "rewound_tokens": 0,
                         "batch_table_checks": 0}
        self._planned: set[int] = set()  # id() of requests Batch.resize grew this step
        self.preempt_mode = preempt_mode
        self.make_room_ahead = room_ahead
        # The oldest suspended request at the last stall: no admission until it steps.
        self._first_after_stall: Request | None = None
        self._recomputed_alone: list[Request] = []  # see step's stall branch
        self.recompute_lost = recompute_lost
        self.manager = manager
        self.batch: Batch | None = None
        if use_batch:
            widest = max(s.num_slots for s in manager.stores[0])
            # Sparse layers write back what a step took: bound it by the step's tokens.
            bound = (token_budget or chunk_tokens * max_batch) if _has_sparse(manager) \
                else None
            self.batch = Batch(manager, max_batch, max(1, widest),
                               max_beam_width=manager.config.max_beam_width,
                               max_total_input_tokens=bound)
            if index_tables:
                for layer in manager.config.layers:
                    if isinstance(layer, AttentionLayerConfig):
                        for buf in layer.buffers:
                            if buf.size:
                                self.batch.register_index_table(layer.layer_id, buf.role)
        self.engine = FingerprintEngine(manager, self.batch)
        #: The engine's stream: given to resume, resize and commit, and the fingerprint kernels
        #: run on it (None: the backend's default stream).
        self.stream = stream
        self.engine.stream = stream
        #: The sparse half of each step (None without sparse layers or a batch).
        self.sparse = SparseSteps(self.engine, sparse_seed) \
            if self.batch is not None and _has_sparse(manager) else None
        self.chunk_tokens = chunk_tokens
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.check = check
        self.close_finished = close_finished
        self._arrivals = itertools.count()
        self.waiting: deque[Request] = deque()
        self.suspended: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        #: Resumes that raised TierIOError or CorruptPageError (the request was closed
        #: and recomputed).
        self.lost_resumes = 0

    def submit(self, req: Request) -> None:
        """Queue a request; its cache is created (prefix matched) when it is admitted."""
        req.arrival = next(self._arrivals)
        self.waiting.append(req)

    def _lost(self, req: Request, report: StepReport | None) -> None:
        """A resume raised TierIOError or CorruptPageError (cold pages lost): close the
        cache, as an engine must; the request is recomputed from what is still cached."""
        req.cache.close()
        req.cache = None
        self.lost_resumes += 1
        if report is not None:
            report.recomputed.append(req)

    def _admit(self, req: Request, report: StepReport | None = None) -> bool:
        m = self.manager
        if req.cache is None:
            match_len = max(0, req.prompt_len - 1)
            req.cache = m.create_kv_cache(req.scope, req.tokens[:match_len], id=req.id,
                                          priority_callback=req.priority_callback)
            req.reused = req.cache.history_length
        cache = req.cache
        chosen = self.choose_optional(cache)
        try:
            resumed = cache.resume(self.stream, optional_reuse_groups=chosen)
        except (TierIOError, CorruptPageError):
            if not self.recompute_lost:
                raise
            self._lost(req, report)
            return False
        if not resumed:
            if len(self.manager.stores) < 2:
                # One level: give the claims back while waiting (held claims of queued
                # requests could fill the GPU, where they can never move). The prefix is
                # matched again next time.
                cache.close()
                req.cache = None
            # Else the refused request keeps its cache while it waits at the head of the
            # queue: its held pages can still move down the levels, and each retry is a
            # refused resume (decided before any per-page work) instead of a
            # create_kv_cache and a close every step.
            return False
        # Recompute what the cache got fresh although its history covers it.
        self.engine.recompute([StepWork(cache, req.tokens)])
        return True

    def choose_optional(self, cache: Any) -> list[int]:
        """OPTIONAL groups to reuse at first resume: every complete one (override to test
        other choices)."""
        from kvcm_core.types import ReusePolicy

        return [g for g, st in cache.reuse_status.items()
                if st.policy is ReusePolicy.OPTIONAL and st.complete]

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.suspended or self.running)

    def step(self) -> StepReport:
        """One iteration: resume suspended requests first, admit waiting ones, give each
        running request its next chunk (preempting the newest on shortage), check and
        write the fingerprints, commit, and finish completed requests."""
        report = StepReport()
        while self.suspended and len(self.running) < self.max_batch:
            req = self.suspended[0]
            try:
                resumed = req.cache.resume(self.stream)
            except (TierIOError, CorruptPageError):  # cold pages lost: recompute them
                if not self.recompute_lost:
                    raise
                self.suspended.popleft()
                self._lost(req, report)
                self._queue_first(req)
                continue
            if not resumed:
                break
            self.suspended.popleft()
            self._run(req)
            report.resumed.append(req)
        if self._first_after_stall is not None and self._first_after_stall.cache is None:
            self._first_after_stall = None  # recomputed since: it waits like the others
        while self.waiting and not self.suspended and len(self.running) < self.max_batch \
                and self._first_after_stall is None:
            req = self.waiting[0]
            if not self._admit(req, report):
                break
            self.waiting.popleft()
            self._run(req)
        self.room_ahead()
        budget = self.token_budget
        work: list[StepWork] = []
        stepped: list[tuple[Request, int]] = []
        started: list[int] = []  # history of each stepped request before this step
        drafts: dict[int, int] = {}  # id(req) -> tokens accepted (speculative steps)
        planned = self._grow_rows() if self.batch_ops and self.batch is not None else {}
        i = 0
        while i < len(self.running):
            req = self.running[i]
            cache = req.cache
            hist = cache.history_length
            want = self._want(req, hist)
            if budget is not None:
                want = min(want, budget)
                if want <= 0:
                    i += 1
                    continue
            cap = min(len(req.tokens), hist + want)
            grown = planned.get(id(req)) == cap and cache.capacity == cap
            self._planned.discard(id(req))
            while not grown and not cache.resize(cap, stream=self.stream):
                if self._release_kept_head():
                    continue  # a waiting request's kept claims went first: try again
                victim = self._preempt(exclude=req)
                if victim is None:
                    break
                report.preempted.append(victim)
                # A victim that already got its chunk this step gives it back.
                for k, (done_req, done_cap) in enumerate(stepped):
                    if done_req is victim:
                        del stepped[k]
                        del work[k]
                        if budget is not None:
                            budget += done_cap - started[k]
                        del started[k]
                        break
                i = self.running.index(req)
            else:
                accepted = self._accepted(req, hist, cap)
                if accepted < cap:  # drafts past the accepted tokens: their own ids
                    drafts[id(req)] = accepted
                    work.append(StepWork(cache, _drafted(req.tokens, accepted, cap)))
                else:
                    work.append(StepWork(cache, req.tokens))
                stepped.append((req, cap))
                started.append(hist)
                if budget is not None:
                    budget -= cap - hist
                i += 1
                continue
            # Could not grow even after preempting everyone else: preempt this one too.
            self._preempt_one(req)
            report.preempted.append(req)
        self._planned.clear()
        if work and self.batch is not None:
            self.batch.publish(self.stream)
            if self.sparse is not None:
                self.sparse.published()
            if self.batch_ops and self.check:
                self.engine.check_batch()
                self.counters["batch_table_checks"] += 1
        if work:
            if self.check:
                self.engine.check(work)
            self.engine.write(work)
            if self.sparse is not None:
                self.sparse.select(work)
        if drafts:
            self._rewind([(req, cap) for req, cap in stepped if id(req) in drafts], drafts)
        for (req, cap), known in zip(stepped, started, strict=True):
            cache = req.cache
            cap = drafts.get(id(req), cap)
            cache.commit(req.tokens[known:cap], self.stream)
            report.stepped += 1
            report.tokens += cap - known
        if self.sparse is not None and stepped:
            self.sparse.flush()
        for req, _ in stepped:
            if req.done:
                self.running.remove(req)
                self.unseat(req)
                if self.close_finished:
                    req.cache.close()
                self.finished.append(req)
                report.finished.append(req)
        if self._first_after_stall is not None and any(
                r is self._first_after_stall for r, _ in stepped):
            self._first_after_stall = None
        if not (report.stepped or report.finished) and self.suspended:
            # Stalled: the suspended requests' pages could not move out of the GPU (colder
            # levels full of held pages). Give the youngest one's pages back (recompute
            # it), and a waiting request's kept cache too. No waiting request is admitted
            # until the oldest suspended one gets a chunk: the recomputed one, admitted
            # again at once, could repeat the same preemptions for ever.
            alone = not self.running and not self.waiting and len(self.suspended) == 1
            if alone and self.suspended[0] in self._recomputed_alone:
                # Recomputed once already with nothing else in the loop, and stalled again:
                # it cannot fit level 0 on its own at this chunk size (one level or more).
                raise RuntimeError(
                    f"engine loop made no progress: request {self.suspended[0].id} does not "
                    f"fit level 0 on its own with chunks of {self.chunk_tokens} tokens")
            self._release_kept_head()
            victim = max(self.suspended, key=lambda r: r.arrival)
            if alone:
                self._recomputed_alone.append(victim)
            self.suspended.remove(victim)
            victim.cache.close()
            victim.cache = None
            self._queue_first(victim)
            report.recomputed.append(victim)
            self._first_after_stall = min(self.suspended, key=lambda r: r.arrival) \
                if self.suspended else None
        return report

    #: The history moves of a speculative step, in order (a test drops "rewind" to show
    #: that the fingerprint check finds the rejected drafts' KV).
    REWIND_PHASES: tuple[str, ...] = ("forward", "rewind")

    def _want(self, req: Request, hist: int) -> int:
        """Tokens ``req`` asks for this step (before the step's token budget): a prefill
        chunk, or one decode token plus its drafts on a speculative step."""
        if hist < req.prompt_len:
            want = min(self.chunk_tokens, req.prompt_len - hist)
        else:
            want = 1 + self._draft(req, hist)
        if self.sparse is not None:
            want = min(want, self.sparse.max_chunk)
        return want

    def _spec_hash(self, req: Request, hist: int) -> int:
        return zlib.crc32(f"{req.id}:{hist}".encode())

    def _draft(self, req: Request, hist: int) -> int:
        """Draft tokens of ``req``'s decode step at ``hist`` (0: not a speculative step)."""
        if not self.rewind_every or hist < req.prompt_len:
            return 0
        h = self._spec_hash(req, hist)
        if h % self.rewind_every:
            return 0
        return max(0, min(self.rewind_draft, self.manager.config.max_rewind_len,
                          len(req.tokens) - hist - 1))

    def _accepted(self, req: Request, hist: int, cap: int) -> int:
        """Where the accepted tokens of a step from ``hist`` to ``cap`` end: ``cap`` but on
        a speculative step, where the target model accepts a hashed number of drafts."""
        k = min(self._draft(req, hist), cap - hist - 1)
        if k <= 0:
            return cap
        self.counters["speculative_steps"] += 1
        return hist + 1 + (self._spec_hash(req, hist) >> 8) % (k + 1)

    def _rewind(self, spec: list[tuple[Request, int]], accepted: dict[int, int]) -> None:
        """After a speculative step's KV is written: move history over every drafted
        token, then rewind it to the accepted ones (one Batch.resize for each with
        ``batch_ops``, else each cache's ``resize``). Refusals here are bugs (no page is
        needed): they raise."""
        for phase in self.REWIND_PHASES:
            targets = [(req, cap if phase == "forward" else accepted[id(req)])
                       for req, cap in spec]
            if self.batch_ops and self.batch is not None:
                caps = [-1] * self.batch.max_rows
                hists = [-1] * self.batch.max_rows
                for req, to in targets:
                    row = self.batch.row_of(req.cache)
                    assert row is not None
                    caps[row] = hists[row] = to
                self.counters["batch_resize_calls"] += 1
                oks = self.batch.resize(caps, hists, stream=self.stream)
                ok = all(oks[self.batch.row_of(req.cache)] for req, _ in targets)
            else:
                ok = all([req.cache.resize(to, to, stream=self.stream) for req, to in targets])
            if not ok:
                raise RuntimeError(f"speculative step: a {phase} history move was refused: "
                                   f"{[r.cache.last_refusal for r, _ in targets]}")
        for req, cap in spec:
            self.counters["rewinds"] += 1
            self.counters["rewound_tokens"] += cap - accepted[id(req)]

    def _step_caps(self) -> Iterator[tuple[Request, int]]:
        """Each running request's capacity for this step as the step loop plans it (its
        chunk, within what is left of the step's token budget, in running order)."""
        budget = self.token_budget
        for req in self.running:
            hist = req.cache.history_length
            want = self._want(req, hist)
            if budget is not None:
                want = min(want, budget)
                if want <= 0:
                    return
                budget -= want
            yield req, min(len(req.tokens), hist + want)

    def _grow_rows(self) -> dict[int, int]:
        """``batch_ops``: grow every running row for this step with one ``Batch.resize``,
        as the step loop would one by one (same chunk and budget). Returns id(request) ->
        capacity of the rows it grew; the others go the one-by-one way (preempting)."""
        assert self.batch is not None
        caps = [-1] * self.batch.max_rows
        want_of: dict[int, tuple[Request, int]] = {}
        for req, cap in self._step_caps():
            cache = req.cache
            row = self.batch.row_of(cache)
            if row is None or cap <= cache.capacity:
                continue
            caps[row] = cap
            want_of[row] = (req, cap)
        if not want_of:
            return {}
        self.counters["batch_resize_calls"] += 1
        oks = self.batch.resize(caps, stream=self.stream)
        grown: dict[int, int] = {}
        for row, (req, cap) in want_of.items():
            if oks[row] and req.cache.capacity == cap:
                grown[id(req)] = cap
                self._planned.add(id(req))
                self.counters["batch_resize_rows"] += 1
            else:
                self.counters["batch_resize_refused_rows"] += 1
        return grown

    def room_ahead(self) -> None:
        """Make room on level 0 once for the pages this step's chunks will take
        (``KVCacheManager.make_room``), so the pages pushed out go down in one batch per
        level instead of one per ``resize``; off with ``room_ahead=False``."""
        if not self.make_room_ahead:
            return
        tpb = self.manager.config.tokens_per_block
        total: dict[int, int] = {}
        for req, cap in self._step_caps():
            cache = req.cache
            if -(-cap // tpb) > cache.num_blocks:
                for g, n in cache.pages_needed(cap).items():
                    total[g] = total.get(g, 0) + n
        if total:
            self.manager.make_room(total, self.stream)

    def _preempt(self, exclude: Request) -> Request | None:
        """Preempt the latest-arrived running request that arrived after ``exclude``
        (never an older one: an old request is not sacrificed for a newer one, which could
        livelock when nothing is reusable); None if there is none."""
        victims = [r for r in self.running
                   if r is not exclude and r.arrival > exclude.arrival
                   and r.cache.status is CacheStatus.ACTIVE]
        if not victims:
            return None
        req = max(victims, key=lambda r: r.arrival)
        self._preempt_one(req)
        return req

    def preempt(self, req: Request) -> None:
        """Preempt one running request now, the way the scheduler does (tests)."""
        self._preempt_one(req)

    def _preempt_one(self, req: Request) -> None:
        """Suspend ``req`` (its pages can move to colder levels), or, where suspending frees
        no GPU page (a single level), close it and queue it again to be recomputed: what
        it committed stays reusable, the rest is computed again."""
        self.running.remove(req)
        self.unseat(req)
        req.preemptions += 1
        mode = self.preempt_mode
        if mode == "auto":
            mode = "recompute" if len(self.manager.levels) == 1 else "suspend"
        if mode == "suspend":
            req.cache.suspend()
            self.suspended.appendleft(req)
        else:
            req.cache.close()
            req.cache = None
            self._queue_first(req)

    def _queue_first(self, req: Request) -> None:
        """Put ``req`` at the head of the waiting queue. Only the head may keep the cache
        of a refused admission (it is the only one retried): the request it displaces
        gives its claims back, else they could stay held behind it for ever."""
        if self.waiting:
            self._release_kept(self.waiting[0])
        self.waiting.appendleft(req)

    def _release_kept_head(self) -> bool:
        """Close the head of the queue's kept cache, if it has one: a running request
        that cannot grow comes before a waiting one's claims (they could hold the very
        pages it needs, on the GPU and below it). Whether one was closed."""
        if self.waiting and self.waiting[0].cache is not None:
            self._release_kept(self.waiting[0])
            return True
        return False

    @staticmethod
    def _release_kept(req: Request) -> None:
        """Close the cache a waiting request kept after a refused admission (if any)."""
        if req.cache is not None:
            req.cache.close()
            req.cache = None

    def _run(self, req: Request) -> None:
        self.running.append(req)
        if self.batch is not None:
            self.batch.add_kv_cache(req.cache)

    def unseat(self, req: Request) -> None:
        """Take a request's cache out of the batch (before suspending or closing it)."""
        row = None if self.batch is None else self.batch.row_of(req.cache)
        if row is not None:
            assert self.batch is not None
            if self.sparse is not None:
                self.sparse.left(self.batch.sparse_lease(row))
            self.batch.remove_kv_cache(req.cache, self.stream)
            if self.batch_ops:  # keep rows dense: the last seated row fills the hole
                members = self.batch.members
                last = max((r for r, c in enumerate(members) if c is not None), default=-1)
                if last > row:
                    self.batch.move(members[last], row)
                    self.counters["batch_moves"] += 1

    def close(self) -> None:
        """Free the batch (the loop's requests must be finished or unseated)."""
        if self.batch is not None:
            self.batch.close(self.stream)

    def close_all(self) -> None:
        """Close every cache the loop still holds (running, suspended, waiting), then free
        the batch: what a run that stops early does before shutting the manager down."""
        for req in (*self.running, *self.suspended, *self.waiting):
            if req.cache is not None:
                self.unseat(req)
                req.cache.close()
        self.close()

    def run(self, requests: Iterable[Request] = (), max_steps: int = 1_000_000,
            on_step: Callable[[StepReport], None] | None = None) -> list[Request]:
        """Submit ``requests`` and step until everything finished."""
        for req in requests:
            self.submit(req)
        for _ in range(max_steps):
            if self.idle:
                return self.finished
            report = self.step()
            if on_step is not None:
                on_step(report)
            if not (report.stepped or report.finished or report.recomputed):
                if self.running or self.suspended or self.waiting:
                    stuck = [r.id for r in (*self.running, *self.suspended, *self.waiting)]
                    raise RuntimeError(f"engine loop made no progress; stuck: {stuck[:10]}")
        raise RuntimeError(f"engine loop did not finish in {max_steps} steps")


def _drafted(tokens: Sequence[Any], accepted: int, cap: int) -> Any:
    """``tokens[:cap]`` with the positions ``[accepted, cap)`` (rejected drafts) replaced by
    other token ids: what the draft model proposed there."""
    if isinstance(tokens, np.ndarray):
        out = np.array(tokens[:cap])
        out[accepted:cap] ^= 0x2A5A5A5
        return out
    head = list(tokens[:cap])
    head[accepted:cap] = [token_id32(t) ^ 0x2A5A5A5 for t in head[accepted:cap]]
    return head


def _has_sparse(manager: Any) -> bool:
    return any(getattr(layer, "sparse", None) is not None for layer in manager.config.layers)


def run_requests(manager: Any, requests: Sequence[Request], **kwargs: Any) -> EngineLoop:
    """Run ``requests`` to completion through a new :class:`EngineLoop`."""
    loop = EngineLoop(manager, **kwargs)
    loop.run(requests)
    return loop


def chat_requests(seed: int, sessions: int, turns: int, system: int, message: tuple[int, int],
                  reply: tuple[int, int]) -> list[Request]:
    """A seeded multi-turn chat: ``sessions`` conversations sharing a ``system``-token
    prompt; each turn appends a message (``message`` = [low, high) tokens) and a reply
    (``reply``) to its conversation, so every request reuses its conversation so far.
    Requests come turn by turn, one per session."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50_000, system).tolist()
    history = [list(shared) for _ in range(sessions)]
    reqs = []
    for turn in range(turns):
        for s in range(sessions):
            msg = rng.integers(0, 50_000, int(rng.integers(*message))).tolist()
            out = rng.integers(0, 50_000, int(rng.integers(*reply))).tolist()
            prompt = history[s] + msg
            reqs.append(Request(f"{turn}-{s}", prompt + out, len(prompt)))
            history[s] = prompt + out
    return reqs
