"""The command line as a reviewer met it (review 24): bad input, unwritable output and odd
environments end in one clear line and a documented exit status, never a traceback, and
nothing written before is lost or cut off.

Exit status (README): 0 ok, 1 verification failed, 2 a usage or configuration error found
before running, 3 a failure while running (a report or result that cannot be written
after the run included)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvcm_core.simulate.runner as runner
from kvcm_core import cli
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.errors import ConfigError
from kvcm_core.simulate.mooncake import TraceError, read_trace, to_requests
from kvcm_core.simulate.workload import WorkloadConfig

DEFAULT = (Path(runner.__file__).parent / "default.toml").read_text()
QUICK = ["--requests", "3", "--seed", "1", "--quiet", "--no-compare"]
TRACE_LINE = '{"timestamp": %s, "input_length": 10, "output_length": %s, "hash_ids": [1]}\n'


def _config(tmp_path: Path, text: str | None = None, **replace: str) -> str:
    """A simulation file: ``text``, else the default one with ``old=new`` replaced."""
    if text is None:
        text = DEFAULT
        for old, new in replace.items():
            assert old in text, old
            text = text.replace(old, new)
    path = tmp_path / "sim.toml"
    path.write_text(text)
    return str(path)


def _trace(tmp_path: Path, *lines: str, name: str = "t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(lines))
    return str(path)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``kvcm ARGS`` in this process: exit status, stdout, stderr."""
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str) -> str:
    """The one error line on stderr (warnings before the run aside), no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1, err
    return lines[0]


def _env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    environ.update(extra)
    return environ


def _kvcm(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = kwargs.pop("env", None) or _env()
    return subprocess.run([sys.executable, "-m", "kvcm_core.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300, **kwargs)


# -- 1. output that cannot be written ------------------------------------------------------


@pytest.mark.parametrize("in_the_way", ["report.json", "hit_rate.png"])
def test_simulate_refuses_a_folder_where_its_report_or_plot_goes_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], in_the_way: str) -> None:
    (tmp_path / "out" / in_the_way).mkdir(parents=True)
    code, _, err = _run(capsys, "simulate", *QUICK, "--out", str(tmp_path / "out"))
    assert code == 2
    line = _one_line(err)
    assert "--out" in line and in_the_way in line and "not a file" in line


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_simulate_refuses_an_out_folder_where_no_file_can_be_made_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "simulate", *QUICK, "--out", "/sys/kernel")
    assert code == 2
    assert "--out /sys/kernel: cannot be written" in _one_line(err)


def test_simulate_refuses_an_empty_out(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "simulate", *QUICK, "--out", "")
    assert code == 2
    assert "--out ''" in _one_line(err)


def test_two_engine_refuses_an_out_that_is_a_file_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep")
    code, _, err = _run(capsys, "simulate", "--preset", "two-engine", "--requests", "2",
                        "--quiet", "--out", str(afile))
    assert code == 2
    assert f"--out {afile}: is an existing file" in _one_line(err)
    assert afile.read_text() == "keep"


def test_a_report_write_that_fails_keeps_the_previous_report_whole_and_exits_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    args = ("simulate", *QUICK, "--no-plots", "--out", str(out))
    assert _run(capsys, *args)[0] == 0
    before = (out / "report.json").read_text()
    json.loads(before)
    real = Path.write_text

    def disk_full(self: Path, data: str, *a: Any, **k: Any) -> int:
        if "report.json" in self.name:
            real(self, data[: len(data) // 2], *a, **k)  # half of it, then the disk is full
            raise OSError(28, "No space left on device")
        return real(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_text", disk_full)
    code, _, err = _run(capsys, *args)
    assert code == 3
    line = _one_line(err)
    assert "report.json" in line and "No space left on device" in line
    assert (out / "report.json").read_text() == before  # the good report, whole
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]  # no temporary left


def test_a_plot_write_that_fails_leaves_no_cut_off_plot_and_exits_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    out = tmp_path / "out"
    args = ("simulate", *QUICK, "--out", str(out))
    assert _run(capsys, *args)[0] == 0
    real = Figure.savefig

    def disk_full(self: Any, fname: Any, *a: Any, **k: Any) -> None:
        real(self, fname, *a, **k)
        Path(fname).write_bytes(Path(fname).read_bytes()[:100])  # cut off, then full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    code, _, err = _run(capsys, *args)
    assert code == 3
    line = _one_line(err)
    assert "hit_rate.png" in line and "No space left on device" in line
    assert json.loads((out / "report.json").read_text())["verification"]["ok"]
    # No cut-off plot nor temporary file; the earlier run's plots went when the run started.
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]


def test_bench_refuses_an_empty_out(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path, TRACE_LINE % (0, 2))
    code, _, err = _run(capsys, "bench", "trace", trace, "--quick", "--out", "")
    assert code == 2
    assert "--out=''" in _one_line(err)


def _fsize_limited(limit: int) -> Any:
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_benchmark_result_that_cannot_be_written_leaves_no_file_and_exits_3(
        tmp_path: Path) -> None:
    trace = _trace(tmp_path, *(TRACE_LINE % (10 * i, 2) for i in range(4)))
    out = tmp_path / "results"
    out.mkdir()
    result = _kvcm("bench", "trace", trace, "--quick", "--out", str(out),
                   preexec_fn=_fsize_limited(600))  # the result is larger: a full disk
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot write" in result.stderr and "trace-" in result.stderr
    assert list(out.iterdir()) == []  # no empty or cut-off result file


# -- 2. configuration values that got past validation --------------------------------------


@pytest.mark.parametrize(("text", "field"), [
    (None, "toml"),  # not UTF-8
    ("x = " + "[" * 5000 + "]" * 5000 + "\n[kvcm]\n", "toml"),
    ("simulate = 5\n[kvcm]\ntokens_per_block = 16\n", "simulate=5"),
    ("kvcm = 5\n", "kvcm=5"),
    ("simulate.workload = 5\n[kvcm]\n", "simulate.workload=5"),
    ("[simulate.workload]\nmix = 5\n[kvcm]\n", "simulate.workload.mix=5"),
    ("[simulate.workload]\nmix = {chat = nan}\n[kvcm]\n", "simulate.workload.mix.chat=nan"),
    ("[simulate.workload]\nmix = {chat = inf}\n[kvcm]\n", "simulate.workload.mix.chat=inf"),
    ("[simulate.workload]\narrival_rate = nan\n[kvcm]\n", "simulate.workload.arrival_rate"),
    ("[simulate]\nlevel_fractions = [inf, 0.5, 4.0]\n[kvcm]\n", "simulate.level_fractions"),
])
def test_a_bad_simulation_file_is_one_configuration_error_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None,
        field: str) -> None:
    if text is None:
        path = tmp_path / "sim.toml"
        path.write_bytes(b"\xff\xfe[kvcm]\n\x80\x81")
        config = str(path)
    else:
        config = _config(tmp_path, text)
    code, _, err = _run(capsys, "simulate", *QUICK, "--config", config,
                        "--out", str(tmp_path / "o"))
    assert code == 2
    line = _one_line(err)
    assert "configuration error" in line and field in line


def test_from_toml_of_a_file_that_is_not_utf8_raises_config_error(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_bytes(b"tokens_per_block = 16\n# \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        KVCacheManagerConfig.from_toml(path)


# -- 3. trace values that got past validation ----------------------------------------------


@pytest.mark.parametrize("n_out", ["100000000000", "99999999999999999999999"])
def test_a_trace_output_length_beyond_the_cap_is_an_error_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], n_out: str) -> None:
    trace = _trace(tmp_path, TRACE_LINE % (0, n_out))
    code, _, err = _run(capsys, "simulate", "--trace", trace, "--quiet",
                        "--out", str(tmp_path / "o"))
    assert code == 2
    line = _one_line(err)
    assert f"{trace}:1: output_length {n_out}" in line and "[0, 16777216]" in line


def test_simulate_names_the_trace_line_whose_arrival_step_overflows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path, TRACE_LINE % (0, 2), TRACE_LINE % (1e9, 2))
    code, _, err = _run(capsys, "simulate", "--trace", trace, "--ms-per-step", "1e-300",
                        "--quiet", "--out", str(tmp_path / "o"))
    assert code == 2
    assert f"{trace}:2: timestamp 1000000000.0 / --ms-per-step 1e-300" in _one_line(err)


def test_a_trace_arrival_step_that_is_not_finite_is_a_trace_error(tmp_path: Path) -> None:
    records = read_trace(_trace(tmp_path, TRACE_LINE % (0, 2), TRACE_LINE % (1e9, 2)))
    with pytest.raises(TraceError, match=r"^trace:2: timestamp .* arrival step inf"):
        to_requests(records, 1e-300)


# -- 4. workloads that would never finish being generated ----------------------------------


@pytest.mark.parametrize(("key", "value"), [
    ("chat_turns", [100_000_000, 100_000_000]),
    ("agent_steps", [1, 100_000_000]),
    ("tenants", 100_000_000),
    ("system_prompts", 100_000_000),
])
def test_workload_sizes_that_cannot_be_generated_are_refused_naming_the_key(
        key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"simulate\.workload\.{key}=.*at most"):
        WorkloadConfig.from_dict({key: value})


# -- 5, 6. quotas computed from level_fractions; preflight of every level -----------------


def test_a_plain_trace_run_raises_a_too_small_cold_level_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path, TRACE_LINE % (0, 2))
    code, _, err = _run(capsys, "simulate", "--trace", trace, "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert "warning: level 1 quota raised from 384 B (level_fractions[1] = 0.5" in err


def test_a_tiny_cold_fraction_is_raised_to_one_slot_per_cold_group(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, **{"level_fractions = [0.10, 0.5, 4.0]":
                                  "level_fractions = [0.1, 0.00001, 4.0]"})
    code, _, err = _run(capsys, "simulate", *QUICK, "--no-plots", "--config", config,
                        "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert "warning: level 1 quota raised from 1 B (level_fractions[1] = 1e-05" in err


def test_a_bad_tier_option_of_a_colder_level_is_found_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, **{'tier = "disk"\n':
                                  'tier = "disk"\noptions = { path = "/proc/nope" }\n'})
    out = tmp_path / "o"
    code, _, err = _run(capsys, "simulate", *QUICK, "--config", config, "--out", str(out))
    assert code == 2
    assert "/proc/nope" in _one_line(err)
    assert not (out / "report.json").exists()  # refused before the run started


def test_a_fraction_giving_a_huge_quota_is_not_called_too_small(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, **{"level_fractions = [0.10, 0.5, 4.0]":
                                  "level_fractions = [1e300, 0.5, 4.0]"})
    code, _, err = _run(capsys, "simulate", *QUICK, "--config", config,
                        "--out", str(tmp_path / "o"))
    assert code == 2
    line = _one_line(err)
    assert "simulate.level_fractions[0]=1e+300" in line and "too large" in line
    assert "too small" not in line


def test_a_level0_quota_that_cannot_be_allocated_is_not_called_too_small(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, **{"level_fractions = [0.10, 0.5, 4.0]\n": "",
                                  'quota = "4MiB"': 'quota = "1000TiB"'})
    code, _, err = _run(capsys, "simulate", *QUICK, "--config", config,
                        "--out", str(tmp_path / "o"))
    assert code == 2
    line = _one_line(err)
    assert "kvcm.levels[0].quota" in line and "1000.0 TiB" in line
    assert "too small" not in line


# -- 7. closed or full stdout ---------------------------------------------------------------


def test_plugins_with_stdout_closed_is_no_traceback() -> None:
    result = subprocess.run(["/bin/sh", "-c", f"'{sys.executable}' -m kvcm_core.cli plugins >&-"],
                            env=_env(), stderr=subprocess.PIPE, text=True, timeout=120)
    assert _one_line(result.stderr) == \
        "kvcm: stdout is closed: the command's output is discarded"
    assert result.returncode == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_plugins_into_a_full_device_is_one_line_and_exit_3(json_flag: list[str]) -> None:
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "kvcm_core.cli", "plugins", *json_flag],
                                env=_env(), stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=120)
    assert result.returncode == 3
    assert _one_line(result.stderr) == "kvcm: cannot write the output: No space left on device"


# -- 8. user text is not rich markup --------------------------------------------------------


def test_plugins_shows_a_kernel_backend_variable_with_brackets_as_written(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_KERNEL_BACKEND", "[/]")
    code, out, err = _run(capsys, "plugins")
    assert code == 0, err
    assert "(KVCM_KERNEL_BACKEND=[/])" in out


def test_simulate_prints_an_out_path_with_brackets_as_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = [a for a in QUICK if a != "--quiet"]
    code, out, err = _run(capsys, "simulate", *args, "--no-plots", "--out", "[red]/o[/]")
    assert code == 0, err
    assert "report: [red]/o[/]/report.json" in out


def test_bench_trace_prints_a_trace_name_with_brackets_as_written(tmp_path: Path) -> None:
    trace = _trace(tmp_path, TRACE_LINE % (0, 2), name="m[bold].jsonl")
    result = _kvcm("bench", "trace", trace, "--quick", "--out", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    assert "m[bold].jsonl" in result.stdout


# -- 9. conformance exit status -------------------------------------------------------------


@pytest.mark.parametrize("args", [["-k", "no_test_has_this_name"],
                                  ["--", "--no-such-pytest-flag"]])
def test_conformance_that_runs_no_test_exits_2_with_a_line(args: list[str]) -> None:
    result = _kvcm("conformance", "--plugin", "numpy", *args)
    assert result.returncode == 2
    assert "kvcm: " in result.stderr and "Traceback" not in result.stderr


# -- 10. --tag stays a file name ------------------------------------------------------------


@pytest.mark.parametrize("tag", ["../../evil", "a/b", ".."])
def test_bench_tag_with_a_path_is_refused_naming_the_rule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tag: str) -> None:
    trace = _trace(tmp_path, TRACE_LINE % (0, 2))
    out = tmp_path / "deep" / "er" / "out"
    code, _, err = _run(capsys, "bench", "trace", trace, "--quick", "--out", str(out),
                        "--tag", tag)
    assert code == 2
    line = _one_line(err)
    assert f"--tag={tag!r}" in line and "letters, digits" in line
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["t.jsonl"]


# -- 11. messages name the field the user wrote --------------------------------------------


def test_requests_0_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "simulate", "--requests", "0", "--quiet")
    assert code == 2
    assert _one_line(err) == "kvcm simulate: --requests 0: must be an int >= 1"


def test_zero_chat_turns_names_the_workload_key() -> None:
    with pytest.raises(ConfigError, match=r"^simulate\.workload\.chat_turns=\[0, 0\]"):
        WorkloadConfig.from_dict({"chat_turns": [0, 0]})


def test_an_unknown_kernel_backend_from_the_environment_names_the_variable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_KERNEL_BACKEND", "nope")
    code, _, err = _run(capsys, "simulate", *QUICK, "--out", str(tmp_path / "o"))
    assert code == 2
    line = _one_line(err)
    assert "KVCM_KERNEL_BACKEND='nope'" in line and "kvcm.kernel_backend" not in line


# -- 12. trace JSON errors --------------------------------------------------------------------


def test_a_trace_json_error_names_the_right_column_once(tmp_path: Path) -> None:
    # The error is at the line's end: its newline is not part of the record.
    trace = _trace(tmp_path, TRACE_LINE % (0, 2), '{"timestamp": 5,\n', '{"a": "b\n')
    with pytest.raises(TraceError) as info:
        read_trace(trace)
    assert str(info.value) == (f"{trace}:2: not valid JSON: Expecting property name enclosed "
                               "in double quotes at column 17")
    with pytest.raises(TraceError) as info:
        read_trace(_trace(tmp_path, '{"a": "b\n', name="u.jsonl"))
    assert str(info.value).endswith("Unterminated string starting at column 7")


# -- 13. silently ignored input -----------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "No", "OFF"])
def test_autoload_false_words_disable_the_entry_points(value: str) -> None:
    result = _kvcm("plugins", env=_env(KVCM_PLUGIN_AUTOLOAD=value))
    assert result.returncode == 0, result.stderr
    assert f"No plugins registered. (KVCM_PLUGIN_AUTOLOAD={value}" in result.stdout


def test_an_autoload_value_that_is_no_yes_or_no_is_refused() -> None:
    result = _kvcm("plugins", env=_env(KVCM_PLUGIN_AUTOLOAD="maybe"))
    assert result.returncode == 2
    assert "KVCM_PLUGIN_AUTOLOAD='maybe'" in _one_line(result.stderr)


def test_a_failed_run_leaves_no_earlier_plots_beside_its_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.json").write_text("{}")  # the folder of an earlier run
    for name in ("hit_rate.png", "occupancy.png"):
        (out / name).write_bytes(b"an earlier run's plot")
    code, _, err = _run(capsys, "simulate", *QUICK, "--corrupt-at", "2", "--out", str(out))
    assert code == 1, err
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]


def test_plots_in_a_folder_that_holds_no_earlier_report_are_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hit_rate.png").write_bytes(b"the user's own picture")
    code, _, err = _run(capsys, "simulate", *QUICK, "--no-plots", "--out", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / "hit_rate.png").read_bytes() == b"the user's own picture"


def test_a_result_written_through_a_link_updates_its_target_and_keeps_its_mode(
        tmp_path: Path) -> None:
    from kvcm_core.console import atomic_output
    target = tmp_path / "kept" / "report.json"
    target.parent.mkdir()
    target.write_text("old")
    target.chmod(0o600)
    link = tmp_path / "report.json"
    link.symlink_to(target)
    with atomic_output(link) as tmp:
        tmp.write_text("new")
    assert link.is_symlink() and target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json"]


# -- 14. one prefix -------------------------------------------------------------------------


def test_bench_without_a_target_has_one_kvcm_prefix(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "bench")
    assert code == 2
    assert "kvcm: kvcm bench" not in err and "kvcm: choose a benchmark" in err
