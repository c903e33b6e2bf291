"""Replaying Mooncake-format traces: the token rule, the exact infinite-cache and LRU hit
rates, ``kvcm bench trace`` and ``kvcm simulate --trace`` on small traces of our own."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvcm_core.cli import main as kvcm
from kvcm_core.frame import FRAME_OVERHEAD
from kvcm_core.simulate.mooncake import (
    MODULUS,
    TRACE_BLOCK,
    TraceError,
    TraceRecord,
    chain_nodes,
    infinite_hits,
    lru_block_hits,
    lru_hits,
    prompt_tokens,
    read_trace,
    to_requests,
)

# -- small traces -----------------------------------------------------------------------------


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_trace(n: int = 36, seed: int = 0) -> list[dict]:
    """Requests that share prefixes of a few documents (and now and then repeat an earlier
    prompt exactly), with fresh blocks of their own; at most 5 blocks (2,560 tokens)."""
    rng = random.Random(seed)
    counter = iter(range(10**6))
    docs = [[next(counter) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    out: list[dict] = []
    for i in range(n):
        if out and rng.random() < 0.15:
            rec = dict(rng.choice(out))
        else:
            base = []
            if rng.random() < 0.75:
                doc = rng.choice(docs)
                base = doc[: rng.randint(1, len(doc))]
            own = [next(counter) for _ in range(rng.randint(0 if base else 1, 2))]
            ids = base + own
            rec = {"input_length": rng.randint(TRACE_BLOCK * (len(ids) - 1) + 1,
                                               TRACE_BLOCK * len(ids)),
                   "output_length": rng.randint(1, 6), "hash_ids": ids}
        rec["timestamp"] = 7 * i
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("trace") / "mini.jsonl", make_trace())


def _rec(ids: list[int], n: int) -> TraceRecord:
    return TraceRecord(0.0, n, 1, tuple(ids))


# -- the token rule ---------------------------------------------------------------------------


def test_token_rule_and_cut_to_input_length() -> None:
    toks = prompt_tokens(_rec([1, 2], 1000))
    assert toks.dtype == np.int32 and len(toks) == 1000
    i = np.arange(TRACE_BLOCK)
    np.testing.assert_array_equal(toks[:512], (1 * 7919 + i * 131) % 1_000_003 + 1)
    np.testing.assert_array_equal(toks[512:], ((2 * 7919 + i * 131) % 1_000_003 + 1)[:488])


def test_equal_ids_give_equal_tokens_and_different_ids_differ_everywhere() -> None:
    a = prompt_tokens(_rec([3, 9], 1024))
    b = prompt_tokens(_rec([3, 8], 700))
    np.testing.assert_array_equal(a[:512], b[:512])
    assert np.all(a[512:700] != b[512:700])
    # Ids equal modulo the prime give the same tokens (the rule's only coincidence).
    np.testing.assert_array_equal(prompt_tokens(_rec([5], 300)),
                                  prompt_tokens(_rec([5 + MODULUS], 300)))


def test_read_trace_keeps_file_order_and_limit(trace_file: Path) -> None:
    recs = read_trace(trace_file)
    assert len(recs) == 36 and [r.timestamp for r in recs] == [7.0 * i for i in range(36)]
    assert len(read_trace(trace_file, 5)) == 5
    assert recs[0].line == 1
    with pytest.raises(TraceError, match="limit -1 must be an int >= 0"):
        read_trace(trace_file, -1)


# -- infinite cache and LRU ---------------------------------------------------------------------

# A hand-built trace and what each request reuses, derived by hand (block size 64).
HAND = [
    _rec([1, 2], 1000),        # r0: nothing before it
    _rec([1, 2, 3], 1100),     # r1: shares r0's 1000 tokens
    _rec([1, 4], 600),         # r2: shares block 1 (512 tokens) with r0 and r1
    _rec([5], 300),            # r3: new
    _rec([5], 300),            # r4: identical to r3
    _rec([1, 2, 3], 1100),     # r5: identical to r1
    _rec([5 + MODULUS], 200),  # r6: the tokens of r3's first 200
    _rec([7, 2], 1024),        # r7: id 2 after another prefix: nothing in common
]
#: partial reuse (kvcm's default): the longest common prefix
PARTIAL = [0, 1000, 512, 0, 300, 1100, 200, 0]
#: full blocks only: rounded down to 64
BLOCKS = [0, 960, 512, 0, 256, 1088, 192, 0]
#: vLLM: full blocks, at least one prompt token computed (r5: 1099 -> 1088; r4: 299 -> 256)
VLLM = [0, 960, 512, 0, 256, 1088, 192, 0]


def test_infinite_cache_hits_on_a_hand_built_trace() -> None:
    assert infinite_hits(HAND, 64).tolist() == PARTIAL
    assert infinite_hits(HAND, 64, rule="blocks").tolist() == BLOCKS
    assert infinite_hits(HAND, 64, rule="vllm").tolist() == VLLM
    # At 512 tokens a block: r1 keeps one full block; r5 two of its three.
    assert infinite_hits(HAND, 512, rule="blocks").tolist() == [0, 512, 512, 0, 0, 1024, 0, 0]
    # Looking up one token less (the engine loop) caps only r4, r5 and r6.
    assert infinite_hits(HAND, 64, lookup_less=1).tolist() == [0, 1000, 512, 0, 299, 1099,
                                                               199, 0]
    assert infinite_hits(HAND, 16, rule="vllm")[4] == 288  # 299 rounded down to 16


def test_a_chain_node_names_the_whole_prefix() -> None:
    nodes = chain_nodes(HAND)
    assert nodes[0] == nodes[1][:2] == nodes[5][:2]
    assert nodes[2][0] == nodes[0][0] and nodes[2][1] != nodes[0][1]
    assert nodes[6] == nodes[3]  # equal modulo the prime
    assert nodes[7][1] != nodes[0][1]  # id 2 under another parent


def test_lru_over_512_token_blocks_by_hand() -> None:
    # Two blocks of room: r1 finds r0's block, r2 too, r5 both of r1's full blocks.
    assert lru_hits(HAND, 1024).tolist() == [0, 512, 512, 0, 0, 1024, 0, 0]
    # One block: r1's second block evicts the first; r2 then misses it.
    assert lru_hits(HAND, 512).tolist() == [0, 512, 0, 0, 0, 512, 0, 0]
    assert lru_hits(HAND, 0).sum() == 0
    # Unbounded: the infinite cache at 512 tokens, full blocks only.
    np.testing.assert_array_equal(lru_hits(HAND, 10**9),
                                  infinite_hits(HAND, 512, rule="blocks"))


def test_to_requests_maps_time_and_makes_up_answers(trace_file: Path) -> None:
    recs = read_trace(trace_file)
    reqs = to_requests(recs, ms_per_step=5.0)
    assert [r.arrival for r in reqs] == [int(7 * i // 5) for i in range(len(recs))]
    for rec, req in zip(recs, reqs, strict=True):
        assert req.prompt_len == rec.input_length
        assert len(req.tokens) == rec.input_length + max(1, rec.output_length)
        np.testing.assert_array_equal(req.tokens[: req.prompt_len], prompt_tokens(rec))
        assert req.tokens[req.prompt_len:].min() > MODULUS  # never in a prompt


# -- kvcm bench trace ---------------------------------------------------------------------------


def _bench(trace: Path, out: Path, *extra: str) -> dict:
    code = kvcm(["bench", "trace", str(trace), "--reps", "1", "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_bench_trace_with_everything_on_the_gpu_reaches_the_infinite_cache(
        trace_file: Path, tmp_path: Path) -> None:
    doc = _bench(trace_file, tmp_path / "r.json", "--reps", "2")
    assert {"what", "kvcm_version", "python_version", "machine", "date", "config",
            "timer", "results"} <= doc.keys()
    assert {"nproc", "platform"} <= doc["machine"].keys()
    assert doc["config"]["block_size"] == 64 and doc["config"]["reps"] == 2
    res = doc["results"]
    for key in ("hit_rate", "infinite_hit_rate", "infinite_hit_rate_full_blocks",
                "infinite_hit_rate_vllm_rules", "lru512_hit_rate", "lru512_capacity_tokens",
                "us_per_request_median", "us_per_request_min", "us_per_block_median",
                "us_per_block_min", "requests", "prompt_tokens", "runs"):
        assert key in res, key
    assert res["requests"] == 36 and len(res["runs"]) == 2
    assert res["us_per_request_min"] <= res["us_per_request_median"]
    recs = read_trace(trace_file)
    hits = infinite_hits(recs, 64)
    assert 0 < res["infinite_hit_rate"] == hits.sum() / sum(r.input_length for r in recs)
    assert res["hit_rate"] == res["infinite_hit_rate"]
    assert res["runs"][0]["reused_tokens"] == hits.sum()
    assert res["hit_rate_all_reps_equal"]


def test_bench_trace_without_partial_reuse_reaches_the_full_block_bound(
        trace_file: Path, tmp_path: Path) -> None:
    res = _bench(trace_file, tmp_path / "r.json", "--block-size", "128",
                 "--no-partial-reuse")["results"]
    assert res["hit_rate"] == res["infinite_hit_rate_full_blocks"] < res["infinite_hit_rate"]


def test_bench_trace_with_a_tiny_gpu_level_reuses_less(trace_file: Path,
                                                       tmp_path: Path) -> None:
    res = _bench(trace_file, tmp_path / "r.json", "--gpu-tokens", "3000")["results"]
    assert res["hit_rate"] < res["infinite_hit_rate"]
    assert res["lru512_capacity_tokens"] == 3000


def test_bench_trace_levels_below_a_tiny_gpu_keep_everything(trace_file: Path,
                                                             tmp_path: Path) -> None:
    doc = _bench(trace_file, tmp_path / "r.json", "--gpu-tokens", "3000",
                 "--host-tokens", "4000", "--disk-tokens", "100000")
    res = doc["results"]
    assert res["hit_rate"] == res["infinite_hit_rate"]
    assert res["lru512_capacity_tokens"] == 107_000
    assert len(res["runs"][0]["reused_blocks_by_level"]) == 3
    assert res["runs"][0]["reused_blocks_by_level"][2] > 0  # some came back from disk


def test_bench_trace_prints_a_table(trace_file: Path, capsys: pytest.CaptureFixture,
                                    tmp_path: Path) -> None:
    assert kvcm(["bench", "trace", str(trace_file), "--reps", "1", "--limit", "10",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kvcm hit rate" in out and "infinite cache" in out and "LRU-512" in out
    assert "10 requests" in out


# -- kvcm simulate --trace ----------------------------------------------------------------------


def test_simulate_trace_with_full_verification(trace_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim"
    code = kvcm(["simulate", "--trace", str(trace_file), "--verify-every", "1", "--no-plots",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["verification"] == {"ok": True, "error": None}
    assert rep["verification_mode"]["mode"] == "full"
    assert "verified (full)" in printed and "trace infinite" in printed
    run = rep["run"]
    assert run["requests_finished"] == rep["workload"]["requests"] == 36
    assert rep["workload"]["by_kind"] == {"trace": 36}
    assert run["verification"]["steps_fully_checked"] == run["verification"]["steps_checked"]
    assert run["verification"]["pages_checked"] > 0
    bound = rep["infinite_bound"]
    trace_bound = bound["trace"]
    assert trace_bound["tokens_per_block"] == rep["meta"]["kvcm"]["tokens_per_block"]
    recs = read_trace(trace_file)
    assert trace_bound["hit_rate"] == pytest.approx(
        infinite_hits(recs, trace_bound["tokens_per_block"], lookup_less=1).sum()
        / sum(r.input_length - 1 for r in recs))
    assert 0 < run["hit_rate"]["overall"] <= trace_bound["hit_rate"] + 1e-12
    assert rep["summary"]["trace_infinite_hit_rate"] == trace_bound["hit_rate"]
    assert rep["meta"]["workload"]["trace"] == str(trace_file)


def test_simulate_trace_sampled_verification_is_named(trace_file: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "sim"
    code = kvcm(["simulate", "--trace", str(trace_file), "--trace-limit", "20", "--quiet",
                 "--no-plots", "--no-compare", "--ms-per-step", "2", "--out", str(out)])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["verification"]["ok"]
    ver = rep["verification_mode"]
    assert ver["mode"] == "sampled" and ver["verify_every"] == 8
    assert "sampled" in ver["description"]
    run = rep["run"]
    assert run["requests_finished"] == 20
    assert 0 < run["verification"]["steps_fully_checked"] < run["steps"]
    assert run["verification"]["fresh_request_checks"] >= 20  # each at admission


# -- bad inputs -----------------------------------------------------------------------------------


def _bad_lines(tmp_path: Path) -> dict[str, Path]:
    good = json.dumps(make_trace(1)[0])
    files = {
        "not valid JSON": "{\"timestamp\": 0,\n",
        "missing field 'hash_ids'": json.dumps({"timestamp": 0, "input_length": 5,
                                                "output_length": 1}) + "\n",
        "does not fit": json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1,
                                    "hash_ids": [1]}) + "\n",
        "hash_ids must be": json.dumps({"timestamp": 0, "input_length": 5,
                                        "output_length": 1, "hash_ids": [-1]}) + "\n",
        "holds no request": "\n",
    }
    out = {}
    for i, (why, text) in enumerate(files.items()):
        out[why] = tmp_path / f"bad{i}.jsonl"
        out[why].write_text(text if why == "holds no request" else good + "\n" + text)
    return out


@pytest.mark.parametrize("command", [["bench", "trace"], ["simulate", "--quiet", "--trace"]])
def test_bad_inputs_give_one_line_and_exit_2(command: list[str], tmp_path: Path,
                                             trace_file: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    cases: list[tuple[list[str], str]] = [
        ([str(tmp_path / "missing.jsonl")], "cannot read trace"),
        ([str(trace_file), "--limit" if command[0] == "bench" else "--trace-limit", "-1"],
         "must be >= 0"),
    ]
    for why, path in _bad_lines(tmp_path).items():
        cases.append(([str(path)], why))
    for args, why in cases:
        code = kvcm([*command, *args, *(["--out", str(tmp_path / "o")]
                                        if command[0] == "simulate" else [])])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1, err
        assert why in err, err
    # A malformed line is named by its line number.
    bad = _bad_lines(tmp_path)["not valid JSON"]
    assert kvcm([*command, str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_simulate_trace_sampled_verification_still_catches_corruption(
        trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = kvcm(["simulate", "--trace", str(trace_file), "--verify-every", "2", "--quiet",
                 "--no-plots", "--no-compare", "--corrupt-at", "20",
                 "--out", str(tmp_path / "sim")])
    assert code == 1
    assert "verification failed" in capsys.readouterr().err


def test_bench_trace_tail_hint_evicts_blocks_past_the_last_full_id_first(
        tmp_path: Path) -> None:
    # A, B and C each hold 16 full blocks of two trace ids plus 3 blocks of a partial
    # third id (two full 64-token blocks and the trailing partial one); the GPU level holds
    # 51 blocks, so C evicts 6 pages. Without the hint the trailing partial blocks of A and
    # B go first (priority 0), then their leaf blocks (priority 1), then LRU takes A's
    # other block past its last full id and A's 16th block; with the hint every block past
    # a last full id is at priority 0, so A's and B's tails go and D, which repeats A's
    # two full ids, reuses all 1024 tokens.
    recs = [{"timestamp": i, "input_length": 1188, "output_length": 1, "hash_ids": ids}
            for i, ids in enumerate([[1, 2, 3], [4, 5, 8], [6, 7, 9], [1, 2, 10]])]
    trace = _write(tmp_path / "t.jsonl", recs)
    plain = _bench(trace, tmp_path / "a.json", "--gpu-tokens", str(51 * 64))["results"]
    hinted = _bench(trace, tmp_path / "b.json", "--gpu-tokens", str(51 * 64),
                    "--tail-hint")["results"]
    assert plain["runs"][0]["reused_tokens"] == 1024 - 64
    assert hinted["runs"][0]["reused_tokens"] == 1024


def test_lru_over_kvcm_blocks_evicts_a_chain_from_its_tail() -> None:
    # Block size 256 (two per trace block); one request of two full trace blocks fills a
    # cache of three blocks: its deepest block, released first, is the one not kept.
    recs = [_rec([1, 2], 1024), _rec([1, 2], 1024)]
    assert lru_block_hits(recs, 768, 256).tolist() == [0, 768]
    # Unbounded it is the infinite cache with full blocks only.
    np.testing.assert_array_equal(lru_block_hits(HAND, 10**9, 64),
                                  infinite_hits(HAND, 64, rule="blocks"))
    with pytest.raises(ValueError, match="must divide 512"):
        lru_block_hits(HAND, 1024, 48)


# -- kvcm bench trace --disk-tokens against the free disk space -------------------------------


def test_bench_trace_refuses_a_disk_level_larger_than_the_free_space_up_front_exit_2(
        trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcm_core.bench import trace as bench_trace

    args = ["--disk-tokens", "6400000", "--limit", "5", "--reps", "1",
            "--out", str(tmp_path / "r.json")]
    need = 4096 + 6_400_000 // 64 * (64 + FRAME_OVERHEAD)  # header, then framed slots
    seen: list[str] = []
    real = bench_trace.shutil.disk_usage

    def usage(path):  # type: ignore[no-untyped-def]
        seen.append(str(path))
        return real(path)._replace(free=need - 1)

    def no_replay(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the replay ran: the disk level was not refused up front")

    monkeypatch.setattr(bench_trace.shutil, "disk_usage", usage)
    monkeypatch.setattr(bench_trace, "replay", no_replay)
    assert kvcm(["bench", "trace", str(trace_file), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--disk-tokens 6400000: the disk level needs {need:,} bytes" in err
    assert f"which has {need - 1:,} bytes free" in err
    assert seen == [tempfile.gettempdir()]  # where the replay makes its disk directory
    assert not (tmp_path / "r.json").exists()


def test_bench_trace_runs_a_disk_level_that_just_fits_the_free_space(
        trace_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcm_core.bench import trace as bench_trace

    need = 4096 + 100_000 // 64 * (64 + FRAME_OVERHEAD)
    real = bench_trace.shutil.disk_usage
    monkeypatch.setattr(bench_trace.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=need))
    res = _bench(trace_file, tmp_path / "r.json", "--limit", "5", "--gpu-tokens", "3000",
                 "--disk-tokens", "100000")["results"]
    assert len(res["runs"][0]["reused_blocks_by_level"]) == 2


def test_the_disk_space_bench_trace_asks_for_is_the_disk_tiers_file_size(
        tmp_path: Path) -> None:
    from kvcm_tier_disk import HEADER_BYTES

    from kvcm_core.bench import trace as bench_trace
    from kvcm_core.manager import KVCacheManager

    assert bench_trace.DISK_HEADER_BYTES == HEADER_BYTES
    for tokens in (6400, 64 * 777 + 5):
        args = bench_trace._parser().parse_args(["x", "--gpu-tokens", "6400",
                                                 "--disk-tokens", str(tokens)])
        disk = tmp_path / f"d{tokens}"
        disk.mkdir()
        m = KVCacheManager(bench_trace.make_config(args, str(disk)))
        try:
            files = [p.stat().st_size for p in disk.rglob("*.kvcm")]
        finally:
            m.shutdown()
        assert files == [bench_trace.disk_bytes_needed(args)], (tokens, files)


def test_bench_trace_reports_an_io_error_of_the_replay_not_the_shutdown_it_leaves_behind(
        trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of the disk level that fails mid-replay is the error the user sees (exit 3):
    the request's cache is closed, so the manager's shutdown does not refuse (an open
    cache) and hide it behind an InvalidStateError."""
    from kvcm_core import TierIOError
    from kvcm_core.cache import KVCache

    real = KVCache.resume
    calls = []

    def resume(self, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 4:
            raise TierIOError("level 2: read of slots [3] failed (injected)")
        return real(self, *a, **k)

    monkeypatch.setattr(KVCache, "resume", resume)
    out = tmp_path / "r.json"
    assert kvcm(["bench", "trace", str(trace_file), "--reps", "1", "--limit", "8",
                 "--gpu-tokens", "3000", "--disk-tokens", "100000", "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "TierIOError: level 2: read of slots [3] failed (injected)" in err, err
    assert "InvalidStateError" not in err and "shutdown" not in err, err
    assert not out.exists()
