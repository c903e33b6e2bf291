"""The quantizing page codecs ``fp8``, ``int8`` and ``int4``: the NumPy reference's rules
(scale, rounding, saturation, cold layout), the codec on the numpy backend, and (``gpu``)
the CUDA kernel on both GPU backends bit for bit equal to the reference."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcm_codec_quant import QuantCodec, kernel_variant
from kvcm_codec_quant.reference import (
    BOUNDS,
    MODES,
    decode_groups,
    decode_pages,
    encode_groups,
    encode_pages,
    from_f32,
    make_plan,
    to_f32,
)
from kvcm_codec_quant.source import (
    DEFAULT_VARIANT,
    KERNEL_ENV,
    PARAM_WORDS,
    VARIANTS,
    Variant,
    source_for,
)

from kvcm_core.backend import KernelBackend, MemoryKind, PageRegion
from kvcm_core.codec import BufferPlace, PageLayout
from kvcm_core.errors import ConfigError
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.testing.conformance.codec import extreme_case

GPU_BACKENDS = ("cupy", "cuda")
_ITEM = {"bf16": 2, "fp16": 2, "fp32": 4}


def kv_like(rng: np.random.Generator, shape: tuple[int, ...], outliers: int = 3) -> np.ndarray:
    """Normal values with a few outlier channels (KV-like), as fp32."""
    x = rng.normal(0.0, 1.0, shape).astype(np.float32)
    cols = rng.choice(shape[-1], size=min(outliers, shape[-1]), replace=False)
    x[..., cols] *= np.float32(40.0)
    return x


def typed_layout(rng: np.random.Generator, dtypes: list[str], exact_every: int = 3,
                 group_size: int = 128) -> PageLayout:
    """One pool per buffer, some exact, with a gap of raw bytes after odd pools."""
    places, sizes = [], []
    for p, dtype in enumerate(dtypes):
        n = int(rng.integers(1, 700))
        size = n * _ITEM[dtype]
        gap = _ITEM[dtype] * int(rng.integers(0, 5)) if p % 2 else 0  # slots stay aligned
        places.append(BufferPlace(p, "kv", p, 0, size, dtype, group_size,
                                  exact=(p % exact_every == exact_every - 1)))
        sizes.append(size + gap)
    return PageLayout(tuple(sizes), tuple(places))


def fill_pool(rng: np.random.Generator, layout: PageLayout, pool: int, blocks: int) -> np.ndarray:
    """``[blocks, slot]`` bytes: KV-like values for typed buffers, random bytes elsewhere."""
    out = rng.integers(0, 256, (blocks, layout.slot_sizes[pool]), dtype=np.uint8)
    for b in layout.buffers:
        if b.pool == pool and b.dtype in _ITEM:
            vals = kv_like(rng, (blocks, b.size // _ITEM[b.dtype]))
            out[:, b.offset : b.offset + b.size] = from_f32(vals, b.dtype).reshape(blocks, -1)
    return out


# -- the reference's rules ---------------------------------------------------------------------


def test_fp8_codes_round_trip_every_e4m3_value_and_saturate_at_448() -> None:
    codes = np.arange(0, 0x7F, dtype=np.uint8)  # every non-negative finite e4m3 code
    values = decode_groups(np.float32(1.0).reshape(1), codes.reshape(1, -1), "fp8", len(codes))
    assert values[0, -1] == 448.0 and values[0, 1] == 2.0**-9
    # Encoding with scale 1 (amax 448): each exact value comes back as its own code.
    x = np.concatenate([values[0], [448.0]]).astype(np.float32).reshape(1, -1)
    scale, got = encode_groups(x, "fp8")
    assert scale[0] == 1.0
    assert np.array_equal(got[0, :-1], codes)


def test_fp8_rounds_halfway_values_to_the_even_code() -> None:
    # Between 1.0 (code 0x38, even) and 1.125 (0x39): the midpoint goes to 0x38; between
    # 1.125 and 1.25 (0x3a, even) the midpoint goes to 0x3a. amax 448 keeps scale 1.
    x = np.array([[448.0, 1.0625, 1.1875, -1.0625]], dtype=np.float32)
    _, got = encode_groups(x, "fp8")
    assert got[0, 1:].tolist() == [0x38, 0x3A, 0xB8]


def test_int_codes_round_half_to_even_and_saturate() -> None:
    x = np.array([[127.0, 0.5, 1.5, 2.5, -2.5, -127.0]], dtype=np.float32)
    _, got = encode_groups(x, "int8")
    assert got.view(np.int8)[0].tolist() == [127, 0, 2, 2, -2, -127]
    x4 = np.array([[7.0, 0.5, 1.5, -7.0]], dtype=np.float32)
    _, packed = encode_groups(x4, "int4")
    assert packed[0].tolist() == [0x07, 0x92]  # (7, 0) and (2, -7) two per byte


@pytest.mark.parametrize("mode", list(MODES))
def test_an_all_zero_group_has_scale_zero_and_decodes_to_zeros(mode: str) -> None:
    x = np.zeros((2, 3, 64), dtype=np.float32)
    scale, codes = encode_groups(x, mode)
    assert not scale.any() and not codes.any()
    assert not decode_groups(scale, codes, mode, 64).any()


@pytest.mark.parametrize("mode", list(MODES))
def test_scale_is_amax_over_qmax_in_fp32(mode: str) -> None:
    rng = np.random.default_rng(1)
    x = kv_like(rng, (5, 128))
    scale, _ = encode_groups(x.reshape(5, 1, 128), mode)
    q = {"fp8": 448, "int8": 127, "int4": 7}[mode]
    want = np.abs(x).max(axis=1).astype(np.float32) / np.float32(q)
    assert np.array_equal(scale[:, 0], want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(list(MODES)),
       dtype=st.sampled_from(["bf16", "fp16", "fp32"]), group=st.sampled_from([1, 7, 32, 128]))
def test_round_trip_error_stays_within_the_declared_bound_relative_to_group_amax(
        seed: int, mode: str, dtype: str, group: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    layout = PageLayout((n * _ITEM[dtype],),
                        (BufferPlace(0, "k", 0, 0, n * _ITEM[dtype], dtype, group, False),))
    plan = make_plan(layout, mode)
    raw = fill_pool(rng, layout, 0, 4)
    out = np.zeros_like(raw)
    decode_pages(plan, encode_pages(plan, [raw]), [out])
    x, y = to_f32(raw, dtype), to_f32(out, dtype)
    groups = -(-n // group)
    pad = np.zeros((4, groups * group), dtype=np.float32)
    pad[:, :n] = np.abs(x)
    amax = np.repeat(pad.reshape(4, groups, group).max(axis=2), group, axis=1)[:, :n]
    assert np.all(np.abs(x - y) <= BOUNDS[mode] * amax)


@pytest.mark.parametrize("mode", list(MODES))
def test_exact_bytes_and_gap_segments_come_back_bit_for_bit(mode: str) -> None:
    rng = np.random.default_rng(2)
    layout = typed_layout(rng, ["bf16", "fp16", "bf16", "fp32", "bf16", "bf16"])
    layout = PageLayout((*layout.slot_sizes, 37),
                        (*layout.buffers, BufferPlace(9, "raw", len(layout.slot_sizes), 0, 37)))
    plan = make_plan(layout, mode)
    pools = [fill_pool(rng, layout, p, 3) for p in range(len(layout.slot_sizes))]
    outs = [np.zeros_like(p) for p in pools]
    decode_pages(plan, encode_pages(plan, pools), outs)
    lossy = {(b.pool, b.offset, b.size) for b in layout.buffers
             if not b.exact and b.dtype != "bytes"}
    for p, (got, want) in enumerate(zip(outs, pools, strict=True)):
        keep = np.ones(got.shape[1], dtype=bool)
        for pool, off, size in lossy:
            if pool == p:
                keep[off : off + size] = False
        assert np.array_equal(got[:, keep], want[:, keep]), f"pool {p}"


def test_cold_page_size_depends_on_the_layout_only_and_shrinks_with_bits() -> None:
    layout = PageLayout((16384,), (BufferPlace(0, "k", 0, 0, 16384, "bf16", 128, False),))
    sizes = {m: make_plan(layout, m).cold_page_size for m in MODES}
    assert sizes == {"fp8": 8192 + 256, "int8": 8192 + 256, "int4": 4096 + 256}
    raw = PageLayout((16384,), (BufferPlace(0, "k", 0, 0, 16384),))
    assert make_plan(raw, "fp8").cold_page_size == 16384


def test_places_shared_by_life_cycles_with_different_types_are_copied_raw() -> None:
    a = BufferPlace(0, "k", 0, 0, 256, "bf16", 128, False)
    b = BufferPlace(1, "k", 0, 0, 256, "fp16", 128, False)
    plan = make_plan(PageLayout((256,), (a, b)), "fp8")
    assert [s.dtype for s in plan.segments] == [None]


# -- the codec on the numpy backend -------------------------------------------------------


@pytest.fixture(scope="module")
def numpy_backend() -> Iterator[KernelBackend]:
    backend = get_plugin_manager().kernel_backend("numpy").factory({})
    yield backend
    backend.close()


def _codec(mode: str, kernel: str | Variant | None = None) -> Any:
    if kernel is None:
        return get_plugin_manager().codec(mode).factory({})
    return QuantCodec(mode, kernel=kernel)


def run_codec(backend: KernelBackend, mode: str, layout: PageLayout, pools: list[np.ndarray],
              pool_slots: np.ndarray, cold_slots: np.ndarray, cold_offset: int = 3,
              cold_kind: str = MemoryKind.DEVICE, stride_pad: int = 5,
              kernel: str | Variant | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Encode ``pools`` (``[blocks, slot]`` each) on ``backend``, read the cold pages,
    decode them into fresh pools: ``(cold pages in cold_slots order, decoded pools)``."""
    codec = _codec(mode, kernel)
    size = codec.cold_page_size(layout)
    blocks = pools[0].shape[0]
    bufs = []
    try:
        src, dst = [], []
        for data, slot in zip(pools, layout.slot_sizes, strict=True):
            for target in (src, dst):
                buf = backend.alloc_device(blocks * slot + 8)
                bufs.append(buf)
                backend.write(buf, 0, np.zeros(buf.nbytes, np.uint8))
                target.append(PageRegion(buf, 0, slot))
            backend.write(src[-1].buffer, 0, data.reshape(-1))
        ncold = int(cold_slots.max()) + 1
        stride = size + stride_pad
        cold_buf = (backend.alloc_device if cold_kind == MemoryKind.DEVICE
                    else backend.alloc_host)(cold_offset + ncold * stride)
        bufs.append(cold_buf)
        cold = PageRegion(cold_buf, cold_offset, stride)
        codec.encode(backend, layout, src, pool_slots, cold, cold_slots)
        backend.synchronize()
        image = backend.read(cold_buf, 0, cold_buf.nbytes)
        pages = np.stack([image[cold.page_start(int(c)) : cold.page_start(int(c)) + size]
                          for c in cold_slots.tolist()])
        codec.decode(backend, layout, cold, cold_slots, dst, pool_slots)
        backend.synchronize()
        out = [backend.read(r.buffer, 0, blocks * s).reshape(blocks, s)
               for r, s in zip(dst, layout.slot_sizes, strict=True)]
        return pages, out
    finally:
        for buf in bufs:
            buf.free()


