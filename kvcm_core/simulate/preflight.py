"""What ``kvcm simulate`` checks before it runs anything, and the warnings it gives.

A configuration error must be found before the run, not as a failure in the middle of it
(exit status 2, one line): every plugin name the configuration uses must be registered and
available here (:func:`check_plugins`), and level 0 must hold the largest request of the
workload on its own (:func:`check_capacity`: that request alone goes through a manager of
level 0 only, prefilled in the scheduler's chunks and decoded token by token, the way the
run will drive it, so the manager's own page accounting decides), and the batch the run
builds must fit (:func:`batch_bytes`: at most :data:`MAX_BATCH_BYTES`, refused as
``simulate.max_batch`` rather than found as an allocation failure in the run).

Warnings (:func:`level_warnings`) point at configurations that run but do not do what the
user probably meant: a level whose quota is far larger than everything the workload could
ever store costs time and memory for nothing (kvcm sets up the whole quota).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.errors import ConfigError, PluginError
from kvcm_core.manager import KVCacheManager
from kvcm_core.plugins import BACKEND_ENV, KvcmPluginManager, get_plugin_manager
from kvcm_core.simulate.runner import SchedulerConfig
from kvcm_core.simulate.workload import TraceRequest
from kvcm_core.sparse.reference import keys_width

__all__ = ["DWARF_FACTOR", "DWARF_MIN_BYTES", "MAX_BATCH_BYTES", "batch_bytes",
           "build_levels", "check_capacity",
           "check_plugins", "human_bytes", "level_warnings", "named_error"]

#: A level is said to dwarf the workload when its quota exceeds this many times the
#: working set ...
DWARF_FACTOR = 8
#: ... and the working set by at least this many bytes (small levels cost nothing).
DWARF_MIN_BYTES = 64 << 20
#: The most bytes the run's batch (:func:`batch_bytes`) may take: more is refused before
#: the run (``simulate.max_batch``), not found as an allocation failure in it.
MAX_BATCH_BYTES = 4 << 30


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (beyond a million TiB: ``"3.2e+290 TiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "TiB" and n >= 1e6:
                return f"{n:.3g} TiB"
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def check_plugins(cfg: KVCacheManagerConfig, pm: KvcmPluginManager | None = None) -> None:
    """Every plugin the configuration names is registered and available.

    Raises:
        ConfigError: naming the field (``kvcm.levels[1].tier``), the name, and the
            plugins that are available (or why the named one is not).
    """
    pm = pm or get_plugin_manager()

    def check(field: str, name: str, lookup: Any) -> None:
        try:
            spec = lookup(name)
        except PluginError as exc:
            raise ConfigError(field, name, str(exc)) from None
        ok, reason = pm.availability_of(spec)
        if not ok:
            raise ConfigError(field, name, f"is not available here: {reason}")

    try:
        pm.select_kernel_backend(cfg.kernel_backend)
    except PluginError as exc:
        env = os.environ.get(BACKEND_ENV, "")
        if cfg.kernel_backend == "auto" and env and env != "auto":
            # The environment chose the backend: name it, not the "auto" it overrides.
            raise ConfigError(BACKEND_ENV, env, f"{exc} (the environment variable picks "
                                                "the backend of kernel_backend = 'auto')"
                              ) from None
        raise ConfigError("kvcm.kernel_backend", cfg.kernel_backend, str(exc)) from None
    check("kvcm.eviction_policy", cfg.eviction_policy, pm.eviction_policy)
    for i, level in enumerate(cfg.levels):
        check(f"kvcm.levels[{i}].tier", level.tier, pm.tier)
        if level.codec is not None:
            check(f"kvcm.levels[{i}].codec", level.codec, pm.codec)


def check_capacity(cfg: KVCacheManagerConfig, trace: Sequence[TraceRequest],
                   sched: SchedulerConfig) -> None:
    """Level 0 alone holds the largest request of ``trace`` (see the module docstring),
    and the run's batch fits (:func:`batch_bytes`, at most :data:`MAX_BATCH_BYTES`).

    Raises:
        ConfigError: ``kvcm.levels[0].quota`` is too small, with the manager's reason;
            ``simulate.max_batch`` makes a batch too large.
    """
    if not trace:
        return
    req = max(trace, key=lambda r: len(r.tokens))
    tokens = req.tokens
    chunk = max(1, min(sched.chunk_tokens, sched.token_budget))
    gpu_only = attrs.evolve(cfg, levels=cfg.levels[:1])
    quota = cfg.levels[0].quota
    rule = (f"too small for the largest request of the workload ({req.id}: {len(tokens)} "
            f"tokens) on its own at {human_bytes(quota)}")
    try:
        manager = KVCacheManager(gpu_only)
    except ConfigError as exc:  # not a refusal: the level cannot be set up at all
        raise named_error(exc) from None
    with manager:
        nbytes = batch_bytes(manager, sched.max_batch)
        if nbytes > MAX_BATCH_BYTES:
            raise ConfigError(
                "simulate.max_batch", sched.max_batch,
                f"the run's batch would take about {human_bytes(nbytes)} (page tables over "
                "level 0's slots for every request, and the sparse layers' working sets): "
                f"at most {human_bytes(MAX_BATCH_BYTES)}; lower max_batch, level 0's quota "
                "or working_set_units")
        with manager.create_kv_cache(req.scope, ()) as cache:
            if not cache.resume():
                raise ConfigError("kvcm.levels[0].quota", quota,
                                  f"{rule}: {cache.last_refusal}")
            pos = 0
            while pos < len(tokens):
                step = min(chunk, req.prompt_len - pos) if pos < req.prompt_len else 1
                if not cache.resize(pos + step):
                    raise ConfigError(
                        "kvcm.levels[0].quota", quota,
                        f"{rule}: at token {pos + step}, {cache.last_refusal}")
                cache.commit(tokens[pos:pos + step])
                pos += step


def batch_bytes(manager: KVCacheManager, max_batch: int) -> int:
    """About the bytes of the batch a run of ``max_batch`` rows builds on ``manager``
    (:class:`~kvcm_core.batch.Batch`, as :class:`~kvcm_core.testing.engine.EngineLoop`
    makes it): a device page table and its host staging per cache group, of a row per beam
    of every request and a column per level-0 slot, plus each sparse layer's working set
    (cells and selection state) per request. Python ints: never wraps."""
    widest = max(1, max(s.num_slots for s in manager.stores[0]))
    beams = manager.config.max_beam_width
    total = 2 * 4 * manager.num_cache_groups * max_batch * beams * widest
    tpb = manager.tokens_per_block
    for layer in manager.config.layers:
        sp = getattr(layer, "sparse", None)
        if sp is None:
            continue
        pages = -(-sp.working_set_units // (tpb // sp.unit_tokens))
        cells = pages * sum(b.size for b in layer.buffers if b.is_sparse)
        total += max_batch * (cells + 32 * keys_width(sp.working_set_units))
    return total


def build_levels(cfg: KVCacheManagerConfig) -> None:
    """Set up every level of ``cfg`` once, as the run will (each tier with its options,
    each level's quota split over its pool groups), and close them again.

    Raises:
        ConfigError: as the manager raises it (see :func:`named_error` for the user's
            field names).
        TierIOError, OutOfPagesError: a level's storage could not be set up.
    """
    with KVCacheManager(cfg):
        pass


def named_error(exc: ConfigError,
                fractions: Mapping[int, tuple[float, int]] | None = None) -> ConfigError:
    """``exc`` (from building a manager) under the name the user wrote: a level's quota
    computed from ``[simulate] level_fractions`` (``fractions``: level -> (fraction,
    quota)) is ``simulate.level_fractions[i]``, naming the computed quota; any other
    field is under ``kvcm.``."""
    match = re.fullmatch(r"levels\[(\d+)\]\.quota", exc.field)
    if match and fractions and int(match.group(1)) in fractions:
        i = int(match.group(1))
        frac, quota = fractions[i]
        return ConfigError(f"simulate.level_fractions[{i}]", frac,
                           f"gives levels[{i}].quota = {human_bytes(quota)} ({quota} bytes) "
                           f"of the working set, which is refused: {exc.rule}")
    if match:
        quota = exc.value if isinstance(exc.value, int) else None
        size = f" ({human_bytes(quota)})" if quota is not None else ""
        return ConfigError(f"kvcm.{exc.field}", exc.value, f"{size.strip()} {exc.rule}"
                           if size else exc.rule)
    if _ROOT.match(exc.field).group(0) in _KVCM_FIELDS:
        return ConfigError(f"kvcm.{exc.field}", exc.value, exc.rule)
    return exc


#: The top-level fields of ``[kvcm]``, which :func:`named_error` places under ``kvcm.``.
_KVCM_FIELDS = frozenset(a.alias for a in attrs.fields(KVCacheManagerConfig) if a.init)
_ROOT = re.compile(r"[^.\[]*")


def level_warnings(cfg: KVCacheManagerConfig, ws_bytes: int) -> list[str]:
    """A warning for each level whose quota dwarfs the working set ``ws_bytes`` (the
    bytes of every distinct block of the workload: all an unbounded cache would hold)."""
    out = []
    for i, level in enumerate(cfg.levels):
        quota = int(level.quota)
        if quota > DWARF_FACTOR * ws_bytes and quota - ws_bytes >= DWARF_MIN_BYTES:
            ratio = quota / ws_bytes if ws_bytes else float("inf")
            out.append(
                f"level {i} ({level.tier}) quota {human_bytes(quota)} is {ratio:.0f}x the "
                f"workload's working set ({human_bytes(ws_bytes)}): the workload can never "
                "use the rest, but kvcm still sets up the whole quota, which makes the run "
                "slower and larger; a quota near the working set (or [simulate] "
                "level_fractions) gives the same result")
    return out
