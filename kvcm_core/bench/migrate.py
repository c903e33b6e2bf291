"""``kvcm bench migrate``: page migrations through the public API against the link's limits
measured in the same process, on every available kernel backend with a device
(``--backends`` to choose; ``numpy`` runs tiny shapes and reports host times only).

The layout is Llama-3-8B-like by default: ``--layers`` (32) attention layers, K and V of
``--kv-kib`` (32 KiB) per 16-token block each, so one block is 2 MiB on the GPU and on the
host level. Phases, each at several request sizes (``--blocks``), after ``--warmup``
untimed repetitions:

- **limits**: plain copies of ``--limit-mib`` between pinned host memory and device
  memory: device to host alone, host to device alone, and both at once on two streams
  (the duplex limit), each the median of ``--reps``.
- **offload**: a request grows (``resize``) into a GPU level full of a suspended request's
  pages, which are pushed to the host level (device to host), against the one-way limit.
- **swap**: a suspended request on the host level is resumed (``resume(stream)``) while
  the request that fills the GPU is pushed out (host to device plus device to host),
  against the duplex limit; the bytes are both directions together.
- **cascade**: the offload with a full host level above a disk level: the host's pages go
  to disk while the GPU's go to the host.

For each call: the device time from an event recorded on the engine's stream before the
call to one recorded on it after the call (the stream waits for the pages to be in
place), and the host time of the call (what the scheduler waits). The result goes to
``migrate-YYYYmmdd-HHMMSS.json`` in ``--out``.

Targets on an H200 (issue 16): swap at 0.8x of the duplex limit or better, offload at 0.9x
of the one-way limit or better, host time of ``resume`` for a 2 GiB swap under 1 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    device_backends,
    parse_with_quick,
    result_header,
    write_result,
)
from kvcm_core.plugins import get_plugin_manager

__all__ = ["main"]

_KIB = 1024
_MIB = 1 << 20

#: What ``--quick`` changes: a run of seconds.
QUICK = {"blocks": [16], "cascade_blocks": [16], "reps": 2, "warmup": 1, "limit_mib": 64}
#: The numpy backend's shapes (tiny: it copies on the CPU).
NUMPY = {"layers": 2, "kv_kib": 1, "blocks": [8], "cascade_blocks": [8], "limit_mib": 4}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcm bench migrate", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--backends", default="auto",
                        help="comma-separated kernel backends ('auto': every available one "
                             "with a device)")
    parser.add_argument("--layers", type=int, default=32, help="attention layers")
    parser.add_argument("--kv-kib", type=int, default=32,
                        help="KiB of K (and of V) per layer and 16-token block")
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512],
                        help="blocks per request (each phase runs at every size)")
    parser.add_argument("--cascade-blocks", type=int, nargs="+", default=[128],
                        help="blocks per request of the cascade (its disk writes are slow)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    parser.add_argument("--limit-mib", type=int, default=1024,
                        help="MiB of each plain copy that measures the limits")
    parser.add_argument("--copy-path", default="", choices=["", "auto", "sm", "ce"],
                        help="the GPU backends' copy path for this run (sets KVCM_COPY_PATH; "
                             "empty: each backend's default)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the host time of one swap resume of the largest size "
                             "(the functions that took most, in the result)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["offload", "swap", "cascade"], help="phases not to run")
    add_output_options(parser, "16 blocks a request, 2 repetitions, 64 MiB limit copies")
    return parser


def _check(args: argparse.Namespace) -> None:
    from kvcm_core.errors import ConfigError

    for name in ("layers", "kv_kib", "reps", "limit_mib"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "must be >= 1")
    if args.warmup < 0:
        raise ConfigError("--warmup", args.warmup, "must be >= 0")
    for name in ("blocks", "cascade_blocks"):
        for n in getattr(args, name):
            if n < 1:
                raise ConfigError(f"--{name.replace('_', '-')}", n, "every size must be >= 1")


# -- timing ---------------------------------------------------------------------------


def _device_seconds(be: Any, stream: Any, call: Callable[[], Any]) -> tuple[float, float]:
    """``(device seconds, host seconds)`` of one call: events on ``stream`` before and
    after it (the stream waits for what the call issued); host seconds where the backend
    has no device clock."""
    be.synchronize()
    start, end = be.create_event(), be.create_event()
    start.record(stream)
    t0 = time.perf_counter()
    out = call()
    host = time.perf_counter() - t0
    end.record(stream)
    end.synchronize()
    if out is False:
        raise RuntimeError("the call was refused: the benchmark's quotas are wrong")
    try:
        return end.elapsed_ms(start) / 1e3, host
    except NotImplementedError:
        return host, host


def limits(be: Any, nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of plain pinned<->device copies of ``nbytes``: each direction alone, and both at
    once on two streams (bytes of both directions over the time of the pair)."""
    host = [be.alloc_host(nbytes) for _ in range(2)]
    dev = [be.alloc_device(nbytes) for _ in range(2)]
    s1, s2 = be.create_stream(), be.create_stream()
    try:
        def one(dst: Any, src: Any) -> float:
            return _device_seconds(be, s1, lambda: be.copy_bytes(dst, 0, src, 0, nbytes, s1))[0]

        def both() -> None:
            mark = be.create_event()
            mark.record(s1)
            s2.wait_event(mark)
            be.copy_bytes(host[0], 0, dev[0], 0, nbytes, s1)
            be.copy_bytes(dev[1], 0, host[1], 0, nbytes, s2)
            done = be.create_event()
            done.record(s2)
            s1.wait_event(done)

        for _ in range(2):  # warm-up
            one(host[0], dev[0])
            one(dev[1], host[1])
            _device_seconds(be, s1, both)
        d2h = statistics.median(one(host[0], dev[0]) for _ in range(reps))
        h2d = statistics.median(one(dev[1], host[1]) for _ in range(reps))
        duplex = statistics.median(_device_seconds(be, s1, both)[0] for _ in range(reps))
        return {"d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9,
                "one_way_gbps": nbytes / max(d2h, h2d) / 1e9,
                "duplex_gbps": 2 * nbytes / duplex / 1e9, "bytes": nbytes}
    finally:
        be.synchronize()
        for buf in (*host, *dev):
            buf.free()