def _case(seed: int, blocks: int = 9) -> tuple[PageLayout, list[np.ndarray], np.ndarray,
                                               np.ndarray]:
    rng = np.random.default_rng(seed)
    dtypes = list(rng.choice(["bf16", "fp16", "fp32"], size=int(rng.integers(1, 5))))
    layout = typed_layout(rng, dtypes, group_size=int(rng.choice([16, 64, 128, 5])))
    pools = [fill_pool(rng, layout, p, blocks) for p in range(len(layout.slot_sizes))]
    n = int(rng.integers(1, blocks + 1))
    pool_slots = rng.permutation(blocks)[:n].astype(np.int32)
    cold_slots = rng.permutation(blocks + 3)[:n].astype(np.int32)
    return layout, pools, pool_slots, cold_slots


def _reference(mode: str, layout: PageLayout, pools: list[np.ndarray],
               pool_slots: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    plan = make_plan(layout, mode)
    pages = encode_pages(plan, [p[pool_slots] for p in pools])
    outs = [np.zeros_like(p) for p in pools]
    chosen = [np.zeros((len(pool_slots), p.shape[1]), np.uint8) for p in pools]
    decode_pages(plan, pages, chosen)
    for o, c in zip(outs, chosen, strict=True):
        o[pool_slots] = c
    return pages, outs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", range(12))
def test_codec_on_numpy_backend_writes_the_reference_cold_pages(
        numpy_backend: KernelBackend, mode: str, seed: int) -> None:
    layout, pools, ps, cs = _case(seed)
    pages, outs = run_codec(numpy_backend, mode, layout, pools, ps, cs)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    assert np.array_equal(pages, want_pages)
    for got, want in zip(outs, want_outs, strict=True):
        assert np.array_equal(got, want)


def test_codec_refuses_a_lossy_buffer_off_its_element_alignment(
        numpy_backend: KernelBackend) -> None:
    layout = PageLayout((8,), (BufferPlace(0, "k", 0, 0, 8, "bf16", 4, False),))
    codec = _codec("fp8")
    buf = numpy_backend.alloc_device(64)
    try:
        with pytest.raises(ValueError, match="aligned"):
            codec.encode(numpy_backend, layout, [PageRegion(buf, 1, 8)],
                         np.array([0], np.int32), PageRegion(buf, 32, 16),
                         np.array([0], np.int32))
    finally:
        buf.free()


@pytest.mark.parametrize("mode", list(MODES))
def test_codecs_declare_distinct_frame_ids_and_their_bounds(mode: str) -> None:
    caps = get_plugin_manager().codec(mode).capabilities
    assert not caps.lossless and caps.error_bound == BOUNDS[mode]
    assert caps.codec_id == {"fp8": 1, "int8": 2, "int4": 3}[mode]


# -- on a GPU: the kernel equals the reference bit for bit ------------------------------------


def _make(name: str) -> KernelBackend:
    spec = get_plugin_manager().kernel_backend(name)
    avail = spec.availability()
    if not avail:
        pytest.skip(f"{name} unavailable: {avail.reason}")
    return spec.factory({})


@pytest.fixture(scope="module", params=GPU_BACKENDS)
def gpu(request: pytest.FixtureRequest) -> Iterator[KernelBackend]:
    backend = _make(request.param)
    yield backend
    backend.close()


@pytest.mark.gpu
@pytest.mark.parametrize("cold_kind", [MemoryKind.DEVICE, MemoryKind.HOST])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", range(12))
def test_gpu_kernel_encodes_and_decodes_bit_for_bit_like_the_reference(
        gpu: KernelBackend, mode: str, seed: int, cold_kind: str) -> None:
    layout, pools, ps, cs = _case(seed)
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=seed % 5,
                            cold_kind=cold_kind)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    assert np.array_equal(pages, want_pages), "encode differs from the reference"
    for p, (got, want) in enumerate(zip(outs, want_outs, strict=True)):
        assert np.array_equal(got, want), f"decode differs from the reference in pool {p}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_gpu_kernel_matches_the_reference_on_a_bench_sized_batch(
        gpu: KernelBackend, mode: str, dtype: str) -> None:
    """4096 blocks of one 16 KiB buffer (the bench's shape), aligned: the vector paths."""
    rng = np.random.default_rng(7)
    blocks, size = 4096, 16384
    layout = PageLayout((size,), (BufferPlace(0, "k", 0, 0, size, dtype, 128, False),))
    pools = [fill_pool(rng, layout, 0, blocks)]
    ps = rng.permutation(blocks).astype(np.int32)
    cs = rng.permutation(blocks).astype(np.int32)
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=0, stride_pad=0)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    assert np.array_equal(pages, want_pages)
    assert np.array_equal(outs[0], want_outs[0])


