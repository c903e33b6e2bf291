"""``kvcm soak``: a seeded random workload over GPU, host and disk levels with injected
disk write and read failures, every step fingerprint-verified and invariant-checked."""

from __future__ import annotations

import numpy as np
import pytest

import kvcm_core
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
    """Slow faults make what happens while the disk level is stuck depend on timing; every
    other kind replays exactly. (A deadline far past any step: on a loaded machine an
    ordinary disk operation can miss the soak's 0.1 s one, which is timing too.)"""
    a, b = (run_soak(SoakConfig(steps=150, seed=11, slow_rate=0, io_deadline_s=30.0,
                                slow_s=60.0)) for _ in range(2))
    assert (a.requests, a.finished, a.tokens, a.faults, a.recomputes) == (
        b.requests, b.finished, b.tokens, b.faults, b.recomputes)


def test_corrupted_disk_pages_are_caught_by_the_frame_check_and_recomputed() -> None:
    result = run_soak(SoakConfig(steps=400, seed=4, write_fault_rate=0, read_fault_rate=0,
                                 corrupt_rate=0.5, slow_rate=0))
    assert result.ok, result.failure
    assert result.faults_by_kind["corrupt"] == result.faults > 100
    assert result.corrupt_pages > 0 and result.recomputes > 0


def test_slow_disk_io_misses_its_deadline_and_no_step_waits_much_longer() -> None:
    result = run_soak(SoakConfig(steps=600, seed=6, write_fault_rate=0, read_fault_rate=0,
                                 corrupt_rate=0, slow_rate=0.05, io_deadline_s=0.05,
                                 slow_s=1.0))
    assert result.ok, result.failure
    # (Operations armed slow while the level is stuck fail at once and never sleep.)
    assert result.faults_by_kind["slow"] == result.faults >= 2
    # A slow operation armed while the level is stuck is refused at once: not a miss.
    assert result.deadline_misses + result.refused_while_stuck >= result.faults
    # A slow operation sleeps 1 s; a step waits for it at most one 0.05 s deadline plus
    # its own work (about 0.06 s in all here). The bound sits far from both, so a loaded
    # machine does not fail the test and a step that waited for the sleep still does.
    assert result.slowest_step_s < 0.6


def test_background_disk_writes_under_faults_give_zero_wrong_kv_and_no_recompute_loop() -> None:
    """A reusable block whose background write failed can never be read: the first reuse
    that tries loses it (it left the tree only on a moving read before, so requests
    reusing it failed and were recomputed again and again: 973 recomputes here)."""
    result = run_soak(SoakConfig(steps=3000, seed=2, write_queue_depth=4))
    assert result.ok, result.failure
    assert result.faults_by_kind["write"] > 50
    assert result.recomputes < result.requests / 4


def test_the_summary_counts_every_fault_kind(capsys) -> None:
    assert main(["soak", "--steps", "200", "--seed", "1", "--corrupt-rate", "0.2",
                 "--slow-rate", "0.02", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert " write, " in out and " read, " in out and " corrupt, " in out and " slow)" in out
    assert "deadline misses" in out and "slowest step" in out and "wrong KV 0" in out


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("corrupt_rate", 1.5, "must be a number in"), ("slow_rate", -0.1, "must be a number in"),
    ("io_deadline_s", 0, "must be seconds in"), ("slow_s", 0.05, "must exceed io_deadline_s"),
    ("slow_s", 0.13, "must exceed io_deadline_s \\(0.1\\) by a margin: at least 0.2")])
def test_bad_soak_rates_and_times_are_refused_naming_the_field(field, value, rule) -> None:
    with pytest.raises(ConfigError, match=f"soak.{field}={value}: {rule}"):
        SoakConfig(**{field: value})


def test_a_bad_soak_argument_exits_2(capsys) -> None:
    assert main(["soak", "--steps", "5", "--read-fault-rate", "2"]) == 2
    assert "read_fault_rate" in capsys.readouterr().err


