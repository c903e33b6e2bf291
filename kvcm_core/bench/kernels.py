"""Kernel-backend benchmark (``kvcm bench kernels``).

In one process, for every available kernel backend (found through the plugin manager, never
by importing a plugin module):

- the limit: one contiguous copy (``copy_bytes``, a plain memcpy) host-to-device,
  device-to-host and device-to-device;
- the naive baseline: one ``copy_bytes`` call per page;
- ``copy_pages`` of random scattered slots for page sizes from 4 KiB to 1 MiB and batches of
  1 to 16k pages, through each copy path the backend has (``copy_path="sm"``: gather kernel;
  ``"ce"``: copy engine), as a ratio to the limit of the same direction;
- host microseconds per call, and the bare cost of launching an empty kernel;
- ``convert_page_indices`` for a full batch, against launch cost + bytes / bandwidth.

Device work is timed with the backend's events (``Event.elapsed_ms``) after a warm-up,
several repetitions each, reporting median and best; backends without a device clock are
timed on the host. Device-to-device bandwidth counts bytes read plus bytes written. Results
go to a JSON file (device, driver and runtime versions, package versions, date) and, when
matplotlib is installed, a PNG plot.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvcm_core.backend import BAD_PAGE_INDEX, Buffer, KernelBackend, MemoryKind, PageRegion
from kvcm_core.bench import (
    DEFAULT_OUT,
    HelpFormatter,
    device_backends,
    parse_with_quick,
    result_path,
    timed_calls,
    write_new,
)
from kvcm_core.console import atomic_output, int_at_least
from kvcm_core.errors import ConfigError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.units import parse_size

__all__ = ["TARGETS", "main", "run"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: (direction, smallest page size, ratio to the limit): the project's performance targets.
TARGETS: list[tuple[str, int, float]] = [
    ("h2d", 4 * KiB, 0.85),
    ("h2d", 16 * KiB, 0.90),
    ("d2h", 4 * KiB, 0.85),
    ("d2h", 16 * KiB, 0.90),
    ("d2d", 64 * KiB, 0.80),
]
DIRECTIONS = {  # name -> (source kind, destination kind)
    "h2d": (MemoryKind.HOST, MemoryKind.DEVICE),
    "d2h": (MemoryKind.DEVICE, MemoryKind.HOST),
    "d2d": (MemoryKind.DEVICE, MemoryKind.DEVICE),
}
_EMPTY_KERNEL = 'extern "C" __global__ void kvcm_bench_empty(unsigned long long x) {}\n'


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcm bench kernels",
        description="Page copies, index conversion and launch cost of each kernel backend, "
        "as ratios to the physical limits measured in the same run. Writes "
        "kernels-DEVICE-YYYYmmdd-HHMMSS[-TAG].json and .png (UTC time) to a new name in "
        "--out, never over an existing file.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="only this backend (repeatable; none given: every available one with a "
        "device, else numpy)",
    )
    p.add_argument(
        "--page-sizes",
        default="4KiB,16KiB,64KiB,256KiB,1MiB",
        help="comma-separated page sizes",
    )
    p.add_argument(
        "--batches",
        default="1,16,256,4096,16384",
        help="comma-separated batch sizes in pages",
    )
    p.add_argument("--directions", default="h2d,d2h,d2d",
                   help="comma-separated copy directions (host to device, device to host, "
                        "device to device)")
    p.add_argument(
        "--pool", default="2GiB", help="bytes of each host and device pool pages are drawn from"
    )
    p.add_argument(
        "--max-bytes", default="1GiB", help="largest copy of one call; bigger batches are skipped"
    )
    p.add_argument("--reps", type=int_at_least(1), default=7, help="timed repetitions")
    p.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed calls first")
    p.add_argument(
        "--naive-pages",
        type=int_at_least(1),
        default=2048,
        help="pages of the one-memcpy-per-page baseline",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run to try the benchmark: 4KiB,64KiB,1MiB pages, batches 1,256,4096, "
        "3 reps (instead of the defaults of those options); options given explicitly still "
        "apply",
    )
    p.add_argument(
        "--options",
        default="{}",
        help="JSON object of backend options added to every backend built (e.g. "
        "'{\"block_threads\": 128}')",
    )
    p.add_argument(
        "--sweep-threads",
        default="",
        help="comma-separated block sizes: also time the gather kernel (copy_path='sm') "
        "with each, side by side, at the largest batch of every page size",
    )
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seed of the random page indices")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR|FILE.json",
                   help="where the results go: a folder gets new timestamped files, a path "
                        "ending in .json is that file (the PNG beside it); an existing file "
                        "is never overwritten")
    p.add_argument("--tag", default="", help="text added to the output file names")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


# -- timing ----------------------------------------------------------------------------------


def _stats(seconds: list[float], nbytes: int) -> dict[str, float]:
    med, best = statistics.median(seconds), min(seconds)
    return {
        "seconds_median": med,
        "seconds_best": best,
        "gbps_median": nbytes / med / 1e9 if med > 0 else float("inf"),
        "gbps_best": nbytes / best / 1e9 if best > 0 else float("inf"),
    }


# -- one backend -----------------------------------------------------------------------------


class _Pools:
    """One host pool and two device pools, so that every direction has a source and a
    destination of its kind."""

    def __init__(self, backend: KernelBackend, nbytes: int) -> None:
        self.host = backend.alloc_host(nbytes)
        self.dev_a = backend.alloc_device(nbytes)
        self.dev_b = backend.alloc_device(nbytes)
        rng = np.random.default_rng(1)
        chunk = rng.integers(0, 256, 64 * MiB, dtype=np.uint8)  # not zeros: see METHOD.md
        for buf in (self.host, self.dev_a, self.dev_b):
            for off in range(0, nbytes, chunk.size):
                backend.write(buf, off, chunk[: min(chunk.size, nbytes - off)])

    def pair(self, direction: str) -> tuple[Buffer, Buffer]:
        """(source, destination) for a direction."""
        return {
            "h2d": (self.host, self.dev_a),
            "d2h": (self.dev_a, self.host),
            "d2d": (self.dev_a, self.dev_b),
        }[direction]

    def free(self) -> None:
        for buf in (self.host, self.dev_a, self.dev_b):
            buf.free()


def _bytes_moved(direction: str, nbytes: int) -> int:
    """Bytes a copy moves through memory: device-to-device counts read plus write."""
    return 2 * nbytes if direction == "d2d" else nbytes


def _bench_backend(
    name: str, spec: Any, args: argparse.Namespace, log: Callable[[str], None]
) -> dict[str, Any]:
    caps = spec.capabilities
    paths = ["sm", "ce"] if caps.copy_engine else ["default"]
    instances: dict[str, KernelBackend] = {}
    for path in paths:
        extra = {} if path == "default" else {"copy_path": path}
        instances[path] = spec.factory({**args.options, **extra})
    main_backend = instances[paths[0]]
    info: dict[str, Any] = {}
    device_info = getattr(main_backend, "device_info", None)
    if callable(device_info):
        info = device_info()
    result: dict[str, Any] = {
        "backend": name,
        "paths": paths,
        "info": info,
        "capabilities": {
            "has_device": caps.has_device,
            "copy_engine": caps.copy_engine,
            "compiles_sources": caps.compiles_sources,
        },
    }
    log(f"[{name}] allocating pools of {args.pool_bytes / GiB:.2f} GiB")
    pools = _Pools(main_backend, args.pool_bytes)
    rng = np.random.default_rng(args.seed)
    try:
        # The limit: one contiguous copy per direction.
        limits: dict[str, dict[str, float]] = {}
        for direction in args.directions:
            src, dst = pools.pair(direction)
            n = args.max_bytes
            dev, host = timed_calls(
                main_backend,
                functools.partial(main_backend.copy_bytes, dst, 0, src, 0, n),
                args.reps,
                args.warmup,
            )
            limits[direction] = {"bytes": n, **_stats(dev, _bytes_moved(direction, n))}
            log(f"[{name}] limit {direction}: {limits[direction]['gbps_median']:.1f} GB/s")
        result["limits"] = limits

        # The naive baseline: one memcpy call per page.
        naive = []
        for direction in args.directions:
            src, dst = pools.pair(direction)
            for page in args.page_sizes:
                count = min(args.naive_pages, args.pool_bytes // page, args.max_bytes // page)
                if count < 1:
                    continue
                d_idx = rng.permutation(args.pool_bytes // page)[:count]
                s_idx = rng.permutation(args.pool_bytes // page)[:count]
                offsets = list(zip((d_idx * page).tolist(), (s_idx * page).tolist(), strict=True))

                def loop(
                    s: Buffer = src,
                    d: Buffer = dst,
                    p: int = page,
                    o: list[tuple[int, int]] = offsets,
                ) -> None:
                    for do, so in o:
                        main_backend.copy_bytes(d, do, s, so, p)

                dev, host = timed_calls(main_backend, loop, max(2, args.reps // 2), 1)
                row = {
                    "direction": direction,
                    "page_bytes": page,
                    "pages": count,
                    **_stats(dev, _bytes_moved(direction, page * count)),
                    "host_us_per_page": statistics.median(host) / count * 1e6,
                }
                row["ratio"] = row["gbps_median"] / limits[direction]["gbps_median"]
                naive.append(row)
            log(f"[{name}] naive {direction} done")
        result["naive"] = naive

        # copy_pages through every path.
        rows = []
        for path, backend in instances.items():
            for direction in args.directions:
                src, dst = pools.pair(direction)
                for page in args.page_sizes:
                    slots = args.pool_bytes // page
                    for batch in args.batches:
                        if batch > slots or batch * page > args.max_bytes:
                            continue
                        pairs = np.stack(
                            [rng.permutation(slots)[:batch], rng.permutation(slots)[:batch]],
                            axis=1,
                        ).astype(np.int32)
                        d_region, s_region = PageRegion(dst, 0, page), PageRegion(src, 0, page)
                        dev, host = timed_calls(
                            backend,
                            functools.partial(backend.copy_pages, d_region, s_region, page, pairs),
                            args.reps,
                            args.warmup,
                        )
                        row = {
                            "path": path,
                            "direction": direction,
                            "page_bytes": page,
                            "batch": batch,
                            **_stats(dev, _bytes_moved(direction, page * batch)),
                            "host_us_median": statistics.median(host) * 1e6,
                            "host_us_best": min(host) * 1e6,
                        }
                        row["ratio"] = row["gbps_median"] / limits[direction]["gbps_median"]
                        row["ratio_best"] = row["gbps_best"] / limits[direction]["gbps_median"]
                        rows.append(row)
                log(f"[{name}] copy_pages path={path} {direction} done")
        result["copy_pages"] = rows

        # The gather kernel's block size, variants interleaved so drift hits all alike.
        sweep = []
        if args.sweep_threads and caps.copy_engine:
            variants = {
                bt: spec.factory({**args.options, "copy_path": "sm", "block_threads": bt})
                for bt in args.sweep_threads
            }
            try:
                for direction in args.directions:
                    src, dst = pools.pair(direction)
                    for page in args.page_sizes:
                        slots = args.pool_bytes // page
                        fits = [
                            b for b in args.batches if b <= slots and b * page <= args.max_bytes
                        ]
                        if not fits:
                            continue
                        batch = max(fits)
                        pairs = np.stack(
                            [rng.permutation(slots)[:batch], rng.permutation(slots)[:batch]],
                            axis=1,
                        ).astype(np.int32)
                        d_region, s_region = PageRegion(dst, 0, page), PageRegion(src, 0, page)
                        for _round in range(2):
                            for bt, variant in variants.items():
                                dev, _host = timed_calls(
                                    variant,
                                    functools.partial(
                                        variant.copy_pages, d_region, s_region, page, pairs
                                    ),
                                    args.reps,
                                    args.warmup,
                                )
                                st = _stats(dev, _bytes_moved(direction, page * batch))
                                sweep.append(
                                    {
                                        "block_threads": bt,
                                        "round": _round,
                                        "direction": direction,
                                        "page_bytes": page,
                                        "batch": batch,
                                        **st,
                                        "ratio": st["gbps_median"]
                                        / limits[direction]["gbps_median"],
                                    }
                                )
                log(f"[{name}] block size sweep done")
            finally:
                for variant in variants.values():
                    variant.close()
        result["sweep"] = sweep

        # Bare launch cost: an empty kernel, and a launch followed by a synchronize.
        launch: dict[str, float] = {}
        compile_fn = getattr(main_backend, "compile", None)
        if caps.compiles_sources and callable(compile_fn):
            module = compile_fn(_EMPTY_KERNEL)
            count = 2000

            def launches() -> None:
                for _ in range(count):
                    module.launch("kvcm_bench_empty", (1, 1, 1), (32, 1, 1), [np.uint64(0)])

            dev, host = timed_calls(main_backend, launches, 3, 1)
            launch["launch_host_us"] = statistics.median(host) / count * 1e6
            launch["launch_device_us"] = statistics.median(dev) / count * 1e6
            t = []
            for _ in range(200):
                t0 = time.perf_counter()
                module.launch("kvcm_bench_empty", (1, 1, 1), (32, 1, 1), [np.uint64(0)])
                main_backend.synchronize()
                t.append(time.perf_counter() - t0)
            launch["launch_and_sync_us"] = statistics.median(t) * 1e6
        # Host cost of the smallest copy_pages call of each path (one 4 KiB page).
        for path, backend in instances.items():
            src, dst = pools.pair("d2d")
            one = np.array([[0, 1]], dtype=np.int32)
            page = 4 * KiB
            dev, host = timed_calls(
                backend,
                functools.partial(backend.copy_pages, PageRegion(dst, 0, page),
                                  PageRegion(src, 0, page), page, one),
                200,
                20,
            )
            launch[f"copy_pages_one_page_host_us_{path}"] = statistics.median(host) * 1e6
        result["launch"] = launch
        log(f"[{name}] launch cost: {launch}")

        # convert_page_indices for a full batch.
        conv = []
        shape = (256, 2048)  # 256 requests x 2048 blocks
        slots_arr = rng.integers(0, 1 << 20, shape, dtype=np.int32)
        slots_arr[rng.random(shape) < 0.05] = BAD_PAGE_INDEX
        for expansion in (1, 2):
            dev, host = timed_calls(
                main_backend,
                functools.partial(main_backend.convert_page_indices, slots_arr, 4, 7, expansion),
                max(3, args.reps),
                args.warmup,
            )
            nbytes = slots_arr.nbytes * (1 + expansion)
            wall = statistics.median(host)
            row = {
                "shape": list(shape),
                "expansion": expansion,
                "bytes": nbytes,
                "host_us_median": wall * 1e6,
                "host_us_best": min(host) * 1e6,
            }
            if "h2d" in limits and "launch_and_sync_us" in launch:
                bw = limits["h2d"]["gbps_median"] * 1e9
                model = launch["launch_and_sync_us"] * 1e-6 + nbytes / bw
                row["model_us"] = model * 1e6
                row["ratio_to_model"] = wall / model
            conv.append(row)
        result["convert_page_indices"] = conv
        log(f"[{name}] convert_page_indices done")
    finally:
        pools.free()
        for backend in instances.values():
            backend.close()
    return result


# -- targets and report ----------------------------------------------------------------------


def _target_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each performance target against each page size at the largest batch measured."""
    out: list[dict[str, Any]] = []
    if not result["capabilities"]["has_device"]:
        return out  # the targets are for device backends
    for row in result.get("copy_pages", []):
        goal = None
        for direction, min_page, ratio in TARGETS:
            if row["direction"] == direction and row["page_bytes"] >= min_page:
                goal = ratio  # TARGETS is ordered by page size, so the last match wins
        if goal is None:
            continue
        same = [
            r
            for r in result["copy_pages"]
            if (r["path"], r["direction"], r["page_bytes"])
            == (row["path"], row["direction"], row["page_bytes"])
        ]
        if row["batch"] != max(r["batch"] for r in same):
            continue
        out.append(
            {
                "backend": result["backend"],
                "path": row["path"],
                "direction": row["direction"],
                "page_bytes": row["page_bytes"],
                "batch": row["batch"],
                "ratio": row["ratio"],
                "target": goal,
                "met": row["ratio"] >= goal,
            }
        )
    return out


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "kvcm",
        "numpy",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "cupy",
        "cuda-bindings",
        "cuda-python",
        "matplotlib",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    directions = report["config"]["directions"]
    fig, axes = plt.subplots(2, len(directions), figsize=(5.5 * len(directions), 8), squeeze=False)
    for col, direction in enumerate(directions):
        top, bottom = axes[0][col], axes[1][col]
        for res in report["backends"]:
            rows = [r for r in res.get("copy_pages", []) if r["direction"] == direction]
            for copy_path in res["paths"]:
                mine = [r for r in rows if r["path"] == copy_path]
                pages = sorted({r["page_bytes"] for r in mine})
                best = []
                for p in pages:
                    at = [r for r in mine if r["page_bytes"] == p]
                    best.append(max(at, key=lambda r: r["batch"])["ratio"])
                if pages:
                    top.plot(
                        [p / KiB for p in pages],
                        best,
                        marker="o",
                        label=f"{res['backend']} {copy_path}",
                    )
                mid = sorted({r["page_bytes"] for r in mine})
                if mid:
                    p64 = min(mid, key=lambda p: abs(p - 64 * KiB))
                    at = sorted(
                        (r for r in mine if r["page_bytes"] == p64), key=lambda r: r["batch"]
                    )
                    bottom.plot(
                        [r["batch"] for r in at],
                        [r["ratio"] for r in at],
                        marker="o",
                        label=f"{res['backend']} {copy_path} ({p64 // KiB} KiB)",
                    )
            naive = sorted(
                (r for r in res.get("naive", []) if r["direction"] == direction),
                key=lambda r: r["page_bytes"],
            )
            if naive:
                top.plot(
                    [r["page_bytes"] / KiB for r in naive],
                    [r["ratio"] for r in naive],
                    linestyle="--",
                    marker="x",
                    label=f"{res['backend']} memcpy per page",
                )
        for d, min_page, goal in TARGETS:
            if d == direction:
                top.hlines(goal, min_page / KiB, 1024, colors="grey", linestyles=":")
        top.set_xscale("log", base=2)
        top.set_ylim(0, 1.15)
        top.set_title(f"{direction}: ratio to contiguous copy (largest batch)")
        top.set_xlabel("page size (KiB)")
        top.set_ylabel("ratio")
        top.legend(fontsize=7)
        bottom.set_xscale("log", base=2)
        bottom.set_ylim(0, 1.15)
        bottom.set_title(f"{direction}: ratio vs batch (64 KiB pages)")
        bottom.set_xlabel("pages per call")
        bottom.set_ylabel("ratio")
        bottom.legend(fontsize=7)
    device = report["meta"].get("device", "")
    fig.suptitle(f"kvcm copy_pages, {device}, {report['meta']['date']}")
    fig.tight_layout()
    try:
        with atomic_output(path, overwrite=False) as tmp:  # never a cut-off plot
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return True


