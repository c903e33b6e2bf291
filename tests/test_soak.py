"""``kvcm soak``: a seeded random workload over GPU, host and disk levels with injected
disk write and read failures, every step fingerprint-verified and invariant-checked."""

from __future__ import annotations

import pytest

from kvcm_core import ConfigError, KVCacheManager, soak
from kvcm_core.cli import main
from kvcm_core.soak import SoakConfig, SoakResult, run_soak


def test_a_few_hundred_soak_steps_with_faults_give_zero_wrong_kv(capsys) -> None:
    assert main(["soak", "--steps", "300", "--seed", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "steps 300," in out and "wrong KV 0" in out and "invariant breaches 0" in out


def test_the_soak_injects_faults_reuses_blocks_and_recomputes_lost_ones() -> None:
    result = run_soak(SoakConfig(steps=400, seed=5, write_fault_rate=0.2,
                                 read_fault_rate=0.2))
    assert result.ok, result.failure
    assert result.faults > 0 and result.recomputes > 0 and result.probes > 0
    assert result.finished > 50 and result.steps == 400


def test_the_soak_replays_exactly_from_its_seed() -> None:
    a, b = (run_soak(SoakConfig(steps=150, seed=11)) for _ in range(2))
    assert (a.requests, a.finished, a.tokens, a.faults, a.recomputes) == (
        b.requests, b.finished, b.tokens, b.faults, b.recomputes)


@pytest.mark.parametrize("field", ["corrupt_rate", "slow_rate"])
def test_fault_kinds_not_built_yet_are_refused_naming_what_they_need(field) -> None:
    with pytest.raises(ConfigError, match=f"soak.{field}=0.1: needs"):
        SoakConfig(**{field: 0.1})


def test_a_bad_soak_argument_exits_2(capsys) -> None:
    assert main(["soak", "--steps", "5", "--read-fault-rate", "2"]) == 2
    assert "read_fault_rate" in capsys.readouterr().err


def test_the_soak_catches_wrong_kv_and_exits_1(monkeypatch, capsys) -> None:
    """The oracle is live: flipping a byte of every GPU page mid-run is reported as wrong
    KV (and a failing run exits 1)."""
    made: list[KVCacheManager] = []
    build = soak._manager
    monkeypatch.setattr(soak, "_manager", lambda *a: made.append(build(*a)) or made[-1])

    def corrupt(step: int, result: SoakResult) -> None:
        if step != 40:
            return
        m = made[0]
        region = m.get_page_region(0, "k")
        for slot in range(m.stores[0][0].num_slots):
            start = region.page_start(slot)
            m.backend.write(region.buffer, start, m.backend.read(region.buffer, start, 1) ^ 1)

    result = run_soak(SoakConfig(steps=200, seed=2, write_fault_rate=0, read_fault_rate=0),
                      corrupt)
    assert not result.ok and result.wrong_kv == 1 and result.steps == 41
    assert "wrong KV" in result.failure
    monkeypatch.setattr(soak, "run_soak", lambda cfg, on_step: result)
    assert main(["soak", "--steps", "200", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "wrong KV 1" in captured.out and "FAILED" in captured.err
