"""``kvcm bench codecs``: the cold-page codecs, on a GPU, on the CPU and in the simulator.

1. **Device** (every available kernel backend with a device): the lossy page codecs
   ``fp8`` and ``int8`` (``int4`` reported too) encode and decode, device to device,
   ``--pages`` pages of ``--page-bytes`` KV-like bf16 values (4096 pages of 16 KiB), one
   call each: bytes read plus bytes written per second, beside the device copy bandwidth
   (read plus write of one plain copy of the same bytes) measured in the same run, each
   call's device time taken with the stream held while the call queues its work (host
   time left out, and reported beside; a slot table's transfer, where the call needs one,
   in). The target is 0.7 of the copy bandwidth for fp8 and int8. ``--kernels`` sweeps
   the page codecs' kernel variants (their ``kernel`` option); ``--slots`` adds calls on
   shuffled cold slots (a slot table per call) to the default consecutive ones. Each
   result also says
   whether the decoded values of a sample of pages stay within the codec's declared bound.
   Without a device backend the ``numpy`` backend runs a small version, marked as a host
   reference (not a device measurement).
2. **CPU**: the blob codecs named ``zstd`` and ``lz4`` (when installed; skipped with a line
   otherwise), page by page, on KV-like bf16 pages and on the fp8 cold pages of the same
   data: MB/s of encode and decode, and compression ratio.
3. **Simulate**: ``kvcm simulate`` on the configurations of ``--configs``
   (``benchmarks/codecs``): raw, fp8 and fp8+zstd cold levels with equal host and disk
   quotas, and raw and fp8 host levels alone (the host level the bottleneck): hit rate
   overall and per level, and bytes moved. fp8+zstd runs only where a ``zstd`` blob codec
   is installed.

The result goes to ``codecs-YYYYmmdd-HHMMSS.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvcm_core.backend import KernelBackend, PageRegion
from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    device_backends,
    parse_with_quick,
    result_header,
    timed_calls,
    write_result,
)
from kvcm_core.codec import BufferPlace, PageLayout
from kvcm_core.console import int_at_least
from kvcm_core.records import CodecKind
from kvcm_core.testing.values import from_bytes, to_bytes

__all__ = ["main"]

#: Page codecs measured on a device, and those held to the 0.7 target.
PAGE_CODECS = ("fp8", "int8", "int4")
TARGETED = ("fp8", "int8")
TARGET = 0.7
BLOB_CODECS = ("zstd", "lz4")
#: ``kvcm bench codecs`` simulations: label, configuration file, blob codec it needs.
SIMULATIONS = (
    ("raw", "simulate-raw.toml", None),
    ("fp8", "simulate-fp8.toml", None),
    ("fp8+zstd", "simulate-fp8-zstd.toml", "zstd"),
    ("raw host only", "simulate-raw-host.toml", None),
    ("fp8 host only", "simulate-fp8-host.toml", None),
)
_SAMPLE = 8  # pages whose decoded values are checked against the bound
_GROUP_BYTES = 256  # one group of 128 bf16 values

#: What ``--quick`` changes.
QUICK = {"pages": 256, "reps": 3, "cpu_pages": 256, "requests": 20}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcm bench codecs", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--pages", type=int_at_least(1), default=4096,
                        help="pages per device call")
    parser.add_argument("--page-bytes", type=int_at_least(_GROUP_BYTES), default=16384,
                        help=f"bytes of one GPU page (bf16 values, groups of 128: a multiple "
                             f"of {_GROUP_BYTES})")
    parser.add_argument("--reps", type=int_at_least(1), default=20,
                        help="timed calls per measurement")
    parser.add_argument("--cpu-pages", type=int_at_least(1), default=2048,
                        help="pages each blob codec encodes and decodes")
    parser.add_argument("--configs", default="benchmarks/codecs",
                        help="folder of the simulate configurations")
    parser.add_argument("--requests", type=int_at_least(1), default=300,
                        help="requests of each simulated workload")
    parser.add_argument("--skip", nargs="*", default=[], choices=["device", "cpu", "simulate"],
                        help="parts not to run")
    parser.add_argument("--kernels", default="",
                        help="comma-separated kernel variants of the page codecs to sweep "
                             "(their 'kernel' option, e.g. legacy,hw4; empty: the codecs' "
                             "default or $KVCM_QUANT_KERNEL)")
    parser.add_argument("--slots", default="consecutive",
                        choices=["consecutive", "shuffled", "both"],
                        help="device calls on consecutive slots (block i at page i), on "
                             "shuffled ones (a slot table each call), or both")
    add_output_options(parser, "256 pages a call, 3 repetitions, 256 CPU pages, 20 simulated "
                               "requests")
    return parser


# -- data ---------------------------------------------------------------------------------


def kv_pages(pages: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    """``uint8 [pages, page_bytes]``: bf16 values, normal with a few outlier channels
    (every 128 values hold 3 channels 20x larger), rounded to nearest even."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 1.0, (pages, page_bytes // 256, 128)).astype(np.float32)
    values[..., [7, 50, 99]] *= np.float32(20.0)
    return to_bytes(values.reshape(pages, -1), "bf16")