def _fast_path_case(seed: int) -> tuple[PageLayout, list[np.ndarray], np.ndarray, np.ndarray]:
    """Aligned 16-bit buffers in whole groups of 128 (the kernel's fast path: 5 and 3
    groups, so the last unit of 4 groups is partial), beside an fp32 buffer and a 16-bit
    buffer of part of a group (the general path) and raw bytes, in one layout."""
    rng = np.random.default_rng(seed)
    places = [
        BufferPlace(0, "k", 0, 0, 5 * 256, "bf16", 128, False),
        BufferPlace(0, "v", 0, 5 * 256, 3 * 256, "fp16", 128, False),
        BufferPlace(1, "k", 1, 0, 1000 * 4, "fp32", 128, False),
        BufferPlace(2, "k", 2, 0, 200 * 2, "bf16", 128, False),
        BufferPlace(3, "scale", 3, 0, 96, "bf16", 128, True),
    ]
    layout = PageLayout((8 * 256, 4000, 400 + 8, 96), tuple(places))
    pools = [fill_pool(rng, layout, p, 7) for p in range(4)]
    return layout, pools, rng.permutation(7)[:5].astype(np.int32), \
        rng.permutation(9)[:5].astype(np.int32)


@pytest.mark.parametrize("mode", list(MODES))
def test_fast_path_layout_round_trips_on_numpy_like_the_reference(
        numpy_backend: KernelBackend, mode: str) -> None:
    layout, pools, ps, cs = _fast_path_case(3)
    pages, outs = run_codec(numpy_backend, mode, layout, pools, ps, cs, cold_offset=0,
                            stride_pad=0)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    assert np.array_equal(pages, want_pages)
    assert all(np.array_equal(g, w) for g, w in zip(outs, want_outs, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", range(3))
def test_gpu_fast_and_general_paths_in_one_launch_match_the_reference(
        gpu: KernelBackend, mode: str, seed: int) -> None:
    layout, pools, ps, cs = _fast_path_case(seed)
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=0, stride_pad=0)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    assert np.array_equal(pages, want_pages), "encode differs from the reference"
    for p, (got, want) in enumerate(zip(outs, want_outs, strict=True)):
        assert np.array_equal(got, want), f"decode differs from the reference in pool {p}"


# -- kernel variants, flush-to-zero, extreme values --------------------------------------------


#: Kernel variants the GPU tests run: the default and ``legacy``, all of them with
#: ``KVCM_QUANT_TEST_VARIANTS=all`` (``gpu_run.sh quant_tests`` sets it), or those named
#: there, comma-separated (the default is always among them).
_TEST_ENV = os.environ.get("KVCM_QUANT_TEST_VARIANTS", "")
TEST_VARIANTS = (list(VARIANTS) if _TEST_ENV == "all" else sorted(
    {DEFAULT_VARIANT, "legacy"} if not _TEST_ENV
    else {DEFAULT_VARIANT} | {v for v in _TEST_ENV.split(",") if v}))


def _extreme(blocks: int = 8) -> tuple[PageLayout, list[np.ndarray], np.ndarray, np.ndarray]:
    case = extreme_case(blocks)
    slots = np.arange(blocks, dtype=np.int32)
    return case.layout, case.images, slots, slots[::-1].copy()


@pytest.mark.parametrize("mode", list(MODES))
def test_extreme_case_reaches_subnormal_scales_zero_groups_and_saturation(mode: str) -> None:
    """The extreme-value case really holds what a flush-to-zero kernel gets wrong: scale
    groups with subnormal fp32 scales (bf16 and fp32 buffers), all-zero groups, and values
    that saturate at the code range's ends."""
    layout, pools, ps, _ = _extreme()
    plan = make_plan(layout, mode)
    pages = encode_pages(plan, [p[ps] for p in pools])
    subnormal = {}
    for seg in plan.segments:
        at = seg.cold_offset
        scales = np.ascontiguousarray(pages[:, at : at + 4 * seg.groups]).view("<f4")
        subnormal[seg.dtype, seg.group_size] = int(np.sum((scales > 0)
                                                          & (scales < np.float32(2.0**-126))))
        assert np.any(scales == 0), f"{seg.dtype}: no all-zero group"
    assert subnormal["bf16", 128] > 0 and subnormal["fp32", 32] > 0
    assert subnormal["fp16", 128] == 0  # fp16 has no values that small
    seg = plan.segments[0]
    codes = pages[:, seg.cold_offset + seg.payload_offset():][:, : seg.groups * 128]
    if mode == "int4":
        codes = np.stack([codes & 15, codes >> 4])
    top = {"fp8": (0x7E, 0xFE), "int8": (0x7F, 0x81), "int4": (0x7, 0x9)}[mode]
    assert np.isin(codes, top).any(), "no saturated code"


def test_kernel_variant_comes_from_the_environment_else_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert QuantCodec("fp8").variant.name == DEFAULT_VARIANT
    for name in VARIANTS:
        monkeypatch.setenv(KERNEL_ENV, name)
        assert QuantCodec("int8").variant is VARIANTS[name]
    assert QuantCodec("int8", kernel="legacy").variant is VARIANTS["legacy"]


def test_unknown_kernel_variant_raises_config_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, "warp9")
    with pytest.raises(ConfigError) as err:
        get_plugin_manager().codec("fp8").factory({})
    assert err.value.field == KERNEL_ENV and err.value.value == "warp9"
    with pytest.raises(ConfigError, match="must be one of"):
        kernel_variant("nope")


