"""The ``kvcm`` command: plugins, conformance, version, and the lazily dispatched
subcommands."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import kvcm_core
from kvcm_core import (
    Availability,
    KernelBackendCapabilities,
    KernelBackendSpec,
    KvcmPluginManager,
    cli,
    hookimpl,
)

DISTS = Path(__file__).parent / "fixtures" / "dists"
BUILTINS = {
    ("tier", "gpu"),
    ("tier", "host"),
    ("tier", "disk"),
    ("kernel_backend", "numpy"),
    ("codec", "raw"),
    ("eviction_policy", "lru"),
}


def kvcm(*args: str, dists: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvcm ARGS`` in a fresh interpreter, optionally with a fake-distribution scenario
    on the path."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    environ.update(env)
    if dists:
        environ["PYTHONPATH"] = os.pathsep.join([str(DISTS / dists), environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "kvcm_core.cli", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVCM_PLUGIN_AUTOLOAD", "KVCM_DISABLE_PLUGINS", "KVCM_KERNEL_BACKEND"):
        monkeypatch.delenv(name, raising=False)


# -- kvcm plugins -------------------------------------------------------------------------


def test_plugins_lists_every_builtin_with_distribution_kvcm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    listed = {(p["kind"], p["name"]): p for p in data["plugins"]}
    assert BUILTINS <= set(listed)
    for key in BUILTINS:
        assert listed[key]["distribution"] == "kvcm"
        assert listed[key]["version"] == data["version"]
    numpy = listed[("kernel_backend", "numpy")]
    assert numpy["available"] is True
    assert numpy["capabilities"]["has_device"] is False
    assert data["auto_kernel_backend"] is not None


def test_plugins_lists_the_example_tier_with_its_own_distribution(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        importlib.metadata.distribution("kvcm-tier-example")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("examples/kvcm-tier-example is not installed (README's test command does)")
    assert cli.main(["plugins", "--json"]) == 0
    rows = {(p["kind"], p["name"]): p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows[("tier", "mmap")]["distribution"] == "kvcm-tier-example"


def test_plugins_table_names_each_plugin_and_the_auto_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    for _, name in BUILTINS:
        assert f" {name} " in out
    assert 'kernel_backend="auto" selects:' in out


def test_plugins_says_why_a_plugin_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Cuda:
        @hookimpl
        def kvcm_kernel_backends(self) -> Any:
            yield KernelBackendSpec(
                name="cuda",
                factory=dict,
                capabilities=KernelBackendCapabilities(has_device=True),
                priority=100,
                availability=lambda: Availability(False, "no driver; install kvcm[cuda]"),
                description="CUDA through cuda-python",
            )

    pm = KvcmPluginManager(autoload=False)
    pm.register(Cuda(), name="cuda", distribution="kvcm-cuda", version="2.0")
    monkeypatch.setattr(cli, "get_plugin_manager", lambda: pm)
    assert cli.main(["plugins", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plugins"]
    assert (row["available"], row["reason"], row["distribution"]) == (
        False,
        "no driver; install kvcm[cuda]",
        "kvcm-cuda",
    )
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "no: no driver; install kvcm[cuda]" in out  # shown as text, not as rich markup
    assert 'kernel_backend="auto" selects nothing' in out


def test_plugins_lists_an_installed_third_party_plugin_with_its_distribution() -> None:
    result = kvcm("plugins", "--json", dists="good")
    assert result.returncode == 0, result.stderr
    rows = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert (rows["faketier"]["distribution"], rows["faketier"]["version"]) == (
        "kvcm-fake-good",
        "1.2.3",
    )


def test_plugins_with_a_broken_plugin_fails_naming_it_and_how_to_disable_it() -> None:
    result = kvcm("plugins", dists="broken")
    assert result.returncode == 1
    assert "fakebroken" in result.stderr and "kvcm-fake-broken" in result.stderr
    assert "KVCM_DISABLE_PLUGINS=fakebroken" in result.stderr
    fixed = kvcm("plugins", dists="broken", KVCM_DISABLE_PLUGINS="fakebroken")
    assert fixed.returncode == 0, fixed.stderr
    assert "Blocked by KVCM_DISABLE_PLUGINS: fakebroken" in fixed.stdout


def test_plugins_with_autoload_off_lists_none() -> None:
    result = kvcm("plugins", dists="broken", KVCM_PLUGIN_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert "No plugins registered. (KVCM_PLUGIN_AUTOLOAD=0" in result.stdout


# -- kvcm conformance ---------------------------------------------------------------------


def test_conformance_for_numpy_passes_and_prints_its_row() -> None:
    result = kvcm("conformance", "--plugin", "numpy")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if " numpy " in line]
    assert rows and "kernel backend" in rows[0]


def test_conformance_json_counts_outcomes_per_plugin() -> None:
    result = kvcm("conformance", "--plugin", "numpy", "lru", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    rows = {(r["kind"], r["plugin"]): r for r in data["results"]}
    assert set(rows) == {("kernel_backend", "numpy"), ("eviction_policy", "lru")}
    for row in rows.values():
        assert row["passed"] > 0 and row["failed"] == 0


def test_conformance_failure_gives_a_nonzero_exit_and_a_failed_count() -> None:
    # faketier's factory raises NotImplementedError: every test of it must fail.
    result = kvcm("conformance", "--plugin", "faketier", "--json", dists="good")
    assert result.returncode != 0
    (row,) = json.loads(result.stdout)["results"]
    assert (row["kind"], row["plugin"]) == ("tier", "faketier")
    assert row["failed"] > 0 and row["passed"] == 0


def test_conformance_with_nothing_selected_exits_nonzero() -> None:
    result = kvcm("conformance", "--plugin", "numpy", "-k", "no_test_has_this_name")
    assert result.returncode != 0
    assert "No conformance test ran" in result.stdout


def test_conformance_refuses_an_unknown_plugin_listing_the_available_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["conformance", "--plugin", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown plugin 'nosuch'" in err and "numpy" in err


# -- version and dispatch -------------------------------------------------------------------


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvcm {kvcm_core.__version__}"


def test_subcommand_is_required_and_unknown_arguments_are_refused() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["plugins", "--colour"])
    assert info.value.code == 2


def test_simulate_hands_its_arguments_to_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("kvcm_core.simulate")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvcm_core.simulate", fake)
    assert cli.main(["simulate", "--config", "run.toml", "--help"]) == 3
    assert seen == [["--config", "run.toml", "--help"]]


def test_bench_hands_its_arguments_to_the_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("kvcm_core.bench.manager")
    fake.main = lambda argv: seen.append(argv)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvcm_core.bench.manager", fake)
    assert cli.main(["bench", "manager", "--requests", "256"]) == 0
    assert seen == [["--requests", "256"]]


def test_subcommand_not_built_yet_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._dispatch("kvcm_core.bench.not_written", [], "`kvcm bench x`") == 2
    assert "`kvcm bench x` is not built yet" in capsys.readouterr().err


def test_missing_dependency_inside_a_subcommand_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def import_module(name: str) -> Any:
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="cupy"):
        cli.main(["bench", "kernels"])


# -- output for people and for pipes ----------------------------------------------------------

LONG_REASON = (
    "cuda-python (cuda.bindings) is not importable (ModuleNotFoundError: No module named "
    "'cuda'); install kvcm[cuda] on a machine with a CUDA GPU and a driver of 12.8 or newer"
)


def _unavailable_plugin_manager() -> KvcmPluginManager:
    class Cuda:
        @hookimpl
        def kvcm_kernel_backends(self) -> Any:
            yield KernelBackendSpec(
                name="cuda", factory=dict,
                capabilities=KernelBackendCapabilities(has_device=True), priority=100,
                availability=lambda: Availability(False, LONG_REASON),
                description="CUDA through cuda-python",
            )

    pm = KvcmPluginManager(autoload=False)
    pm.register(Cuda(), name="cuda", distribution="kvcm-cuda", version="2.0")
    return pm


def _plain(text: str) -> str:
    """Text without ANSI escapes, every run of white space one blank."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def test_plugins_on_an_80_column_terminal_gives_the_whole_availability_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "get_plugin_manager", _unavailable_plugin_manager)
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal ...
    monkeypatch.setenv("COLUMNS", "80")  # ... of 80 columns
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert max(len(re.sub(r"\x1b\[[0-9;]*m", "", line)) for line in out.splitlines()) <= 80
    assert f"available no: {LONG_REASON}" in _plain(out)
    assert "…" not in out


