"""A NumPy backend whose streams really are queues (CPU tests of stream ordering).

:class:`DeferredBackend` claims a device, so the manager takes its asynchronous paths
(:mod:`kvcm_core.fences`), but runs no work when it is queued: copies and fingerprint
writes wait in their stream until something needs their result — a ``synchronize`` of the
stream, the backend or an event recorded after them, a fingerprint check on that stream, a
``read`` / ``write`` backdoor — and then only the work that result depends on runs (a
stream's queue in order; ``wait_event`` runs the recording stream up to the event). Work
that nothing waited for stays queued, so a missing event or a missing host wait shows up
as wrong bytes, exactly as a race would on a GPU, but every time. ``Event.query()`` runs
the recording stream by one item while its event is not reached, as a GPU makes progress
while the host polls (a host polling loop such as ``Batch`` waiting for its reader fence
ends). ``convert_page_tables`` is queued like every other kernel: an index table is
converted from the device table as the upload queued before it left it, and the sparse
kernels (resolve, fetch and write-back) read the tables uploaded before them.

Register it with :func:`deferred_plugin_manager` (backend name ``"deferred"``).
A test helper: the core never imports a plugin, this file does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import kvcm_kernels_numpy
import numpy as np

from kvcm_core import hookimpl
from kvcm_core.backend import (
    CopyTask,
    Event,
    FingerprintPages,
    PageRegion,
    SparseCopy,
    SparseResolve,
    Stream,
    check_copy_args,
)
from kvcm_core.plugins import KvcmPluginManager
from kvcm_core.records import KernelBackendCapabilities, KernelBackendSpec

__all__ = ["DeferredBackend", "deferred_plugin_manager"]

CAPABILITIES = KernelBackendCapabilities(has_device=True, host_mapped=True)


def _numpy() -> Any:
    return kvcm_kernels_numpy


class _Record:
    """One ``Event.record``: done once the stream ran up to it."""

    def __init__(self, stream: DeferredStream | None) -> None:
        self.stream = stream
        self.done = stream is None

    def reach(self) -> None:
        st = self.stream
        while not self.done and st is not None and st.queue:
            st.queue.popleft()()
        assert self.done, "an event's stream ran dry before the event"


class DeferredStream(Stream):
    def __init__(self, backend: DeferredBackend) -> None:
        self.backend = backend
        self.queue: deque[Callable[[], None]] = deque()

    def run(self) -> None:
        while self.queue:
            self.queue.popleft()()

    def synchronize(self) -> None:
        self.run()

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, DeferredEvent)
        rec = event.current  # as CUDA: the record at the time of the call
        if rec is not None:
            self.backend._queue(self, rec.reach)


class DeferredEvent(Event):
    def __init__(self, backend: DeferredBackend) -> None:
        self.backend = backend
        self.current: _Record | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = self.backend.default_stream if stream is None else stream
        assert isinstance(stream, DeferredStream)
        rec = _Record(stream)
        self.current = rec
        if stream is not None:
            def mark() -> None:
                rec.done = True
            self.backend._queue(stream, mark)

    def query(self) -> bool:
        rec = self.current
        if (self.backend.progress_on_query and rec is not None and not rec.done
                and rec.stream is not None and rec.stream.queue):
            rec.stream.queue.popleft()()  # the device makes progress while the host polls
        return rec is None or rec.done

    def synchronize(self) -> None:
        if self.current is not None:
            self.current.reach()


class DeferredBackend(_numpy().NumpyBackend):
    """The numpy backend's kernels, queued on streams (see module docstring)."""

    name = "deferred"
    capabilities = CAPABILITIES
    #: ``Event.query()`` runs the event's stream by one item (False: streams stand still
    #: while the host polls, for tests of what a query alone concludes).
    progress_on_query = True
    #: Work queued on the default stream runs at once (after what it was made to wait
    #: for), as a GPU may run an idle stream: a second legal schedule, in which work the
    #: default stream was not ordered after runs later than it.
    eager_default = False

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self._streams: list[DeferredStream] = []
        self._stream = self.create_stream()

    @property
    def default_stream(self) -> Stream:
        return self._stream

    def create_stream(self) -> Stream:
        st = DeferredStream(self)
        self._streams.append(st)
        return st

    def create_event(self) -> Event:
        return DeferredEvent(self)

    def _on(self, stream: Stream | None) -> DeferredStream:
        st = self._stream if stream is None else stream
        assert isinstance(st, DeferredStream)
        return st

    def _queue(self, stream: Stream | None, run: Callable[[], None]) -> None:
        st = self._on(stream)
        st.queue.append(run)
        if self.eager_default and st is self._stream:
            st.run()

    def synchronize(self) -> None:
        while any(st.queue for st in self._streams):
            for st in self._streams:
                st.run()

    def pending(self) -> int:
        """Work items still queued (tests: something was left for later)."""
        return sum(len(st.queue) for st in self._streams)

    def read(self, buffer: Any, offset: int, nbytes: int) -> np.ndarray:
        self.synchronize()
        return super().read(buffer, offset, nbytes)

    def write(self, buffer: Any, offset: int, data: Any) -> None:
        self.synchronize()
        super().write(buffer, offset, data)

    def copy_pages(self, dst: PageRegion, src: PageRegion, page_bytes: int,
                   pairs: np.ndarray, stream: Stream | None = None) -> None:
        self.copy_pages_batch([CopyTask(dst, src, page_bytes, pairs)], stream)

    def copy_pages_batch(self, tasks: Sequence[CopyTask], stream: Stream | None = None) -> None:
        for t in tasks:  # bad arguments raise now, as on a GPU
            check_copy_args(t.dst, t.src, t.page_bytes, t.pairs)
        tasks = [CopyTask(t.dst, t.src, t.page_bytes, t.pairs.copy()) for t in tasks]

        def run() -> None:
            _numpy().NumpyBackend.copy_pages_batch(self, tasks, None)
        self._queue(stream, run)

    def copy_bytes(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int,
                   stream: Stream | None = None) -> None:
        def run() -> None:
            _numpy().NumpyBackend.copy_bytes(self, dst, dst_offset, src, src_offset, nbytes)
        self._queue(stream, run)

    def fingerprint_write(self, pages: FingerprintPages, stream: Stream | None = None) -> None:
        def run() -> None:
            _numpy().NumpyBackend.fingerprint_write(self, pages, None)
        self._queue(stream, run)

    def convert_page_tables(self, tables: Sequence[Any], rows: np.ndarray,
                            stream: Stream | None = None) -> None:
        rows = np.array(rows, copy=True)
        tables = list(tables)

        def run() -> None:
            _numpy().NumpyBackend.convert_page_tables(self, tables, rows, None)
        self._queue(stream, run)

    def sparse_resolve(self, job: SparseResolve, stream: Stream | None = None) -> None:
        # The job names device buffers only: the kernel reads them when it runs.
        self._queue(stream, lambda: _numpy().NumpyBackend.sparse_resolve(self, job, None))

    def sparse_copy(self, job: SparseCopy, stream: Stream | None = None) -> None:
        self._queue(stream, lambda: _numpy().NumpyBackend.sparse_copy(self, job, None))

    def fingerprint_check(self, pages: FingerprintPages,
                          stream: Stream | None = None) -> np.ndarray:
        # Only what the stream was made to wait for has run: nothing else is forced.
        self._on(stream).run()
        return _numpy().NumpyBackend.fingerprint_check(self, pages, None)


class _Plugin:
    @hookimpl
    def kvcm_kernel_backends(self) -> Any:
        yield KernelBackendSpec(name="deferred", factory=DeferredBackend,
                                description="numpy kernels queued on streams (tests)",
                                capabilities=CAPABILITIES, priority=-10)


def deferred_plugin_manager() -> KvcmPluginManager:
    """A fresh plugin manager with the ``deferred`` backend registered."""
    pm = KvcmPluginManager()
    pm.register(_Plugin(), name="deferred")
    return pm