def _layout(page_bytes: int) -> PageLayout:
    return PageLayout((page_bytes,), (BufferPlace(0, "kv", 0, 0, page_bytes, "bf16", 128,
                                                  False),))


# -- device -------------------------------------------------------------------------------


#: Holds the stream while a call's work is queued, so that the host time of the call is
#: not in the device time; gives up after about 2**32 cycles (a call that waits on the
#: device then shows as slow rather than hanging).
_GATE = r"""
extern "C" __global__ void kvcm_bench_codecs_gate(unsigned long long flag) {
    const long long t0 = clock64();
    while (*(volatile int*)flag == 0 && clock64() - t0 < (1LL << 32)) { }
}
"""


class _Gate:
    """Device seconds of the work a call queues (``timed_calls`` without device clock)."""

    def __init__(self, backend: KernelBackend) -> None:
        self.backend = backend
        compile_source = getattr(backend, "compile", None)
        self.module = compile_source(_GATE) if (
            backend.capabilities.compiles_sources and compile_source is not None) else None
        self.flag = backend.alloc_host(64) if self.module is not None else None
        #: Host seconds of each call of the last :meth:`seconds` (queuing its work; empty
        #: without the gate).
        self.host: list[float] = []

    def seconds(self, call: Callable[[], Any], reps: int) -> list[float]:
        if self.module is None or self.flag is None:
            return timed_calls(self.backend, call, reps, 2)[0]
        for _ in range(2):
            call()  # warm-up: compiles, allocates staging
        self.backend.synchronize()
        flag = self.flag.host_view()[:4].view(np.int32)
        out = []
        self.host = []
        for _ in range(reps):
            flag[0] = 0
            self.module.launch("kvcm_bench_codecs_gate", (1, 1, 1), (1, 1, 1),
                               [np.uint64(self.flag.ptr)])
            start, end = self.backend.create_event(), self.backend.create_event()
            start.record()
            try:
                t0 = time.perf_counter()
                call()
                self.host.append(time.perf_counter() - t0)
                end.record()
            finally:
                flag[0] = 1
            end.synchronize()
            out.append(end.elapsed_ms(start) / 1e3)
        return out

    def close(self) -> None:
        if self.flag is not None:
            self.flag.free()


def _median_gbps(gate: _Gate, call: Callable[[], Any], nbytes: int, reps: int) -> float:
    return nbytes / statistics.median(gate.seconds(call, reps)) / 1e9


def _within_bound(backend: KernelBackend, src: Any, dst: Any, page_bytes: int,
                  pages: int, bound: float) -> bool:
    """Decoded sample pages within ``bound`` times their group's largest magnitude."""
    n = min(_SAMPLE, pages) * page_bytes
    x = from_bytes(backend.read(src, 0, n), "bf16").reshape(-1, 128)
    y = from_bytes(backend.read(dst, 0, n), "bf16").reshape(-1, 128)
    amax = np.abs(x).max(axis=1, keepdims=True)
    return bool(np.all(np.abs(x - y) <= bound * amax))


