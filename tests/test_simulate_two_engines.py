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
