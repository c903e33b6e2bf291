"""``kvcm simulate`` as a user meets it: exit status 2 and one line for every configuration
error found before running (unknown or unavailable plugins, level 0 too small for the
largest request), 3 with the likely cause for a failure during the run (a stall, a storage
failure, an internal error), no traceback without ``--debug``; warnings for a raised level
0 quota and for a level that dwarfs the working set; hints keep their square brackets; a
table that does not wrap when piped, with a legend; plots whose legends cover no data and
whose lines can be told apart."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvcm_core.simulate.runner as runner
from kvcm_core import (
    Availability,
    ConfigError,
    KernelBackendCapabilities,
    KernelBackendSpec,
    TierIOError,
    hookimpl,
)
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.simulate import load_config, main
from kvcm_core.simulate.preflight import level_warnings
from kvcm_core.testing.engine import StepReport
from kvcm_core.testing.faults import FaultPlan, faulty_tier_spec

DEFAULT = (Path(runner.__file__).parent / "default.toml").read_text()
QUICK = ["--requests", "8", "--seed", "3", "--quiet", "--no-plots", "--no-compare"]


def _config(tmp_path: Path, **replace: str) -> str:
    """The default simulation file with text replaced (``old=new`` pairs)."""
    text = DEFAULT
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "sim.toml"
    path.write_text(text)
    return str(path)


def _kvcm_simulate(*args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    return subprocess.run([sys.executable, "-m", "kvcm_core.cli", "simulate", *args],
                          env=environ, capture_output=True, text=True, timeout=600)


def _one_line(err: str) -> str:
    """The one line of the error on stderr (warnings given before running aside)."""
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def register() -> Iterator[Any]:
    """Registers plugin objects in the process-wide plugin manager for one test."""
    pm = get_plugin_manager()
    names: list[str] = []

    def add(plugin: object, name: str) -> None:
        pm.register(plugin, name=name)
        names.append(name)

    yield add
    for name in names:
        pm.unregister(name)


# -- configuration errors: exit 2, one line, before running ---------------------------------


def test_unknown_tier_exits_2_with_one_line_naming_the_field_and_the_choices(tmp_path):
    cfg = _config(tmp_path, **{'tier = "host"': 'tier = "hots"'})
    result = _kvcm_simulate("--config", cfg, *QUICK, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    line = _one_line(result.stderr)
    assert "configuration error: kvcm.levels[1].tier='hots': unknown tier 'hots'" in line
    assert "available: " in line and "host" in line
    assert not (tmp_path / "out").exists()  # refused before running


def test_unknown_kernel_backend_exits_2_with_one_line(tmp_path, capsys):
    cfg = _config(tmp_path, **{'kernel_backend = "auto"': 'kernel_backend = "cudaa"'})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "kvcm.kernel_backend='cudaa': unknown kernel backend 'cudaa'" in line
    assert "numpy" in line


def test_unavailable_backend_hint_keeps_its_square_brackets(tmp_path, capsys, register):
    class Fake:
        @hookimpl
        def kvcm_kernel_backends(self) -> Any:
            yield KernelBackendSpec(
                name="fakegpu", factory=dict,
                capabilities=KernelBackendCapabilities(has_device=True), priority=-1,
                availability=lambda: Availability(False, "no device; pip install "
                                                         "'kvcm[fakegpu]'"))

    register(Fake(), "fakegpu")
    cfg = _config(tmp_path, **{'kernel_backend = "auto"': 'kernel_backend = "fakegpu"'})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "is unavailable: no device; pip install 'kvcm[fakegpu]'" in line


def test_level_0_too_small_for_the_largest_request_exits_2_before_running(tmp_path, capsys):
    cfg = _config(tmp_path, **{"level_fractions = [0.10, 0.5, 4.0]\n": "",
                               'quota = "4MiB"': 'quota = "16KiB"'})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "kvcm.levels[0].quota=16384: too small for the largest request" in line
    assert "cannot provide" in line  # the manager's own reason
    assert not (tmp_path / "out").exists()


def test_level_0_that_holds_the_largest_request_passes_the_check(tmp_path):
    # Exactly what the check refuses above, with room for one request: the run goes on.
    cfg = _config(tmp_path, **{"level_fractions = [0.10, 0.5, 4.0]\n": "",
                               'quota = "4MiB"': 'quota = "64KiB"'})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("replace", [{"seed = 0": "seed = -1"},
                                     {"vocab = 32000": "vocab = 9999999999999"}])
def test_a_negative_seed_or_a_vocab_past_int32_in_the_file_exits_2_naming_the_field(
        tmp_path, capsys, replace):
    cfg = _config(tmp_path, **replace)
    args = [a for a in QUICK if a not in ("--seed", "3")]
    assert main(["--config", cfg, *args, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert ("simulate.seed=-1: must be an int >= 0" in line
            or "simulate.workload.vocab=9999999999999: must be an int in [1, 2**31]" in line), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("option", "value"), [("--seed", "-1"), ("--corrupt-at", "-1"),
                                               ("--seed", "abc")])
def test_a_negative_seed_or_corrupt_at_option_is_a_usage_error_naming_it(
        tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as info:
        main([*QUICK, option, value, "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {value if value != 'abc' else repr(value)}: must be an int " \
           ">= 0" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("knob", "bad", "low"), [
    ("chunk_tokens", 0, 1), ("max_batch", 0, 1), ("token_budget", 0, 1), ("samples", 0, 1),
    ("invariants_every", -1, 0)])
def test_a_scheduler_knob_that_cannot_work_exits_2_with_must_be_at_least(
        tmp_path, capsys, knob, bad, low):
    line_of = {"chunk_tokens": "chunk_tokens = 256", "max_batch": "max_batch = 16",
               "token_budget": "token_budget = 1024", "samples": "samples = 200",
               "invariants_every": "invariants_every = 100"}
    cfg = _config(tmp_path, **{line_of[knob]: f"{knob} = {bad}"})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"configuration error: simulate.{knob}={bad}: must be an int >= {low}" in line
    assert not (tmp_path / "out").exists()


def test_corrupt_at_past_the_runs_end_corrupts_nothing_and_exits_2_saying_so(tmp_path,
                                                                              capsys):
    assert main([*QUICK, "--corrupt-at", "999999", "--out", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--corrupt-at 999999: nothing was corrupted" in line
    assert "the run ended after" in line and "before step 999999" in line


# -- warnings -----------------------------------------------------------------------------------


def test_raising_level_0_quota_over_its_fraction_is_a_warning(tmp_path, capsys):
    cfg = _config(tmp_path, **{"[0.10, 0.5, 4.0]": "[0.001, 0.5, 4.0]"})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: level 0 quota raised from" in err
    assert "level_fractions[0] = 0.001 of the working set" in err


def test_a_level_that_dwarfs_the_working_set_is_a_warning(tmp_path, capsys):
    cfg = _config(tmp_path, **{"level_fractions = [0.10, 0.5, 4.0]\n": "",
                               'quota = "16MiB"': 'quota = "256MiB"'})
    assert main(["--config", cfg, *QUICK, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: level 1 (host) quota 256.0 MiB is " in err
    assert "x the workload's working set" in err
    assert "level 0" not in err  # 4 MiB is small: no warning for it


def test_dwarf_rule_needs_both_the_ratio_and_the_excess_bytes() -> None:
    from kvcm_core import KVCacheManagerConfig

    def warn(quota: int, ws: int) -> list[str]:
        cfg = KVCacheManagerConfig.from_dict({
            "tokens_per_block": 16, "layers": [{"layer_id": 0, "buffers": [
                {"role": "kv", "size": 256}]}],
            "levels": [{"tier": "gpu", "quota": quota}]})
        return level_warnings(cfg, ws)

    mib = 1 << 20
    assert warn(100 * mib, 1 * mib)  # 100x and 99 MiB more
    assert not warn(8 * mib, 1 * mib // 100)  # 800x but only 8 MiB: small levels cost nothing
    assert not warn(600 * mib, 100 * mib)  # 500 MiB more but only 6x


# -- runtime failures: exit 3 with the likely cause ---------------------------------------------


def test_a_stalled_scheduler_exits_3_with_the_likely_cause(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner._SimLoop, "step", lambda self: StepReport())
    assert main([*QUICK, "--out", str(tmp_path)]) == 3
    line = _one_line(capsys.readouterr().err)
    assert "the scheduler stalled: step " in line and "no request advanced" in line
    assert "likely cause: level 0 cannot hold the pages" in line
    assert (tmp_path / "report.json").exists()


def test_a_livelock_giving_tokens_but_no_progress_is_reported_after_stall_steps(
        tmp_path, capsys, monkeypatch):
    """Every step reports tokens given, yet no request's history ever gets further (as
    when requests are recomputed over and over): the watchdog ends the run after
    ``--stall-steps`` steps, exit 3, naming the stall."""
    monkeypatch.setattr(runner._SimLoop, "step", lambda self: StepReport(stepped=1, tokens=1))
    assert main([*QUICK, "--stall-steps", "40", "--out", str(tmp_path)]) == 3
    line = _one_line(capsys.readouterr().err)
    assert "the scheduler stalled: step 39: no request advanced" in line
    assert "for 40 steps (stall_steps = 40;" in line
    assert "likely cause: level 0 cannot hold the pages" in line
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["scheduler"]["stall_steps"] == 40


def test_stall_steps_comes_from_the_simulate_table_and_must_be_at_least_1(tmp_path, capsys):
    assert load_config(None).scheduler.stall_steps == runner.STALL_STEPS
    sim = load_config(_config(tmp_path, **{"stall_steps = 1000": "stall_steps = 7"}))
    assert sim.scheduler.stall_steps == 7
    with pytest.raises(ConfigError, match="stall_steps"):
        load_config(_config(tmp_path, **{"stall_steps = 1000": "stall_steps = 0"}))
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, "--stall-steps", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--stall-steps: 0: must be an int >= 1" in capsys.readouterr().err


def test_progress_is_a_request_getting_further_than_it_ever_had_or_finishing():
    from types import SimpleNamespace as NS

    def req(rid: str, n: int) -> Any:
        return NS(id=rid, cache=NS(history_length=n))

    furthest: dict[Any, int] = {}
    a, b = req("a", 10), req("b", 4)
    loop = NS(running=[a, b])
    assert runner._progressed(loop, StepReport(stepped=2), furthest)
    assert furthest == {"a": 10, "b": 4}
    a.cache.history_length = 0  # a recomputed from scratch
    b.cache = None  # b preempted
    for n in (4, 8, 10):  # tokens a had before: no progress
        a.cache.history_length = n
        assert not runner._progressed(loop, StepReport(stepped=1), furthest)
    a.cache.history_length = 11
    assert runner._progressed(loop, StepReport(stepped=1), furthest)
    assert not runner._progressed(NS(running=[]), StepReport(resumed=[b]), furthest)
    assert runner._progressed(NS(running=[]), StepReport(finished=[a]), furthest)
    assert furthest == {"b": 4}


def test_a_storage_failure_during_the_run_exits_3_naming_it(tmp_path, capsys, register):
    spec = faulty_tier_spec(get_plugin_manager().tier("disk"),
                            FaultPlan(fail_all_reads=True), name="faulty-disk")

    class Faults:
        @hookimpl
        def kvcm_tiers(self) -> Any:
            yield spec

    register(Faults(), "faults")
    # Writes not held: a read of a held page is served from its held rows, not the disk.
    cfg = _config(tmp_path, **{'tier = "disk"': 'tier = "faulty-disk"\nwrite_combine_bytes = 0'})
    code = main(["--config", cfg, "--requests", "40", "--seed", "3", "--quiet",
                 "--no-plots", "--no-compare", "--out", str(tmp_path)])
    assert code == 3
    line = _one_line(capsys.readouterr().err)
    assert "storage failed: TierIOError: reading 1 pages from level 2 failed" in line
    assert "injected fault: read" in line
    assert "likely cause: a colder level's tier could not" in line


def test_an_internal_error_exits_3_and_shows_its_traceback_only_with_debug(
        tmp_path, capsys, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("slot 7")

    monkeypatch.setattr("kvcm_core.simulate.run_trace", broken)
    assert main([*QUICK, "--out", str(tmp_path)]) == 3
    line = _one_line(capsys.readouterr().err)
    assert "internal error: KeyError: 'slot 7'; likely cause: a bug" in line
    assert main([*QUICK, "--debug", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'slot 7'" in err


def test_a_storage_failure_is_not_reported_as_a_verification_failure(tmp_path, capsys,
                                                                     monkeypatch):
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise TierIOError("pwrite: No space left on device")

    monkeypatch.setattr("kvcm_core.simulate.run_trace", failing)
    assert main([*QUICK, "--out", str(tmp_path)]) == 3
    line = _one_line(capsys.readouterr().err)
    assert "verification failed" not in line
    assert "storage failed: TierIOError: pwrite: No space left on device" in line


# -- the report as printed and drawn ------------------------------------------------------------


def test_piped_table_does_not_wrap_and_explains_mean_and_p99(tmp_path):
    result = _kvcm_simulate("--requests", "8", "--seed", "3", "--no-plots",
                            "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert len({len(r) for r in rows}) == 1, "\n".join(rows)  # one line per row
    title = next(line for line in lines if line.startswith("kvcm simulate: "))
    assert title.rstrip().endswith("B")  # "working set 70.5 KiB" on the title's line
    assert any("mgr µs/step mean" in r for r in rows) and any("mgr µs/step p99" in r
                                                              for r in rows)
    legend = " ".join(lines[lines.index(next(line for line in lines
                                             if line.startswith("legend: "))):])
    assert "mean / p99 = the average and the 99th percentile" in legend


def test_the_table_fits_80_columns_and_cuts_no_number(tmp_path) -> None:
    import io
    import json

    from rich.console import Console

    from kvcm_core.simulate.report import print_report

    assert main(["--requests", "60", "--seed", "0", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "seeded")]) == 0
    assert main(["--trace", _gapped_trace(tmp_path), "--quiet", "--no-plots",
                 "--out", str(tmp_path / "trace")]) == 0
    for name in ("seeded", "trace"):
        report = json.loads((tmp_path / name / "report.json").read_text())
        # Bigger figures than the run's, as a long run has: none may be cut either.
        report["run"]["verification"]["pages_checked"] = 123_456_789
        report["run"]["timing"]["manager_us_per_request"]["p99"] = 1_234_567.0
        console = Console(file=io.StringIO(), width=80, color_system=None)
        print_report(report, console)
        text = console.file.getvalue()
        rows = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
        assert rows and max(len(r) for r in rows) <= 80, "\n".join(rows)
        assert "…" not in text
        assert "123,456,789" in text and "1234567" in text
        assert ("│   trace infinite " in text) == (name == "trace")


def test_missing_matplotlib_note_keeps_the_extra_in_brackets(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["--requests", "6", "--seed", "3", "--no-compare", "--out",
                 str(tmp_path)]) == 0
    assert "pip install 'kvcm[plot]'" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
@pytest.mark.parametrize("figure", ["hit_rate_figure", "occupancy_figure"])
def test_plot_legends_cover_no_data_and_every_line_looks_different(tmp_path, figure):
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvcm_core.simulate import report as rep

    assert main(["--requests", "12", "--seed", "3", "--quiet", "--no-plots", "--out",
                 str(tmp_path)]) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    fig = getattr(rep, figure)(data)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        assert legends
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), figure
        for ax in fig.axes:
            looks = [(line.get_color(), line.get_linestyle(), line.get_marker(),
                      line.get_fillstyle(), line.get_alpha())
                     for line in ax.get_lines() if not line.get_label().startswith("_")]
            assert len(looks) == len(set(looks)), looks
    finally:
        plt.close(fig)


# -- step units: one definition for the table, --corrupt-at and a failure's message ---------

def _gapped_trace(tmp_path: Path) -> str:
    """Three requests with long idle stretches (seconds of trace time) between them."""
    import json

    recs = [{"timestamp": t, "input_length": 700, "output_length": 40, "hash_ids": [i, 9]}
            for i, t in enumerate((0, 8000, 16000))]
    path = tmp_path / "gapped.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_corrupt_at_counts_the_steps_the_summary_counts_and_the_failure_names_its_step(
        tmp_path: Path, capsys) -> None:
    import json

    trace = _gapped_trace(tmp_path)
    base = ["--trace", trace, "--verify-every", "1", "--quiet", "--no-plots", "--no-compare"]
    assert main([*base, "--out", str(tmp_path / "ok")]) == 0
    steps = json.loads((tmp_path / "ok" / "report.json").read_text())["run"]["steps"]
    # Idle stretches are not steps: a STEP past the summary's count corrupts nothing.
    capsys.readouterr()
    assert main([*base, "--corrupt-at", str(steps), "--out", str(tmp_path / "past")]) == 2
    assert f"the run ended after {steps} steps" in _one_line(capsys.readouterr().err)
    # One inside the last request's life is caught at the next step, which the message names.
    at = steps - 10
    assert main([*base, "--corrupt-at", str(at), "--out", str(tmp_path / "bad")]) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"verification failed at step {at + 1}: FingerprintMismatch" in line
    rep = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert rep["meta"]["self_test"]["injected_at_step"] == at
    assert f"at step {at + 1}" in rep["verification"]["error"]


def test_help_defines_the_step_units(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "idle stretches waiting for the next arrival are skipped and not counted" in text
