"""Mooncake-format serving traces: reading them, the token rule, and the hit rates an
infinite cache and an LRU cache reach on them.

The format (the one the Mooncake paper's traces use, FAST'25): one JSON object per line,

- ``timestamp``: arrival in milliseconds from the start of the trace;
- ``input_length`` / ``output_length``: prompt and answer lengths in tokens;
- ``hash_ids``: one id per 512-token block of the prompt. An id stands for its block *and
  everything before it*, so two requests whose lists start with the same ``k`` ids share
  their first ``k`` blocks of prompt. ``input_length`` lies in ``(512 * (n - 1), 512 * n]``
  for ``n`` ids: the last block may be partial.

The trace holds no tokens. The token rule turns a record into a prompt: token ``i``
(0..511) of block id ``h`` is ``(h * 7919 + i * 131) % 1_000_003 + 1``; a prompt is its
blocks' tokens in order, cut to ``input_length``. Since 1,000,003 is prime, two ids give
the same token at an offset exactly when they are equal modulo 1,000,003, and then they give
the same tokens at every offset: two prompts agree on their first ``512 * k`` tokens
exactly when their first ``k`` ids agree (modulo 1,000,003), and differ at every position
of the first block whose ids differ. Answers are not in the trace: a replay that decodes
makes up answer tokens, which no later prompt contains.

So the longest common token prefix of two prompts follows from the ids alone:
``min(len_a, len_b, 512 * k)`` with ``k`` their common run of ids. :func:`infinite_hits`
uses this to compute exactly what an unbounded cache reuses, at any block size, under
kvcm's matching rules, and :func:`lru_hits` what an exact LRU over 512-token blocks does.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcm_core.simulate.workload import TraceRequest
from kvcm_core.types import ReuseScope

__all__ = [
    "ANSWER_TOKEN_BASE",
    "MODULUS",
    "TRACE_BLOCK",
    "TraceError",
    "TraceRecord",
    "chain_nodes",
    "infinite_hits",
    "lru_block_hits",
    "lru_hits",
    "prompt_tokens",
    "read_trace",
    "to_requests",
]

#: Tokens per trace block (one hash id).
TRACE_BLOCK = 512
#: The token rule's modulus (a prime).
MODULUS = 1_000_003
#: Made-up answer tokens are drawn from ``[ANSWER_TOKEN_BASE, 2**31)``: above every prompt
#: token (which lie in ``[1, MODULUS]``), so no prompt ever matches an answer.
ANSWER_TOKEN_BASE = 2_000_000
#: The largest ``output_length`` a record may have: its answer is made-up tokens held in
#: memory (64 MiB of int32 at most).
MAX_OUTPUT_LENGTH = 1 << 24
#: A request's arrival step (``timestamp / ms_per_step``) must be below this: steps are
#: counted exactly in a float up to 2**53.
MAX_ARRIVAL_STEP = 1 << 53


class TraceError(ValueError):
    """An unreadable or malformed trace; the message is one line naming the place."""


@attrs.frozen
class TraceRecord:
    """One request of a Mooncake-format trace (``line``: its 1-based line in the file)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _record(obj: Any, where: str, line: int) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise TraceError(f"{where}: missing field {key!r}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) \
            or ts < 0:
        raise TraceError(f"{where}: timestamp {ts!r} must be a number >= 0 (milliseconds)")
    n_in, n_out, ids = obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _int(n_in, 1):
        raise TraceError(f"{where}: input_length {n_in!r} must be an int >= 1")
    if not _int(n_out, 0) or n_out > MAX_OUTPUT_LENGTH:
        raise TraceError(f"{where}: output_length {n_out!r} must be an int in [0, "
                         f"{MAX_OUTPUT_LENGTH}] (2**24: the answer's tokens are made up "
                         "and held in memory)")
    if not isinstance(ids, list) or not all(_int(h, 0) for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of ints >= 0")
    if not TRACE_BLOCK * (len(ids) - 1) < n_in <= TRACE_BLOCK * len(ids):
        raise TraceError(f"{where}: input_length {n_in} does not fit {len(ids)} hash ids of "
                         f"{TRACE_BLOCK} tokens (needs {TRACE_BLOCK} * (n - 1) < input_length "
                         f"<= {TRACE_BLOCK} * n)")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids), line)


