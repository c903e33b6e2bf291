"""``kvcm simulate`` (quality.md §4): a short run verifies every step and reports; an
injected corruption fails it; the workload is seeded and realistic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvcm_core.simulate import load_config, main
from kvcm_core.simulate.workload import KINDS, WorkloadConfig, generate_trace

SHORT = ["--requests", "24", "--quiet", "--seed", "3"]


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("sim")
    return main([*SHORT, "--out", str(out)]), out


def test_short_run_verifies_every_step_and_exits_zero(short_run: tuple[int, Path]) -> None:
    code, out = short_run
    assert code == 0
    rep = _report(out)
    assert rep["verification"] == {"ok": True, "error": None}
    run = rep["run"]
    assert run["requests_finished"] == rep["workload"]["requests"] == 24
    assert run["verification"]["steps_checked"] > 0
    assert run["verification"]["pages_checked"] > 0
    assert run["verification"]["invariant_checks"] >= 1


def test_report_json_has_the_documented_keys(short_run: tuple[int, Path]) -> None:
    _, out = short_run
    rep = _report(out)
    assert {"meta", "workload", "verification", "run", "gpu_only", "infinite_bound",
            "summary"} <= rep.keys()
    run = rep["run"]
    assert {"overall", "by_level", "by_kind"} <= run["hit_rate"].keys()
    assert len(run["hit_rate"]["by_level"]) == len(run["levels"])
    assert {"onboard_bytes", "offload_bytes"} <= run["bytes_moved"].keys()
    assert {"dropped_blocks", "dropped_before_reuse"} <= run["evictions"].keys()
    timing = run["timing"]
    assert {"manager_s", "manager_us_per_step", "manager_us_per_request", "manager_calls",
            "fingerprint_s"} <= timing.keys()
    assert timing["manager_calls"]["create_kv_cache"]["calls"] >= 24
    series = run["series"]
    assert len(series["occupancy"]) == len(run["levels"])
    assert len(series["step"]) == len(series["cumulative_hit_rate"]) > 0
    assert {"hit_rate", "fraction_of_bound"} <= rep["summary"].keys()
    if len(run["levels"]) > 1:
        assert rep["gpu_only"]["levels"] == run["levels"][:1]


def test_report_counts_each_storage_levels_io_and_the_gpu_only_run_has_none(
        short_run: tuple[int, Path]) -> None:
    _, out = short_run
    rep = _report(out)
    io = rep["run"]["storage_io"]
    disk = [str(i) for i, lv in enumerate(rep["run"]["levels"]) if lv["tier"] == "disk"]
    assert disk and sorted(io) == disk  # the embedded default: one disk level
    assert {"operations", "direct_reads", "direct_writes", "queue_full_drops",
            "read_misses", "write_misses", "background_misses",
            "fast_fails"} <= io[disk[0]].keys()
    assert rep["gpu_only"]["storage_io"] == {}


def test_a_run_that_reaches_the_disk_reports_its_reads_and_writes(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    assert main(["--requests", "60", "--quiet", "--seed", "3", "--no-plots",
                 "--no-compare", "--out", str(out)]) == 0
    run = _report(out)["run"]
    (stats,) = run["storage_io"].values()
    # writes (held back, on the level's thread or the tier's own) and any read not served
    # directly or from held rows
    assert stats["held_writes"] + stats["operations"] + stats["direct_writes"] > 0
    assert stats["read_misses"] == stats["write_misses"] == stats["bad_reads"] == 0
    assert stats["background_misses"] == stats["fast_fails"] == 0
    assert run["bytes_moved"]["onboard_blocks"] > 0
    assert stats["direct_reads"] + stats["held_reads"] <= run["bytes_moved"]["onboard_blocks"]


def test_infinite_bound_is_at_least_every_measured_hit_rate(
        short_run: tuple[int, Path]) -> None:
    _, out = short_run
    rep = _report(out)
    bound = rep["infinite_bound"]
    assert bound["dropped_blocks"] == 0
    assert 0 < bound["hit_rate"] <= 1
    for run in (rep["run"], rep["gpu_only"]):
        if run is not None:
            assert run["hit_rate"]["overall"] <= bound["hit_rate"] + 1e-12


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_plots_are_written_as_png(short_run: tuple[int, Path]) -> None:
    _, out = short_run
    for name in ("hit_rate.png", "occupancy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corrupted_page_fails_verification_with_exit_one(tmp_path: Path) -> None:
    code = main([*SHORT, "--requests", "12", "--no-compare", "--no-plots", "--corrupt-at",
                 "4", "--out", str(tmp_path)])
    assert code == 1
    rep = _report(tmp_path)
    assert rep["verification"]["ok"] is False
    assert "FingerprintMismatch" in rep["verification"]["error"]


#: A sampled run (one full check in 1000 steps) in which the page --corrupt-at 112 flips
#: belongs to a request no later fresh check covers: before the fix it exited 0, verified.
SAMPLED = ["--requests", "12", "--seed", "3", "--quiet", "--no-plots", "--no-compare",
           "--verify-every", "1000"]


@pytest.mark.parametrize("at", [112, 168, 196])
def test_with_sampled_verification_the_check_after_a_corruption_is_full_and_detects_it(
        tmp_path: Path, capsys: pytest.CaptureFixture, at: int) -> None:
    code = main([*SAMPLED, "--corrupt-at", str(at), "--out", str(tmp_path)])
    assert code == 1
    assert "FingerprintMismatch" in capsys.readouterr().err
    rep = _report(tmp_path)
    assert rep["verification"]["ok"] is False
    test = rep["meta"]["self_test"]
    assert test["corrupt_at"] == at and test["injected"] is True
    assert test["injected_at_step"] >= at and test["detected"] is True


def test_a_self_test_run_failing_for_another_reason_does_not_count_as_detected(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``meta.self_test.detected`` says the injected corruption was found as wrong KV: a
    run that fails its invariants instead (exit 1 as well) does not count."""
    from kvcm_core.testing.fingerprint import FingerprintEngine

    calls = []

    def broken(self, work):  # after the injection: a broken invariant, not wrong KV
        calls.append(1)
        if len(calls) > 20:
            raise AssertionError("an invariant broke")

    monkeypatch.setattr(FingerprintEngine, "check", broken)
    code = main([*SHORT, "--requests", "12", "--no-compare", "--no-plots", "--corrupt-at",
                 "4", "--out", str(tmp_path)])
    assert code == 1
    assert "a manager invariant broke" in capsys.readouterr().err
    test = _report(tmp_path)["meta"]["self_test"]
    assert test["injected"] is True and test["detected"] is False


