"""Events instead of host synchronisation for page migrations (device backends).

A migration between the GPU level and a device-accessible cold level (pinned host) is
issued on one of two copy streams of the manager, so both directions of the link work at
once: evictions (device to host) on the *evict* stream, onboards (host to device) on the
*onboard* stream. The call that issued them returns at once. What keeps every reader and
writer of a slot ordered is a **fence** per slot: the sequence number of the last copy
batch that read or wrote it, whose event is recorded on the batch's stream right after it.

- A copy batch waits (on the device: ``stream.wait_event``) for the fences of every slot
  it reads or writes, so a slot freed by an eviction is overwritten only after the copy
  that read it has completed, and a page is read only after the copy that brought it in.
- A copy through the host (storage levels, codecs that run synchronously) waits for the
  fences of its slots on the host first (``event.synchronize``), as it always did.
- Before the first copy of a call, the copy streams wait for the caller's stream (the
  engine's work queued so far, which may still read or write pages that move).
- When the call returns, the caller's stream waits for every copy batch still tracked
  (:meth:`Fences.wait_all`; a stream that already waited for a batch does not wait twice):
  whatever the engine queues next sees the pages in place.

On a backend without a device (numpy) nothing is tracked: copies run synchronously and
every event is already complete, which is the same contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvcm_core.backend import Event, KernelBackend, Stream

__all__ = ["Fences"]

_PRUNE = 64  # tracked batches before completed ones are forgotten


class Fences:
    """Per-slot fences of one manager's stores (see module docstring)."""

    def __init__(self, backend: KernelBackend) -> None:
        self.backend = backend
        self.enabled = bool(backend.capabilities.has_device)
        self.seq = 0
        #: Batches still tracked: sequence number -> (lane, event). A number no longer
        #: here has completed.
        self.events: dict[int, tuple[int, Event]] = {}
        self.latest: dict[int, int] = {}  # lane -> its last batch
        self._lanes: dict[int, list[int]] = {}  # lane -> its tracked batches, in order
        self._waited: dict[tuple[int, int], int] = {}  # (waiting lane, lane) -> batch
        self._slots: dict[int, np.ndarray] = {}  # store index -> batch per slot
        self._spare: list[Event] = []
        self._known: dict[int, Stream] = {}
        self.evict: Stream | None = None
        self.onboard: Stream | None = None
        #: The stream of the public call in progress (None: the default stream).
        self.op_stream: Stream | None = None
        self._op_mark: Event | None = None
        self._op_waited: set[int] = set()
        self.batches = 0  # copy batches issued (a statistic for tests and benchmarks)

    # -- streams ------------------------------------------------------------------------

    def streams(self) -> tuple[Stream, Stream]:
        """The evict and onboard streams (created on first use)."""
        if self.evict is None or self.onboard is None:
            self.evict = self.backend.create_stream()
            self.onboard = self.backend.create_stream()
        return self.evict, self.onboard

    def _stream(self, stream: Stream | None) -> Stream:
        return self.backend.default_stream if stream is None else stream

    def lane(self, stream: Stream) -> int:
        """A stream's key (the object is kept, so its id is never reused meanwhile)."""
        key = id(stream)
        if key not in self._known:
            self._known[key] = stream
        return key

    def begin(self, stream: Stream | None) -> None:
        """A public call that may move pages starts: copy streams will wait for
        ``stream``'s work queued so far before their first copy."""
        self.op_stream = stream
        self._op_mark = None
        self._op_waited.clear()

    def join_op(self, lane_stream: Stream) -> None:
        """Make a copy stream wait (once per call) for the caller's stream."""
        lane = self.lane(lane_stream)
        if lane in self._op_waited:
            return
        op = self._stream(self.op_stream)
        if self.lane(op) == lane:
            return
        if self._op_mark is None:
            self._op_mark = self._new_event()
            self._op_mark.record(op)
        lane_stream.wait_event(self._op_mark)
        self._op_waited.add(lane)

    def end(self, stream: Stream | None, wait: bool = True) -> None:
        """The public call returns: ``stream`` waits for every tracked copy batch
        (``wait=False``: it does not; a later call's ``end`` makes its stream wait)."""
        if self._op_mark is not None:
            self._spare.append(self._op_mark)
            self._op_mark = None
        self._op_waited.clear()
        self.op_stream = None
        if wait and self.events:
            self.wait_all(stream)

    # -- slots --------------------------------------------------------------------------

    def of(self, store: Any) -> np.ndarray:
        """The fence array of a store (one batch number per slot; 0: none)."""
        arr = self._slots.get(store.index)
        n = store.num_slots
        if arr is None or len(arr) < n:
            new = np.zeros(max(n, 1), dtype=np.int64)
            if arr is not None:
                new[: len(arr)] = arr
            self._slots[store.index] = arr = new
        return arr

    def _pending(self, parts: Iterable[tuple[Any, np.ndarray]]) -> list[int]:
        events = self.events
        if not events:
            return []
        found: set[int] = set()
        for store, slots in parts:
            if len(slots):
                found.update(self._tracked(self.of(store)[slots]))
        return list(found)

    def _tracked(self, values: np.ndarray) -> list[int]:
        """The batches among fence ``values`` still tracked (distinct)."""
        events = self.events
        if not events or not len(values):
            return []
        oldest = next(iter(events))  # numbers are inserted in increasing order
        top = int(values.max())
        if top < oldest:
            return []
        if int(values.min()) == top:  # the usual batch: its slots share one fence
            return [top] if top in events else []
        live = values[values >= oldest]
        return [v for v in np.unique(live).tolist() if v in events]

    def wait_device(self, stream: Stream, parts: Iterable[tuple[Any, np.ndarray]]) -> None:
        """``stream`` waits for the batches that last touched these slots."""
        self.wait_batches(stream, self._pending(parts))

    def batch_waits(self, values: np.ndarray, starts: list[int]) -> list[list[int] | None]:
        """For a move copied in batches starting at ``starts`` (positions in fence
        ``values``, read before the move): the tracked batches each must wait for (None:
        none). The usual batch's slots share one fence: one reduction for all batches."""
        if not self.events or not len(values):
            return [None] * len(starts)
        oldest = next(iter(self.events))
        tops = np.maximum.reduceat(values, starts).tolist()
        lows = np.minimum.reduceat(values, starts).tolist()
        out: list[list[int] | None] = []
        for k, top in enumerate(tops):
            if top < oldest:
                out.append(None)
            elif lows[k] == top:
                out.append([top] if top in self.events else None)
            else:
                hi = starts[k + 1] if k + 1 < len(starts) else len(values)
                out.append(self._tracked(values[starts[k]:hi]) or None)
        return out

    def wait_batches(self, stream: Stream, seqs: list[int]) -> None:
        """``stream`` waits for batches ``seqs`` (only the last of each lane; one no longer
        tracked has completed)."""
        if not seqs:
            return
        me = self.lane(stream)
        events = self.events
        if len(seqs) == 1:  # the usual batch: one earlier batch of one lane
            entry = events.get(seqs[0])
            if entry is not None and entry[0] != me:
                self._wait(stream, me, entry[0], seqs[0])
            return
        last: dict[int, int] = {}
        for seq in seqs:
            entry = events.get(seq)
            if entry is None:
                continue
            lane = entry[0]
            if lane != me and seq > last.get(lane, 0):
                last[lane] = seq
        for lane, seq in last.items():
            self._wait(stream, me, lane, seq)

    def _wait(self, stream: Stream, me: int, lane: int, seq: int) -> None:
        # Events of one lane complete in order: waiting for a later one covers earlier.
        if self._waited.get((me, lane), 0) >= seq:
            return
        stream.wait_event(self.events[seq][1])
        self._waited[(me, lane)] = seq

    def wait_host(self, parts: Iterable[tuple[Any, np.ndarray]]) -> None:
        """The host waits for the batches that last touched these slots."""
        for seq in sorted(self._pending(parts)):
            entry = self.events.get(seq)
            if entry is not None:
                entry[1].synchronize()

    def wait_all(self, stream: Stream | None) -> None:
        """``stream`` waits for every tracked batch (the last of each lane)."""
        st = self._stream(stream)
        me = self.lane(st)
        # The most recent first (on the deferred test backend this runs the later lane
        # first, so a batch that does not wait for an earlier one reads wrong bytes).
        for lane, seq in sorted(self.latest.items(), key=lambda item: -item[1]):
            if lane != me and seq in self.events:
                self._wait(st, me, lane, seq)

    def record(self, stream: Stream, parts: Iterable[tuple[Any, np.ndarray]]) -> int:
        """A batch was queued on ``stream`` touching these slots: fence them."""
        seq = self.record_batch(stream)
        for store, slots in parts:
            if len(slots):
                self.of(store)[slots] = seq
        return seq

    def record_batch(self, stream: Stream) -> int:
        """A batch was queued on ``stream``: its number, whose event completes after it.
        The caller fences the batch's slots with it (``of(store)[slots] = number``)."""
        lane = self.lane(stream)
        seq = self._record(stream, lane, self._lanes.setdefault(lane, []))
        self._recorded(lane)
        return seq

    def run_batches(self, stream: Stream, nb: int, waits: list[list[int] | None] | None,
                    copy: Callable[[int], None], each: bool) -> list[int]:
        """Queue a move's ``nb`` batches on ``stream``: batch ``k`` waits for the batches
        ``waits[k]`` (``waits`` or an item None: none), then ``copy(k)`` queues its
        copies, then its event is recorded (``each``; else one event after the last
        batch). Returns the number of each batch (the last one's for all when not
        ``each``): :meth:`wait_batches` and :meth:`record_batch` in one loop, for the
        many batches of a large move."""
        me = self.lane(stream)
        tracked = self._lanes.setdefault(me, [])
        out: list[int] = []
        last_wait = None
        for k in range(nb):
            w = waits[k] if waits is not None else None
            if w is not None and w != last_wait:
                last_wait = w
                self.wait_batches(stream, w)
            copy(k)
            if each or k == nb - 1:
                self._record(stream, me, tracked)
            out.append(self.seq)
        if nb:
            self._recorded(me)
        return out

    def _record(self, stream: Stream, lane: int, tracked: list[int]) -> int:
        """An event recorded on ``stream`` after its batch: the batch's new number,
        tracked on ``lane`` (``tracked``: the lane's list)."""
        ev = self._new_event()
        ev.record(stream)
        self.seq += 1
        self.events[self.seq] = (lane, ev)
        tracked.append(self.seq)
        self.batches += 1
        return self.seq

    def _recorded(self, lane: int) -> None:
        """Batches were recorded on ``lane``: its latest, and completed ones forgotten
        once many are tracked."""
        self.latest[lane] = self.seq
        if len(self.events) > _PRUNE:
            self.prune()

    def order(self, store: Any, slots: np.ndarray) -> np.ndarray:
        """``slots`` sorted by their fences (stable): a batch of the first ones then waits
        only for the earliest copies that freed them."""
        if not self.events or len(slots) < 2:
            return slots
        f = self.of(store)[slots]
        return slots[np.argsort(f, kind="stable")]

    # -- bookkeeping --------------------------------------------------------------------

    def _new_event(self) -> Event:
        return self._spare.pop() if self._spare else self.backend.create_event()

    def prune(self) -> None:
        """Forget completed batches (their events are reused). The batches of one lane
        complete in order, so the completed ones of a lane are a prefix of its batches:
        one query when the lane's last batch has completed (the usual case), else found
        by bisection (a few queries, whatever the number tracked)."""
        events = self.events
        for seqs in self._lanes.values():
            if not seqs:
                continue
            if events[seqs[-1]][1].query():
                lo = len(seqs)
            else:
                lo, hi = 0, len(seqs) - 1  # seqs[:lo] completed; seqs[hi:] not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if events[seqs[mid]][1].query():
                        lo = mid + 1
                    else:
                        hi = mid
            spare = self._spare
            for seq in seqs[:lo]:
                spare.append(events.pop(seq)[1])
            del seqs[:lo]

    def synchronize(self) -> None:
        """The host waits for every tracked batch; nothing is tracked afterwards."""
        for seq in sorted(self.events):
            self.events[seq][1].synchronize()
        self._spare.extend(ev for _, ev in self.events.values())
        self.events.clear()
        for seqs in self._lanes.values():
            seqs.clear()

    def close(self) -> None:
        self.synchronize()
        self._spare.clear()
        self._known.clear()
        self._lanes.clear()
        self.evict = self.onboard = None