# -- the manager ----------------------------------------------------------------------


def _config(backend: str, layers: int, kv: int, gpu_blocks: int, host_blocks: int,
            disk: str | None, disk_blocks: int) -> Any:
    from kvcm_core import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig

    block = 2 * layers * kv
    levels = [LevelConfig(tier="gpu", quota=gpu_blocks * block),
              LevelConfig(tier="host", quota=host_blocks * block)]
    if disk is not None:
        levels.append(LevelConfig(tier="disk", quota=disk_blocks * block,
                                  options={"path": disk}))
    return KVCacheManagerConfig(
        tokens_per_block=16,
        layers=[AttentionLayerConfig(layer_id=i, buffers=[BufferConfig(role="k", size=kv),
                                                          BufferConfig(role="v", size=kv)])
                for i in range(layers)],
        levels=levels, kernel_backend=backend, max_util_for_resume=1.0)


class _Rig:
    """One manager whose GPU level holds exactly one request of ``n`` blocks."""

    def __init__(self, backend: str, layers: int, kv: int, n: int, host_blocks: int,
                 disk: str | None = None, disk_blocks: int = 0) -> None:
        from kvcm_core import KVCacheManager

        self.n = n
        self.block_bytes = 2 * layers * kv
        self.m = KVCacheManager(_config(backend, layers, kv, n, host_blocks, disk,
                                        disk_blocks))
        self.be = self.m.backend
        self.stream = self.be.create_stream()
        self.live: list[Any] = []

    def new(self) -> Any:
        cache = self.m.create_kv_cache()
        if not cache.resume(self.stream):
            raise RuntimeError("resume of an empty request refused")
        self.live.append(cache)
        return cache

    def grow(self, cache: Any) -> bool:
        return bool(cache.resize(self.n * 16, stream=self.stream))

    def close(self) -> None:
        for cache in self.live:
            cache.close()
        self.be.synchronize()
        self.m.shutdown()


def _summary(times: list[tuple[float, float]], nbytes: int, limit: float) -> dict[str, Any]:
    dev = statistics.median(t for t, _ in times)
    host = [h for _, h in times]
    gbps = nbytes / dev / 1e9
    return {"bytes": nbytes, "device_ms": dev * 1e3, "gbps": gbps, "limit_gbps": limit,
            "ratio": gbps / limit, "host_ms_median": statistics.median(host) * 1e3,
            "host_ms_max": max(host) * 1e3, "reps": len(times)}


def offload(backend: str, args: argparse.Namespace, n: int, lim: dict[str, float],
            disk: str | None = None) -> dict[str, Any]:
    """A request grows into a GPU full of a suspended request's pages (pushed down)."""
    host_blocks = n if disk is not None else 2 * n
    rig = _Rig(backend, args.layers, args.kv_kib * _KIB, n, host_blocks, disk, 4 * n)
    try:
        prev = rig.new()
        rig.grow(prev)
        prev.suspend()
        older: list[Any] = []
        times = []
        for rep in range(args.warmup + args.reps):
            cache = rig.new()
            t = _device_seconds(rig.be, rig.stream, lambda c=cache: rig.grow(c))
            cache.suspend()
            older.append(prev)
            prev = cache
            # The disk holds 4 requests, the host 1 or 2: close what would overflow.
            while len(older) > (3 if disk is not None else 1):
                older.pop(0).close()
            if rep >= args.warmup:
                times.append(t)
        return _summary(times, n * rig.block_bytes, lim["d2h_gbps"])
    finally:
        rig.close()


