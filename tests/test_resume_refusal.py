"""The early refusal of ``resume`` (over ``max_util_for_resume``, decided before any
per-page work) is an optimisation only: it never changes a decision or its reason."""

from __future__ import annotations

from typing import Any

import kvcm_core.cache_resume as cache_resume
from kvcm_core.cli import main

_RESUME = cache_resume.ResumeMixin._resume
_CHECK = cache_resume.ResumeMixin._over_limit_early


def _simulate(monkeypatch: Any, tmp_path: Any, early: bool) -> tuple[list[Any], int]:
    calls: list[Any] = []
    fired = [0]
    resume, check = _RESUME, _CHECK

    def recorded(self: Any, *args: Any, **kwargs: Any) -> bool:
        ok = resume(self, *args, **kwargs)
        calls.append((self.id, ok, self.last_refusal, self.history_length))
        return ok

    def early_check(self: Any) -> bool:
        refused = early and check(self)
        fired[0] += refused
        return refused

    monkeypatch.setattr(cache_resume.ResumeMixin, "_resume", recorded)
    monkeypatch.setattr(cache_resume.ResumeMixin, "_over_limit_early", early_check)
    out = tmp_path / ("early" if early else "late")
    # The default preset: a sliding-window layer (no fast path), partial reuse (pending
    # copies), three levels, and a GPU level small enough that preempted requests are
    # refused again and again.
    assert main(["simulate", "--requests", "120", "--no-compare", "--no-plots", "--quiet",
                 "--out", str(out)]) == 0
    return calls, fired[0]


def test_early_resume_refusals_are_the_decisions_and_reasons_of_the_full_path(
        monkeypatch, tmp_path):
    with_early, fired = _simulate(monkeypatch, tmp_path, early=True)
    without, none = _simulate(monkeypatch, tmp_path, early=False)
    assert fired > 0 and none == 0  # the early path did refuse in the first run
    refused = [c for c in with_early if not c[1]]
    assert len(refused) >= fired
    assert with_early == without  # every resume: same result, same reason, same history
