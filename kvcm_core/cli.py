"""The ``kvcm`` command.

Subcommands:

- ``kvcm plugins [--json]``: every registered plugin (kind, name, distribution, version,
  whether it is available here and why not, key capabilities, description) and the kernel
  backend ``kernel_backend="auto"`` selects.
- ``kvcm conformance [--plugin NAME ...] [-k EXPR] [--json]``: run the conformance suite
  (:mod:`kvcm_core.testing.suite`) in-process and print a table of plugin x result; the
  exit status is non-zero on any failure.
- ``kvcm bench kernels|manager|mixed|trace|eviction|batch|redis|codecs|sparse|migrate ...``:
  the benchmarks (:mod:`kvcm_core.bench`).
- ``kvcm simulate ...``: the main job (:mod:`kvcm_core.simulate`).
- ``kvcm --version``.

Heavy modules (pytest, the benchmarks, the simulator) are imported only by the subcommand
that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib
import importlib.metadata
import io
import json
import os
import signal
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import attrs
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from kvcm_core.console import make_console, silence_stdout
from kvcm_core.errors import ConfigError, KvcmError, PluginError
from kvcm_core.plugins import (
    AUTOLOAD_ENV,
    DISABLE_ENV,
    KvcmPluginManager,
    RegisteredPlugin,
    autoload_from_env,
    get_plugin_manager,
)

__all__ = ["main"]

_KIND_ORDER = {"tier": 0, "kernel_backend": 1, "codec": 2, "eviction_policy": 3}
OUTCOMES = ("passed", "failed", "skipped", "xfailed")


def _version() -> str:
    try:
        return importlib.metadata.version("kvcm")
    except importlib.metadata.PackageNotFoundError:
        from kvcm_core import __version__

        return __version__


def _console(stderr: bool = False) -> Console:
    return make_console(stderr=stderr)


def _error(message: str) -> None:
    _console(stderr=True).print(f"[bold red]kvcm:[/] {escape(message)}", highlight=False)


# -- kvcm plugins -------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _capabilities(record: RegisteredPlugin) -> dict[str, Any]:
    spec = record.spec
    caps = getattr(spec, "capabilities", None)
    out = {k: _plain(v) for k, v in attrs.asdict(caps, recurse=False).items()} if caps else {}
    if hasattr(spec, "priority"):
        out["priority"] = spec.priority
    return out


def _capability_summary(caps: dict[str, Any]) -> str:
    """Short text: true flags by name, other set values as key=value (octal for modes)."""
    parts = []
    for key, value in caps.items():
        if value is True:
            parts.append(key)
        elif value is False or value is None:
            continue
        elif key.endswith("_mode") and isinstance(value, int):
            parts.append(f"{key}={value:o}")
        else:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def _plugin_rows(pm: KvcmPluginManager) -> list[dict[str, Any]]:
    rows = []
    records = sorted(pm.registered(), key=lambda r: (_KIND_ORDER.get(r.spec.kind, 9), r.spec.name))
    for record in records:
        ok, reason = pm.availability_of(record.spec)
        rows.append(
            {
                "kind": record.spec.kind,
                "name": record.spec.name,
                "plugin": record.plugin,
                "distribution": record.distribution,
                "version": record.version,
                "available": ok,
                "reason": reason,
                "capabilities": _capabilities(record),
                "known_gaps": dict(record.spec.known_gaps),
                "description": record.spec.description,
            }
        )
    return rows


#: Narrower terminals get the plugins as a list: a seven-column table there would cut words.
PLUGINS_TABLE_MIN_WIDTH = 120


def _caps_text(row: dict[str, Any]) -> str:
    caps = _capability_summary(row["capabilities"])
    if row["known_gaps"]:
        caps += f"{', ' if caps else ''}known_gaps={len(row['known_gaps'])}"
    return caps


def _available_text(row: dict[str, Any]) -> str:
    # Plugin text is escaped: "install kvcm[cupy]" is not rich markup.
    return "[green]yes[/]" if row["available"] else f"[red]no[/]: {escape(row['reason'])}"


def _print_plugins_table(console: Console, rows: list[dict[str, Any]]) -> None:
    """One row a plugin; cells wrap (long words fold) but are never cut short."""
    table = Table(title=f"kvcm {_version()} plugins", title_justify="left")
    for column in ("kind", "name", "distribution", "version", "available", "capabilities",
                   "description"):
        table.add_column(column, overflow="fold",
                         no_wrap=column in ("kind", "name", "version"))
    for row in rows:
        table.add_row(
            row["kind"].replace("_", " "),
            escape(row["name"]),
            escape(row["distribution"]),
            escape(row["version"]),
            _available_text(row),
            escape(_caps_text(row)),
            escape(row["description"]),
        )
    console.print(table)


def _print_plugins_list(console: Console, rows: list[dict[str, Any]]) -> None:
    """A few lines a plugin, wrapped at the terminal's width, nothing cut."""
    console.print(f"[bold]kvcm {_version()} plugins[/]", highlight=False)
    for row in rows:
        console.print(
            f"[bold]{row['kind'].replace('_', ' ')} {escape(row['name'])}[/] "
            f"({escape(row['distribution'])} {escape(row['version'])}): "
            f"available {_available_text(row)}", overflow="fold", highlight=False)
        caps = _caps_text(row)
        details = [f"capabilities: {caps}"] if caps else []
        details += [row["description"]] if row["description"] else []
        for text in details:
            console.print(Padding(Text(text, overflow="fold"), (0, 0, 0, 4)))