def _print_summary(report: dict[str, Any]) -> None:
    print("\nkernel bench summary (median ratio to the contiguous copy of the same run)")
    for res in report["backends"]:
        lim = ", ".join(f"{d} {v['gbps_median']:.1f} GB/s" for d, v in res["limits"].items())
        print(f"\n{res['backend']}: limits {lim}")
        launch = res.get("launch", {})
        if launch:
            print("  " + ", ".join(f"{k} {v:.1f}" for k, v in launch.items()))
        for row in res.get("convert_page_indices", []):
            extra = (
                f", model {row['model_us']:.0f} us, x{row['ratio_to_model']:.2f}"
                if "model_us" in row
                else ""
            )
            print(
                f"  convert {row['shape']} x{row['expansion']}: "
                f"{row['host_us_median']:.0f} us{extra}"
            )
        print(
            f"  {'path':<7} {'dir':<4} {'page':>8} {'batch':>6} {'GB/s':>8} {'ratio':>6} "
            f"{'host us':>8}"
        )
        for r in res.get("copy_pages", []):
            print(
                f"  {r['path']:<7} {r['direction']:<4} {r['page_bytes'] // KiB:>6}Ki "
                f"{r['batch']:>6} {r['gbps_median']:>8.1f} {r['ratio']:>6.3f} "
                f"{r['host_us_median']:>8.1f}"
            )
    for res in report["backends"]:
        if res.get("sweep"):
            print(f"\n{res['backend']}: gather kernel block size sweep (ratio, two rounds)")
            keys = sorted({(r["direction"], r["page_bytes"]) for r in res["sweep"]})
            for direction, page in keys:
                cells = [
                    f"bt{r['block_threads']} {r['ratio']:.3f}"
                    for r in res["sweep"]
                    if (r["direction"], r["page_bytes"]) == (direction, page)
                ]
                print(f"  {direction} {page // KiB:>5} KiB: " + "  ".join(cells))
    print("\ntargets (largest batch of each page size)")
    for t in report["targets"]:
        mark = "ok  " if t["met"] else "MISS"
        print(
            f"  {mark} {t['backend']:<5} {t['path']:<7} {t['direction']} "
            f"{t['page_bytes'] // KiB:>5} KiB x{t['batch']:<6} ratio {t['ratio']:.3f} "
            f">= {t['target']:.2f}"
        )