def _host_us(gate: _Gate) -> float | None:
    return statistics.median(gate.host) * 1e6 if gate.host else None


def _codec_rates(backend: KernelBackend, gate: _Gate, codec: Any, layout: PageLayout,
                 pool_in: list[PageRegion], pool_out: list[PageRegion], cold: PageRegion,
                 slots: np.ndarray, cold_slots: np.ndarray, moved: int,
                 reps: int) -> tuple[float, float, float | None, float | None]:
    """Encode and decode GB/s (device time), and the median host microseconds a call took
    to queue its work (None without the gate)."""
    enc = _median_gbps(gate, lambda: codec.encode(backend, layout, pool_in, slots, cold,
                                                  cold_slots), moved, reps)
    enc_host = _host_us(gate)
    dec = _median_gbps(gate, lambda: codec.decode(backend, layout, cold, cold_slots, pool_out,
                                                  slots), moved, reps)
    return enc, dec, enc_host, _host_us(gate)


def device_part(backend: KernelBackend, pm: Any, pages: int, page_bytes: int,
                reps: int, kernels: list[str] | None = None,
                slot_orders: tuple[str, ...] = ("consecutive",)) -> dict[str, Any]:
    """Copy bandwidth and each page codec's encode and decode on one backend; with
    ``kernels``, once per kernel variant (the codecs' ``kernel`` option), the copy measured
    again after each."""
    n = pages * page_bytes
    src, dst = backend.alloc_device(n), backend.alloc_device(n)
    buffers = [src, dst]
    gate = _Gate(backend)
    try:
        for lo in range(0, pages, 512):
            chunk = kv_pages(min(512, pages - lo), page_bytes, seed=lo)
            backend.write(src, lo * page_bytes, chunk.reshape(-1))
        copy = _median_gbps(gate, lambda: backend.copy_bytes(dst, 0, src, 0, n), 2 * n, reps)
        out: dict[str, Any] = {"copy_read_write_gbps": copy, "codecs": {}}
        layout = _layout(page_bytes)
        slots = np.arange(pages, dtype=np.int32)
        shuffled = np.random.default_rng(1).permutation(pages).astype(np.int32)
        pool_in, pool_out = [PageRegion(src, 0, page_bytes)], [PageRegion(dst, 0, page_bytes)]
        sweep: dict[str, Any] = {}
        variants: list[str | None] = list(kernels) if kernels else [None]
        for kernel in variants:
            options = {} if kernel is None else {"kernel": kernel}
            results: dict[str, Any] = {}
            if kernel is not None:
                print(f"  kernel {kernel}:")
            try:
                for name in PAGE_CODECS:
                    if name not in pm.codecs():
                        print(f"  {name}: not installed; skipped")
                        continue
                    codec = pm.codec(name).factory(options)
                    size = codec.cold_page_size(layout)
                    cold_buf = backend.alloc_device(pages * size)
                    buffers.append(cold_buf)
                    cold = PageRegion(cold_buf, 0, size)
                    moved = n + pages * size
                    target = TARGET if name in TARGETED else None
                    res: dict[str, Any] = {"cold_page_bytes": size, "bytes_per_call": moved,
                                           "target_vs_copy": target}
                    for order in slot_orders:
                        cold_slots = slots if order == "consecutive" else shuffled
                        enc, dec, enc_us, dec_us = _codec_rates(
                            backend, gate, codec, layout, pool_in, pool_out, cold, slots,
                            cold_slots, moved, reps)
                        rates = {"encode_gbps": enc, "decode_gbps": dec,
                                 "encode_host_us": enc_us, "decode_host_us": dec_us,
                                 "encode_vs_copy": enc / copy, "decode_vs_copy": dec / copy,
                                 "meets_target": None if target is None
                                 else min(enc, dec) / copy >= target}
                        if order == slot_orders[0]:
                            res.update(rates, slot_order=order)
                        else:
                            res[order] = rates
                        print(f"  {name:5} cold page {size} B, {order} slots: encode {enc:8.1f} "
                              f"GB/s ({enc / copy:.2f} x copy), decode {dec:8.1f} GB/s "
                              f"({dec / copy:.2f} x copy)"
                              f"{'' if target is None else f', target {target} x copy'}"
                              f"{'' if enc_us is None else f'; host {enc_us:.0f}/{dec_us:.0f} us'}")
                    backend.synchronize()
                    res["within_bound"] = _within_bound(backend, src, dst, page_bytes, pages,
                                                        codec.error_bound)
                    print(f"  {name:5} within bound: {res['within_bound']}")
                    results[name] = res
                    cold_buf.free()
                    buffers.remove(cold_buf)
            except Exception as exc:  # a swept variant that fails: reported, the rest run
                if kernel is None:
                    raise
                print(f"  kernel {kernel}: failed: {exc!r}")
                sweep[kernel] = {"error": repr(exc)}
                continue
            if kernel is None:
                out["codecs"] = results
                continue
            after = _median_gbps(gate, lambda: backend.copy_bytes(dst, 0, src, 0, n), 2 * n,
                                 reps)
            sweep[kernel] = {"codecs": results, "copy_after_gbps": after}
            if not out["codecs"]:
                out["codecs"] = results
        if kernels:
            out["kernels"] = sweep
        return out
    finally:
        backend.synchronize()
        gate.close()
        for buf in buffers:
            buf.free()