def test_plugins_piped_prints_each_plugin_on_one_table_row_without_cutting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "get_plugin_manager", _unavailable_plugin_manager)
    assert cli.main(["plugins"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "kvcm-cuda" in line]
    assert f"no: {LONG_REASON}" in row  # no wrapping, no "…"
    assert "CUDA through cuda-python" in row


@pytest.mark.parametrize("args", [
    ["plugins", "--json"],
    ["plugins"],  # a rich table: rich's own broken-pipe handling exited 1
    ["simulate", "--requests", "30", "--no-compare", "--no-plots"],
], ids=["plugins-json", "plugins-table", "simulate"])
def test_output_into_a_pipe_closed_early_exits_141_without_a_traceback(
        args: list[str], tmp_path: Path) -> None:
    """Exit 1 means a failed verification; a reader that went away is 141, as for a
    process killed by SIGPIPE, whichever way the command prints."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    if args[0] == "simulate":
        args = [*args, "--out", str(tmp_path / "sim")]
    proc = subprocess.Popen([sys.executable, "-m", "kvcm_core.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before kvcm writes (like `| head` does)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 128 + 13  # what a shell reports for SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bench_help_lists_every_benchmark_and_exits_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for target in ("kernels", "manager", "mixed", "trace", "eviction"):
        assert re.search(rf"^  {target} +\S", out, re.M), target
    assert "--quick" in out and "never overwriting" in out


def test_bench_without_a_benchmark_is_a_usage_error_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench"]) == 2
    assert "choose a benchmark: kernels, manager, mixed, trace, eviction" in \
        capsys.readouterr().err


def test_a_kvcm_error_from_a_command_is_one_line_with_exit_2_or_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcm_core import ConfigError, TierIOError

    for exc, code in ((ConfigError("quota", "1x", "is not a size"), 2),
                      (TierIOError("disk full"), 3)):
        fake = types.ModuleType("kvcm_core.bench.manager")

        def fail(argv: list[str], exc: Exception = exc) -> int:
            raise exc

        fake.main = fail  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "kvcm_core.bench.manager", fake)
        assert cli.main(["bench", "manager"]) == code
        err = capsys.readouterr().err
        assert type(exc).__name__ in err and "Traceback" not in err
        with pytest.raises(type(exc)):
            cli.main(["--debug", "bench", "manager"])  # --debug: the traceback