def _cmd_plugins(args: argparse.Namespace) -> int:
    try:
        pm = get_plugin_manager()
        rows = _plugin_rows(pm)
    except PluginError as exc:
        _error(str(exc))
        return 1
    try:
        auto: str | None = pm.select_kernel_backend("auto").name
        auto_error = ""
    except PluginError as exc:
        auto, auto_error = None, str(exc)
    env_backend = os.environ.get("KVCM_KERNEL_BACKEND", "")
    autoload = autoload_from_env()
    if args.json:
        print(
            json.dumps(
                {
                    "version": _version(),
                    "plugins": rows,
                    "auto_kernel_backend": auto,
                    "auto_kernel_backend_error": auto_error or None,
                    "disabled": sorted(pm.disabled),
                    "autoload": autoload,
                },
                indent=2,
            )
        )
        return 0
    console = _console()
    if console.width >= PLUGINS_TABLE_MIN_WIDTH:
        _print_plugins_table(console, rows)
    else:
        _print_plugins_list(console, rows)
    if not rows:
        console.print(
            "No plugins registered."
            + (f" ({AUTOLOAD_ENV}={os.environ.get(AUTOLOAD_ENV, '')}: entry points are "
               "not loaded.)" if not autoload else ""), markup=False, highlight=False
        )
    if pm.disabled:
        console.print(f"Blocked by {DISABLE_ENV}: {escape(', '.join(sorted(pm.disabled)))}",
                      highlight=False)
    # User text (an environment variable's value) is escaped: "[/]" is not rich markup.
    source = f" ({escape('KVCM_KERNEL_BACKEND=' + env_backend)})" if env_backend else ""
    if auto is not None:
        console.print(f'kernel_backend="auto" selects: [bold]{escape(auto)}[/]{source}')
    else:
        console.print(f'kernel_backend="auto" selects nothing{source}: {escape(auto_error)}')
    return 0


# -- kvcm conformance ---------------------------------------------------------------------