def run_device(pm: Any, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    names = device_backends(pm)
    pages = args.pages
    if not names:
        pages = min(args.pages, 64)
        print(f"device: no kernel backend with a device here; the numpy backend runs {pages} "
              "pages as a host reference (not a device measurement)")
        names = ["numpy"]
    for name in names:
        backend = pm.kernel_backend(name).factory({})
        try:
            copy_note = "" if backend.capabilities.has_device else " (host reference)"
            print(f"device {name}{copy_note}: {pages} pages of {args.page_bytes} B")
            kernels = [k for k in args.kernels.split(",") if k] or None
            orders = ("consecutive", "shuffled") if args.slots == "both" else (args.slots,)
            res = device_part(backend, pm, pages, args.page_bytes, args.reps, kernels, orders)
            res["host_reference"] = not backend.capabilities.has_device
            res["pages"] = pages
            print(f"  copy: {res['copy_read_write_gbps']:.1f} GB/s read + write")
            results[name] = res
        finally:
            backend.close()
    return results


# -- CPU ----------------------------------------------------------------------------------


def _blob_rate(codec: Any, pages: np.ndarray) -> dict[str, float]:
    t0 = time.perf_counter()
    blobs = [codec.encode(memoryview(p)) for p in pages]
    t1 = time.perf_counter()
    for blob, p in zip(blobs, pages, strict=True):
        if codec.decode(blob, expected_size=len(p)) != p.tobytes():
            raise AssertionError("blob codec did not give back the page")
    t2 = time.perf_counter()
    nbytes = pages.nbytes
    return {"encode_mbps": nbytes / (t1 - t0) / 1e6, "decode_mbps": nbytes / (t2 - t1) / 1e6,
            "ratio": nbytes / sum(len(b) for b in blobs)}


def _fp8_pages(pm: Any, pages: np.ndarray) -> np.ndarray | None:
    """The fp8 cold pages of ``pages`` (through the fp8 codec on the numpy backend)."""
    if "fp8" not in pm.codecs():
        return None
    codec = pm.codec("fp8").factory({})
    layout = _layout(pages.shape[1])
    size = codec.cold_page_size(layout)
    backend = pm.kernel_backend("numpy").factory({})
    try:
        src, cold = backend.alloc_device(pages.nbytes), backend.alloc_device(len(pages) * size)
        backend.write(src, 0, pages.reshape(-1))
        slots = np.arange(len(pages), dtype=np.int32)
        codec.encode(backend, layout, [PageRegion(src, 0, pages.shape[1])], slots,
                     PageRegion(cold, 0, size), slots)
        return backend.read(cold, 0, len(pages) * size).reshape(len(pages), size)
    finally:
        backend.close()


def run_cpu(pm: Any, args: argparse.Namespace) -> dict[str, Any]:
    pages = kv_pages(args.cpu_pages, args.page_bytes)
    inputs = {"bf16": pages}
    fp8 = _fp8_pages(pm, pages)
    if fp8 is not None:
        inputs["fp8 cold pages"] = fp8
    results: dict[str, Any] = {}
    codecs = pm.codecs()
    for name in BLOB_CODECS:
        spec = codecs.get(name)
        if spec is None or spec.capabilities.kind is not CodecKind.BLOB:
            print(f"cpu {name}: no blob codec plugin named {name!r} is installed; skipped")
            results[name] = {"skipped": "not installed"}
            continue
        codec = spec.factory({})
        results[name] = {}
        for label, data in inputs.items():
            res = _blob_rate(codec, data)
            results[name][label] = res
            print(f"cpu {name} on {label} pages of {data.shape[1]} B: encode "
                  f"{res['encode_mbps']:.0f} MB/s, decode {res['decode_mbps']:.0f} MB/s, "
                  f"ratio {res['ratio']:.3f}")
    return results


# -- simulate -----------------------------------------------------------------------------


def _simulate(path: Path, requests: int) -> dict[str, Any]:
    from kvcm_core.simulate import main as simulate

    with tempfile.TemporaryDirectory() as out:
        code = simulate(["--config", str(path), "--quiet", "--no-compare", "--requests",
                         str(requests), "--out", out])
        report = Path(out) / "report.json"
        doc = json.loads(report.read_text()) if report.exists() else {}
    run = doc.get("run") or {}
    return {"exit_status": code, "verified": (doc.get("verification") or {}).get("ok"),
            "hit_rate": (run.get("hit_rate") or {}).get("overall"),
            "hit_rate_by_level": (run.get("hit_rate") or {}).get("by_level"),
            "bytes_moved": run.get("bytes_moved")}


def run_simulate(pm: Any, args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.configs)
    results: dict[str, Any] = {}
    for label, file, needs in SIMULATIONS:
        path = folder / file
        if not path.exists():
            print(f"simulate {label}: {path} not found; skipped")
            continue
        if needs is not None and needs not in pm.codecs():
            print(f"simulate {label}: needs the {needs!r} blob codec plugin; skipped")
            results[label] = {"skipped": f"{needs} not installed"}
            continue
        res = _simulate(path, args.requests)
        results[label] = res
        moved = res["bytes_moved"] or {}
        print(f"simulate {label}: exit {res['exit_status']}, hit rate {res['hit_rate']}, "
              f"by level {res['hit_rate_by_level']}, offload {moved.get('offload_bytes')} B, "
              f"onboard {moved.get('onboard_bytes')} B")
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the parts not skipped, print a line per result and write the JSON."""
    parser = _parser()
    args = parse_with_quick(parser, argv, QUICK)
    if args.page_bytes % _GROUP_BYTES:
        parser.error(f"argument --page-bytes: {args.page_bytes}: must be a multiple of "
                     f"{_GROUP_BYTES} (groups of 128 bf16 values)")
    if "simulate" not in args.skip and not Path(args.configs).is_dir():
        parser.error(f"argument --configs: {args.configs!r}: not a folder (the simulate "
                     f"configurations; --skip simulate runs without them)")

    from kvcm_core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    doc: dict[str, Any] = {
        **result_header("cold-page codecs: device encode/decode against the copy bandwidth, "
                        "blob codecs on the CPU, simulated hit rates per cold codec"),
        "config": vars(args),
    }
    if "device" not in args.skip:
        doc["device"] = run_device(pm, args)
    if "cpu" not in args.skip:
        doc["cpu"] = run_cpu(pm, args)
    if "simulate" not in args.skip:
        doc["simulate"] = run_simulate(pm, args)
    write_result(doc, args.out, "codecs", args.tag)
    return 0
