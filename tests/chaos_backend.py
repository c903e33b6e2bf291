"""A :class:`DeferredBackend` whose streams may run in any order and make progress on their own.

The deferred backend runs queued work only when something waits for it, and then in a
fixed order. A GPU's streams are less polite: any stream may run ahead of the others
(subject to its waits) at any time. :class:`ChaosBackend` emulates that, seeded:

* ``mode="lazy"``: the deferred backend (work runs when waited for; ``Event.query()``
  advances the event's stream by one item), except that :meth:`synchronize` runs the
  streams in a random order.
* ``mode="eager"``: additionally, around every enqueue, with probability ``p``, the front
  one to four items of a random stream run.

The chaos settings are constructor arguments, given to :func:`chaos_plugin_manager`
(backend name ``"chaos"``): each manager built with that plugin manager gets its own
backend and random generator, nothing is shared between tests.
A test helper: the core never imports a plugin, this file does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import kvcm_kernels_numpy
from deferred_backend import CAPABILITIES, DeferredBackend, deferred_plugin_manager

from kvcm_core import FingerprintPages, KvcmPluginManager, hookimpl
from kvcm_core.backend import CopyTask, Stream
from kvcm_core.records import KernelBackendSpec

__all__ = ["MODES", "ChaosBackend", "chaos_plugin_manager"]

MODES = ("lazy", "eager")


class ChaosBackend(DeferredBackend):
    """Deferred streams that also run ahead on their own (see module docstring)."""

    name = "chaos"

    def __init__(self, options: dict | None = None, *, mode: str = "lazy", p: float = 0.35,
                 seed: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"chaos mode must be one of {MODES}, not {mode!r}")
        super().__init__(options)
        self.rng = random.Random(seed)
        self.mode = mode
        self.p = p
        self._busy = False

    def progress(self) -> None:
        """Eager mode: with probability ``p``, a random stream runs its front items."""
        if self.mode != "eager" or self._busy or self.rng.random() >= self.p:
            return
        live = [s for s in self._streams if s.queue]
        if not live:
            return
        st = self.rng.choice(live)
        self._busy = True
        try:
            for _ in range(self.rng.randint(1, 4)):
                if not st.queue:
                    break
                st.queue.popleft()()
        finally:
            self._busy = False

    def synchronize(self) -> None:
        while any(st.queue for st in self._streams):
            order = list(self._streams)
            self.rng.shuffle(order)
            for st in order:
                st.run()

    def copy_pages_batch(self, tasks: Sequence[CopyTask], stream: Stream | None = None) -> None:
        self.progress()
        super().copy_pages_batch(tasks, stream)
        self.progress()

    def copy_bytes(self, *args: Any, **kwargs: Any) -> None:
        self.progress()
        super().copy_bytes(*args, **kwargs)
        self.progress()

    def fingerprint_write(self, pages: FingerprintPages, stream: Stream | None = None) -> None:
        self.progress()
        super().fingerprint_write(pages, stream)
        self.progress()

    def convert_page_tables(self, tables: Sequence[Any], rows: Any,
                            stream: Stream | None = None) -> None:
        self.progress()
        super().convert_page_tables(tables, rows, stream)

    def enqueue(self, stream: Stream | None, fn: Callable[[], None]) -> None:
        """Queue ``fn`` on ``stream``: a 'kernel' of the test."""
        self.progress()
        self._on(stream).queue.append(fn)

    def fingerprint_check_now(self, pages: FingerprintPages) -> Any:
        """The numpy check on the bytes as they are (for a kernel queued by :meth:`enqueue`)."""
        return kvcm_kernels_numpy.NumpyBackend.fingerprint_check(self, pages, None)


class _ChaosPlugin:
    def __init__(self, mode: str, p: float, seed: int) -> None:
        self.settings = {"mode": mode, "p": p, "seed": seed}

    def _make(self, options: dict | None = None) -> ChaosBackend:
        return ChaosBackend(options, **self.settings)

    @hookimpl
    def kvcm_kernel_backends(self) -> Any:
        yield KernelBackendSpec(name="chaos", factory=self._make,
                                description="deferred streams with random progress (tests)",
                                capabilities=CAPABILITIES, priority=-11)


def chaos_plugin_manager(mode: str = "lazy", p: float = 0.35,
                         seed: int = 0) -> KvcmPluginManager:
    """A fresh plugin manager with the ``deferred`` and ``chaos`` backends registered; its
    ``chaos`` backends are built with these settings (see :class:`ChaosBackend`)."""
    if mode not in MODES:
        raise ValueError(f"chaos mode must be one of {MODES}, not {mode!r}")
    pm = deferred_plugin_manager()
    pm.register(_ChaosPlugin(mode, p, seed), name="chaos")
    return pm