def run(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark for the parsed ``args``; returns the report (not yet written)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    pm = get_plugin_manager()
    names = args.backend or device_backends(pm)
    if not names:
        names = ["numpy"]
        log("no GPU backend is available here: measuring numpy on the host")
    skipped = {}
    chosen = []
    for n in names:
        spec = pm.kernel_backend(n)
        ok, why = pm.availability_of(spec)
        if ok:
            chosen.append((n, spec))
        else:
            skipped[n] = why
            log(f"[{n}] skipped: {why}")
    report: dict[str, Any] = {
        "meta": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "platform": platform.platform(),
            "versions": _versions(),
        },
        "config": {
            "page_sizes": args.page_sizes,
            "batches": args.batches,
            "directions": args.directions,
            "pool_bytes": args.pool_bytes,
            "max_bytes": args.max_bytes,
            "reps": args.reps,
            "warmup": args.warmup,
            "seed": args.seed,
            "options": args.options,
            "quick": args.quick,
        },
        "skipped": skipped,
        "backends": [],
    }
    for n, spec in chosen:
        report["backends"].append(_bench_backend(n, spec, args, log))
    for res in report["backends"]:
        if res["info"].get("device"):
            report["meta"]["device"] = res["info"]["device"]
            break
    report["targets"] = [t for res in report["backends"] for t in _target_rows(res)]
    return report


