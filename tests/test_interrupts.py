"""An interrupt (``KeyboardInterrupt``, any ``BaseException``) landing while a public call
waits for a storage level, or copies pages, leaves no trace: the manager's records hold
(``check_invariants``), no slot leaks, the interrupted cache can resume (or resize) again
or be closed, every page keeps its data, and once every cache is closed and the reusable
blocks cleared every slot of every level is free.

The interrupt is injected deterministically: the n-th call of one of the points where the
scheduler thread waits or copies (a cold write, a cold read, a frame's wrap, a level's
I/O hand-over before or after its job ran, the mover's copy) raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from levels_helpers import Driver, assert_all_free, assert_invariants, make_manager, quota, tokens

from kvcm_core.frame import FrameBook
from kvcm_core.level_io import LevelIO
from kvcm_core.migration import Mover


class _Armed:
    """Raise KeyboardInterrupt at the ``n``-th call of the patched point (once)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0
        self.fired = False

    def hit(self) -> None:
        self.calls += 1
        if not self.fired and self.calls == self.n:
            self.fired = True
            raise KeyboardInterrupt(f"injected at call {self.n}")


def _before(orig: Callable[..., Any], arm: _Armed) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        arm.hit()
        return orig(*args, **kw)
    return wrapper


def _after(orig: Callable[..., Any], arm: _Armed) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        out = orig(*args, **kw)
        arm.hit()  # the job ran; the interrupt lands while its caller waits
        return out
    return wrapper


# name -> (owner, attribute, static, wrap)
POINTS: dict[str, tuple[Any, str, bool, Callable[..., Any]]] = {
    "cold-write": (Mover, "_put", True, _before),
    "cold-write-done": (Mover, "_put", True, _after),
    "cold-read": (Mover, "_get", True, _before),
    "frame-wrap": (FrameBook, "wrap", False, _before),
    "io-call": (LevelIO, "call", False, _before),
    "io-call-done": (LevelIO, "call", False, _after),
    "mover-copy": (Mover, "copy", False, _before),
}


@contextlib.contextmanager
def interrupt_at(monkeypatch: pytest.MonkeyPatch, point: str, n: int) -> Iterator[_Armed]:
    owner, attr, static, wrap = POINTS[point]
    orig = owner.__dict__[attr]
    fn = orig.__func__ if static else orig
    arm = _Armed(n)
    patched = wrap(fn, arm)
    with monkeypatch.context() as mp:
        mp.setattr(owner, attr, staticmethod(patched) if static else patched)
        yield arm


def _settle(m: Any, d: Driver, caches: list[Any]) -> None:
    """After the interrupt: invariants hold, every cache resumes with its data intact,
    and everything closed frees every slot."""
    assert_invariants(m)
    for c in caches:
        if c.status.name == "ACTIVE":
            c.suspend()
            assert_invariants(m)
    d.resume_and_verify(*caches)
    for c in caches:
        c.close()
        assert_invariants(m)
    assert_all_free(m)


def _resume_scenario(tmp: Path) -> tuple[Any, Driver, list[Any], Callable[[], Any]]:
    # Four suspended requests of 8 blocks on an 8-slot GPU: resuming one pushes the
    # others' held pages down through a 2-slot host level to the disk.
    m = make_manager([("gpu", 8), ("host", 2), ("disk", 32)], tmp)
    d = Driver(m)
    cs = [d.write(tokens(32, i), chunk=8) for i in range(4)]
    return m, d, cs, lambda: cs[0].resume()


def _resize_scenario(tmp: Path) -> tuple[Any, Driver, list[Any], Callable[[], Any]]:
    # An active request grows by 8 blocks: held pages of suspended ones move down.
    m = make_manager([("gpu", 8), ("host", 2), ("disk", 32)], tmp)
    d = Driver(m)
    cs = [d.write(tokens(16, i), chunk=8) for i in range(3)]
    c = d.create(tokens(32, 9))
    assert c.resume()
    cs.append(c)

    def op() -> Any:
        if c.resize(32):
            d.engine.step(d.work(c))
            c.commit(d.toks[id(c)][:32])
    return m, d, cs, op


def _resume_cold_scenario(tmp: Path, general: bool = False
                          ) -> tuple[Any, Driver, list[Any], Callable[[], Any]]:
    # A resume that reads its own pages back from the disk and pushes nothing down (the
    # fast path; ``general``: the general path, which a reuse choice takes).
    m = make_manager([("gpu", 8), ("host", 2), ("disk", 32)], tmp)
    d = Driver(m)
    cs = [d.write(tokens(32, i), chunk=8) for i in range(3)]
    assert m.resize(0, quota("full", 0, 32))
    assert m.get_storage_statistics(2).free < m.get_storage_statistics(2).total
    if general:
        return m, d, cs, lambda: cs[0].resume(optional_reuse_groups=[])
    return m, d, cs, lambda: cs[0].resume()


