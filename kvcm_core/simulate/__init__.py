"""``kvcm simulate``: replay a seeded serving workload through the manager, verifying every
step with the fingerprint engine, and report what the cache achieved.

Phases:

1. The workload (:mod:`kvcm_core.simulate.workload`) is generated from the seed, or read
   from a Mooncake-format trace file with ``--trace FILE``
   (:mod:`kvcm_core.simulate.mooncake`), and its working set measured (distinct blocks
   over the whole trace, in bytes).
2. Level quotas are set from ``[simulate] level_fractions`` (a fraction of the working set
   per level) where given, else taken from ``[kvcm]`` as written.
3. The measured run: the trace through :class:`~kvcm_core.testing.engine.EngineLoop` with
   every level of the configuration, the fingerprint check on at every step.
4. The GPU-only run: the same trace with only level 0 (same quota), also verified; skipped
   when the configuration has a single level (the measured run is then GPU-only).
5. The infinite-cache bound (:func:`~kvcm_core.simulate.runner.infinite_bound`); for a
   trace file also the trace's own infinite-cache hit rate, computed exactly from its
   hash ids (:func:`~kvcm_core.simulate.mooncake.infinite_hits`).
6. The report: a table, ``report.json`` and ``hit_rate.png`` / ``occupancy.png``.

A trace file (``--trace FILE``): request ``i`` arrives at engine step
``floor(timestamp_ms / --ms-per-step)`` (default 10 ms a step); its prompt follows the
token rule, its answer is ``output_length`` made-up tokens (at least one) that no later
prompt contains; every request is its own session in one reuse scope; ``--trace-limit N``
keeps the first ``N`` requests. ``--verify-every N`` samples the fingerprint check (see
:mod:`kvcm_core.simulate.runner`); the report names the verification mode.

Steps, everywhere (the table's and report's ``steps``, ``--corrupt-at STEP``, the step a
failure names, the progress bar and the plots' x axis), are the engine steps that ran,
numbered from 0 (:data:`~kvcm_core.simulate.runner.STEP_UNITS`): a stretch with no request
in the system, waiting for a trace's next arrival, is skipped and not counted.

Before running, ``--out`` is checked (a folder where ``report.json`` and the plots can be
made; the previous run's plots there are removed when the run starts), and
:mod:`kvcm_core.simulate.preflight` checks every plugin name, sets up every level once
(each tier with its options, each quota) and checks that level 0 holds the largest request
on its own; it warns (on stderr) when it raised level 0's quota for that, when it raised a
colder level's quota from ``level_fractions`` so that each cold group gets a slot, or when
a level's quota dwarfs the working set.

Exit status: 0 when every step verified; 1 when verification failed (a fingerprint
mismatch or a broken manager invariant), or a ``--corrupt-at`` self-test corrupted a page
that no check detected; 2 on a bad command line or configuration, found before running
(bad flag, bad TOML, unknown or unavailable plugin, level 0 too small for the largest
request, a ``max_batch`` whose batch is too large), or a ``--corrupt-at STEP`` that
corrupted nothing (the run ended before STEP); 3 when the run failed for another reason
(the scheduler stalled, a storage tier failed, an internal error, the report or a plot
could not be written: the previous file is then left whole), with the likely cause.
Every failure is one line on stderr (``--debug`` adds the traceback) and, once the run
started, ``report.json`` with ``verification.ok = false`` and the traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import math
import platform
import re
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.markup import escape

from kvcm_core.config import KVCacheManagerConfig, SsmLayerConfig, read_toml
from kvcm_core.console import OutputError, int_at_least, make_console
from kvcm_core.errors import (
    ConfigError,
    CorruptPageError,
    OutOfPagesError,
    PluginError,
    TierIOError,
)
from kvcm_core.manager import KVCacheManager
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.simulate.mooncake import TraceError, infinite_hits, read_trace, to_requests
from kvcm_core.simulate.preflight import (
    build_levels,
    check_capacity,
    check_plugins,
    human_bytes,
    level_warnings,
    named_error,
)
from kvcm_core.simulate.report import build_report, print_report, write_json, write_plots
from kvcm_core.simulate.runner import (
    STALL_STEPS,
    STEP_UNITS,
    RunResult,
    SchedulerConfig,
    SchedulerStalled,
    StepHook,
    infinite_bound,
    run_trace,
    working_set,
)
from kvcm_core.simulate.workload import WorkloadConfig, generate_trace, trace_summary

__all__ = ["MAX_BATCH", "MAX_WORKING_SET_UNITS", "SimulateConfig", "load_config", "main"]

#: ``--verify-every`` with ``--trace`` unless given: the full check of a 300-request
#: Mooncake trace (15k-token prompts) takes several minutes a run on two cores.
TRACE_VERIFY_EVERY = 8

_SIM_KEYS = ("seed", "level_fractions", "workload", *(a.name for a in attrs.fields(
    SchedulerConfig)))
#: The least value of a scheduler knob where it is not 1 (``invariants_every = 0``: the
#: invariant check only at the end).
_SIM_MIN = {"invariants_every": 0, "rewind_every": 0, "rewind_draft": 0}
#: The most requests ``[simulate] max_batch`` may run at once: the run's batch has a page
#: table row (and a sparse working set) for each, whatever the workload needs.
MAX_BATCH = 4096
#: The most units a sparse layer's ``working_set_units`` may keep per request in a run
#: (the run's batch holds that many for each of its ``max_batch`` rows).
MAX_WORKING_SET_UNITS = 1 << 20


@attrs.frozen(kw_only=True)
class SimulateConfig:
    """A whole simulation: workload, scheduler, manager configuration as plain data (so
    that quotas can still be set from the working set) and the seed."""

    seed: int
    workload: WorkloadConfig
    scheduler: SchedulerConfig
    level_fractions: tuple[float, ...] | None
    kvcm: Mapping[str, Any]


#: Embedded configurations ``--preset`` names: ``default`` (a small hybrid model),
#: ``sparse`` (sparse-attention layers sharing one selection, beside a dense one),
#: ``two-engine`` (two managers sharing a Redis level: :mod:`kvcm_core.simulate.two_engine`)
#: and ``hybrid`` (SWA and SSM layers, a lossy disk level, multimodal prompts, the engine's
#: Batch.resize / Batch.move and speculative rewinds: ``hybrid.toml``).
PRESETS = ("default", "sparse", "two-engine", "hybrid")


def load_config(path: str | Path | None = None, preset: str = "default") -> SimulateConfig:
    """Read a simulation file (``[simulate]`` and ``[kvcm]`` tables); ``None``: the
    embedded preset (``kvcm_core/simulate/PRESET.toml``).

    Raises:
        ConfigError: unreadable file, unknown key or bad value.
    """
    if path is None:  # the embedded preset: known good
        data = tomllib.loads(
            importlib.resources.files(__name__).joinpath(f"{preset}.toml").read_text())
    else:
        data = read_toml(path)
    for key in data:
        if key not in ("simulate", "kvcm"):
            raise ConfigError(str(key), data[key], "unknown table; allowed: simulate, kvcm")
    if "kvcm" not in data:
        raise ConfigError("kvcm", None, "is required (the manager configuration)")
    if not isinstance(data["kvcm"], dict):
        raise ConfigError("kvcm", data["kvcm"], "must be a table ([kvcm])")
    if not isinstance(data.get("simulate", {}), dict):
        raise ConfigError("simulate", data["simulate"], "must be a table ([simulate])")
    sim = dict(data.get("simulate", {}))
    for key in sim:
        if key not in _SIM_KEYS:
            raise ConfigError(f"simulate.{key}", sim[key],
                              f"unknown key; allowed: {', '.join(sorted(_SIM_KEYS))}")
    seed = sim.pop("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError("simulate.seed", seed, "must be an int >= 0")
    fractions = sim.pop("level_fractions", None)
    if fractions is not None:
        if not isinstance(fractions, list) or not all(
                isinstance(f, int | float) and not isinstance(f, bool)
                and math.isfinite(f) and f > 0 for f in fractions):
            raise ConfigError("simulate.level_fractions", fractions,
                              "must be a list of finite numbers > 0, one per level")
        fractions = tuple(float(f) for f in fractions)
    workload = sim.pop("workload", {})
    if not isinstance(workload, dict):
        raise ConfigError("simulate.workload", workload,
                          "must be a table ([simulate.workload])")
    workload = WorkloadConfig.from_dict(workload)
    if not isinstance(sim.get("batch_ops", False), bool):
        raise ConfigError("simulate.batch_ops", sim["batch_ops"], "must be true or false")
    for key, value in sim.items():
        if key == "batch_ops":
            continue
        low = _SIM_MIN.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"simulate.{key}", value, f"must be an int >= {low}")
        if key == "max_batch" and value > MAX_BATCH:
            raise ConfigError("simulate.max_batch", value,
                              f"must be at most {MAX_BATCH} (the run's batch holds a page "
                              "table row for each request it may run)")
    sched = SchedulerConfig(**sim)
    try:  # report errors now, by their place in the file ([kvcm])
        cfg = KVCacheManagerConfig.from_dict(data["kvcm"])
    except ConfigError as exc:
        raise ConfigError(f"kvcm.{exc.field}", exc.value, exc.rule) from None
    for i, layer in enumerate(cfg.layers):
        sp = getattr(layer, "sparse", None)
        if sp is not None and sp.working_set_units > MAX_WORKING_SET_UNITS:
            raise ConfigError(f"kvcm.layers[{i}].sparse.working_set_units",
                              sp.working_set_units,
                              f"must be at most {MAX_WORKING_SET_UNITS} in a simulation (the "
                              "run's batch keeps that many units for every request)")
        if sp is not None and sched.batch_ops:
            raise ConfigError("simulate.batch_ops", True,
                              f"needs a model without sparse layers (kvcm.layers[{i}] is "
                              "sparse: its engine seats rows with add and remove only)")
    return SimulateConfig(seed=seed, workload=workload, scheduler=sched,
                          level_fractions=fractions, kvcm=data["kvcm"])


#: The largest quota ``[simulate] level_fractions`` may compute (8 EiB: an int64).
MAX_QUOTA = (1 << 63) - 1


def _manager_config(sim: SimulateConfig, ws: dict[str, int], gpu_only: bool,
                    warnings: list[str],
                    fitted: dict[int, tuple[float, int]] | None = None
                    ) -> KVCacheManagerConfig:
    """The manager configuration of the run: ``[kvcm]`` with quotas from the fractions.
    ``fitted`` (level -> (fraction, quota)) gets each quota computed from a fraction."""
    raw = dict(sim.kvcm)
    levels = [dict(lv) for lv in raw["levels"]]
    if sim.level_fractions is not None:
        if len(sim.level_fractions) != len(levels):
            raise ConfigError("simulate.level_fractions", list(sim.level_fractions),
                              f"needs one fraction per level ({len(levels)})")
        # The GPU level must hold the largest request alone, or nothing could run.
        floor = 2 * (ws["largest_request_blocks"] + 1) * ws["bytes_per_block"]
        for i, (lv, frac) in enumerate(zip(levels, sim.level_fractions, strict=True)):
            exact = frac * ws["bytes"]
            if not exact <= MAX_QUOTA:
                raise ConfigError(f"simulate.level_fractions[{i}]", frac,
                                  f"gives levels[{i}].quota = {human_bytes(exact)} of the "
                                  f"working set ({human_bytes(ws['bytes'])}): too large (at "
                                  "most 8 EiB)")
            quota = max(1, int(exact))
            if i == 0 and quota < floor:
                warnings.append(
                    f"level 0 quota raised from {human_bytes(quota)} (level_fractions[0] = "
                    f"{frac} of the working set) to {human_bytes(floor)} so that the "
                    f"largest request ({ws['largest_request_blocks']} blocks) fits: the run "
                    "has more GPU memory than the fraction says")
                quota = floor
            lv["quota"] = quota
            if fitted is not None:
                fitted[i] = (frac, quota)
    if gpu_only:
        levels = levels[:1]
    raw["levels"] = levels
    return KVCacheManagerConfig.from_dict(raw)


def _fit_levels(cfg: KVCacheManagerConfig, fitted: dict[int, tuple[float, int]],
                bytes_per_block: int, warnings: list[str]) -> KVCacheManagerConfig:
    """Set up every level of ``cfg`` once before the run (preflight: every tier with its
    options, every quota), raising a colder level's quota computed from a fraction
    (``fitted``) that leaves one of its cold groups without a slot, with a warning, as
    level 0's is raised for the largest request.

    Raises:
        ConfigError: a level cannot be set up (named as the user wrote it).
    """
    raised: dict[int, int] = {}
    for _ in range(80):
        try:
            build_levels(cfg)
            break
        except ConfigError as exc:
            match = re.fullmatch(r"levels\[(\d+)\]\.quota", exc.field)
            i = int(match.group(1)) if match else 0
            if not (match and i >= 1 and i in fitted and "no slot" in exc.rule):
                raise named_error(exc, fitted) from None
            quota = cfg.levels[i].quota
            new = max(2 * quota, bytes_per_block)
            raised.setdefault(i, quota)
            levels = list(cfg.levels)
            levels[i] = attrs.evolve(levels[i], quota=new)
            cfg = attrs.evolve(cfg, levels=type(cfg.levels)(levels))
            fitted[i] = (fitted[i][0], new)
    else:  # pragma: no cover - the quota doubles each time: a slot comes long before
        raise ConfigError(f"simulate.level_fractions[{max(raised)}]", None,
                          "no quota gives every cold group a slot")
    for i, old in sorted(raised.items()):
        warnings.append(
            f"level {i} quota raised from {human_bytes(old)} (level_fractions[{i}] = "
            f"{fitted[i][0]} of the working set) to {human_bytes(cfg.levels[i].quota)} so "
            "that each of its cold groups gets a slot: the level is larger than the "
            "fraction says")
    return cfg


def _speculative(cfg: KVCacheManagerConfig, sched: SchedulerConfig
                 ) -> tuple[SchedulerConfig, KVCacheManagerConfig | None]:
    """Where the speculative-decoding rewinds (``rewind_every``, ``rewind_draft``) run:
    the scheduler of the measured and GPU-only runs, and the configuration of a companion
    run (None: none). A model with SSM layers cannot rewind history: its runs go without
    rewinds and the companion run takes the model less its SSM layers, with
    ``max_rewind_len`` at least ``rewind_draft``. Without SSM layers the measured run
    rewinds itself.

    Raises:
        ConfigError: rewinds asked of a model without SSM layers whose ``max_rewind_len``
            is 0.
    """
    if not (sched.rewind_every and sched.rewind_draft):
        return sched, None
    if not any(isinstance(layer, SsmLayerConfig) for layer in cfg.layers):
        if cfg.max_rewind_len < 1:
            raise ConfigError("kvcm.max_rewind_len", cfg.max_rewind_len,
                              "must be >= 1 for simulate.rewind_every (speculative "
                              "decoding rewinds history)")
        return sched, None
    layers = [layer for layer in cfg.layers if not isinstance(layer, SsmLayerConfig)]
    spec = attrs.evolve(cfg, layers=type(cfg.layers)(layers), commit_min_snapshot=False,
                        max_rewind_len=max(cfg.max_rewind_len, sched.rewind_draft))
    return attrs.evolve(sched, rewind_every=0, rewind_draft=0), spec


def corrupt_after(at_step: int) -> StepHook:
    """A step hook that inverts the first byte of a running request's first committed page
    after step ``at_step`` (a self-test: the next check must fail). Its ``corrupted`` list
    holds the step it did so at (empty while it has not); it returns the corrupted cache
    (so that sampled verification checks every page next), else None."""
    done: list[int] = []

    def hook(manager: KVCacheManager, loop: Any, step: int) -> Any:
        if done or step < at_step:
            return None
        tpb = manager.tokens_per_block
        layer = next(lay for lay in manager.config.layers
                     if getattr(lay, "sliding_window_size", 0) is None)
        role = layer.buffers[0].role
        group = manager.get_buffer_group_id(layer.layer_id, role)
        for req in loop.running:
            cache = req.cache
            if cache is None or cache.history_length < tpb:
                continue
            slot = int(cache.get_base_page_indices(group)[0])
            if slot < 0:
                continue
            region = manager.get_page_region(layer.layer_id, role)
            start = region.offset + slot * region.stride
            byte = manager.backend.read(region.buffer, start, 1)
            manager.backend.write(region.buffer, start, byte ^ 0xFF)
            done.append(step)
            return cache
        return None

    hook.corrupted = done  # type: ignore[attr-defined]
    return hook


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcm simulate",
        description="Replay a seeded serving workload through the KV-cache manager, "
                    "verify every step with the fingerprint engine, and report hit rates "
                    "against the infinite-cache bound and a GPU-only run.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE",
                     help="a TOML file with [simulate] and [kvcm] tables (default: the "
                          "embedded preset)")
    src.add_argument("--preset", choices=PRESETS, default="default",
                     help="an embedded configuration: default (a small hybrid model), "
                          "hybrid (full attention, SWA with sinks and an SSM layer; an int8 "
                          "disk level; images in prompts; Batch.resize and Batch.move; "
                          "speculative rewinds in a companion run without the SSM layer), "
                          "sparse (sparse-attention layers with one shared top-k selection "
                          "that drifts step to step) or two-engine (two managers serving "
                          "alternate turns, sharing a Redis level on a redis-server the run "
                          "starts; compared with local levels only and the GPU only; it "
                          "verifies every page at every step and refuses, exit 2, "
                          "--corrupt-at, --verify-every, --gpu-only, --no-compare, "
                          "--duration and --trace)")
    p.add_argument("--seed", type=int_at_least(0),
                   help="workload seed, an int >= 0 (overrides [simulate] seed)")
    p.add_argument("--requests", type=int, metavar="N", help="requests in the trace")
    p.add_argument("--duration", type=int, metavar="STEPS",
                   help="start sessions only during the first STEPS steps")
    p.add_argument("--out", default="kvcm-simulate-out", metavar="DIR",
                   help="where report.json and the plots go (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--gpu-only", action="store_true",
                   help="run with level 0 only (no comparison run is then needed)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the GPU-only comparison run")
    p.add_argument("--corrupt-at", type=int_at_least(0), metavar="STEP",
                   help="self-test: flip a byte of a committed page after step STEP (>= 0; "
                        "steps, here, in the table and in a failure's message, are "
                        f"{STEP_UNITS}: a run of N steps has steps 0 .. N-1); the "
                        "run must then fail verification (exit 1). With sampled "
                        "verification every check after the corruption is full until one "
                        "covers the corrupted request; a corruption no check detected also "
                        "fails (exit 1). report.json's meta.self_test records the step it "
                        "was injected at and whether it was detected. A STEP the run ends "
                        "before (or after which no running request has a committed page) "
                        "corrupts nothing: an error, exit 2")
    p.add_argument("--trace", metavar="FILE",
                   help="replay a Mooncake-format trace (JSON lines: timestamp, "
                        "input_length, output_length, hash_ids) instead of the seeded "
                        "workload")
    p.add_argument("--trace-limit", type=int, default=0, metavar="N",
                   help="with --trace: the first N requests (0: all; default)")
    p.add_argument("--ms-per-step", type=float, default=10.0, metavar="MS",
                   help="with --trace: milliseconds of trace time per engine step; a "
                        "request arrives at step floor(timestamp / MS) (default "
                        "%(default)s)")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of a failure (default: a one-line message; "
                        "report.json has the traceback either way)")
    p.add_argument("--stall-steps", type=int_at_least(1), default=None, metavar="N",
                   help="stall watchdog: the run fails (exit 3, naming the stuck requests "
                        "and the likely cause) when for N engine steps in a row no request "
                        "got further than it ever had (tokens recomputed after a preemption "
                        "are no progress) and none finished (overrides [simulate] "
                        f"stall_steps; default {STALL_STEPS})")
    p.add_argument("--verify-every", type=int, default=None, metavar="N",
                   help="1: check every page at every step (full; the default for the "
                        "seeded workload); N > 1: sampled verification: every page every "
                        "N-th step, and each request at its first step after it was "
                        f"admitted or resumed (default with --trace: {TRACE_VERIFY_EVERY})")
    return p


#: The plots a run draws into ``--out`` (unless ``--no-plots``).
PLOTS = ("hit_rate.png", "occupancy.png")


def check_out(out: str, names: Sequence[str]) -> str | None:
    """Why no report could be written under ``--out out`` (None: it can be): an empty
    path, an existing file where the folder goes, one of ``names`` there that is not a
    file (a folder in the way), or a nearest existing folder in which no file can be made
    (permissions, a read-only or pseudo file system). Checked before the run, so that a
    run is never thrown away for want of a place to put its report."""
    if not out:
        return "--out '': must name a folder (use --out . for the current one)"
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"--out {out}: is an existing file, not a folder"
    for name in names:
        target = path / name
        if target.exists() and not target.is_file():
            return f"--out {out}: {target} is in the way: it is not a file"
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"--out {out}: cannot be made: {folder} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"--out {out}: cannot be written: no file can be made in {folder} " \
               f"({exc.strerror})"
    return None


def _usage(message: str) -> int:
    """A bad command line or trace: one line on stderr, exit status 2."""
    print(f"kvcm simulate: {message}", file=sys.stderr)
    return 2


def _verification_mode(every: int) -> dict[str, Any]:
    if every <= 1:
        return {"mode": "full", "verify_every": 1,
                "description": "every page checked at every step"}
    return {"mode": "sampled", "verify_every": every,
            "description": f"sampled: every page of every running request at every "
                           f"{every}th step, and each request's pages at its first step "
                           f"after every admission or resume (records written every step; "
                           f"manager invariants every {every}x invariants_every steps)"}


def _trace_infinite(records: Any, cfg: KVCacheManagerConfig) -> dict[str, Any]:
    """The trace's infinite-cache hit rate at the configured block size, file order, each
    request looking up its prompt less the last token (as the engine loop does)."""
    rule = "partial" if cfg.enable_partial_reuse else "blocks"
    hits = infinite_hits(records, cfg.tokens_per_block, rule=rule, lookup_less=1)
    lookup = sum(max(0, r.input_length - 1) for r in records)
    return {"hit_rate": int(hits.sum()) / lookup if lookup else 0.0,
            "hit_tokens": int(hits.sum()), "lookup_tokens": lookup,
            "tokens_per_block": cfg.tokens_per_block, "rule": rule, "order": "file order"}


def _progress(console: Console, enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                    console=console, transient=False)


def _runner(progress: Any, label: str, total: int) -> Callable[[RunResult, Any], None] | None:
    if progress is None:
        return None
    task = progress.add_task(label, total=total, info="")

    def update(res: RunResult, _report: Any) -> None:
        if res.steps % 8:
            return
        progress.update(task, completed=res.finished,
                        info=f"step {res.steps}  hit {res.hit_rate:.3f}  "
                             f"preempted {res.preemptions}")

    def final(res: RunResult) -> None:
        progress.update(task, completed=res.finished,
                        info=f"step {res.steps}  hit {res.hit_rate:.3f}  "
                             f"preempted {res.preemptions}")

    update.final = final  # type: ignore[attr-defined]
    return update


def _classify(exc: BaseException) -> tuple[int, str]:
    """The exit status and one-line message of a failure during the run."""
    from kvcm_core.testing.fingerprint import FingerprintMismatch

    what = f"{type(exc).__name__}: {exc}"
    # The runner names where it failed: "step N" (STEP_UNITS) or "the end of the run".
    where = getattr(exc, "kvcm_step", None)
    at = f" at {where}" if where is not None else ""
    if isinstance(exc, FingerprintMismatch):
        return 1, f"verification failed{at}: {what}"
    if isinstance(exc, AssertionError):
        return 1, f"verification failed{at}: a manager invariant broke: {what}"
    if isinstance(exc, SchedulerStalled):
        return 3, f"the scheduler stalled: {exc}"
    if isinstance(exc, TierIOError | CorruptPageError):
        return 3, (f"storage failed: {what}; likely cause: a colder level's tier could not "
                   "write or read pages back (disk full or not writable, or a faulty tier "
                   "plugin)")
    if isinstance(exc, OutOfPagesError):
        return 3, (f"out of pages: {what}; likely cause: the levels are too small for the "
                   "requests the scheduler runs together")
    if isinstance(exc, ConfigError | PluginError):
        return 2, f"configuration error: {what}"
    return 3, (f"internal error: {what}; likely cause: a bug in kvcm or in a plugin "
               "(report it with the traceback: --debug, or report.json)")


def _corrupt_at_missed(at_step: int, steps: int) -> str:
    """The error of a ``--corrupt-at`` self-test that corrupted nothing."""
    why = (f"the run ended after {steps} steps (0 .. {steps - 1}), before step {at_step}"
           if at_step >= steps
           else f"no running request had a committed page from step {at_step} to the "
                f"run's end (step {steps})")
    return (f"--corrupt-at {at_step}: nothing was corrupted, the self-test did not run: "
            f"{why}; choose an earlier STEP")


def _corrupt_undetected(at_step: int, step: int) -> str:
    """The error of a ``--corrupt-at`` self-test whose corruption no check detected."""
    return (f"verification failed: --corrupt-at {at_step} corrupted a page after step "
            f"{step} and no check detected it by the run's end: the self-test did not prove "
            "detection")


def _fail(err: Console, message: str, code: int, tb: str | None, debug: bool) -> int:
    """One line on stderr (and the traceback with ``--debug``); returns ``code``."""
    if debug and tb:
        err.print(tb, markup=False, highlight=False)
    err.print(f"[red]kvcm simulate: {escape(message)}[/]", highlight=False)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvcm simulate``; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = make_console()  # piped: wide enough that the table never wraps
    err = make_console(stderr=True)
    if args.preset == "two-engine" and args.config is None:
        if args.trace is not None or args.gpu_only or args.corrupt_at is not None or \
                args.duration is not None or args.verify_every is not None or \
                args.no_compare:
            return _usage("--preset two-engine takes --seed, --requests, --out, --quiet, "
                          "--no-plots and --debug only (it refuses --corrupt-at, "
                          "--verify-every, --gpu-only, --no-compare, --duration and "
                          "--trace: it always verifies every page at every step)")
    for flag, value in (("--requests", args.requests), ("--duration", args.duration)):
        if value is not None and value < 1:
            return _usage(f"{flag} {value}: must be an int >= 1")
    if args.verify_every is None:
        args.verify_every = TRACE_VERIFY_EVERY if args.trace is not None else 1
    if args.verify_every < 1:
        return _usage(f"--verify-every {args.verify_every}: must be >= 1 (1: every step)")
    if args.trace is None and (args.trace_limit or args.ms_per_step != 10.0):
        return _usage("--trace-limit and --ms-per-step apply to --trace FILE only")
    if args.trace is not None:
        if args.trace_limit < 0:
            return _usage(f"--trace-limit {args.trace_limit}: must be >= 0 (0: every "
                          "request)")
        if not args.ms_per_step > 0:
            return _usage(f"--ms-per-step {args.ms_per_step}: must be > 0")
        if args.requests is not None or args.duration is not None:
            return _usage("--requests and --duration apply to the seeded workload; with "
                          "--trace use --trace-limit")
    two_engine = args.preset == "two-engine" and args.config is None
    problem = check_out(args.out, () if two_engine else
                        ("report.json",) if args.no_plots else ("report.json", *PLOTS))
    if problem is not None:
        return _usage(problem)
    if two_engine:
        from kvcm_core.simulate.two_engine import run_two_engine

        return run_two_engine(args, Path(args.out), console, err)
    records = None
    warnings: list[str] = []
    try:
        sim = load_config(args.config, args.preset)
        if args.stall_steps is not None:
            sim = attrs.evolve(sim, scheduler=attrs.evolve(sim.scheduler,
                                                           stall_steps=args.stall_steps))
        wl = sim.workload
        if args.requests is not None:
            wl = attrs.evolve(wl, requests=args.requests)
        elif args.duration is not None:
            wl = attrs.evolve(wl, requests=10**9)
        if args.duration is not None:
            wl = attrs.evolve(wl, duration=args.duration)
        seed = sim.seed if args.seed is None else args.seed
        t0 = time.perf_counter()
        if args.trace is not None:
            records = read_trace(args.trace, args.trace_limit)
            trace = to_requests(records, args.ms_per_step, seed=seed, source=args.trace)
        else:
            trace = generate_trace(wl, seed)
        base = KVCacheManagerConfig.from_dict(sim.kvcm)
        check_plugins(base)
        ws = working_set(trace, base)
        cfg = _fit_levels(_manager_config(sim, ws, args.gpu_only, warnings, fitted := {}),
                          fitted, ws["bytes_per_block"], warnings)
        check_capacity(cfg, trace, sim.scheduler)
        warnings += level_warnings(cfg, ws["bytes"])
        sched, spec_cfg = _speculative(cfg, sim.scheduler)
    except TraceError as exc:
        return _usage(str(exc))
    except (ConfigError, PluginError) as exc:
        return _fail(err, f"configuration error: {exc}", 2, traceback.format_exc(),
                     args.debug)
    except (TierIOError, OutOfPagesError) as exc:  # setting up a level's storage failed
        return _fail(err, f"storage failed while setting up the levels: "
                          f"{type(exc).__name__}: {exc}", 3, traceback.format_exc(),
                     args.debug)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if (out / "report.json").is_file():  # an earlier run's folder: a failed run must
            for name in PLOTS:               # not leave that run's plots beside its report
                if (out / name).is_file() or (out / name).is_symlink():
                    (out / name).unlink()
    except OSError as exc:
        return _usage(f"--out {args.out}: cannot prepare the folder ({exc.strerror})")
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    notes: list[str] = []
    summary = trace_summary(trace)
    summary.update({"working_set_blocks": ws["blocks"], "working_set_bytes": ws["bytes"],
                    "bytes_per_block": ws["bytes_per_block"]})
    if records is not None:
        summary["trace_file"] = args.trace
    try:
        version = importlib.metadata.version("kvcm")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    meta: dict[str, Any] = {
        "kvcm_version": version, "seed": seed, "config": args.config or f"{args.preset}.toml",
        "python": platform.python_version(), "machine": platform.machine(),
        "kernel_backend": cfg.kernel_backend,
        "kernel_backend_selected": get_plugin_manager().select_kernel_backend(
            cfg.kernel_backend).name, "argv": list(argv or []),
        "workload": attrs.asdict(wl), "scheduler": attrs.asdict(sim.scheduler),
        "level_fractions": sim.level_fractions, "kvcm": cfg.to_dict(), "notes": notes,
        "warnings": warnings, "verification": _verification_mode(args.verify_every),
    }
    if records is not None:
        meta["workload"] = {
            "trace": args.trace, "trace_limit": args.trace_limit,
            "ms_per_step": args.ms_per_step,
            "arrival": "step floor(timestamp_ms / ms_per_step)",
            "answers": "output_length made-up tokens (at least 1) from [2000000, 2**31), "
                       "never in a prompt",
        }
    show = not args.quiet and console.is_terminal
    progress = _progress(console, show)
    hook = corrupt_after(args.corrupt_at) if args.corrupt_at is not None else None
    main_res: RunResult | None = None
    gpu_res: RunResult | None = None
    spec_res: RunResult | None = None
    bound: dict[str, Any] | None = None
    error: str | None = None
    code = 0
    runs: list[RunResult] = []
    try:
        if progress is not None:
            progress.start()
        label = "gpu-only" if len(cfg.levels) == 1 else "all levels"
        cb = _runner(progress, label, len(trace))
        main_res = run_trace(cfg, trace, sched, label=label, on_step=hook,
                             progress=cb, verify_every=args.verify_every)
        runs.append(main_res)
        if cb is not None:
            cb.final(main_res)  # type: ignore[attr-defined]
        if len(cfg.levels) > 1 and not args.no_compare:
            cb = _runner(progress, "gpu-only", len(trace))
            gpu_cfg = attrs.evolve(cfg, levels=cfg.levels[:1])
            gpu_res = run_trace(gpu_cfg, trace, sched, label="gpu-only", progress=cb,
                                verify_every=args.verify_every)
            if cb is not None:
                cb.final(gpu_res)  # type: ignore[attr-defined]
        if spec_cfg is not None:
            cb = _runner(progress, "speculative", len(trace))
            spec_res = run_trace(spec_cfg, trace, sim.scheduler, label="speculative",
                                 progress=cb, verify_every=args.verify_every)
            if cb is not None:
                cb.final(spec_res)  # type: ignore[attr-defined]
            notes.append(
                "a model with SSM layers cannot rewind history (docs/semantics.md): the "
                "speculative-decoding rewinds ran in a companion run of the same trace on the "
                f"model less its SSM layers, max_rewind_len = {spec_cfg.max_rewind_len} "
                "(report.json: speculative)")
        elif len(cfg.levels) == 1:
            notes.append("a single level is configured: the measured run is the GPU-only run")
        bound = infinite_bound(cfg, trace, main_res.creation_order, ws["bytes"])
        if records is not None:
            bound["trace"] = _trace_infinite(records, cfg)
        if bound["dropped_blocks"]:
            notes.append(f"the infinite-cache replay evicted {bound['dropped_blocks']} blocks: "
                         "the bound is underestimated")
    except Exception as exc:  # every failure ends in a one-line message and a report
        code, error = _classify(exc)
        meta["traceback"] = traceback.format_exc()
        meta["exit_status"] = code
        from kvcm_core.testing.fingerprint import FingerprintMismatch
        mismatch = isinstance(exc, FingerprintMismatch)
    else:
        mismatch = False
    finally:
        if progress is not None:
            progress.stop()
    if hook is not None:
        corrupted = hook.corrupted  # type: ignore[attr-defined]
        detected = bool(corrupted) and mismatch  # wrong KV found, not any other failure
        meta["self_test"] = {"corrupt_at": args.corrupt_at, "injected": bool(corrupted),
                             "injected_at_step": corrupted[0] if corrupted else None,
                             "detected": detected}
        if error is None and main_res is not None and not corrupted:
            code, error = 2, _corrupt_at_missed(args.corrupt_at, main_res.steps)
            meta["exit_status"] = code
        elif error is None and corrupted:
            # A corruption no check found: the self-test proved nothing; never exit 0.
            code, error = 1, _corrupt_undetected(args.corrupt_at, corrupted[0])
            meta["exit_status"] = code
    meta["wall_s"] = time.perf_counter() - t0
    report = build_report(meta=meta, workload=summary, main=main_res, gpu_only=gpu_res,
                          speculative=spec_res,
                          bound=bound, error=error)
    report_path = out / "report.json"
    try:
        write_json(report, report_path)
    except OutputError as exc:
        # The run's outcome stands; the previous report.json (if any) is left whole.
        if error is None:
            if not args.quiet:
                print_report(report, console)
            return _fail(err, f"the run verified but its report was not written: {exc}", 3,
                         traceback.format_exc(), args.debug)
        return _fail(err, f"{error} (the report was not written: {exc})", code,
                     meta.get("traceback"), args.debug)
    if error is None and not args.quiet:
        print_report(report, console)
    if error is None and not args.no_plots:
        try:
            plots = write_plots(report, out)
        except OutputError as exc:
            return _fail(err, f"the run verified and its report is in {report_path}, but a "
                              f"plot was not written: {exc}", 3, traceback.format_exc(),
                         args.debug)
        if isinstance(plots, str):
            notes.append(plots)
            if not args.quiet:
                console.print(f"[yellow]note:[/] {escape(plots)}")
        elif not args.quiet:
            console.print(f"plots: {escape(', '.join(str(p) for p in plots))}",
                          highlight=False)
    if not args.quiet:
        console.print(f"report: {escape(str(report_path))}  ({meta['wall_s']:.1f} s)",
                      highlight=False)
    if error is not None:
        return _fail(err, f"{error} (report: {report_path})", code,
                     meta.get("traceback"), args.debug)
    return 0
