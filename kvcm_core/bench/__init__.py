"""kvcm's benchmarks, run as ``kvcm bench NAME``; none of them is a timed test.

- :mod:`kvcm_core.bench.kernels`: page copies, index conversion and launch cost of every
  available kernel backend, as ratios to the physical limits measured in the same run.
- :mod:`kvcm_core.bench.manager`: the manager's host overhead, beside vLLM's.
- :mod:`kvcm_core.bench.mixed`: a mixed-precision companion, REQUIRED vs SINK_REQUIRED_ONLY.
- :mod:`kvcm_core.bench.eviction`: ns per page of the eviction policies' batch methods.
- :mod:`kvcm_core.bench.trace`: a Mooncake-format serving trace replayed through the
  manager, beside vLLM's replay of the same trace and the trace's own hit-rate bounds.
- :mod:`kvcm_core.bench.batch`: a Batch's per-step resize + publish on the host, and its
  publish with index-table conversion on each GPU backend against a measured model.
- :mod:`kvcm_core.bench.redis`: the redis tier's pipelined put and get beside
  ``redis-benchmark`` on the same server.
- :mod:`kvcm_core.bench.codecs`: page codecs on a GPU against its copy bandwidth, blob
  codecs on the CPU, and simulated hit rates per cold codec.
- :mod:`kvcm_core.bench.sparse`: the sparse kernels (resolve, fetch, flush) on each GPU
  backend against limits measured in the same run, and trace hits beside an exact LRU.

Each module has ``main(argv) -> int`` and ``_parser()``, takes ``--quick`` for a short run
(smaller sizes, fewer repetitions; options given explicitly still win), and writes its
JSON (machine, versions, date) to a new file: ``--out DIR`` (default
``benchmarks/results``) gets ``NAME-YYYYmmdd-HHMMSS[-TAG].json`` (UTC), ``--out FILE.json``
that very file. A result file is never overwritten: an existing ``--out FILE.json`` is
refused before the benchmark runs (``kernels``: its ``FILE.png`` too, unless
``--no-plot``), as is an ``--out`` that cannot be written (an existing
file that is not ``.json``, a folder where no file can be made), and two runs in the same
second get ``-2``, ``-3`` ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvcm_core.console import OutputError, atomic_output
from kvcm_core.errors import ConfigError

__all__ = [
    "DEFAULT_OUT",
    "DeviceGate",
    "HelpFormatter",
    "add_output_options",
    "check_out",
    "check_tag",
    "device_backends",
    "parse_with_quick",
    "result_header",
    "result_path",
    "split_steps",
    "timed_calls",
    "write_new",
    "write_result",
]

#: Where results go unless ``--out`` says otherwise (relative to the working directory).
DEFAULT_OUT = "benchmarks/results"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default in its help (flags and
    empty defaults aside: their help says what leaving them out means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == "" or default == []
                or default is argparse.SUPPRESS or "%(default)" in text):
            return text
        return f"{text} (default: %(default)s)"


def device_backends(pm: Any, names: str = "auto") -> list[str]:
    """Kernel backends to measure: ``"auto"`` names every available backend with a device
    (none on a machine without one), else the comma-separated ``names`` as given.

    Raises:
        PluginError: a name is unknown or its backend unavailable here (every name is
            checked before any is measured).
    """
    if names == "auto":
        return [n for n, s in pm.kernel_backends().items()
                if s.capabilities.has_device and pm.availability_of(s)[0]]
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    for name in chosen:
        pm.select_kernel_backend(name)
    return chosen


def add_output_options(parser: argparse.ArgumentParser, quick: str) -> None:
    """``--out``, ``--tag`` and ``--quick`` (``quick``: what the short run changes)."""
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR|FILE.json",
                        help="where the JSON result goes: a folder gets a new file "
                             "NAME-YYYYmmdd-HHMMSS[-TAG].json (UTC time), a path ending in "
                             ".json is that file; an existing file is never overwritten")
    parser.add_argument("--tag", default="", help="text added to the result's file name")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run to try the benchmark: {quick}; options given "
                             "explicitly still apply")


def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     quick: Mapping[str, Any]) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick`` the ``quick`` defaults replace the usual ones
    (what the command line sets explicitly still wins). Checks ``--out`` (see
    :func:`check_out`)."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    check_out(args.out)
    check_tag(getattr(args, "tag", ""))
    return args


#: What ``--tag`` may hold: it becomes part of a file name in ``--out``, never a path.
TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def check_tag(tag: str) -> None:
    """Refuse a ``--tag`` that is not a plain piece of a file name: only letters, digits,
    ``.``, ``_`` and ``-``, and no ``..`` (so a result never lands outside ``--out``).

    Raises:
        ConfigError: naming ``--tag``, the value and the rule.
    """
    if not set(tag) <= TAG_CHARS or ".." in tag:
        raise ConfigError("--tag", tag, "may hold only letters, digits, '.', '_' and '-' "
                                        "(no '..'): it is part of the result's file name")


def check_out(out: str) -> None:
    """Refuse, before any work, an ``--out`` no result could be written to: an existing
    ``FILE.json``, an existing file for a folder, or a path under which no file can be made
    (its nearest existing folder is a file, or not writable).

    Raises:
        ConfigError: the file exists (a result is never overwritten), or ``out`` cannot be
            written.
    """
    if not out:
        raise ConfigError("--out", out, "must name a folder or a FILE.json (use --out . "
                                        "for the current folder)")
    path = Path(out)
    if out.endswith(".json"):
        if os.path.lexists(out):
            raise ConfigError("--out", out, "exists: a benchmark never overwrites a result; "
                                            "name a new file, or a folder for a timestamped "
                                            "one")
        folder = path.parent
    else:
        if path.exists() and not path.is_dir():
            raise ConfigError("--out", out, "is an existing file, not a folder: name a "
                                            "folder for a timestamped result, or a new "
                                            "FILE.json")
        folder = path
    while not folder.exists() and folder != folder.parent:  # the folders made on writing
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError("--out", out, f"cannot be written: {folder} is not a folder")
    try:  # a file made and removed at once: permissions, read-only or pseudo file systems
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError("--out", out, f"cannot be written: no file can be made in "
                                        f"{folder} ({exc.strerror})") from None


def result_path(out: str, name: str, tag: str = "", suffixes: Sequence[str] = (".json",)
                ) -> Path:
    """The path of a new result file (see the module docstring): for a folder, ``name``,
    the UTC date and time and ``tag``, with ``-2``, ``-3`` ... until no file with any of
    ``suffixes`` exists.

    Raises:
        ConfigError: ``out`` is an existing ``.json`` file.
    """
    check_out(out)
    check_tag(tag)
    if out.endswith(".json"):
        return Path(out)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    stem = f"{name}-{stamp}" + (f"-{tag}" if tag else "")
    folder = Path(out)
    candidate, n = stem, 2
    while any((folder / f"{candidate}{s}").exists() for s in suffixes):
        candidate, n = f"{stem}-{n}", n + 1
    return folder / f"{candidate}{suffixes[0]}"


def result_header(what: str) -> dict[str, Any]:
    """The common head of a result file: what it measures, versions, machine and date."""
    import kvcm_core

    return {
        "what": what,
        "kvcm_version": kvcm_core.__version__,
        "python_version": platform.python_version(),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_result(doc: dict[str, Any], out: str, name: str, tag: str = "") -> Path:
    """Write a result document as JSON to a new file (:func:`result_path`; its folder is
    made), never over an existing one, and say where."""
    path = result_path(out, name, tag)
    write_new(path, json.dumps(doc, indent=1, default=float))
    print(f"wrote {path}")
    return path


def write_new(path: Path, text: str) -> None:
    """Write ``text`` to the new file ``path`` (its folder is made) in one step: a failed
    write (disk full, say) leaves no file, cut off or empty, and an existing file is
    never overwritten.

    Raises:
        OutputError: naming the file and the reason.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"--out: cannot create {path.parent}: "
                          f"{exc.strerror or exc}") from None
    with atomic_output(path, overwrite=False) as tmp:
        tmp.write_text(text)


