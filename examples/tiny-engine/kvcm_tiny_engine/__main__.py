"""``python -m kvcm_tiny_engine [--torch DEVICE] [--backend NAME]``: serve the demo
workload through kvcm and check every token against the model without a cache. Exit 0: every
check held; 1: a check failed; 2: the run could not start (a backend or torch missing, or a
torch device torch cannot use, such as `--torch cuda` without CUDA)."""

from __future__ import annotations

import argparse
import sys

from kvcm_core.errors import KvcmError
from kvcm_tiny_engine.demo import (
    TOLERANCE,
    compare_with_reference,
    requirements_unmet,
    run_demo,
)
from kvcm_tiny_engine.model import TinyModel
from kvcm_tiny_engine.ops import TorchOps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcm_tiny_engine", description=__doc__)
    parser.add_argument("--backend", default="numpy",
                        help="kvcm kernel backend: numpy (default), cupy or cuda")
    parser.add_argument("--torch", metavar="DEVICE", default=None,
                        help="run the model in torch on DEVICE (e.g. cuda) instead of NumPy")
    args = parser.parse_args(argv)
    try:
        ops = TorchOps(args.torch) if args.torch else None
        run = run_demo(ops, kernel_backend=args.backend)
    except (KvcmError, ImportError) as exc:  # a setup the run cannot have: one line, exit 2
        print(f"kvcm_tiny_engine: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(run.stats.summary())
    cmp = compare_with_reference(TinyModel(run.model.config), run.requests)
    print(f"{cmp.steps} generated tokens checked against recomputation without a cache: "
          f"worst logit error {cmp.worst_error:.2e} of scale (tolerance {TOLERANCE:.0e}); "
          f"{cmp.decided} decided tokens, {len(cmp.token_mismatches)} differ; "
          f"{cmp.close_calls} near-ties")
    unmet = requirements_unmet(run, cmp)
    for line in unmet:
        print(f"FAILED: {line}")
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main())
