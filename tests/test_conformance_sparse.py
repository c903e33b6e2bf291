"""Every registered kernel backend through the sparse-kernel conformance suite (GPU backends
are skipped without a device)."""

from __future__ import annotations

from kvcm_core.testing.conformance.sparse import SparseKernelConformance


class TestSparseKernels(SparseKernelConformance):
    pass
