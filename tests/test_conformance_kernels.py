"""Every registered kernel backend through the kernel-backend conformance suite."""

from __future__ import annotations

from kvcm_core.testing.conformance.kernels import KernelBackendConformance


class TestKernelBackends(KernelBackendConformance):
    pass
