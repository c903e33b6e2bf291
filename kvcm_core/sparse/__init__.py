"""Sparse attention: host-resident history, the batch's cell arena, resolve / fetch / flush.

:mod:`.storage` places sparse pools in pinned host memory, :mod:`.reference` is the NumPy
reference of the kernels, :mod:`.arena` is the per-batch state (leases, residency, cells)
behind the sparse methods of :class:`~kvcm_core.batch.Batch`, :mod:`.state` its tables by
selection group.
"""

from __future__ import annotations
