"""The redis tier's throughput beside ``redis-benchmark`` (``kvcm bench redis``).

For each value size (``--sizes``, default 16 KiB and 64 KiB), in one run against one server:

- ``redis-benchmark -c 1 -P PIPELINE -d SIZE -t set -n N -r N``, then, on a server holding
  every one of its N keys (``key:000000000000`` ...: written first by pipelined SETs),
  ``-t get`` with the same options: one client, PIPELINE commands in flight, the server's
  own C client, every GET a hit like the tier's (with ``-r N`` alone about a third of its
  GETs would find nothing and cost far less): the store's limit on this machine;
- the ``redis`` tier: ``put_many`` then ``get_many`` of N distinct keys in batches of
  PIPELINE values (one pipeline each, exactly what the core sends per migration batch),
  every value read back checked.

Each pair runs ``--reps`` times, alternating, on an emptied server. The ratio tier /
redis-benchmark (requests per second) is taken within each pair, run next to each other,
and its median reported (a machine whose load drifts moves both sides of a pair alike);
the medians of each side are reported too. The server is one
started on a free loopback port for the run (``redis-server`` must be installed) unless
``--url`` names one, which is then flushed (``FLUSHDB``) between runs: never point it at a
server holding data you want.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import shutil
import statistics
import subprocess
import time
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    parse_with_quick,
    result_header,
    write_result,
)
from kvcm_core.console import int_at_least
from kvcm_core.errors import ConfigError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcm bench redis", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--url", default="", help="a server to use (flushed!); default: start one")
    p.add_argument("--sizes", default="16384,65536", help="value sizes in bytes, comma-separated")
    p.add_argument("--total-mib", type=int_at_least(1), default=256,
                   help="MiB of values per size and run (N = total / size)")
    p.add_argument("--pipeline", type=int_at_least(1), default=64,
                   help="values per batch / pipeline")
    p.add_argument("--reps", type=int_at_least(1), default=5, help="alternating runs per size")
    add_output_options(p, "32 MiB per size, 1 rep")
    return p


def _redis_benchmark(host: str, port: int, size: int, n: int, pipeline: int,
                     admin: Any) -> dict[str, float]:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise ConfigError("redis-benchmark", None, "not found on PATH (Debian: apt-get "
                                                   "install redis-tools)")

    def run(test: str) -> float:
        out = subprocess.run([exe, "-h", host, "-p", str(port), "-c", "1", "-P",
                              str(pipeline), "-d", str(size), "-t", test, "-n", str(n), "-r",
                              str(n), "--csv"],
                             capture_output=True, text=True, timeout=600, check=True).stdout
        rows = {r[0]: float(r[1]) for r in csv.reader(io.StringIO(out)) if len(r) > 1
                and r[0] == test.upper()}
        return rows[test.upper()]

    set_rps = run("set")
    admin.flushdb()
    value = b"x" * size
    for lo in range(0, n, pipeline):  # every key redis-benchmark's GETs will draw
        pipe = admin.pipeline(transaction=False)
        for i in range(lo, min(n, lo + pipeline)):
            pipe.set(b"key:%012d" % i, value)
        pipe.execute()
    before = admin.info("stats")
    get_rps = run("get")
    after = admin.info("stats")
    hits = after["keyspace_hits"] - before["keyspace_hits"]
    misses = after["keyspace_misses"] - before["keyspace_misses"]
    return {"set_rps": set_rps, "get_rps": get_rps,
            "get_hit_fraction": hits / max(1, hits + misses)}


def _tier_run(tier: Any, size: int, n: int, pipeline: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, size * 8, dtype=np.uint8).tobytes()
    # Distinct values without generating N of them: windows of one random pool.
    values = [pool[(i % 7) * size // 8:(i % 7) * size // 8 + size] for i in range(pipeline)]
    keys = [b"bench:%d" % i for i in range(n)]
    far = time.monotonic() + 600
    t0 = time.perf_counter()
    for lo in range(0, n, pipeline):
        batch = keys[lo:lo + pipeline]
        if not tier.put_many(batch, values[:len(batch)], deadline=far).all():
            raise RuntimeError("the server refused values (maxmemory?)")
    t1 = time.perf_counter()
    for lo in range(0, n, pipeline):
        batch = keys[lo:lo + pipeline]
        got = tier.get_many(batch, deadline=far)
        for v, w in zip(got, values, strict=False):
            if v != w:
                raise RuntimeError("a value read back differs from the one written")
    t2 = time.perf_counter()
    return {"set_rps": n / (t1 - t0), "get_rps": n / (t2 - t1)}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parse_with_quick(parser, argv, {"total_mib": 32, "reps": 1})
    size = int_at_least(1)
    try:
        sizes = [size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --sizes: {exc} (a comma-separated list)")
    if not sizes:
        parser.error(f"argument --sizes: {args.sizes!r}: needs at least one size")
    import redis

    from kvcm_core.plugins import get_plugin_manager
    from kvcm_core.testing.redis_server import RedisServer

    if args.url:  # a server that does not answer: one line naming --url, before any work
        try:
            with redis.Redis.from_url(args.url) as probe:
                probe.ping()
        except (redis.RedisError, ValueError) as exc:
            raise ConfigError("--url", args.url, f"no Redis server answers there "
                                                 f"({type(exc).__name__}: {exc})") from None
    server = None if args.url else RedisServer()
    url = args.url or server.url  # type: ignore[union-attr]
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    tier = get_plugin_manager().tier("redis").factory(None, {"url": url})
    results = []
    try:
        admin = redis.Redis.from_url(url)
        for size in sizes:
            n = max(args.pipeline, (args.total_mib << 20) // size)
            runs: dict[str, list[float]] = {}
            for rep in range(args.reps):
                for who, run in (
                        ("redis-benchmark", functools.partial(
                            _redis_benchmark, host, port, size, n, args.pipeline, admin)),
                        ("tier", functools.partial(_tier_run, tier, size, n, args.pipeline,
                                                   rep))):
                    admin.flushdb()
                    for k, v in run().items():
                        runs.setdefault(f"{who} {k}", []).append(v)
            med = {k: statistics.median(v) for k, v in runs.items()}
            row = {"value_bytes": size, "values": n, "pipeline": args.pipeline,
                   "runs": runs, "median": med,
                   "set_ratio": statistics.median(
                       t / r for t, r in zip(runs["tier set_rps"],
                                             runs["redis-benchmark set_rps"], strict=True)),
                   "get_ratio": statistics.median(
                       t / r for t, r in zip(runs["tier get_rps"],
                                             runs["redis-benchmark get_rps"], strict=True))}
            results.append(row)
            print(f"{size:>7} B x {n}: SET tier {med['tier set_rps']:9.0f}/s "
                  f"redis-benchmark {med['redis-benchmark set_rps']:9.0f}/s "
                  f"ratio {row['set_ratio']:.2f} | GET tier {med['tier get_rps']:9.0f}/s "
                  f"redis-benchmark {med['redis-benchmark get_rps']:9.0f}/s "
                  f"ratio {row['get_ratio']:.2f}")
        admin.flushdb()
        admin.close()
        version = subprocess.run(["redis-server", "--version"], capture_output=True,
                                 text=True, check=False).stdout.strip()
    finally:
        tier.close()
        if server is not None:
            server.stop()
    doc = result_header("redis tier put_many/get_many beside redis-benchmark -c 1 -P N")
    doc.update({"redis_server": version, "redis_py": redis.__version__,
                "options": vars(args), "results": results})
    write_result(doc, args.out, "redis", args.tag)
    return 0
