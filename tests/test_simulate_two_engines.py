"""``kvcm simulate --preset two-engine``: two managers serving alternate turns of the same
conversations share one Redis level on a redis-server the run starts itself; sharing
beats local levels only, which beat the GPU only, and no run beats the infinite-cache
bound. Every run is checked by the fingerprint engine at every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis_fixtures import need_binaries

import kvcm_core.testing.redis_server as redis_server
from kvcm_core.simulate import main

pytest.importorskip("redis", reason="the redis client package is not installed")


def test_sharing_a_redis_level_beats_local_levels_which_beat_the_gpu_only(
        tmp_path: Path) -> None:
    need_binaries()
    assert main(["--preset", "two-engine", "--requests", "40", "--quiet",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    runs = report["runs"]
    shared, local, gpu = (runs[k]["hit_rate"] for k in ("shared", "local only", "gpu only"))
    bound = report["infinite_bound"]["hit_rate"]
    assert gpu < local < shared <= bound + 1e-9
    assert runs["shared"]["remote_blocks"] > 0
    assert runs["local only"]["remote_blocks"] == 0
    # Both engines read what the other wrote, and nothing read back was damaged.
    for engine in runs["shared"]["remote"]:
        assert engine["pulled_blocks"] > 0 and engine["written"] > 0
        assert engine["corrupt"] == engine["foreign"] == engine["truncated"] == 0


def test_the_server_the_run_started_is_stopped(tmp_path: Path, monkeypatch) -> None:
    need_binaries()
    started: list[redis_server.RedisServer] = []
    real = redis_server.RedisServer

    class Recorded(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(redis_server, "RedisServer", Recorded)
    assert main(["--preset", "two-engine", "--requests", "6", "--quiet",
                 "--out", str(tmp_path)]) == 0
    assert len(started) == 1
    assert not started[0].nodes[0].alive


def test_without_redis_server_the_preset_fails_with_one_clear_line(
        tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(redis_server, "redis_binaries",
                        lambda: "redis-server not found on PATH (Debian: apt-get install "
                                "redis-server redis-tools)")
    assert main(["--preset", "two-engine", "--quiet", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "redis-server" in err and "apt-get install" in err
    assert "Traceback" not in err


def test_the_preset_refuses_flags_it_does_not_take(tmp_path: Path, capsys) -> None:
    assert main(["--preset", "two-engine", "--gpu-only", "--out", str(tmp_path)]) == 2
    assert "--preset two-engine takes" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--corrupt-at", "3"], ["--verify-every", "4"],
                                   ["--verify-every", "1"], ["--no-compare"]])
def test_the_preset_refuses_corrupt_at_and_verify_every_with_exit_2(
        tmp_path: Path, capsys, flags: list[str]) -> None:
    assert main(["--preset", "two-engine", *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--preset two-engine takes" in err and flags[0] in err


def test_the_help_says_which_options_two_engine_refuses(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "refuses, exit 2, --corrupt-at, --verify-every" in text


def test_a_wrong_page_in_a_two_engine_run_fails_verification_with_exit_1_and_a_report(
        tmp_path: Path, monkeypatch, capsys) -> None:
    need_binaries()
    import kvcm_core.simulate as simulate
    from kvcm_core.simulate import two_engine

    hook = simulate.corrupt_after(30)
    real_step = two_engine._Loop.step
    steps: dict[int, int] = {}

    def step(self):  # type: ignore[no-untyped-def]
        report = real_step(self)
        n = steps.get(id(self), 0)
        steps[id(self)] = n + 1
        if self.manager.remote is not None:  # the shared run's engines only
            hook(self.manager, self, n)
        return report

    monkeypatch.setattr(two_engine._Loop, "step", step)
    code = main(["--preset", "two-engine", "--requests", "40", "--quiet",
                 "--out", str(tmp_path)])
    assert hook.corrupted  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert code == 1, err
    assert "verification failed at step " in err and "FingerprintMismatch" in err
    assert "Traceback" not in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verification"]["ok"] is False
    assert "FingerprintMismatch" in report["verification"]["error"]
    assert report["exit_status"] == 1


def test_the_report_and_summary_say_how_many_pages_were_verified(
        tmp_path: Path, capsys) -> None:
    need_binaries()
    assert main(["--preset", "two-engine", "--requests", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verification"] == {"ok": True, "error": None}
    mode = report["verification_mode"]
    assert mode["mode"] == "full" and mode["pages_checked"] > 0
    assert mode["pages_checked"] == sum(r["pages_checked"] for r in report["runs"].values())
    out = " ".join(capsys.readouterr().out.split())
    assert "verified (full)" in out and f"{mode['pages_checked']:,} pages checked" in out