def _ptx(source: str, tmp_path: Any) -> str:
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    cu, ptx = tmp_path / "k.cu", tmp_path / "k.ptx"
    cu.write_text(source)
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ftz=true", "-ptx", str(cu),
                           "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return ptx.read_text()


def test_kernels_compiled_with_flush_to_zero_use_no_flushing_instruction(tmp_path: Any) -> None:
    """CuPy compiles with ``-ftz=true``: the codec's fp32 arithmetic must not depend on it.
    Compiled so, the PTX of the default, legacy, lean and slot-table-parameter variants
    has no ``.ftz`` instruction, while the C-intrinsics form (the bug) has."""
    for name in sorted({DEFAULT_VARIANT, "legacy", "hw4x", "hw4sxp", "hw4sxp2"}):
        ptx = _ptx(source_for(VARIANTS[name]), tmp_path)
        flushing = [line.strip() for line in ptx.splitlines() if ".ftz" in line]
        assert not flushing, f"{name}: {flushing[:5]}"
    plain = _ptx(source_for(attrs.evolve(VARIANTS[DEFAULT_VARIANT], plain_c_math=True)),
                 tmp_path)
    assert "mul.rn.ftz.f32" in plain and "div.rn.ftz.f32" in plain


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", TEST_VARIANTS)
def test_gpu_kernel_variants_match_the_reference_on_extreme_values(
        gpu: KernelBackend, mode: str, variant: str) -> None:
    layout, pools, ps, cs = _extreme()
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=0, stride_pad=0,
                            kernel=variant)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    assert np.array_equal(pages, want_pages), "encode differs from the reference"
    for p, (got, want) in enumerate(zip(outs, want_outs, strict=True)):
        assert np.array_equal(got, want), f"decode differs from the reference in pool {p}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", TEST_VARIANTS)
