"""One scheduler thread per manager, enforced.

A manager and everything it made (its caches, its :class:`~kvcm_core.batch.Batch`es) are
driven by one thread: the first thread that calls a mutating method owns them, and a
mutating call from any other thread raises :class:`~kvcm_core.errors.InvalidStateError`
naming both threads, before it changes anything. ``manager.bind_thread()`` hands ownership
to the calling thread (an engine that builds on one thread and schedules on another calls
it once). kvcm's own I/O threads never call the public API, so they are never checked.

The check is on every per-step call, so it costs one ``threading.get_ident()`` and one
compare when the owner calls (the slow path, claiming or refusing, runs only otherwise).
"""

from __future__ import annotations

import threading
from threading import get_ident

from kvcm_core.errors import InvalidStateError

__all__ = ["ThreadGuard"]


class ThreadGuard:
    """The owner thread of one manager and what it made.

    Args:
        enabled: check calls (``KVCacheManagerConfig.check_thread``); when False,
            :meth:`check` does nothing.

    Attributes:
        ident: ``threading.get_ident()`` of the owner, or None before the first mutation.
        name: the owner thread's name when it took ownership.
    """

    __slots__ = ("_lock", "check", "ident", "name")

    def __init__(self, enabled: bool = True) -> None:
        self.ident: int | None = None
        self.name = ""
        self._lock = threading.Lock()
        self.check = self._check if enabled else _nothing

    def _check(self) -> None:
        """Raise InvalidStateError unless the calling thread owns the manager (the first
        caller becomes the owner)."""
        if get_ident() != self.ident:
            self._claim_or_refuse()

    def _claim_or_refuse(self) -> None:
        me = get_ident()
        with self._lock:
            if self.ident is None:
                self.ident, self.name = me, threading.current_thread().name
                return
            owner, name = self.ident, self.name
        raise InvalidStateError(
            f"thread {threading.current_thread().name!r} (ident {me}) called a mutating "
            f"method of a kvcm manager driven by thread {name!r} (ident {owner}); "
            "one scheduler thread drives a manager and what it made: call "
            "manager.bind_thread() on the new thread to hand it over")

    def bind(self) -> None:
        """Make the calling thread the owner."""
        with self._lock:
            self.ident, self.name = get_ident(), threading.current_thread().name


def _nothing() -> None:
    pass
