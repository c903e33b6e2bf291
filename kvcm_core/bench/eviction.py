"""Eviction-policy micro-benchmark (``kvcm bench eviction``).

Nanoseconds per page of ``insert_many``, ``touch_many``, ``remove_many`` and
``pop_victims`` with batches of 1, 16 and 256 pages, for every registered eviction policy
(through the plugin manager) and for the per-page ``LruPolicy`` kvcm had before the
batch contract (dict buckets, one Python call per page: ``insert``, ``touch``, ``remove``,
``pop_victim``), driven the way the core drove it, one call per page in a Python loop.

A policy holding ``--base`` pages at the default priority (the manager's common case: a
full GPU level) runs once untimed, then ``--repeat`` timed runs; each times, batch after
batch, the insertion of ``--pages`` fresh pages, a touch of each batch, the removal of each
batch, and (after inserting them again) as many ``pop_victims(b)`` calls, which take the
oldest pages: the policy is back at its size after every run (steady state). With
``--mixed`` each insertion batch spreads its pages over four priorities. The best of
``--repeat`` runs is reported. Pages are Python ints in lists, as the core passes them most
of the time. The table is printed and written as JSON to a new file
``eviction-YYYYmmdd-HHMMSS.json`` in ``--out`` (never over an existing one).
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from kvcm_core.bench import (
    HelpFormatter,
    add_output_options,
    parse_with_quick,
    result_header,
    write_result,
)
from kvcm_core.console import int_at_least
from kvcm_core.eviction import DEFAULT_PRIORITY, MAX_PRIORITY, check_priority

__all__ = ["main"]

#: The largest page id a policy takes (``0..2**31-1``: :mod:`kvcm_core.eviction`).
MAX_PAGE_ID = 2**31 - 1
OPS = ("insert_many", "touch_many", "remove_many", "pop_victims")


class _PerPageLru:
    """kvcm's ``lru`` before the batch contract (commit ce222d8), verbatim in substance:
    a dict per priority bucket, an index, a bitmask of non-empty buckets."""

    def __init__(self) -> None:
        self._buckets: list[dict[Hashable, None]] = [{} for _ in range(MAX_PRIORITY + 1)]
        self._priority_of: dict[Hashable, int] = {}
        self._nonempty = 0

    def _add(self, key: Hashable, priority: int) -> None:
        self._buckets[priority][key] = None
        self._priority_of[key] = priority
        self._nonempty |= 1 << priority

    def _drop(self, key: Hashable) -> int:
        priority = self._priority_of.pop(key)
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            self._nonempty &= ~(1 << priority)
        return priority

    def _priority(self, key: Hashable, action: str) -> int:
        try:
            return self._priority_of[key]
        except KeyError:
            raise ValueError(f"cannot {action} key {key!r}: not in the policy") from None

    def insert(self, key: Hashable, priority: int = DEFAULT_PRIORITY) -> None:
        check_priority(priority)
        if key in self._priority_of:
            raise ValueError(f"cannot insert key {key!r}: already present")
        self._add(key, priority)

    def remove(self, key: Hashable) -> None:
        self._priority(key, "remove")
        self._drop(key)

    def touch(self, key: Hashable) -> None:
        priority = self._priority(key, "touch")
        bucket = self._buckets[priority]
        del bucket[key]
        bucket[key] = None

    def pop_victim(self) -> Hashable | None:
        if not self._nonempty:
            return None
        lowest = (self._nonempty & -self._nonempty).bit_length() - 1
        key = next(iter(self._buckets[lowest]))
        self._drop(key)
        return key

    def victims(self) -> Iterator[Hashable]:
        mask = self._nonempty
        while mask:
            low = mask & -mask
            yield from self._buckets[low.bit_length() - 1]
            mask ^= low

    # The core's loops, as batch calls.
    def insert_many(self, pages: list[int], priorities: Any = DEFAULT_PRIORITY) -> None:
        if isinstance(priorities, int):
            for page in pages:
                self.insert(page, priorities)
        else:
            for page, p in zip(pages, priorities, strict=True):
                self.insert(page, p)

    def touch_many(self, pages: list[int]) -> None:
        for page in pages:
            self.touch(page)

    def remove_many(self, pages: list[int]) -> None:
        for page in pages:
            self.remove(page)

    def pop_victims(self, k: int) -> list[Any]:
        out = []
        for _ in range(k):
            page = self.pop_victim()
            if page is None:
                break
            out.append(page)
        return out

    def __len__(self) -> int:
        return len(self._priority_of)


def _run(policy: Any, b: int, first: int, pages_per_run: int, mixed: bool
         ) -> dict[str, float]:
    """One timed run on ``policy`` (in steady state, holding its base pages): ns per page of
    each operation for batches of ``b`` fresh pages numbered from ``first``; the policy
    holds as many pages after the run as before."""
    n_batches = max(8, pages_per_run // b)
    batches = [list(range(first + i * b, first + (i + 1) * b)) for i in range(n_batches)]
    prios: Any = DEFAULT_PRIORITY
    if mixed:
        levels = [DEFAULT_PRIORITY - 10, DEFAULT_PRIORITY, DEFAULT_PRIORITY + 10, MAX_PRIORITY]
        prios = [levels[i % 4] for i in range(b)]
    size = len(policy)
    total = n_batches * b
    out: dict[str, float] = {}
    clock = time.perf_counter_ns

    t = clock()
    for batch in batches:
        policy.insert_many(batch, prios)
    out["insert_many"] = (clock() - t) / total
    t = clock()
    for batch in batches:
        policy.touch_many(batch)
    out["touch_many"] = (clock() - t) / total
    t = clock()
    for batch in batches:
        policy.remove_many(batch)
    out["remove_many"] = (clock() - t) / total
    for batch in batches:
        policy.insert_many(batch, prios)
    t = clock()
    for _ in range(n_batches):
        policy.pop_victims(b)
    out["pop_victims"] = (clock() - t) / total
    assert len(policy) == size
    return out


def measure(make: Callable[[], Any], b: int, base: int, pages_per_run: int, repeat: int,
            mixed: bool = False) -> dict[str, float]:
    """Best ns per page of each operation over ``repeat`` timed runs on one policy that
    holds ``base`` pages, after one untimed run."""
    policy = make()
    policy.insert_many(list(range(base)))
    first = base
    best = {op: float("inf") for op in OPS}
    for i in range(repeat + 1):
        result = _run(policy, b, first, pages_per_run, mixed)
        first += max(8, pages_per_run // b) * b
        if i:
            best = {op: min(best[op], result[op]) for op in OPS}
    return best


#: What ``--quick`` changes: a run of a few seconds.
QUICK = {"batches": [1, 256], "base": 10_000, "pages": 2_000, "repeat": 1}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcm bench eviction", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1, 16, 256],
                        help="pages per call; each batch size is measured in turn")
    parser.add_argument("--base", type=int_at_least(0), default=100_000,
                        help="pages held by the policy before each run")
    parser.add_argument("--pages", type=int_at_least(1), default=20_000,
                        help="pages per operation per run")
    parser.add_argument("--repeat", type=int_at_least(1), default=5,
                        help="timed runs (after one untimed); the best is reported")
    parser.add_argument("--mixed", action="store_true",
                        help="spread each insertion batch over four priorities")
    add_output_options(parser, "batches of 1 and 256 pages, 10000 pages held, 2000 pages "
                               "per operation, one timed run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a table (ns per page, best of the repeats) and write it."""
    parser = _parser()
    args = parse_with_quick(parser, argv, QUICK)
    for b in args.batches:  # page ids: 0..2**31-1 (the eviction policy contract)
        last = args.base + (args.repeat + 1) * max(8, args.pages // b) * b - 1
        if last > MAX_PAGE_ID:
            parser.error(f"--base {args.base}, --pages {args.pages}, --repeat {args.repeat} "
                         f"and batches of {b}: page ids up to {last}, past the policies' "
                         f"limit {MAX_PAGE_ID}")

    from kvcm_core.plugins import get_plugin_manager

    makers: dict[str, Callable[[], Any]] = {"per-page lru (before)": _PerPageLru}
    for record in get_plugin_manager().registered("eviction_policy"):
        spec = record.spec
        makers[spec.name] = functools.partial(spec.factory, {})

    print(f"ns per page, best of {args.repeat}; {args.base} pages held; "
          f"{'mixed' if args.mixed else 'one'} priority per batch; Python "
          f"{platform.python_version()} on {platform.machine()}")
    header = f"{'policy':24} {'batch':>5} " + " ".join(f"{op:>12}" for op in OPS)
    print(header)
    print("-" * len(header))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, make in makers.items():
        for b in args.batches:
            best = measure(make, b, args.base, args.pages, args.repeat, args.mixed)
            results.setdefault(name, {})[str(b)] = best
            print(f"{name:24} {b:>5} " + " ".join(f"{best[op]:>12.1f}" for op in OPS))
    doc = {
        **result_header("eviction policies: ns per page of the batch methods, best of "
                        f"{args.repeat} runs"),
        "config": vars(args),
        "unit": "ns per page",
        "results": results,
    }
    write_result(doc, args.out, "eviction", args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
