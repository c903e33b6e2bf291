"""``kvcm bench``: every benchmark writes a new timestamped result file and never
overwrites one, takes ``--quick``, and documents every option with its default."""

from __future__ import annotations

import argparse
import importlib
import json
import re
from pathlib import Path

import pytest

from kvcm_core import cli
from kvcm_core.bench import result_path

BENCHES = ["kernels", "manager", "mixed", "trace", "eviction", "batch", "codecs", "sparse",
           "migrate"]
#: The file name each benchmark writes into an --out folder.
STEMS = {"kernels": "kernels-host", "manager": "host_overhead", "mixed": "mixed_precision",
         "trace": "trace", "eviction": "eviction", "batch": "batch", "codecs": "codecs",
         "sparse": "sparse", "migrate": "migrate"}
TRACE = "\n".join(json.dumps(r) for r in [
    {"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [1, 2]},
    {"timestamp": 5, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
    {"timestamp": 9, "input_length": 300, "output_length": 2, "hash_ids": [7]},
]) + "\n"


def _quick_args(name: str, tmp_path: Path) -> list[str]:
    if name == "kernels":  # small pools: the numpy backend copies in host memory
        return ["--pool", "64MiB", "--max-bytes", "16MiB", "--no-plot"]
    if name == "trace":
        trace = tmp_path / "mini.jsonl"
        trace.write_text(TRACE)
        return [str(trace)]
    if name in ("sparse", "migrate"):  # host times of the reference, where no GPU is
        return ["--backends", "numpy"]
    return []


@pytest.mark.parametrize("name", BENCHES)
def test_quick_runs_write_a_new_timestamped_file_each_time(name: str, tmp_path: Path,
                                                           capsys) -> None:
    out = tmp_path / "results"
    args = ["bench", name, *_quick_args(name, tmp_path), "--quick", "--out", str(out)]
    assert cli.main(args) == 0
    assert cli.main(args) == 0  # the same second, maybe: a second file all the same
    files = sorted(out.glob("*.json"))
    assert len(files) == 2, files
    for path in files:
        assert re.fullmatch(rf"{STEMS[name]}-\d{{8}}-\d{{6}}(-\d+)?\.json", path.name), path
        doc = json.loads(path.read_text())
        config = doc.get("config") or doc.get("meta", {}).get("config", {})
        assert "date" in doc or "meta" in doc
        if config:
            assert config["quick"] is True
    assert capsys.readouterr().out.count("wrote ") >= 2


@pytest.mark.parametrize("name", ["manager", "mixed", "trace", "eviction", "kernels",
                                  "batch", "sparse"])
def test_an_existing_result_file_is_refused_before_running(name: str, tmp_path: Path,
                                                           capsys) -> None:
    old = tmp_path / "result.json"
    old.write_text('{"kept": true}')
    code = cli.main(["bench", name, *_quick_args(name, tmp_path), "--quick", "--out",
                     str(old)])
    assert code == 2
    err = capsys.readouterr().err
    assert "exists: a benchmark never overwrites a result" in err
    assert "Traceback" not in err
    assert old.read_text() == '{"kept": true}'


def _unwritable_outs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """``--out`` values no result can be written to, and what the refusal says."""
    plain = tmp_path / "notes.txt"
    plain.write_text("kept")
    outs = {"existing non-JSON file": (str(plain), "is an existing file, not a folder"),
            "a file as a folder": (str(plain / "r.json"), f"{plain} is not a folder")}
    if Path("/proc").is_dir():  # no file can be made in /proc, even by root
        outs["/proc"] = ("/proc/kvcm-bench.json", "no file can be made in /proc")
    return outs


@pytest.mark.parametrize("name", ["manager", "mixed", "batch", "kernels", "eviction"])
def test_an_out_path_that_cannot_be_written_is_refused_before_running(name: str,
                                                                      tmp_path: Path,
                                                                      capsys) -> None:
    for what, (out, why) in _unwritable_outs(tmp_path).items():
        code = cli.main(["bench", name, *_quick_args(name, tmp_path), "--quick", "--out",
                         out])
        captured = capsys.readouterr()
        assert code == 2, what
        assert captured.out == "", what  # nothing ran
        assert f"--out={out!r}" in captured.err and why in captured.err, captured.err
        assert "Traceback" not in captured.err
    assert (tmp_path / "notes.txt").read_text() == "kept"


@pytest.mark.parametrize(("name", "args", "message"), [
    ("manager", ["--decode-batch", "0"], "argument --decode-batch: 0: must be an int >= 1"),
    ("manager", ["--reps", "0"], "argument --reps: 0: must be an int >= 1"),
    ("manager", ["--cpu", "99999"], "argument --cpu: 99999: not a CPU this process may run on"),
    ("manager", ["--prefix-len", "8"], "--prefix-len 8 with --prefill-len 1024: the shared "
                                       "prefix and the rest of each prompt must each hold"),
    ("kernels", ["--reps", "0"], "argument --reps: 0: must be an int >= 1"),
    ("kernels", ["--page-sizes", "0"], "argument --page-sizes: '0': must be a size >= 1 byte"),
    ("kernels", ["--page-sizes", "abc"], "argument --page-sizes='abc': must be a byte count"),
    ("kernels", ["--options", "notjson"], "argument --options: 'notjson': not JSON"),
    ("kernels", ["--batches", "0"], "argument --batches: 0: must be an int >= 1"),
    ("kernels", ["--batches", "1,-5"], "argument --batches: -5: must be an int >= 1"),
    ("kernels", ["--directions", "h2x"], "argument --directions: unknown direction(s)"),
    ("batch", ["--reps", "0"], "argument --reps: 0: must be an int >= 1"),
    ("batch", ["--steps", "0"], "argument --steps: 0: must be an int >= 1"),
    ("mixed", ["--sessions", "0"], "argument --sessions: 0: must be an int >= 1"),
    ("mixed", ["--turns", "0"], "argument --turns: 0: must be an int >= 1"),
    ("mixed", ["--batch", "0"], "argument --batch: 0: must be an int >= 1"),
    ("mixed", ["--tokens-per-block", "0"], "argument --tokens-per-block: 0: must be an int >= 1"),
    ("mixed", ["--chunk", "0"], "argument --chunk: 0: must be an int >= 1"),
    ("mixed", ["--question-len", "15"], "argument --question-len: 15: must be an int >= 16"),
    ("mixed", ["--output-len", "-1"], "argument --output-len: -1: must be an int >= 0"),
    ("mixed", ["--gpu-blocks", "0"], "argument --gpu-blocks: 0: must be an int >= 1"),
    ("mixed", ["--companion-margin", "nan"],
     "argument --companion-margin: nan: must be a finite number > 0"),
    ("mixed", ["--companion-margin", "0.001"],
     "argument --companion-margin: 0.001: leaves the companion no GPU slot"),
    ("eviction", ["--batches", "0"], "argument --batches: 0: must be an int >= 1"),
    ("eviction", ["--base", "-5"], "argument --base: -5: must be an int >= 0"),
    ("eviction", ["--pages", "0"], "argument --pages: 0: must be an int >= 1"),
    ("eviction", ["--repeat", "0"], "argument --repeat: 0: must be an int >= 1"),
    ("eviction", ["--pages", "100000000000"], "past the policies' limit 2147483647"),
    ("codecs", ["--pages", "0"], "argument --pages: 0: must be an int >= 1"),
    ("codecs", ["--reps", "0"], "argument --reps: 0: must be an int >= 1"),
    ("codecs", ["--cpu-pages", "-1"], "argument --cpu-pages: -1: must be an int >= 1"),
    ("codecs", ["--requests", "0"], "argument --requests: 0: must be an int >= 1"),
    ("codecs", ["--page-bytes", "300"], "argument --page-bytes: 300: must be a multiple of 256"),
    ("codecs", ["--configs", "/nonexistent"], "argument --configs: '/nonexistent': not a "
                                              "folder"),
    ("sparse", ["--rows", "0"], "argument --rows: 0: must be an int >= 1"),
    ("sparse", ["--steps", "0"], "argument --steps: 0: must be an int >= 1"),
    ("sparse", ["--unit-kib", "0"], "argument --unit-kib: 0: must be an int >= 1"),
    ("sparse", ["--missed-mib", "0"], "argument --missed-mib: 0: must be an int >= 1"),
    ("sparse", ["--selected", "8192"], "--selected 8192 with --working-set 4096: a row's "
                                       "selection must fit its working set"),
    ("redis", ["--sizes", "0"], "argument --sizes: 0: must be an int >= 1"),
    ("redis", ["--sizes", "abc"], "argument --sizes: 'abc': must be an int >= 1"),
    ("redis", ["--sizes", ","], "argument --sizes: ',': needs at least one size"),
    ("redis", ["--pipeline", "0"], "argument --pipeline: 0: must be an int >= 1"),
    ("redis", ["--reps", "0"], "argument --reps: 0: must be an int >= 1"),
    ("redis", ["--total-mib", "0"], "argument --total-mib: 0: must be an int >= 1"),
])
def test_a_bench_argument_that_cannot_work_is_a_usage_error_before_running(
        name: str, args: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", name, *_quick_args(name, tmp_path), "--quick", *args, "--out",
                  str(tmp_path / "out")])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "out").exists()