def test_a_negative_soak_seed_exits_2_naming_the_field(capsys) -> None:
    with pytest.raises(ConfigError, match=r"soak\.seed=-1: must be an int >= 0"):
        SoakConfig(seed=-1)
    assert main(["soak", "--steps", "5", "--seed", "-1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "soak.seed=-1: must be an int >= 0" in err and "Traceback" not in err


@pytest.mark.parametrize(("option", "field"), [
    ("--steps", "steps"), ("--seed", "seed"), ("--write-queue-depth", "write_queue_depth")])
def test_a_negative_soak_count_exits_2_naming_the_field_and_the_rule(option, field,
                                                                    capsys) -> None:
    assert main(["soak", "--steps", "5", option, "-1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"kvcm soak: soak.{field}=-1: must be an int >= 0" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("steps", -1, "must be an int >= 0"), ("steps", 1.5, "must be an int >= 0"),
    ("probe_every", -1, "must be an int >= 0"), ("resize_every", True, "must be an int >= 0"),
    ("arrival_rate", -0.5, "must be a finite number >= 0"),
    ("arrival_rate", float("nan"), "must be a finite number >= 0")])
def test_a_bad_soak_count_or_arrival_rate_is_a_config_error_naming_the_field(
        field, value, rule) -> None:
    with pytest.raises(ConfigError, match=f"soak.{field}={value}: {rule}"):
        SoakConfig(**{field: value})


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


def test_deadline_misses_count_operations_past_the_deadline_and_refusals_are_apart(
        monkeypatch, capsys) -> None:
    """The disk level's IOStats count a read or write refused at once in fast_fails only
    (in no read or write miss); the soak reports its misses and refusals as they are."""
    seen: dict[str, int] = {}
    shutdown = KVCacheManager.shutdown

    def record(self, *a, **k):  # type: ignore[no-untyped-def]
        io = self.storage_levels.io[2] if len(self.storage_levels.io) > 2 else None
        if io is not None:
            seen.update(io.stats.as_dict())
        return shutdown(self, *a, **k)

    monkeypatch.setattr(KVCacheManager, "shutdown", record)
    result = run_soak(SoakConfig(steps=600, seed=6, write_fault_rate=0, read_fault_rate=0,
                                 corrupt_rate=0, slow_rate=0.05, io_deadline_s=0.05,
                                 slow_s=1.0))
    assert result.ok, result.failure
    assert seen["fast_fails"] > 0 and seen["read_misses"] + seen["write_misses"] > 0
    assert result.refused_while_stuck == seen["fast_fails"]
    assert result.deadline_misses == seen["read_misses"] + seen["write_misses"]
    assert result.background_misses == seen["background_misses"] == 0  # no queue here
    text = result.summary()
    assert f"deadline misses {result.deadline_misses} (ran past it)" in text
    assert f"refused at once while stuck {result.refused_while_stuck}" in text
    assert f"background writes past the deadline {result.background_misses}" in text


def test_a_cache_left_open_is_a_leak_naming_it_exit_1_and_the_summary_says_the_check_ran(
        monkeypatch, capsys) -> None:
    leaked: list = []
    probe = soak._probe

    def leaky(m, work):  # type: ignore[no-untyped-def]
        if not leaked:
            tokens = work.prompt()
            leaked.append(m.create_kv_cache(None, tokens, id="leaky-cache"))  # never closed
        return probe(m, work)

    monkeypatch.setattr(soak, "_probe", leaky)
    assert main(["soak", "--steps", "60", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "1 caches left open ('leaky-cache')" in captured.err
    assert "leak check FAILED: 1 caches left open ('leaky-cache')" in captured.out


def test_a_clean_run_says_the_leak_check_passed_and_wraps_its_summary(capsys) -> None:
    assert main(["soak", "--steps", "60", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "leak check passed" in out
    assert max(len(line) for line in out.splitlines()) <= 80, out


def test_a_kvcm_that_ignores_a_failed_disk_write_fails_the_soak(monkeypatch) -> None:
    """A failed write's poison read back as a page is a page the frame check rejects
    although no corrupting fault damaged it: the soak must fail, not count it as a corrupt
    page caught and recompute."""
    from kvcm_core.errors import TierIOError
    from kvcm_core.migration import Mover

    put = Mover._put

    def ignoring(*args):  # type: ignore[no-untyped-def]
        try:
            put(*args)
        except TierIOError:
            pass

    monkeypatch.setattr(Mover, "_put", staticmethod(ignoring))
    result = run_soak(SoakConfig(steps=1000, seed=1))
    assert not result.ok and result.unexplained_losses == 1, result.summary()
    assert "holds the poison of a failed write" in result.failure


def test_a_kvcm_that_ignores_a_failed_disk_read_fails_the_soak(monkeypatch) -> None:
    """A failed read's poison used as frames (its error unseen) fails the frame check of
    pages no fault damaged: the soak fails."""
    from kvcm_core.testing import faults

    wait = faults._FaultyHandle.wait

    def ignoring_reads(self, timeout=None):  # type: ignore[no-untyped-def]
        if self._error is not None and "read" in str(self._error):
            self._error = None
        wait(self, timeout)

    monkeypatch.setattr(faults._FaultyHandle, "wait", ignoring_reads)
    result = run_soak(SoakConfig(steps=1000, seed=1))
    assert not result.ok and result.unexplained_losses == 1, result.summary()
    assert "no injected fault damaged it" in result.failure


def test_disk_pages_lost_with_no_fault_fail_the_soak(monkeypatch) -> None:
    """Every disk frame reported damaged (every disk page lost): unexplained, exit 1."""
    from kvcm_core.frame import FrameBook

    monkeypatch.setattr(FrameBook, "check",
                        lambda self, slots, frames: np.zeros(len(slots), dtype=bool))
    assert main(["soak", "--steps", "300", "--seed", "1", "--quiet"]) == 1
    result = run_soak(SoakConfig(steps=300, seed=1, write_fault_rate=0, read_fault_rate=0,
                                 corrupt_rate=0, slow_rate=0))
    assert not result.ok and "no injected fault damaged it" in result.failure


def test_a_page_lost_in_a_step_without_an_io_fault_fails_the_soak(monkeypatch) -> None:
    """kvcm losing a held disk page with no I/O fault behind it (here: the first onboard
    loses one of its pages) is reported, not recomputed in silence."""
    from kvcm_core.levels import Levels

    onboard = Levels.onboard
    done: list[int] = []

    def lossy(self, pids, stream=None, lock=False):  # type: ignore[no-untyped-def]
        if not done and len(pids) and (self.arena.level[pids] == 2).any():
            done.append(1)
            self.lose(int(pids[self.arena.level[pids] == 2][0]))
            raise kvcm_core.TierIOError("a bug: lost a page")
        return onboard(self, pids, stream, lock)

    monkeypatch.setattr(Levels, "onboard", lossy)
    result = run_soak(SoakConfig(steps=1000, seed=1, write_fault_rate=0, read_fault_rate=0,
                                 corrupt_rate=0, slow_rate=0))
    assert done and not result.ok and result.unexplained_losses == 1, result.summary()
    assert "was lost, but the disk level met no I/O fault" in result.failure


def test_corrupt_faults_and_failed_writes_are_told_apart_by_the_faulty_tier(tmp_path) -> None:
    from kvcm_core.plugins import KvcmPluginManager
    from kvcm_core.testing.faults import FaultPlan, FaultyTier

    disk = KvcmPluginManager().tier("disk")
    tier = FaultyTier(disk.factory(None, {"path": str(tmp_path)}),
                      FaultPlan(fail_writes={1}, corrupt_writes={2}))
    pool = tier.create_pool(64, 8)
    rows = np.zeros((2, 64), dtype=np.uint8)
    with pytest.raises(kvcm_core.TierIOError):
        pool.write(np.array([0, 1]), rows).wait()
    pool.write(np.array([2]), rows[:1]).wait()
    tier.corrupt(pool, 3)
    assert [tier.damage(pool, s) for s in range(5)] == [
        "failed write", "failed write", "corrupt", "corrupt", None]
    pool.write(np.array([1, 2]), rows).wait()  # good data again
    assert [tier.damage(pool, s) for s in range(4)] == ["failed write", None, None, "corrupt"]
    tier.close()


def test_a_step_that_waits_out_a_slow_disk_operation_fails_the_soak(monkeypatch) -> None:
    """Every slow fault sleeps past the deadline, so each must be a miss; a kvcm that
    waits for its disk level with no deadline (here: a deadline of a minute) has none,
    and the soak fails (it passed, with 4 s steps against a 0.1 s deadline)."""
    import time

    from kvcm_core.level_io import LevelIO

    call = LevelIO.call

    def patient(self, fn, what, kind, until=None, reads=None):  # type: ignore[no-untyped-def]
        return call(self, fn, what, kind, time.monotonic() + 60, reads)

    monkeypatch.setattr(LevelIO, "call", patient)
    result = run_soak(SoakConfig(steps=200, seed=6, write_fault_rate=0, read_fault_rate=0,
                                 corrupt_rate=0, slow_rate=0.05, io_deadline_s=0.05,
                                 slow_s=0.1))
    assert result.faults_by_kind["slow"] > 0
    assert not result.ok and result.deadline_breaches == 1, result.summary()
    assert "slept past the I/O deadline but only" in result.failure


@pytest.mark.parametrize("error", ["InvalidStateError", "ConfigError", "KeyError"])
def test_an_exception_kvcm_raises_mid_run_fails_with_seed_step_and_summary_then_shuts_down(
        monkeypatch, capsys, error) -> None:
    """A kvcm error mid-run (here the first quota resize, step 99) is exit 1 with the
    seed, the step, the error and the summary, no traceback, and the manager is still
    shut down (it was exit 3, or 2 for a ConfigError, with one line and no shutdown)."""
    def broken(self, level, quota):  # type: ignore[no-untyped-def]
        raise {"InvalidStateError": kvcm_core.InvalidStateError("page 17 is owned twice"),
               "ConfigError": ConfigError(f"levels[{level}].quota", 123, "a core bug"),
               "KeyError": KeyError(17)}[error]

    shut: list[int] = []
    shutdown = KVCacheManager.shutdown

    def record(self, *a, **k):  # type: ignore[no-untyped-def]
        shut.append(1)
        return shutdown(self, *a, **k)

    monkeypatch.setattr(KVCacheManager, "resize", broken)
    monkeypatch.setattr(KVCacheManager, "shutdown", record)
    assert main(["soak", "--steps", "300", "--seed", "7", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert shut == [1]
    assert f"kvcm soak (seed 7): FAILED: step 99: {error}" in captured.err
    assert "Traceback" not in captured.err and "--debug for the traceback" in captured.err
    assert "steps 99," in captured.out and "kvcm errors 1" in captured.out
    assert "leak check passed" in captured.out  # the caches were closed after it
    assert main(["--debug", "soak", "--steps", "300", "--seed", "7", "--quiet"]) == 1
    assert "Traceback" in capsys.readouterr().err