def test_a_corruption_no_check_detects_fails_the_run_saying_so(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcm_core.testing.fingerprint import FingerprintEngine

    monkeypatch.setattr(FingerprintEngine, "check", lambda self, work: None)
    code = main([*SHORT, "--requests", "12", "--no-compare", "--no-plots", "--corrupt-at",
                 "4", "--out", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "verification failed" in err and "no check detected it" in err
    rep = _report(tmp_path)
    assert rep["verification"]["ok"] is False
    assert rep["meta"]["self_test"]["injected"] is True
    assert rep["meta"]["self_test"]["detected"] is False


def test_manager_time_per_step_counts_the_batch_calls_the_engine_makes_every_step(
        short_run: tuple[int, Path]) -> None:
    _, out = short_run
    timing = _report(out)["run"]["timing"]
    calls = timing["manager_calls"]
    for name in ("batch.publish", "batch.add_kv_cache", "batch.remove_kv_cache"):
        assert calls[name]["calls"] > 0 and calls[name]["total_s"] > 0, name
    # Every timed call is in the manager's total (and so in its time per step).
    assert timing["manager_s"] == pytest.approx(sum(c["total_s"] for c in calls.values()))


def test_lookups_after_a_preemption_are_counted_apart_from_admission_retries(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # GPU only: every preemption recomputes, and a refused admission gives its cache back.
    assert main(["--requests", "60", "--seed", "0", "--gpu-only", "--no-plots",
                 "--out", str(tmp_path)]) == 0
    run = _report(tmp_path)["run"]
    again = run["relookups"]
    assert "recompute_lookups" not in run
    assert run["preemptions"] > 0
    assert again["after_preemption"]["lookups"] == run["preemptions"]
    assert again["admission_retries"]["lookups"] > 0
    legend = " ".join(capsys.readouterr().out.split())
    assert "at each request's first lookup" in legend
    assert "not the prefill the run saved" in legend


def test_gpu_only_flag_runs_level_zero_alone(tmp_path: Path) -> None:
    code = main([*SHORT, "--requests", "10", "--gpu-only", "--no-plots", "--out",
                 str(tmp_path)])
    assert code == 0
    rep = _report(tmp_path)
    assert len(rep["run"]["levels"]) == 1 and rep["gpu_only"] is None


def test_bad_configuration_exits_two(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[simulate]\nbogus = 1\n[kvcm]\n")
    assert main(["--config", str(cfg), "--quiet", "--out", str(tmp_path)]) == 2


def test_embedded_default_loads() -> None:
    sim = load_config()
    assert sim.level_fractions is not None
    assert len(sim.level_fractions) == len(sim.kvcm["levels"])


def test_workload_is_deterministic_for_a_seed() -> None:
    cfg = WorkloadConfig(requests=80)
    a, b = generate_trace(cfg, 7), generate_trace(cfg, 7)
    assert [r.id for r in a] == [r.id for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    c = generate_trace(cfg, 8)
    assert [r.tokens.tolist() for r in a] != [r.tokens.tolist() for r in c]


def test_workload_produces_every_kind() -> None:
    trace = generate_trace(WorkloadConfig(requests=80), 0)
    assert {r.kind for r in trace} == set(KINDS)
    assert len(trace) == 80


def test_later_turns_extend_the_whole_earlier_sequence() -> None:
    trace = generate_trace(WorkloadConfig(requests=120), 1)
    by_id = {r.id: r for r in trace}
    continued = [r for r in trace if r.after is not None]
    assert continued and {r.kind for r in continued} == {"chat", "agent"}
    for r in continued:
        prev = by_id[r.after]
        assert r.prompt_len > len(prev.tokens)
        assert np.array_equal(r.tokens[:len(prev.tokens)], prev.tokens)


def test_shared_system_prompts_are_shared_within_a_tenant_only() -> None:
    trace = generate_trace(WorkloadConfig(requests=120, tenants=2, system_prompts=1), 2)
    heads: dict[object, set[bytes]] = {}
    for r in trace:
        if r.kind == "system":
            heads.setdefault(r.scope, set()).add(r.tokens[:200].tobytes())
    assert all(len(h) == 1 for h in heads.values())
    assert len({next(iter(h)) for h in heads.values()}) == len(heads)


def test_infinite_bound_running_out_of_pages_says_so_rather_than_refusing_its_shutdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The infinite-cache replay's own error (its working set underestimated) reaches the
    caller: the cache left open by the failed request is closed on the way out, so the
    manager's shutdown does not refuse and replace the error with an InvalidStateError."""
    from kvcm_core.cache import KVCache
    from kvcm_core.config import KVCacheManagerConfig
    from kvcm_core.simulate.runner import infinite_bound

    cfg = load_config(None)
    trace = generate_trace(WorkloadConfig(requests=3), seed=0)
    monkeypatch.setattr(KVCache, "resize", lambda self, *a, **k: False)
    with pytest.raises(RuntimeError, match="infinite-cache replay ran out of pages"):
        infinite_bound(KVCacheManagerConfig.from_dict(cfg.kvcm), trace, [r.id for r in trace],
                       1 << 20)