def test_gpu_kernel_variants_match_the_reference_on_mixed_paths(
        gpu: KernelBackend, mode: str, variant: str) -> None:
    layout, pools, ps, cs = _fast_path_case(1)
    for pad, offset in ((0, 0), (4, 4), (2, 2)):  # half-warp, warp and general cold paths
        pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=offset,
                                stride_pad=pad, kernel=variant)
        want_pages, want_outs = _reference(mode, layout, pools, ps)
        assert np.array_equal(pages, want_pages), f"encode differs (cold offset {offset})"
        for got, want in zip(outs, want_outs, strict=True):
            assert np.array_equal(got, want), f"decode differs (cold offset {offset})"


@functools.cache
def _consecutive_case(mode: str) -> tuple[Any, ...]:
    rng = np.random.default_rng(11)
    blocks, size = 600, 16384
    layout = PageLayout((size,), (BufferPlace(0, "k", 0, 0, size, "bf16", 128, False),))
    pools = [fill_pool(rng, layout, 0, blocks)]
    ps = np.arange(3, 3 + 517, dtype=np.int32)
    cs = np.arange(7, 7 + 517, dtype=np.int32)
    return layout, pools, ps, cs, _reference(mode, layout, pools, ps)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", TEST_VARIANTS)
def test_gpu_kernel_variants_match_the_reference_on_consecutive_slots(
        gpu: KernelBackend, mode: str, variant: str) -> None:
    """Consecutive pool and cold slots (a launch without a slot table), bench-like pages."""
    layout, pools, ps, cs, (want_pages, want_outs) = _consecutive_case(mode)
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=0, stride_pad=0,
                            kernel=variant)
    assert np.array_equal(pages, want_pages)
    assert np.array_equal(outs[0], want_outs[0])