#: What ``--quick`` changes (options given explicitly still apply).
QUICK = {"page_sizes": "4KiB,64KiB,1MiB", "batches": "1,256,4096", "reps": 3}


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check ``argv``; a bad value is a usage error (exit 2) naming the option,
    the value and the rule, before any work."""
    parser = _parser()
    args = parse_with_quick(parser, list(argv), QUICK)

    def counts(option: str, text: str, low: int = 1) -> list[int]:
        parse = int_at_least(low)
        try:
            return [parse(x) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument {option}: {exc} (a comma-separated list)")

    def size(option: str, text: str) -> int:
        try:
            value = parse_size(text, option)
        except ConfigError as exc:
            parser.error(f"argument {exc}")
        if value < 1:
            parser.error(f"argument {option}: {text!r}: must be a size >= 1 byte")
        return value

    args.page_sizes = [size("--page-sizes", x) for x in args.page_sizes.split(",") if x]
    args.batches = counts("--batches", args.batches)
    if not args.page_sizes or not args.batches:
        parser.error("--page-sizes and --batches need at least one value each")
    args.directions = [d for d in args.directions.split(",") if d]
    bad = [d for d in args.directions if d not in DIRECTIONS]
    if bad or not args.directions:
        parser.error(f"argument --directions: unknown direction(s) {bad}; known: "
                     f"{', '.join(DIRECTIONS)}")
    args.sweep_threads = counts("--sweep-threads", args.sweep_threads)
    try:
        args.options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        parser.error(f"argument --options: {args.options!r}: not JSON ({exc})")
    if not isinstance(args.options, dict):
        parser.error(f"argument --options: must be a JSON object, not {args.options!r}")
    args.pool_bytes = size("--pool", args.pool)
    args.max_bytes = min(size("--max-bytes", args.max_bytes), args.pool_bytes)
    if max(args.page_sizes) > args.max_bytes:
        parser.error(f"argument --page-sizes: {max(args.page_sizes)} bytes: larger than the "
                     f"largest copy ({args.max_bytes} bytes: --max-bytes, at most --pool)")
    png = Path(args.out).with_suffix(".png")
    if args.out.endswith(".json") and not args.no_plot and os.path.lexists(png):
        # Its plot goes beside it: refused now, not after the run (a folder --out skips
        # names whose .json or .png exists).
        raise ConfigError("--out", args.out, f"its plot {png} exists: a benchmark never "
                                             "overwrites a result; name a new file, or "
                                             "give --no-plot")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``kvcm bench kernels``: run, print a summary, write JSON and PNG.

    Returns:
        0, also when a target is missed (the report says which): a benchmark measures.
    """
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    device = report["meta"].get("device", "host").replace(" ", "-")
    json_path = result_path(args.out, f"kernels-{device}", args.tag, (".json", ".png"))
    write_new(json_path, json.dumps(report, indent=1, default=float))
    _print_summary(report)
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png = json_path.with_suffix(".png")
        if _plot(report, png):
            print(f"wrote {png}")
        else:
            print("matplotlib is not installed: no plot (pip install 'kvcm[plot]')")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
