"""The tiny engine in torch: on CUDA over each kvcm GPU kernel backend, the model reads and
writes kvcm's device pages in place through DLPack, and generation still matches the
model recomputing every sequence without a cache (in NumPy on the CPU).

torch is optional: without it every test here skips; without a usable CUDA device the
``gpu`` tests skip (kvcm's pytest plugin), as they do in CI.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvcm_tiny_engine import (
    ModelConfig,
    PagedKV,
    TinyModel,
    TorchOps,
    compare_with_reference,
    demo_levels,
    kvcm_config,
    make_manager,
    run_demo,
)
from kvcm_tiny_engine.demo import requirements_unmet

from kvcm_core import get_plugin_manager

GPU_BACKENDS = ("cupy", "cuda")


def _torch_on_cuda(backend: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    avail = get_plugin_manager().kernel_backend(backend).availability()
    if not avail:
        pytest.skip(f"kvcm kernel backend {backend} unavailable: {avail.reason}")
    # The tolerance is for fp32 arithmetic: no TF32 in matrix products.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_torch_on_cuda_over_kvcm_device_pages_matches_recomputation(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _torch_on_cuda(backend, monkeypatch)
    run = run_demo(TorchOps("cuda"), kernel_backend=backend)
    assert run.engine.manager.kernel_backend == backend
    assert run.engine.kv.pages[0][0].device.type == "cuda"
    cmp = compare_with_reference(TinyModel(run.model.config), run.requests)
    print(f"\n[{backend}] {run.stats.summary()}\n[{backend}] {cmp.steps} tokens: worst "
          f"logit error {cmp.worst_error:.2e} of scale, {cmp.decided} decided, "
          f"{len(cmp.token_mismatches)} differ")
    assert requirements_unmet(run, cmp) == []


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_torch_page_views_are_kvcm_device_pages_without_a_copy(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = _torch_on_cuda(backend, monkeypatch)
    config = ModelConfig()
    manager, _ = make_manager(kvcm_config(config, levels=demo_levels(),
                                          kernel_backend=backend))
    try:
        keys = PagedKV(manager, config, TorchOps("cuda")).pages[1][0]
        assert keys.data_ptr() == manager.get_mem_pool_base_address(1, "key")
        keys[3] = 2.5
        torch.cuda.synchronize()
        region = manager.get_page_region(1, "key")
        raw = manager.backend.read(region.buffer, region.page_start(3), keys[3].numel() * 4)
        assert np.all(raw.view(np.float32) == 2.5)
    finally:
        manager.shutdown()


def test_torch_on_the_cpu_over_numpy_backend_pages_matches_recomputation() -> None:
    """The same torch code on the CPU (where torch is installed), over the ``numpy``
    backend's pages: checks the torch path without a GPU."""
    pytest.importorskip("torch")
    run = run_demo(TorchOps("cpu"))
    cmp = compare_with_reference(TinyModel(run.model.config), run.requests)
    assert requirements_unmet(run, cmp) == []