def test_too_few_manager_slots_is_one_line_naming_num_blocks(tmp_path: Path, capsys) -> None:
    code = cli.main(["bench", "manager", "--quick", "--num-blocks", "10", "--lookup-sizes",
                     "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--num-blocks=10: too few GPU slots for the decode part" in err
    assert "Traceback" not in err


def test_a_mixed_workload_the_gpu_slots_cannot_hold_is_one_line_naming_gpu_blocks(
        tmp_path: Path, capsys) -> None:
    code = cli.main(["bench", "mixed", "--quick", "--gpu-blocks", "10", "--out",
                     str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--gpu-blocks=10: with --companion-margin 1.3: too few GPU slots" in err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("name", "args", "message"), [
    ("sparse", ["--backends", "numpy,nosuch"], "unknown kernel backend 'nosuch'"),
    ("migrate", ["--backends", "numpy,nosuch"], "unknown kernel backend 'nosuch'"),
    ("redis", ["--url", "redis://127.0.0.1:1"],
     "--url='redis://127.0.0.1:1': no Redis server answers there"),
    ("redis", ["--url", "notaurl"], "--url='notaurl': no Redis server answers there"),
])
def test_a_backend_or_server_that_cannot_be_used_is_one_line_before_any_work(
        name: str, args: list[str], message: str, tmp_path: Path, capsys) -> None:
    code = cli.main(["bench", name, *_quick_args(name, tmp_path), "--quick", *args, "--out",
                     str(tmp_path / "out")])
    assert code == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""  # numpy did not run first
    assert not (tmp_path / "out").exists()


def test_options_given_explicitly_still_apply_with_quick_in_bench_kernels(tmp_path: Path
                                                                         ) -> None:
    from kvcm_core.bench import kernels

    base = ["--quick", "--out", str(tmp_path)]
    args = kernels._parse_args([*base, "--page-sizes", "8KiB", "--batches", "7", "--reps",
                                "1"])
    assert (args.page_sizes, args.batches, args.reps) == ([8192], [7], 1)
    args = kernels._parse_args([*base, "--batches", "7"])  # the others: the quick defaults
    assert (args.page_sizes, args.batches, args.reps) == ([4096, 65536, 1 << 20], [7], 3)
    args = kernels._parse_args(["--out", str(tmp_path)])
    assert args.reps == 7 and len(args.page_sizes) == 5


def test_result_path_never_names_an_existing_file(tmp_path: Path) -> None:
    first = result_path(str(tmp_path), "host_overhead", "s2")
    assert first.name.startswith("host_overhead-") and first.name.endswith("-s2.json")
    first.write_text("{}")
    second = result_path(str(tmp_path), "host_overhead", "s2")
    assert second != first and not second.exists()
    new_file = result_path(str(tmp_path / "named.json"), "ignored")
    assert new_file == tmp_path / "named.json"


@pytest.mark.parametrize("name", BENCHES)
def test_every_option_has_help_giving_its_default(name: str) -> None:
    parser = importlib.import_module(f"kvcm_core.bench.{name}")._parser()
    text = " ".join(parser.format_help().split())
    options = [a for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert {"--quick", "--out", "--tag"} <= {s for a in options for s in a.option_strings}
    for action in options:
        assert action.help and action.help.strip(), action.option_strings
        default = action.default
        if default is None or default is False or default == "" or default == []:
            continue  # a flag, or nothing by default: the help says what leaving it out does
        shown = " ".join(f"(default: {default})".split())
        assert shown in text, (action.option_strings, shown)
    quick = next(a for a in options if "--quick" in a.option_strings)
    assert "a short run" in quick.help


@pytest.mark.parametrize("name", BENCHES)
def test_bench_help_of_each_benchmark_exits_zero(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", name, "--help"])
    assert info.value.code == 0
    assert f"kvcm bench {name}" in capsys.readouterr().out


def test_a_kernel_plot_that_fails_to_write_leaves_no_cut_off_png_and_exits_3(
        tmp_path: Path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def savefig(self, fname, **kw):  # half a file, then the disk is full
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", savefig)
    out = tmp_path / "results"
    args = [a for a in _quick_args("kernels", tmp_path) if a != "--no-plot"]
    code = cli.main(["bench", "kernels", *args, "--quick", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "Traceback" not in err and "No space left" in err
    assert not list(out.glob("*.png")) and not list(out.glob(".*.tmp"))


def test_bench_kernels_refuses_an_existing_plot_beside_its_out_file_before_running(
        tmp_path: Path, capsys) -> None:
    """``--out FILE.json`` writes its plot to FILE.png: an existing FILE.png is refused
    before the benchmark runs (exit 2, nothing written), as an existing FILE.json is; with
    ``--no-plot`` no plot is written, so the run goes ahead."""
    png = tmp_path / "k.png"
    png.write_bytes(b"kept")
    out = tmp_path / "k.json"
    args = [a for a in _quick_args("kernels", tmp_path) if a != "--no-plot"]
    code = cli.main(["bench", "kernels", *args, "--quick", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == ""  # nothing ran
    assert f"its plot {png} exists" in captured.err and "Traceback" not in captured.err
    assert not out.exists() and png.read_bytes() == b"kept"
    assert cli.main(["bench", "kernels", *args, "--no-plot", "--quick", "--out",
                     str(out)]) == 0
    assert out.exists() and png.read_bytes() == b"kept"