def swap(backend: str, args: argparse.Namespace, n: int, lim: dict[str, float]
         ) -> dict[str, Any]:
    """Two requests take turns on a GPU that holds one: each resume pushes the other out."""
    rig = _Rig(backend, args.layers, args.kv_kib * _KIB, n, 2 * n)
    try:
        a, b = rig.new(), rig.new()
        rig.grow(a)
        a.suspend()
        rig.grow(b)  # pushes a to the host level
        b.suspend()
        times = []
        turn = [a, b]
        for rep in range(args.warmup + args.reps):
            cache = turn[rep % 2]
            t = _device_seconds(rig.be, rig.stream, lambda c=cache: c.resume(rig.stream))
            cache.suspend()
            if rep >= args.warmup:
                times.append(t)
        out = _summary(times, 2 * n * rig.block_bytes, lim["duplex_gbps"])
        if args.profile and n == max(args.blocks):
            out["profile"] = _profile(rig, turn[(args.warmup + args.reps) % 2])
        return out
    finally:
        rig.close()


def _profile(rig: _Rig, cache: Any, top: int = 30) -> list[str]:
    """The functions that took most host time in one ``resume`` (own time, then with
    what they call)."""
    import cProfile
    import io
    import pstats

    rig.be.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    cache.resume(rig.stream)
    prof.disable()
    rig.be.synchronize()
    cache.suspend()
    lines = []
    f8 = pstats.f8  # the columns in microseconds (pstats prints whole milliseconds)
    pstats.f8 = lambda x: f"{x * 1e6:8.1f}"  # type: ignore[attr-defined]
    try:
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
            part = [ln for ln in text.getvalue().splitlines() if ln.strip()]
            print(f"-- by {order} (us)\n" + "\n".join(part[-top - 2:]))
            lines += part
    finally:
        pstats.f8 = f8  # type: ignore[attr-defined]
    return lines


def run_backend(args: argparse.Namespace, name: str) -> dict[str, Any]:
    pm = get_plugin_manager()
    be = pm.select_kernel_backend(name).factory({})
    if not be.capabilities.has_device:
        for key, value in NUMPY.items():  # tiny shapes: the CPU copies
            setattr(args, key, value)
    out: dict[str, Any] = {"layers": args.layers, "kv_kib": args.kv_kib,
                           "block_bytes": 2 * args.layers * args.kv_kib * _KIB,
                           "has_device": be.capabilities.has_device}
    lim = limits(be, args.limit_mib * _MIB, args.reps)
    be.close()
    out["limits"] = lim
    print(f"[{name}] limits: d2h {lim['d2h_gbps']:.1f} GB/s, h2d {lim['h2d_gbps']:.1f} GB/s,"
          f" duplex {lim['duplex_gbps']:.1f} GB/s")
    for phase in ("offload", "swap", "cascade"):
        if phase in args.skip:
            continue
        rows = []
        for n in args.cascade_blocks if phase == "cascade" else args.blocks:
            if phase == "offload":
                r = offload(name, args, n, lim)
            elif phase == "swap":
                r = swap(name, args, n, lim)
            else:
                with tempfile.TemporaryDirectory(prefix="kvcm-bench-migrate-") as disk:
                    r = offload(name, args, n, lim, disk)
            r["blocks"] = n
            rows.append(r)
            print(f"[{name}] {phase:8s} {n:5d} blocks {r['bytes'] / 2**30:6.3f} GiB: "
                  f"{r['gbps']:6.1f} GB/s = {r['ratio']:.2f}x of {r['limit_gbps']:.1f}; "
                  f"host {r['host_ms_median']:.3f} ms (max {r['host_ms_max']:.3f})")
        out[phase] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_with_quick(_parser(), argv, QUICK)
    _check(args)
    if args.copy_path:
        os.environ["KVCM_COPY_PATH"] = args.copy_path
    pm = get_plugin_manager()
    names = device_backends(pm, args.backends)
    if not names:
        print("kvcm bench migrate: no kernel backend with a device is available (try "
              "--backends numpy for a tiny host run)", file=sys.stderr)
        return 2
    base = dict(vars(args))
    results = {}
    for name in names:
        run_args = argparse.Namespace(**base)
        results[name] = run_backend(run_args, name)
    doc = {**result_header("kvcm migrations (offload, swap, cascade) through the public "
                           "API against pinned<->device copy limits measured in the same "
                           "process; device and host time of each call"),
           "config": base, "backends": results}
    write_result(doc, args.out, "migrate", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
