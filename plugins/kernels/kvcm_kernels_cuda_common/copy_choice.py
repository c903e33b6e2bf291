"""``copy_path="measure"``: choosing between the gather kernel and the copy engines from a
measurement on the machine at hand.

Between pinned host memory and the device, which copy path is faster depends on the host
as much as on the GPU: on one H100 host the SMs read pinned host memory at 30-34 GB/s of
a 55 GB/s link (the gather kernel then moves host to device at about 0.6 of the link at
every page size) while the copy engines reach all of it from 64 KiB pages; on another H100
host the gather kernel reached 0.91-0.93. A fixed page-size threshold cannot be right on
both. A backend built with ``copy_path="measure"`` (or ``KVCM_COPY_PATH=measure``) times
both paths once, each direction between host and device, at the page sizes below, and
from then on behaves as ``"auto"`` with thresholds taken from what won
(:meth:`~kvcm_kernels_cuda_common.base.CudaKernelBackend.measure_copy_paths`).
"""

from __future__ import annotations

from collections.abc import Mapping

#: Page sizes timed, each direction, each path.
MEASURE_PAGE_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
#: Bytes one timed copy moves (pages spread over buffers of this size, in random order).
MEASURE_BYTES = 16 << 20
#: Timed repetitions of each copy (after one untimed one); the median counts.
MEASURE_REPS = 3
#: The copy engine takes over only where it took at most this fraction of the gather
#: kernel's time: near a tie the kernel's lower host time per page is worth more.
MEASURE_MARGIN = 0.9


def ce_threshold(times: Mapping[int, tuple[float, float]],
                 margin: float = MEASURE_MARGIN) -> int | None:
    """The smallest measured page size from which the copy engine won at every larger
    measured size, or ``None`` where it did not win at the largest.

    ``times`` maps a page size to ``(gather kernel seconds, copy engine seconds)`` for the
    same copy; the engine wins a size where its time is at most ``margin`` times the
    kernel's. Sizes are judged from the largest down, so a size where the engine won again
    below one where it lost does not pull the threshold under the loss.
    """
    threshold = None
    for page in sorted(times, reverse=True):
        sm, ce = times[page]
        if not ce <= margin * sm:
            break
        threshold = page
    return threshold