def read_trace(path: str | Path, limit: int = 0) -> list[TraceRecord]:
    """The records of a Mooncake-format file, in file order (blank lines skipped).

    Args:
        path: the file.
        limit: keep the first ``limit`` records (0: all).

    Raises:
        TraceError: the file cannot be read, a line is not a valid record, ``limit < 0``,
            or the file holds no record.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise TraceError(f"limit {limit!r} must be an int >= 0 (0: every request)")
    out: list[TraceRecord] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    at = " " if exc.msg.endswith(" at") else " at "
                    raise TraceError(f"{where}: not valid JSON: {exc.msg}{at}column "
                                     f"{exc.colno}") from None
                except RecursionError:
                    raise TraceError(f"{where}: not valid JSON: nested too deeply") from None
                except ValueError:  # an int of more digits than Python converts (4300)
                    raise TraceError(f"{where}: not valid JSON here: a number too long to "
                                     "read (more than 4300 digits)") from None
                out.append(_record(obj, where, lineno))
                if limit and len(out) >= limit:
                    break
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"cannot read trace {path}: not UTF-8 text ({exc.reason})") from None
    if not out:
        raise TraceError(f"trace {path} holds no request")
    return out


_OFFSETS = np.arange(TRACE_BLOCK, dtype=np.int64) * 131


def prompt_tokens(rec: TraceRecord) -> np.ndarray:
    """The record's prompt by the token rule, as int32 (``input_length`` tokens)."""
    ids = np.asarray(rec.hash_ids, dtype=object) % MODULUS  # exact for any id size
    ids = ids.astype(np.int64)[:, None]
    toks = (ids * 7919 + _OFFSETS) % MODULUS + 1
    return toks.reshape(-1)[: rec.input_length].astype(np.int32)


def chain_nodes(records: Sequence[TraceRecord]) -> list[list[int]]:
    """For each record, one node per trace block: the node names the whole run of ids up to
    and including that block (ids taken modulo :data:`MODULUS`, as the token rule does), so
    two records share node ``k`` exactly when their first ``k + 1`` blocks hold the same
    tokens. Nodes are small ints, interned in a trie (parent node, id)."""
    trie: dict[tuple[int, int], int] = {}
    out = []
    for rec in records:
        parent = -1
        nodes = []
        for h in rec.hash_ids:
            key = (parent, h % MODULUS)
            node = trie.get(key)
            if node is None:
                node = trie[key] = len(trie)
            nodes.append(node)
            parent = node
        out.append(nodes)
    return out


def infinite_hits(records: Sequence[TraceRecord], block_size: int, *,
                  rule: str = "partial", lookup_less: int = 0,
                  nodes: list[list[int]] | None = None) -> np.ndarray:
    """Prompt tokens each request reuses from an unbounded cache that holds every earlier
    request's whole prompt (sequential replay in file order).

    The longest common prefix ``lcp`` of a request's prompt with every earlier prompt is
    exact (see the module docstring); ``L = input_length - lookup_less`` tokens are looked
    up. What is reused, by ``rule``:

    - ``"partial"``: ``min(lcp, L)``: kvcm with ``enable_partial_reuse`` (its default)
      reuses full blocks and then the longest common prefix of one more block, the
      trailing partial block an earlier request published when it closed included;
    - ``"blocks"``: ``floor(min(lcp, L) / block_size) * block_size``: full blocks only
      (kvcm without partial reuse: a request's trailing partial block is never reused,
      even by an identical prompt);
    - ``"vllm"``: the ``"blocks"`` rule with at least one prompt token left to compute
      (``L - 1``), as vLLM's prefix cache does.

    Returns:
        int64 hit tokens per record.
    """
    if rule not in ("partial", "blocks", "vllm"):
        raise ValueError(f"rule={rule!r}: must be partial, blocks or vllm")
    if nodes is None:
        nodes = chain_nodes(records)
    longest: dict[int, int] = {}  # node -> longest earlier prompt through it
    hits = np.zeros(len(records), dtype=np.int64)
    for i, (rec, chain) in enumerate(zip(records, nodes, strict=True)):
        n = rec.input_length
        lcp = 0
        for depth, node in enumerate(chain, 1):
            other = longest.get(node)
            if other is None:
                break
            lcp = max(lcp, min(n, other, TRACE_BLOCK * depth))
        look = max(0, n - lookup_less)
        if rule == "vllm":
            look = max(0, look - 1)
        hit = min(lcp, look)
        if rule != "partial":
            hit -= hit % block_size
        hits[i] = hit
        for node in chain:
            if longest.get(node, 0) < n:
                longest[node] = n
    return hits