#: Shuffled-slot cases ``(pool blocks, blocks moved, first cold slot)``: a ``param``
#: variant takes each parameter size with narrow (slots < 2**16) and wide tables, full to
#: the last word, and one table too large for any (uploaded instead).
TABLE_CASES = (
    (600, 517, 0),  # narrow, 1024 words
    (3000, 3000, 0),  # narrow, 4096 words
    (PARAM_WORDS[-1], PARAM_WORDS[-1], 0),  # narrow, the largest size full
    (PARAM_WORDS[-1] + 40, PARAM_WORDS[-1] + 1, 0),  # too large: uploaded
    (600, 512, 1 << 16),  # wide, 1024 words full
    (PARAM_WORDS[-1] // 2, PARAM_WORDS[-1] // 2, 1 << 16),  # wide, the largest size full
)


def _small_layout() -> PageLayout:
    """Two pools of small slots: 4 half-warp groups of bf16; an fp16 group and raw bytes."""
    return PageLayout((512, 256 + 16), (
        BufferPlace(0, "k", 0, 0, 512, "bf16", 128, False),
        BufferPlace(1, "v", 1, 0, 256, "fp16", 128, False),
    ))


@functools.cache
def _table_case(mode: str, case: tuple[int, int, int]) -> tuple[Any, ...]:
    blocks, n, cold0 = case
    rng = np.random.default_rng(blocks + n)
    layout = _small_layout()
    pools = [fill_pool(rng, layout, p, blocks) for p in range(2)]
    ps = rng.permutation(blocks)[:n].astype(np.int32)
    cs = (cold0 + rng.permutation(n + 3)[:n]).astype(np.int32)
    return layout, pools, ps, cs, _reference(mode, layout, pools, ps)


#: Variants of the slot-table test: each way of passing the table (the ``device`` way is
#: one code path whatever the kernel shape: the default and one other stand for it).
TABLE_VARIANTS = sorted({v for v in TEST_VARIANTS if VARIANTS[v].slots != "device"}
                        | {DEFAULT_VARIANT, "hw4sx"})


@pytest.mark.gpu
@pytest.mark.parametrize("case", TABLE_CASES, ids=lambda c: f"{c[1]}-from-{c[2]}")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", TABLE_VARIANTS)
def test_gpu_kernel_variants_match_the_reference_on_shuffled_slot_tables_of_every_size(
        gpu: KernelBackend, mode: str, variant: str, case: tuple[int, int, int]) -> None:
    """Shuffled pool and cold slots: the slot table reaches the kernel whatever its size
    and width (a ``param`` variant: each parameter size, narrow and wide, and the upload
    when none holds it) and every block lands where the table says."""
    layout, pools, ps, cs, (want_pages, want_outs) = _table_case(mode, case)
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=0, stride_pad=0,
                            kernel=variant)
    assert np.array_equal(pages, want_pages), "encode differs from the reference"
    for p, (got, want) in enumerate(zip(outs, want_outs, strict=True)):
        assert np.array_equal(got, want), f"decode differs from the reference in pool {p}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_flush_to_zero_kernels_differ_on_extreme_values_and_are_caught(
        gpu: KernelBackend, mode: str) -> None:
    """The bug the extreme values catch: the same kernels with C float intrinsics are
    flushed by CuPy's ``-ftz=true`` and differ from the reference there, and equal it on
    the ``cuda`` backend (NVRTC's default keeps subnormals)."""
    plain = attrs.evolve(VARIANTS[DEFAULT_VARIANT], name="plain-c-math", plain_c_math=True)
    layout, pools, ps, cs = _extreme()
    pages, outs = run_codec(gpu, mode, layout, pools, ps, cs, cold_offset=0, stride_pad=0,
                            kernel=plain)
    want_pages, want_outs = _reference(mode, layout, pools, ps)
    same = np.array_equal(pages, want_pages) and all(
        np.array_equal(g, w) for g, w in zip(outs, want_outs, strict=True))
    assert same == (gpu.name != "cupy")