class _Collector:
    """A pytest plugin counting outcomes per (kind, plugin) of conformance tests."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[str, str]] = {}
        self.outcome: dict[str, str] = {}
        self.counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self.reasons: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.collect_errors: list[str] = []

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        for item in items:
            cls = getattr(item, "cls", None)
            kind = getattr(cls, "kvcm_kind", "")
            callspec = getattr(item, "callspec", None)
            name = callspec.params.get("kvcm_plugin_name") if callspec else None
            name = name or getattr(cls, "plugin_name", None)
            if kind and name:
                self.keys[item.nodeid] = (kind, name)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_errors.append(report.nodeid or "<collection>")

    def pytest_runtest_logreport(self, report: Any) -> None:
        key = self.keys.get(report.nodeid)
        if key is None:
            return  # e.g. "no tier plugin selected" placeholders
        current = self.outcome.get(report.nodeid)
        if report.failed:
            current = "failed"
        elif current != "failed":
            if report.skipped:
                if hasattr(report, "wasxfail"):
                    current = "xfailed"
                else:
                    current = "skipped"
                    reason = _skip_reason(report)
                    if reason and reason not in self.reasons[key]:
                        self.reasons[key].append(reason)
            elif report.when == "call":
                current = "passed"  # a non-strict xpass counts as passed
        if current is not None:
            self.outcome[report.nodeid] = current
        if report.when == "teardown":
            self.counts[key][self.outcome.pop(report.nodeid, "passed")] += 1

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for kind, name in sorted(self.counts, key=lambda k: (_KIND_ORDER.get(k[0], 9), k[1])):
            counts = self.counts[(kind, name)]
            out.append(
                {
                    "kind": kind,
                    "plugin": name,
                    **{o: counts[o] for o in OUTCOMES},
                    "skip_reasons": self.reasons[(kind, name)],
                }
            )
        return out


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
        return text.removeprefix("Skipped: ")
    return ""


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        pm = get_plugin_manager()
        known = {r.spec.name for r in pm.registered()}
    except PluginError as exc:
        _error(str(exc))
        return 1
    unknown = [n for n in args.plugin if n not in known]
    if unknown:
        _error(
            f"unknown plugin {', '.join(map(repr, unknown))}; available: "
            f"{', '.join(sorted(known)) or 'none'}"
        )
        return 2

    import importlib.util

    import pytest

    # Located, not imported: pytest imports it inside the session, after setting up
    # assertion rewriting for it and its base classes.
    suite = importlib.util.find_spec("kvcm_core.testing.suite")
    assert suite is not None and suite.origin is not None
    collector = _Collector()
    pytest_args = [
        suite.origin,
        "-c",
        os.devnull,  # the suite's own settings, not those of whatever project is around
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        "--tb=short",
    ]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        pytest_args += ["-p", "kvcm_core.testing.pytest_plugin"]
    for name in args.plugin:
        pytest_args += ["--kvcm-plugin", name]
    if args.k:
        pytest_args += ["-k", args.k]
    pytest_args += args.pytest_args
    if args.json:
        with contextlib.redirect_stdout(io.StringIO()):
            code = int(pytest.main(pytest_args, plugins=[collector]))
    else:
        code = int(pytest.main(pytest_args, plugins=[collector]))
    rows = collector.rows()
    failed = code != 0 or any(r["failed"] for r in rows)
    if args.json:
        print(json.dumps({"exit_code": code, "results": rows}, indent=2))
    else:
        _print_conformance(rows, code)
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.NO_TESTS_COLLECTED):
        # Not a failed test: a bad pytest option or -k, or nothing selected (exit 2).
        _error("no conformance test ran: check --plugin, -k and the pytest options"
               if code == pytest.ExitCode.NO_TESTS_COLLECTED else
               "pytest refused the arguments (see above): check -k and the options after --")
        return 2
    if code == pytest.ExitCode.INTERNAL_ERROR:
        return 3
    return 1 if failed else 0


def _print_conformance(rows: list[dict[str, Any]], code: int) -> None:
    console = _console()
    table = Table(title="kvcm conformance", title_justify="left")
    table.add_column("kind", no_wrap=True)
    table.add_column("plugin", no_wrap=True)
    for outcome in OUTCOMES:
        table.add_column(outcome, justify="right")
    table.add_column("skip reasons", overflow="fold")
    for row in rows:
        failed = f"[red]{row['failed']}[/]" if row["failed"] else "0"
        table.add_row(
            row["kind"].replace("_", " "),
            row["plugin"],
            str(row["passed"]),
            failed,
            str(row["skipped"]),
            str(row["xfailed"]),
            escape("; ".join(row["skip_reasons"])),
        )
    console.print(table)
    if code == 5 or not rows:
        console.print("No conformance test ran (check --plugin and -k).")


# -- lazily dispatched subcommands ----------------------------------------------------------


def _dispatch(module: str, argv: list[str], what: str) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module == missing or module.startswith(missing + ".")):
            _error(f"{what} is not built yet ({module} is missing).")
            return 2
        raise
    return int(mod.main(argv) or 0)


#: ``kvcm bench TARGET``: each target's module in :mod:`kvcm_core.bench`, and what it does.
BENCH_TARGETS = {
    "kernels": "page copies, index conversion and launch cost of each kernel backend, "
               "beside the copy limits measured in the same run (for a GPU)",
    "manager": "the manager's host time per decode step and per prefix lookup, and how "
               "lookup scales with the cached blocks",
    "mixed": "a mixed-precision companion: prefix hit rate of REQUIRED against "
             "SINK_REQUIRED_ONLY",
    "trace": "a Mooncake-format trace through the manager: hit rate and host time per "
             "request, beside the trace's infinite-cache and LRU hit rates",
    "eviction": "nanoseconds per page of every eviction policy's batch methods",
    "batch": "Batch.resize + publish per decode step (host), and publish with index-table "
             "conversion on each GPU backend against a model measured in the same run",
    "redis": "the redis tier's pipelined put and get beside redis-benchmark in the same run",
    "codecs": "page codecs' encode and decode on a GPU against its copy bandwidth, blob "
              "codecs on the CPU, and simulated hit rates with raw and lossy cold levels",
    "sparse": "sparse attention: resolve, fetch and flush device time against limits "
              "measured in the same run, and trace hits against an exact host LRU",
    "migrate": "offload, swap and cascade of a Llama-3-8B-like layout through the public "
               "API against the one-way and duplex copy limits measured in the same run",
}


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.target is None:
        if {"-h", "--help"} & set(args.rest):
            args.bench_parser.print_help()
            return 0
        args.bench_parser.print_usage(sys.stderr)
        _error(f"choose a benchmark: {', '.join(BENCH_TARGETS)} "
               "(kvcm bench --help)")
        return 2
    return _dispatch(f"kvcm_core.bench.{args.target}", args.rest, f"`kvcm bench {args.target}`")


def _cmd_simulate(args: argparse.Namespace) -> int:
    rest = ["--debug", *args.rest] if args.debug and "--debug" not in args.rest else args.rest
    return _dispatch("kvcm_core.simulate", rest, "`kvcm simulate`")


def _cmd_soak(args: argparse.Namespace) -> int:
    rest = ["--debug", *args.rest] if args.debug and "--debug" not in args.rest else args.rest
    return _dispatch("kvcm_core.soak", rest, "`kvcm soak`")


# -- entry point ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcm",
        description="kvcm: a paged KV-cache manager for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvcm {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a configuration or runtime error "
                             "(default: a one-line message)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plugins", help="list every registered plugin and its availability")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser(
        "conformance",
        help="run the plugin conformance suite; a table of plugin x result",
        description="Run the conformance suite for every registered plugin (or those named). "
        "Arguments after `--` go to pytest.",
    )
    p.add_argument(
        "--plugin",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="only these plugins (repeatable)",
    )
    p.add_argument("-k", metavar="EXPR", help="only tests matching this pytest -k expression")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_conformance)

    # No -h of their own: `kvcm simulate --help` reaches the simulator's parser, and
    # `kvcm bench manager --help` the benchmark's; `kvcm bench --help` lists the targets.
    targets = "\n".join(f"  {name:<9} {what}" for name, what in BENCH_TARGETS.items())
    p = sub.add_parser(
        "bench", help="kernel, manager, mixed-precision, trace-replay and eviction-policy "
        "benchmarks (other arguments go on)",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="kvcm bench TARGET [options]  (kvcm bench TARGET --help for its options)",
        description="Run one of kvcm's benchmarks. Each writes its results to a new "
        "timestamped JSON file (never overwriting one) and takes --quick for a short run.",
        epilog=f"targets:\n{targets}",
    )
    p.add_argument("target", nargs="?", choices=list(BENCH_TARGETS), metavar="TARGET",
                   help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_bench, passes_rest=True, bench_parser=p)

    p = sub.add_parser(
        "simulate", help="replay a serving workload through the manager", add_help=False
    )
    p.set_defaults(func=_cmd_simulate, passes_rest=True)

    p = sub.add_parser(
        "soak", help="a long seeded random workload over three levels with injected storage "
        "faults, verified every step (kvcm soak --steps N --seed S)", add_help=False)
    p.set_defaults(func=_cmd_soak, passes_rest=True)
    return parser


def _is_output_error(exc: OSError) -> bool:
    """An error writing to stdout, not a file: rich and print raise it from the stream."""
    import errno

    if isinstance(exc, KvcmError):
        return False
    return exc.errno in (errno.ENOSPC, errno.EBADF, errno.EIO, errno.EDQUOT, errno.EFBIG) \
        and getattr(exc, "filename", None) is None


def _stderr_line(text: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(text, file=sys.stderr, flush=True)


def _reopen_closed_streams() -> None:
    """Point a closed stdout/stderr (None at start-up) at the null device."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError):
                setattr(sys, name, open(os.devnull, "w"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcm`` command.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    if sys.stdout is None or sys.stderr is None:
        # Started with stdout or stderr closed (`kvcm plugins >&-`): say so once (on
        # whichever is open) and run with the closed one pointing at the null device.
        closed = [name for name in ("stdout", "stderr") if getattr(sys, name) is None]
        _reopen_closed_streams()
        if "stdout" in closed:
            _stderr_line("kvcm: stdout is closed: the command's output is discarded")
    parser = _parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if rest and not getattr(args, "passes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        code = int(args.func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`kvcm plugins --json | head`): stop quietly, as a process
        # ended by SIGPIPE does.
        silence_stdout()
        return 128 + int(getattr(signal, "SIGPIPE", 13))
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except KvcmError as exc:
        if args.debug:
            raise
        # A configuration error is found before running (exit 2); anything else kvcm
        # reports by type happened while running (exit 3).
        code = 2 if isinstance(exc, ConfigError | PluginError) else 3
        _error(f"{type(exc).__name__}: {exc} (--debug for the traceback)")
        return code
    except OSError as exc:
        if not _is_output_error(exc):
            raise
        # stdout cannot be written (`> /dev/full`, a closed descriptor): one line on stderr.
        silence_stdout()
        _stderr_line(f"kvcm: cannot write the output: {exc.strerror or exc}")
        return 3


if __name__ == "__main__":
    sys.exit(main())