def lru_hits(records: Sequence[TraceRecord], capacity_tokens: int, *,
             nodes: list[list[int]] | None = None) -> np.ndarray:
    """Prompt tokens each request reuses from an exact LRU cache of 512-token blocks holding
    ``capacity_tokens // 512`` blocks (sequential replay in file order).

    A request reuses the leading run of its full 512-token blocks found in the cache; then
    every full block of it is touched in prompt order (moved to the most recent end, or
    inserted, evicting the least recently used). A trailing partial block is neither
    reused nor kept.
    """
    return _lru_replay(records, capacity_tokens, TRACE_BLOCK, deepest_first=False,
                       nodes=nodes)


def lru_block_hits(records: Sequence[TraceRecord], capacity_tokens: int, block_size: int, *,
                   nodes: list[list[int]] | None = None) -> np.ndarray:
    """Prompt tokens each request reuses from an exact LRU cache of ``block_size``-token
    blocks holding ``capacity_tokens // block_size`` blocks, released the way kvcm releases
    them (sequential replay in file order): a request reuses the leading run of its full
    blocks found in the cache; when it ends, every full block of it becomes the most
    recently used, the deepest first released (so a chain is evicted from its tail).
    Trailing partial blocks are neither reused nor kept. ``block_size`` must divide 512.
    """
    if block_size <= 0 or TRACE_BLOCK % block_size:
        raise ValueError(f"block_size={block_size}: must divide {TRACE_BLOCK}")
    return _lru_replay(records, capacity_tokens, block_size, deepest_first=True, nodes=nodes)


def _lru_replay(records: Sequence[TraceRecord], capacity_tokens: int, block_size: int, *,
                deepest_first: bool, nodes: list[list[int]] | None) -> np.ndarray:
    """The LRU replays above: a block is (trace-block node, index inside it)."""
    if nodes is None:
        nodes = chain_nodes(records)
    per = TRACE_BLOCK // block_size
    cap = max(0, capacity_tokens) // block_size
    lru: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = np.zeros(len(records), dtype=np.int64)
    for i, (rec, chain) in enumerate(zip(records, nodes, strict=True)):
        blocks = [(chain[b // per], b % per) for b in range(rec.input_length // block_size)]
        run = 0
        for blk in blocks:
            if blk not in lru:
                break
            run += 1
        hits[i] = run * block_size
        if not cap:
            continue
        for blk in reversed(blocks) if deepest_first else blocks:
            if blk in lru:
                lru.move_to_end(blk)
            else:
                lru[blk] = None
                if len(lru) > cap:
                    lru.popitem(last=False)
    return hits


def to_requests(records: Sequence[TraceRecord], ms_per_step: float, *,
                seed: int = 0, source: str = "trace") -> list[TraceRequest]:
    """The records as simulator requests: request ``i`` (``"t<i>"``, kind ``"trace"``)
    arrives at step ``floor(timestamp / ms_per_step)``, its prompt by the token rule,
    followed by ``max(1, output_length)`` made-up answer tokens from ``[2_000_000,
    2**31)`` (seeded), which no later prompt contains. Every request is its own session:
    the trace's reuse is all in its prompts. One reuse scope for all.

    Raises:
        TraceError: a record's arrival step is not finite or beyond 2**53 (named
            ``SOURCE:LINE``).
    """
    if not ms_per_step > 0:
        raise ValueError(f"ms_per_step={ms_per_step!r} must be > 0")
    rng = np.random.default_rng(seed)
    scope = ReuseScope()
    out = []
    for i, rec in enumerate(records):
        arrival = rec.timestamp / ms_per_step
        if not math.isfinite(arrival) or arrival >= MAX_ARRIVAL_STEP:
            where = f"{source}:{rec.line}" if rec.line else f"{source}: request {i}"
            raise TraceError(f"{where}: timestamp {rec.timestamp!r} / --ms-per-step "
                             f"{ms_per_step!r} = arrival step {arrival:g}: must be below "
                             f"{MAX_ARRIVAL_STEP} (2**53; a larger --ms-per-step makes "
                             "fewer steps)")
        prompt = prompt_tokens(rec)
        answer = rng.integers(ANSWER_TOKEN_BASE, 2**31 - 1, max(1, rec.output_length),
                              dtype=np.int32)
        out.append(TraceRequest(
            id=f"t{i}", kind="trace", session=i, turn=0, scope=scope,
            tokens=np.concatenate([prompt, answer]), prompt_len=len(prompt),
            arrival=int(rec.timestamp // ms_per_step), after=None, delay=0))
    return out