def timed_calls(backend: Any, call: Callable[[], Any], reps: int,
                warmup: int) -> tuple[list[float], list[float]]:
    """Device seconds (events around each call on the backend's default stream, read after
    one synchronize at the end) and host seconds of each of ``reps`` calls, after
    ``warmup`` untimed ones. A backend without a device clock reports host seconds."""
    for _ in range(warmup):
        call()
    backend.synchronize()
    events = [(backend.create_event(), backend.create_event()) for _ in range(reps)]
    host: list[float] = []
    for start, end in events:
        start.record()
        t0 = time.perf_counter()
        call()
        host.append(time.perf_counter() - t0)
        end.record()
    backend.synchronize()
    try:
        device = [end.elapsed_ms(start) / 1e3 for start, end in events]
    except NotImplementedError:  # no device clock: the call ran on the host
        device = list(host)
    return device, host


def split_steps(step_ns: Sequence[int], boundary: Sequence[bool], per: int,
                name: str) -> dict[str, float]:
    """Microseconds per item-step of timed steps (``per`` items each): overall, on steps
    that cross a block boundary, and on the others (keys ``name``, ``name_block_boundary``,
    ``name_no_new_block``; ``nan`` where a kind has no step)."""
    def mean(ts: list[int]) -> float:
        return sum(ts) / (len(ts) * per) / 1e3 if ts else float("nan")

    return {
        name: mean(list(step_ns)),
        f"{name}_block_boundary": mean([t for t, b in zip(step_ns, boundary, strict=True)
                                        if b]),
        f"{name}_no_new_block": mean([t for t, b in zip(step_ns, boundary, strict=True)
                                      if not b]),
    }


_GATE = ('extern "C" __global__ void kvcm_bench_gate(unsigned long long flag) '
         '{ while (*(volatile int*)flag == 0) { } }\n')


class DeviceGate:
    """Times the device work of a call alone: a kernel spinning on a pinned flag holds the
    default stream while the host queues the call between two events, then the flag lets
    it go (so the host's queuing time is not in the events' interval). Needs a backend that
    compiles CUDA C (``compile``)."""

    def __init__(self, backend: Any) -> None:
        import numpy as np

        self.backend = backend
        self.module = backend.compile(_GATE)
        self.flag = backend.alloc_host(64)
        self.view = self.flag.host_view()[:4].view(np.int32)
        self._arg = [np.uint64(self.flag.ptr)]

    def time(self, call: Callable[[], Any]) -> tuple[float, float]:
        """``(device seconds, host seconds)`` of one ``call``."""
        be = self.backend
        self.view[0] = 0
        self.module.launch("kvcm_bench_gate", (1, 1, 1), (1, 1, 1), self._arg)
        start, end = be.create_event(), be.create_event()
        start.record()
        try:
            t0 = time.perf_counter()
            call()
            host = time.perf_counter() - t0
            end.record()
        finally:
            self.view[0] = 1
        end.synchronize()
        return end.elapsed_ms(start) / 1e3, host

    def close(self) -> None:
        self.flag.free()