def _level_resize_scenario(tmp: Path) -> tuple[Any, Driver, list[Any], Callable[[], Any]]:
    # manager.resize() shrinks the host level: its pages move to the disk.
    m = make_manager([("gpu", 8), ("host", 16), ("disk", 64)], tmp)
    d = Driver(m)
    cs = [d.write(tokens(32, i), chunk=8) for i in range(3)]
    return m, d, cs, lambda: m.resize(1, quota("full", 1, 2))


SCENARIOS = {
    "resume": _resume_scenario,
    "resume-cold": _resume_cold_scenario,
    "resume-cold-general": lambda tmp: _resume_cold_scenario(tmp, general=True),
    "resize": _resize_scenario,
    "manager-resize": _level_resize_scenario,
}


# Where each scenario waits or copies (a resume that pushes nothing down writes nothing;
# reads from the disk go direct, without the level's thread; nothing else reads).
_NOT_REACHED = {("resume-cold", p) for p in POINTS if p not in ("cold-read", "mover-copy")} | \
    {("resume-cold-general", p) for p in POINTS if p not in ("cold-read", "mover-copy")} | \
    {("resize", "cold-read"), ("manager-resize", "cold-read")}
CASES = [(s, p) for s in sorted(SCENARIOS) for p in sorted(POINTS) if (s, p) not in _NOT_REACHED]


@pytest.mark.parametrize(("scenario", "point"), CASES)
def test_an_interrupt_leaves_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      scenario: str, point: str) -> None:
    fired = 0
    for n in (1, 2, 3, 5, 8, 13):
        m, d, caches, op = SCENARIOS[scenario](tmp_path / f"{n}")
        with interrupt_at(monkeypatch, point, n) as arm:
            try:
                op()
            except KeyboardInterrupt:
                assert arm.fired
        if not arm.fired:
            break  # the operation makes fewer calls: later n interrupt nothing either
        fired += 1
        _settle(m, d, caches)
        m.shutdown()
    assert fired, f"{scenario} never reaches {point}"


def test_a_resumed_cache_can_resume_after_an_interrupt(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's case: the interrupted resume is retried at once and succeeds."""
    m, d, cs, op = _resume_scenario(tmp_path)
    with interrupt_at(monkeypatch, "io-call", 1) as arm:
        with pytest.raises(KeyboardInterrupt):
            op()
    assert arm.fired
    assert_invariants(m)
    assert cs[0].resume(), cs[0].last_refusal
    d.check(cs[0])
    _settle(m, d, cs)
    m.shutdown()


@pytest.mark.parametrize("seed", range(6))
def test_interrupts_in_a_random_workload_leave_no_trace(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        seed: int) -> None:
    """A seeded workload (create, step, suspend, resume, close on a small GPU over a host
    and a disk level) interrupted at random waits: after each interrupt the invariants
    hold; at the end every cache's data is intact and every slot is free."""
    rng = random.Random(seed)
    m = make_manager([("gpu", 8), ("host", 2), ("disk", 64)], tmp_path)
    d = Driver(m)
    caches: list[Any] = []
    interrupts = 0
    for _ in range(40):
        point = rng.choice(sorted(POINTS))
        with interrupt_at(monkeypatch, point, rng.randint(1, 6)):
            try:
                op = rng.random()
                if op < 0.4 or not caches:
                    c = d.create(tokens(24, rng.randrange(12)))
                    caches.append(c)
                    if c.resume():
                        while c.history_length < 24 and d.step(c, 8):
                            pass
                        c.suspend()
                elif op < 0.7:
                    c = rng.choice(caches)
                    if c.status.name == "SUSPENDED" and c.history_length == 24 and \
                            c.resume():
                        d.check(c)
                        c.suspend()
                else:
                    c = caches.pop(rng.randrange(len(caches)))
                    c.close()
            except KeyboardInterrupt:
                interrupts += 1
        assert_invariants(m)
    assert interrupts
    for c in caches:
        if c.status.name == "ACTIVE":
            c.suspend()
    d.resume_and_verify(*[c for c in caches if c.history_length == 24])
    for c in caches:
        c.close()
    assert_all_free(m)
    m.shutdown()