# -- the launch's host side, on a recording stand-in for a compiling backend --------------------


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _Stream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _Module:
    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[int, ...], tuple[int, ...], list[Any]]] = []

    def launch(self, name: str, grid: Any, block: Any, args: Any, stream: Any = None) -> None:
        # scalars as ints; a struct passed by value as a copy of its bytes
        self.launches.append((name, grid, block, [
            a.copy() if isinstance(a, np.ndarray) else int(a) for a in args]))


class _Recorder:
    """The numpy backend's memory, with ``compiles_sources``: launches are recorded, table
    uploads counted, events never complete on their own."""

    def __init__(self, inner: KernelBackend) -> None:
        self.inner = inner
        self.capabilities = attrs.evolve(inner.capabilities, compiles_sources=True)
        self.module = _Module()
        self.default_stream = _Stream()
        self.copies = 0

    def compile(self, source: str) -> _Module:
        return self.module

    def create_event(self) -> _Event:
        return _Event(done=False)

    def copy_bytes(self, *args: Any) -> None:
        self.copies += 1
        self.inner.copy_bytes(*args[:5])

    def synchronize(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_launch_uploads_a_descriptor_table_once_and_needs_no_slot_table_for_consecutive_slots(
        numpy_backend: KernelBackend) -> None:
    rec = _Recorder(numpy_backend)
    layout = PageLayout((16384,), (BufferPlace(0, "k", 0, 0, 16384, "bf16", 128, False),))
    codec = QuantCodec("fp8", kernel="hw4sx")
    size = codec.cold_page_size(layout)
    pool, cold = numpy_backend.alloc_device(16384 * 40), numpy_backend.alloc_device(size * 40)
    try:
        regions, cold_region = [PageRegion(pool, 0, 16384)], PageRegion(cold, 0, size)
        ps = np.arange(5, 37, dtype=np.int32)
        codec.encode(rec, layout, regions, ps, cold_region, ps - 3)
        codec.decode(rec, layout, cold_region, ps - 3, regions, ps)
        assert rec.copies == 1  # the descriptor table, once
        (enc, grid, block, args), (dec, _, _, dargs) = rec.module.launches
        assert (enc, dec) == ("kvcm_quant_encode", "kvcm_quant_decode")
        assert block == (128, 1, 1) and grid == (2, 32, 1)  # 64 groups in blocks of 32
        assert args[2] == 0 and args[5] == 5 | (2 << 32)  # no slot table; the bases
        assert dargs[5] == 5 | (2 << 32)
        # the table's upload never completed: calls on another stream wait for it
        assert len(rec.default_stream.waited) == 1
        other = _Stream()
        shuffled = np.array([7, 3, 9], dtype=np.int32)
        codec.encode(rec, layout, regions, shuffled, cold_region, shuffled, stream=other)
        assert len(other.waited) == 1
        assert rec.copies == 2  # the slot table; the descriptor table is kept
        assert rec.module.launches[-1][3][2] != 0
    finally:
        pool.free()
        cold.free()


def _recorded_launch(numpy_backend: KernelBackend, kernel: str, ps: np.ndarray,
                     cs: np.ndarray) -> tuple[_Recorder, QuantCodec, tuple[Any, ...]]:
    """Encode blocks ``ps`` into cold pages ``cs`` (256-byte bf16 slots) on a recorder:
    the recorder, the codec, and the encode launch ``(name, grid, block, args)``."""
    rec = _Recorder(numpy_backend)
    layout = PageLayout((256,), (BufferPlace(0, "k", 0, 0, 256, "bf16", 128, False),))
    codec = QuantCodec("fp8", kernel=kernel)
    size = codec.cold_page_size(layout)
    pool = numpy_backend.alloc_device(256 * (int(ps.max()) + 1))
    cold = numpy_backend.alloc_device(size * (int(cs.max()) + 1))
    try:
        codec.encode(rec, layout, [PageRegion(pool, 0, 256)], ps, PageRegion(cold, 0, size), cs)
    finally:
        pool.free()
        cold.free()
    return rec, codec, rec.module.launches[-1]


def _param_words(arg: np.ndarray) -> np.ndarray:
    assert arg.shape == (1,) and arg.dtype.kind == "V"  # one struct, passed by value
    return arg.view(np.uint32)


def test_param_variant_passes_a_narrow_slot_table_in_the_launch_and_copies_nothing_else(
        numpy_backend: KernelBackend) -> None:
    ps = np.array([7, 3, 9, 0], dtype=np.int32)
    cs = np.array([65535, 2, 40000, 1], dtype=np.int32)
    rec, _, (name, grid, block, args) = _recorded_launch(numpy_backend, "hw4sxp", ps, cs)
    assert rec.copies == 1  # the descriptor table only
    assert name == f"kvcm_quant_encode_p{PARAM_WORDS[0]}"
    assert grid == (1, 4, 1) and block == (128, 1, 1)
    assert args[2:5] == [4, MODES["fp8"], 0]  # blocks, mode, narrow
    words = _param_words(args[5])
    assert len(words) == PARAM_WORDS[0]
    assert list(words[:4]) == [int(p) | (int(c) << 16) for p, c in zip(ps, cs, strict=True)]


def test_param_variant_widens_the_table_for_slots_from_2_16_and_takes_the_smallest_size(
        numpy_backend: KernelBackend) -> None:
    n = PARAM_WORDS[0] // 2 + 1  # two words a block: past the smallest size
    ps = np.arange(n, dtype=np.int32)[::-1].copy()
    cs = (np.arange(n, dtype=np.int32) + (1 << 16)).astype(np.int32)
    _, _, (name, _, _, args) = _recorded_launch(numpy_backend, "hw4sxp", ps, cs)
    assert name == f"kvcm_quant_encode_p{PARAM_WORDS[1]}"
    assert args[2:5] == [n, MODES["fp8"], 1]  # wide
    words = _param_words(args[5])
    assert np.array_equal(words[0 : 2 * n : 2], ps) and np.array_equal(words[1 : 2 * n : 2], cs)


def test_param_variant_uploads_a_table_too_large_for_any_parameter_size(
        numpy_backend: KernelBackend) -> None:
    n = PARAM_WORDS[-1] + 1
    ps = np.arange(n, dtype=np.int32)[::-1].copy()
    rec, _, (name, _, _, args) = _recorded_launch(numpy_backend, "hw4sxp", ps, ps)
    assert name == "kvcm_quant_encode" and rec.copies == 2  # descriptors, then the pairs
    assert args[2] != 0 and args[3] == n and args[5] == 0


def test_mapped_variant_hands_the_kernel_the_pinned_host_table_without_a_copy(
        numpy_backend: KernelBackend) -> None:
    ps = np.array([5, 1, 4], dtype=np.int32)
    rec, codec, (name, _, _, args) = _recorded_launch(numpy_backend, "hw4sxm", ps, ps[::-1].copy())
    assert name == "kvcm_quant_encode" and rec.copies == 1  # the descriptor table only
    staging = next(iter(codec._staging.values()))[1]
    assert staging.host is not None and args[2] == staging.host.ptr  # slot 0 of the host area
    pairs = staging.host.host_view()[: 3 * 8].view(np.int32).reshape(3, 2)
    assert np.array_equal(pairs[:, 0], ps) and np.array_equal(pairs[:, 1], ps[::-1])


def test_variant_refuses_an_unknown_slot_table_way() -> None:
    with pytest.raises(ValueError, match="slots='pcie'"):
        Variant("x", 4, 128, 8, slots="pcie")


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_the_host_path_on_a_device_backend_runs_after_the_work_queued_on_its_stream(
        mode: str) -> None:
    """On a backend with a device that cannot compile the kernel (the deferred test
    backend: streams are real queues), a copy into a device page is queued on a stream,
    then the page is encoded on that stream: the encode must read the page as the copy
    left it (as a kernel on that stream would), and a decode on the stream gives it back
    within the codec's bound. Before, the host path ran at once, ahead of the copy."""
    from deferred_backend import DeferredBackend

    from kvcm_core.backend import CopyTask, copy_pairs

    be = DeferredBackend()
    n = 64
    layout = PageLayout((2 * n,), (BufferPlace(0, "k", 0, 0, 2 * n, "bf16", 32, exact=False),))
    codec = QuantCodec(mode)
    page = layout.page_bytes
    want = np.linspace(-3, 3, n, dtype=np.float32)
    src = be.alloc_host(page)
    src.host_view()[:page] = from_f32(want, "bf16").view(np.uint8)
    gpu, out = be.alloc_device(page), be.alloc_device(page)
    cold = be.alloc_host(codec.cold_page_size(layout))
    stream = be.create_stream()
    one = np.zeros(1, dtype=np.int32)
    be.copy_pages_batch([CopyTask(PageRegion(gpu, 0, page), PageRegion(src, 0, page), page,
                                  copy_pairs(one, one))], stream)
    codec.encode(be, layout, [PageRegion(gpu, 0, page)], one,
                 PageRegion(cold, 0, cold.nbytes), one, stream)
    codec.decode(be, layout, PageRegion(cold, 0, cold.nbytes), one, [PageRegion(out, 0, page)],
                 one, stream)
    stream.synchronize()
    got = to_f32(out.host_view()[:page].copy().view(np.uint16), "bf16")
    exact = to_f32(from_f32(want, "bf16"), "bf16")  # the page as written
    assert np.all(np.abs(got - exact) <= BOUNDS[mode] * np.abs(exact).max())
