"""A shared remote level on a keyed tier (a Redis server or cluster): prefixes one manager
computed are reused by managers in other processes and on other machines.

A keyed level is the last entry of ``config.levels`` (``tier = "redis"``). It holds no
slots: the manager's own levels stay as they are, and :class:`RemoteLevel` adds

- **writes at commit**: every full block a cache commits is encoded by the level's page
  codec (on the scheduler thread, one batch per commit) and handed to a bounded queue; a
  writer thread frames the pages (:mod:`kvcm_core.frame`, checked by whoever reads them)
  and stores them with ``put_many`` under ``write_deadline_s``. A full queue drops writes
  (counted): the engine never waits for the store.
- **reads at create**: ``create_kv_cache`` extends the local match with one batched
  ``get_many`` for the prompt's next blocks (at most ``max_blocks``, within
  ``io_deadline_s``; one per 16 MiB of frames). Intact frames of consecutive blocks are
  pulled into a local level (level 1, or level 0 without cold levels) as committed pages,
  held while the cache is built, so a remote hit cannot vanish before the cache owns it;
  the local matcher then decides what is reused. A value that is not an intact frame of
  this block in this layout (foreign, truncated or corrupt) is counted and treated as a
  miss, never decoded as KV.
- **faults**: a round trip that fails or runs past its deadline is a miss for the whole
  lookup (the engine recomputes), and lookups are skipped for ``retry_after_s`` (a lookup
  read in parts whose first part arrived keeps the parts read, and skips nothing); a failed
  write (or delete, or own-key check) makes the writer skip its calls for as long, on a
  timer of its own (a store that refuses writes but serves reads is still read).
- **an own-key quota**: the level's ``quota`` bounds the bytes of the keys *this* manager
  wrote, least recently used first; it deletes only those keys. What the store evicts by
  itself (``maxmemory``) is ordinary loss.
- **restarts**: when a tier reports a new server identity at an address it reached before
  (:meth:`~kvcm_core.tier.KeyedTier.store_instances`: a restart, empty or reloaded), the
  level forgets which keys it believed stored (so blocks computed again are written again)
  and the writer thread checks every key it counts as its own with ``exists_many``,
  dropping those the store lost from ``own_keys``/``own_bytes`` (retried after
  ``retry_after_s``, at least 50 ms, if the store cannot be reached).

Keys: ``<layout fingerprint>:<scope>:<cache group>:<block key>`` (hex) under the tier's own
namespace. The fingerprint covers layers, buffers, sizes, tokens per block, the block-key
rule (``sha256-prefix``, kvcm_core/radix.py), the codecs and the frame version (so two
geometries or codecs never read each other's pages, nor pages keyed under an older rule),
and the level's required ``model`` and ``shard`` options (geometry cannot tell a base model
from its fine-tune, nor tensor-parallel rank 0 from rank 1: these two options do); the
scope part (and the block key, which hashes the scope's root with the whole prefix) keeps
tenants apart. The frame's key field holds a digest of the cache group and block key, so a
value stored under another key is detected.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import numbers
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import google_crc32c
import numpy as np

from kvcm_core.backend import Buffer, KernelBackend, Stream
from kvcm_core.codec import BlobCodec, PageCodec
from kvcm_core.config import KVCacheManagerConfig, LevelConfig
from kvcm_core.errors import (
    ArgumentTypeError,
    ConfigError,
    CorruptPageError,
    InvalidArgumentError,
    OutOfPagesError,
    TierIOError,
)
from kvcm_core.frame import FRAME_MAGIC, FRAME_OVERHEAD, FRAME_VERSION, HEADER, layout_fingerprint
from kvcm_core.matching import Match
from kvcm_core.migration import Mover
from kvcm_core.plugins import make_tier
from kvcm_core.radix import KEY_HASH, extend_keys, key_cursor
from kvcm_core.records import CodecKind
from kvcm_core.tier import DevicePool, KeyedTier
from kvcm_core.tokens import TokenLog, encode_token_ids, sliceable

if TYPE_CHECKING:
    from kvcm_core.levels import Levels
    from kvcm_core.plugins import KvcmPluginManager
    from kvcm_core.records import CodecSpec
    from kvcm_core.storage import Store

__all__ = ["RemoteLevel", "RemoteOptions", "RemoteStatistics", "build_remote",
           "remote_options", "split_keyed_level", "wait_seconds"]

_HEAD = struct.Struct("<4sHH16s32sQI")  # the frame header (kvcm_core.frame.HEADER)
assert _HEAD.size == HEADER.itemsize
_WRITE_BATCH = 64  # pages per put_many of the writer thread
_KNOWN_KEYS = 1 << 16  # keys remembered as stored remotely (not written again)
_WARM_UP_S = 2.0  # seconds the first connection may take (at construction)
_RESYNC_KEYS = 4096  # own keys per exists_many when checking them after a restart
_RESYNC_BACKOFF_S = 0.05  # the least wait before an own-key check that failed is retried
_LOOKUP_PART_BYTES = 16 << 20  # frames per round trip of a lookup (see _get_parts)
_SENTINEL_TTL_S = 600.0  # a sentinel not renewed for this long expires (its manager died)
_SENTINEL_RENEW_S = 60.0  # an idle writer renews the sentinel this often
_SENTINEL_BATCH_RENEW_S = 0.5  # ... and a busy one at most this often (Redis's LRU clock
# counts seconds: renewing more often gains nothing and costs a round trip a batch)
_COUNTERS = {"miss": "misses", "foreign": "foreign", "truncated": "truncated",
             "corrupt": "corrupt"}


@attrs.frozen(kw_only=True)
class RemoteOptions:
    """The core's options of a keyed level (``levels[i].options``; the other keys go to
    the tier).

    Attributes:
        model: names the model whose KV the level holds: weights and revision, tokenizer,
            and how the engine lays out and quantizes KV in its buffers (required).
        shard: the engine's tensor/pipeline-parallel position, such as ``"tp0of8-pp0of1"``
            (``"0"`` for a single device; required). Both are folded into the layout
            fingerprint: two models, or two shards, of the same geometry never share keys.
        io_deadline_s: seconds the lookup of ``create_kv_cache`` may take (one round trip
            per 16 MiB of frames); as much again for the sentinel check of a lookup that
            missed an own key (at most once per ``retry_after_s``).
        max_blocks: blocks past the local match one lookup asks for.
        write_queue_blocks: pages waiting to be written, at most (more are dropped).
        write_queue_bytes: bytes of the pages waiting to be written, at most (more are
            dropped).
        write_deadline_s: seconds one batch of writes (or deletes) may take.
        retry_after_s: after a failed or late round trip, seconds the lookups (after a
            read) or the writer's calls (after a write, delete or check) are skipped.
    """

    model: str
    shard: str
    io_deadline_s: float = 0.05
    max_blocks: int = 256
    write_queue_blocks: int = 4096
    write_queue_bytes: int = 1 << 30
    write_deadline_s: float = 2.0
    retry_after_s: float = 1.0


_OPTION_NAMES = tuple(a.name for a in attrs.fields(RemoteOptions))
_IDENTITY = {  # the required options that say whose KV a page is
    "model": "a non-empty string naming the model: weights and revision, tokenizer, and how "
             "the engine lays out and quantizes KV in its buffers",
    "shard": "a non-empty string naming the engine's tensor/pipeline-parallel position "
             "(e.g. 'tp0of8-pp0of1'; '0' for a single device)",
}


def remote_options(index: int, options: Mapping[str, Any]) -> tuple[RemoteOptions, dict[str, Any]]:
    """Split a keyed level's options into the core's (checked) and the tier's.

    Raises:
        ConfigError: a core option breaks its rule (named ``levels[i].options.NAME``).
    """
    mine = {k: v for k, v in options.items() if k in _OPTION_NAMES}
    rest = {k: v for k, v in options.items() if k not in _OPTION_NAMES}
    for name, rule in _IDENTITY.items():  # geometry alone cannot tell two models apart
        value = mine.get(name)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"levels[{index}].options.{name}", value,
                              f"required: {rule}; pages are shared by the managers that "
                              f"give the same {name} (and geometry), so pages of another "
                              f"{name} would be served as this one's")
    for name, value in mine.items():
        field = f"levels[{index}].options.{name}"
        if name in _IDENTITY:
            continue
        if name in ("max_blocks", "write_queue_blocks", "write_queue_bytes"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(field, value, "must be an int >= 1")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not (
                value >= 0 if name == "retry_after_s" else value > 0):
            raise ConfigError(field, value, "must be a number >= 0" if name == "retry_after_s"
                              else "must be a number > 0 (seconds)")
        elif not value <= threading.TIMEOUT_MAX:  # inf, nan: no thread can wait that long
            raise ConfigError(field, value, f"must be finite seconds, at most "
                              f"threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:g})")
    return RemoteOptions(**mine), rest


def wait_seconds(name: str, value: object) -> float | None:
    """``value``, an API call's time to wait, as ``Condition.wait`` takes it: None (no
    limit), or a real number of seconds >= 0; ``inf`` or more than
    ``threading.TIMEOUT_MAX`` (no thread can wait longer) is no limit (None).

    Raises:
        ArgumentTypeError: not None nor a real number (a ``str``, a ``bool``).
        InvalidArgumentError: negative or ``nan``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}={value!r}: must be seconds (a real number >= 0) "
                                f"or None (no limit)")
    try:
        seconds = float(value)
    except OverflowError:  # an int past every float
        seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds) or seconds < 0:
        shown = f"<an int of {value.bit_length()} bits>" if isinstance(value, int) and \
            not math.isfinite(seconds) else repr(value)
        raise InvalidArgumentError(f"{name}={shown}: must be seconds >= 0, or None or inf "
                                   f"(no limit)")
    return None if seconds > threading.TIMEOUT_MAX else seconds


def split_keyed_level(config: KVCacheManagerConfig, pm: KvcmPluginManager
                      ) -> tuple[KVCacheManagerConfig, LevelConfig | None]:
    """The configuration of the manager's own levels, and its keyed level (or None).

    Raises:
        ConfigError: more than one keyed level, or one that is not the last level.
    """
    keyed = [i for i, lv in enumerate(config.levels) if pm.tier(lv.tier).capabilities.keyed]
    if not keyed:
        return config, None
    i = keyed[0]
    if len(keyed) > 1:
        raise ConfigError(f"levels[{keyed[1]}].tier", config.levels[keyed[1]].tier,
                          "a manager has at most one keyed (shared remote) level")
    if i == 0:
        raise ConfigError("levels[0].tier", config.levels[0].tier,
                          "level 0 must be device memory, not a keyed remote store")
    if i != len(config.levels) - 1:
        raise ConfigError(f"levels[{i}].tier", config.levels[i].tier,
                          "a keyed (shared remote) level must be the last level")
    lv = config.levels[i]
    io_default = attrs.fields(LevelConfig).io_deadline_s.default
    for name, default, instead in (("io_deadline_s", io_default, "options.io_deadline_s"),
                                   ("write_queue_depth", None, "options.write_queue_blocks"),
                                   ("write_combine_bytes", None, None)):
        if getattr(lv, name) != default:  # the level's own I/O thread settings
            raise ConfigError(f"levels[{i}].{name}", getattr(lv, name),
                              "does not apply to a keyed (shared remote) level" +
                              (f": set {instead} (see docs/remote.md)" if instead else ""))
    return attrs.evolve(config, levels=config.levels[:i]), lv


@attrs.define
class RemoteStatistics:
    """Counters of a manager's remote level since it was built (pages are per cache
    group and block; blocks count each block once).

    Attributes:
        lookups: round trips of ``create_kv_cache``; ``probes``: of ``probe_reuse``.
        skipped: lookups and probes not made (within ``retry_after_s`` of a failed one).
        hits: intact pages found; ``misses``: pages asked for and absent.
        foreign: intact frames of another layout, codec, block or group (misses).
        truncated: values shorter than their frame says (misses).
        corrupt: values that are no frame or fail the checksum (misses).
        read_failures: round trips that failed or ran past ``io_deadline_s``.
        pulled_blocks, pulled_pages: placed into a local level by ``create_kv_cache``.
        unplaced_pages: found, but the local level had no room for them.
        writes_queued: pages handed to the writer; ``writes_dropped``: the queue was full.
        written, written_bytes: pages (frames) the store accepted.
        write_failures: pages whose write failed, was refused or was skipped.
        deleted: own keys deleted to stay under the level's quota.
        own_keys, own_bytes: keys (and their bytes) this manager wrote and still counts
            (those of a batch whose write failed or ran late too: it may have landed).
        store_restarts: servers of the store found restarted (a new identity at an
            address reached before); each makes the level check its own keys.
        own_keys_lost: losses of keys seen without a restart, each making the level act
            as after one: a lookup that missed a key this manager wrote and found the
            sentinel gone (at most one per ``retry_after_s``), or a renewal that found it
            gone (``FLUSHALL``, an eviction, a lossy failover). A restart the same call
            found, or one being acted on, is counted in ``store_restarts`` only.
    """

    lookups: int = 0
    probes: int = 0
    skipped: int = 0
    hits: int = 0
    misses: int = 0
    foreign: int = 0
    truncated: int = 0
    corrupt: int = 0
    read_failures: int = 0
    pulled_blocks: int = 0
    pulled_pages: int = 0
    unplaced_pages: int = 0
    writes_queued: int = 0
    writes_dropped: int = 0
    written: int = 0
    written_bytes: int = 0
    write_failures: int = 0
    deleted: int = 0
    own_keys: int = 0
    own_bytes: int = 0
    store_restarts: int = 0
    own_keys_lost: int = 0


# -- staging: cold pages in host memory, as a store the Mover copies from and to ---------


class _HostPages(DevicePool):
    def __init__(self, buffer: Buffer, slot_bytes: int, count: int) -> None:
        self._buffer = buffer
        self.slot_bytes = slot_bytes
        self.num_slots = count

    @property
    def buffer(self) -> Buffer:
        return self._buffer

    def resize(self, num_slots: int) -> None:  # pragma: no cover - never resized
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Stage:
    """Cold pages of the remote level's codec in pinned host memory (the Mover's view of
    the remote level: ``level`` indexes the codec list it was given)."""

    frames = None
    index = -1

    def __init__(self, level: int, buffer: Buffer, slot_bytes: int, count: int) -> None:
        self.level = level
        self.pools = [_HostPages(buffer, slot_bytes, count)]

    def rows(self, n: int) -> np.ndarray:
        pool = self.pools[0]
        return pool.buffer.host_view()[: n * pool.slot_bytes].reshape(n, pool.slot_bytes)


# -- frames of the remote level -----------------------------------------------------------


def _crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def frame_key(group: int, block_key: bytes) -> bytes:
    """The 32 bytes a remote frame carries for ``(cache group, block key)``."""
    return hashlib.sha256(b"kvcm-remote:%d:" % group + block_key).digest()


class _Plan:
    """One lookup: the blocks after the local match, what is local, what to ask for.
    ``rows``: the blocks' tokens as ``[n, tpb]`` int32 (digests by their 32-bit id);
    ``items``: each block's exact tokens and digests when any block holds a digest, else
    None."""

    def __init__(self, b0: int, keys: list[bytes], nodes: np.ndarray, rows: np.ndarray,
                 items: list[list[Any]] | None, have: np.ndarray) -> None:
        self.b0, self.keys, self.nodes, self.have = b0, keys, nodes, have
        self.rows, self.items = rows, items
        self.want: list[tuple[int, int]] = [
            (int(i), int(j)) for i, j in zip(*np.nonzero(~have), strict=True)]


class RemoteLevel:
    """A manager's shared remote level (see module docstring). Built by
    :func:`build_remote`; driven by the manager (lookups, probes) and by commits."""

    def __init__(self, *, index: int, level: LevelConfig, options: RemoteOptions,
                 readers: KeyedTier, writers: KeyedTier, levels: Levels,
                 backend: KernelBackend, codec: PageCodec, codec_id: int,
                 blob: BlobCodec | None, fingerprint: bytes, groups: Sequence[int],
                 required: Sequence[int], tokens_per_block: int) -> None:
        self.index = index
        self.config = level
        self.options = options
        self.quota = level.quota
        self.tier = readers
        self.fingerprint = fingerprint
        #: The level's page codec (its ``error_bound`` bounds what a pulled page differs by).
        self.codec = codec
        self.stats = RemoteStatistics()
        self._writers = writers
        self._levels = levels
        self._tree = levels.tree
        self._codec = codec
        self._codec_id = codec_id
        self._blob = blob
        self._groups = list(groups)
        self._required = [self._groups.index(g) for g in required if g in self._groups] \
            or list(range(len(self._groups)))
        self._tpb = tokens_per_block
        self._backend = backend
        self._target = 1 if len(levels.stores) > 1 else 0
        self._stage_level = len(levels.codecs)
        self._mover = Mover(backend, [*levels.codecs, codec])
        self._stage_buf: Buffer | None = None
        self._cold = {g: codec.cold_page_size(levels.layouts[levels.pool_group_of(g)])
                      for g in self._groups}
        self._prefix = fingerprint.hex().encode() + b":"
        self._seq = itertools.count(1)
        # After a failure, lookups and the writer's calls are skipped until these times:
        # apart, so a store that refuses writes but serves reads is still read.
        self._read_skip_until = 0.0
        self._write_skip_until = 0.0
        self._resync_attempts = 0  # own-key checks made (each ends a wait of flush)
        self._lock = threading.Condition()
        self._queue: collections.deque[tuple[bytes, bytes, bytes]] = collections.deque()
        self._queue_bytes = 0  # of the pages in _queue
        self._busy = False
        self._closing = False
        self._own: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._own_bytes = 0
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._instances: dict[str, set[str]] = {}  # address -> server identities seen
        self._resync = False  # own keys to check against the store (after a restart)
        self._checking = False  # ... being checked now (by the writer)
        self._next_loss_check = 0.0  # see _lost_own
        # A key of this manager's alone, written before its first blocks: gone means the
        # store lost keys wholesale (FLUSHALL), there means an ordinary loss (see _lost_own).
        self._sentinel = self._prefix + b"alive:" + os.urandom(8).hex().encode()
        self._sentinel_set = False
        self._sentinel_tried = False  # a write of it was sent (see close)
        self._sentinel_expiring = False  # written with an expiry the store now refuses
        self._sentinel_renewed = 0.0  # (monotonic) see _keep_sentinel
        self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                        name="kvcm-remote-writer")
        self._thread.start()
        # Open both connections now: the first request's lookup should not pay for it. A
        # store that is down is not an error here (lookups skip it until it answers).
        for tier, writes in ((readers, False), (writers, True)):
            try:
                tier.exists_many([self._prefix + b"warm-up"],
                                 deadline=time.monotonic() + _WARM_UP_S)
            except TierIOError:
                self._failed(writes=writes)
        self._check_restarts()

    # -- keys ------------------------------------------------------------------------------

    def key(self, root_key: bytes, group: int, block_key: bytes) -> bytes:
        """The store key of ``group``'s page of a block (under the tier's namespace)."""
        return b"%s%s:%d:%s" % (self._prefix, root_key[:8].hex().encode(), group,
                                block_key.hex().encode())

    def _stage(self, cold: int, n: int) -> _Stage:
        need = cold * n
        if self._stage_buf is None or self._stage_buf.nbytes < need:
            if self._stage_buf is not None:
                self._stage_buf.free()
            self._stage_buf = self._backend.alloc_host(max(need, 1 << 20))
        return _Stage(self._stage_level, self._stage_buf, cold, n)

    def _remember(self, key: bytes) -> None:
        known = self._known
        known[key] = None
        known.move_to_end(key)
        if len(known) > _KNOWN_KEYS:
            known.popitem(last=False)

    def _forget(self, key: bytes) -> bool:
        """A key found absent: not known, and no longer counted against the quota. True
        when it was one of this manager's own keys (the store lost a key it wrote)."""
        with self._lock:
            self._known.pop(key, None)
            size = self._own.pop(key, None)
            if size is not None:
                self._own_bytes -= size
            return size is not None

    def _lost_own(self) -> None:
        """A lookup missed a key this manager wrote (it was forgotten already). An
        ordinary loss (Redis evicting under ``maxmemory``, another manager's quota deleting
        a block both wrote) needs nothing more; a store that lost keys wholesale without a
        restart the identities show (``FLUSHALL``) does, and the sentinel key tells them
        apart: gone means wholesale, so as after a restart the level forgets which keys
        it believed stored (a block computed again is written again, not skipped; done
        here, before this request's blocks are committed), the writer drops the own keys
        the store no longer holds and writes the sentinel again (``own_keys_lost``). One
        small round trip, at most once per ``retry_after_s``, with a deadline of its own
        (``io_deadline_s`` from its start: the lookup's own may be spent, and a call that
        runs out of time closes its connection). A check that fails or runs late is a
        read failure (lookups skipped for ``retry_after_s``) and concludes nothing: the
        next such miss past ``retry_after_s`` checks again. Nothing is done or
        counted while an emptied store is being acted on (the sentinel not yet written
        again, the own keys still to check): it is part of that."""
        now = time.monotonic()
        with self._lock:
            if not self._sentinel_set and (self._resync or self._checking):
                return  # the store was found emptied (a restart, a loss): acted on already
            if now < self._next_loss_check:
                return
            self._next_loss_check = now + self.options.retry_after_s
            known_set = self._sentinel_set
        if known_set:
            try:
                there = bool(self.tier.exists_many(
                    [self._sentinel], deadline=time.monotonic() + self.options.io_deadline_s)[0])
            except TierIOError:
                self.stats.read_failures += 1
                self._failed(writes=False)
                return
            if there:
                return
        with self._lock:
            self.stats.own_keys_lost += 1
            self._store_emptied()

    def _store_emptied(self) -> None:
        """(Lock held.) The store may have lost every key (a restart, a flush): forget
        which keys are believed stored, write the sentinel again, and have the writer
        check the own keys against the store."""
        self._known.clear()
        self._sentinel_set = False
        self._resync = True
        self._lock.notify_all()

    def _keep_sentinel(self) -> None:
        """Writer thread, before the blocks of a batch (at most every
        ``_SENTINEL_BATCH_RENEW_S``; every ``_SENTINEL_RENEW_S`` while idle): renew the
        sentinel key (``renew_many``: its expiry pushed back to ``_SENTINEL_TTL_S`` from
        now, and a use for the store's LRU, so an ordinary eviction takes the manager's
        older pages first, not it), or write it where it is not set. Found gone, the store
        lost it since the last renewal: acted on as :meth:`_lost_own` does (a store
        flushed). A manager that died leaves its sentinel for ``_SENTINEL_TTL_S`` at most.

        Raises:
            TierIOError: the store could not be reached (the batch is not tried).
        """
        now = time.monotonic()
        with self._lock:
            was_set = self._sentinel_set
        if was_set and now < self._sentinel_renewed + _SENTINEL_BATCH_RENEW_S:
            return
        deadline = now + self.options.write_deadline_s
        self._sentinel_renewed = now
        if was_set:
            expiring = self._writers.expires
            held = bool(self._writers.renew_many([self._sentinel], ttl_s=_SENTINEL_TTL_S,
                                                 deadline=deadline)[0])
            # the store refuses expiries: the sentinel, written with one, would expire under
            # this live manager (taken for a flush): written again, without (until it is)
            self._sentinel_expiring |= expiring and not self._writers.expires
            if held and not self._sentinel_expiring:
                return
            if not held:
                # gone: a restart when the renewal's connection found a new server
                # (counted as one in store_restarts, not as a loss too), else a loss
                self._check_restarts()
                with self._lock:
                    if self._sentinel_set:  # (not emptied meanwhile by a lookup's check)
                        self.stats.own_keys_lost += 1
                        self._store_emptied()
        # written with its expiry in one command: a call that fails or runs late (and
        # lands all the same) never leaves a sentinel that does not expire (where the store
        # refuses expiries, a plain write: a failed one leaves _sentinel_expiring, so the
        # next renewal writes it again)
        self._sentinel_tried = True  # (deleted at close, wherever a write may have landed)
        expiring = self._writers.expires
        ok = bool(self._writers.put_expiring_many([self._sentinel], [b"kvcm"],
                                                  ttl_s=_SENTINEL_TTL_S, deadline=deadline)[0])
        self._sentinel_expiring = expiring and not self._writers.expires  # (found meanwhile)
        with self._lock:
            self._sentinel_set = ok

    def _renewal_due(self) -> bool:
        return (self._sentinel_set and not self._closing
                and time.monotonic() >= max(self._sentinel_renewed + _SENTINEL_RENEW_S,
                                            self._write_skip_until))

    def _failed(self, *, writes: bool, at_least: float = 0.0) -> None:
        """A round trip failed: skip lookups (or the writer's calls) for ``retry_after_s``
        (at least ``at_least``)."""
        until = time.monotonic() + max(self.options.retry_after_s, at_least)
        if writes:
            self._write_skip_until = until
        else:
            self._read_skip_until = until

    # -- restarts ----------------------------------------------------------------------------

    def _check_restarts(self) -> bool:
        """After a call: if a tier found a server with a new identity where it had found
        another before (a restart), forget which keys are believed stored and have the
        writer check the own keys against the store; True then. Cheap: no I/O."""
        seen = [tier.store_instances() for tier in (self.tier, self._writers)]
        with self._lock:
            restarted = False
            for instances in seen:
                for where, ident in instances.items():
                    idents = self._instances.setdefault(where, set())
                    if ident not in idents:
                        restarted |= bool(idents)
                        idents.add(ident)
            if restarted:
                self.stats.store_restarts += 1
                self._store_emptied()
            return restarted

    def _resync_due(self) -> bool:
        return self._resync and time.monotonic() >= self._write_skip_until

    def _resync_own(self) -> None:
        """Drop from the own keys those the store no longer holds (writer thread)."""
        try:
            self._check_own()
        finally:
            with self._lock:
                self._resync_attempts += 1

    def _check_own(self) -> None:
        with self._lock:
            self._resync = False
            self._checking = True
            keys = list(self._own)
        try:
            self._check_chunks(keys)
        finally:
            with self._lock:
                self._checking = False

    def _check_chunks(self, keys: list[bytes]) -> None:
        for lo in range(0, len(keys), _RESYNC_KEYS):
            chunk = keys[lo:lo + _RESYNC_KEYS]
            try:
                held = self._writers.exists_many(
                    chunk, deadline=time.monotonic() + self.options.write_deadline_s)
            except TierIOError:
                # again once the store answers; never sooner than _RESYNC_BACKOFF_S (with
                # retry_after_s = 0 the writer would spin on a dead store)
                self._failed(writes=True, at_least=_RESYNC_BACKOFF_S)
                with self._lock:
                    self._resync = True
                return
            finally:
                self._check_restarts()
            with self._lock:
                for key, there in zip(chunk, held.tolist(), strict=True):
                    if not there:
                        self._known.pop(key, None)
                        size = self._own.pop(key, None)
                        if size is not None:
                            self._own_bytes -= size

    # -- frames ------------------------------------------------------------------------------

    def _frame(self, fkey: bytes, payload: bytes) -> bytes:
        if self._blob is not None:
            payload = self._blob.encode(payload)
        body = _HEAD.pack(FRAME_MAGIC, FRAME_VERSION, self._codec_id, self.fingerprint, fkey,
                          next(self._seq), len(payload)) + payload
        return body + _crc(body).to_bytes(4, "little")

    def check(self, value: bytes | None, fkey: bytes, cold: int) -> tuple[str, bytes | None]:
        """``(verdict, cold page)`` of a value read back: ``"hit"`` with the page, else
        ``"miss"``, ``"foreign"``, ``"truncated"`` or ``"corrupt"`` with None."""
        if value is None:
            return "miss", None
        n = len(value)
        if n < FRAME_OVERHEAD:
            return "truncated", None
        magic, version, codec, layout, key, _seq, length = _HEAD.unpack_from(value)
        if magic != FRAME_MAGIC:
            return "corrupt", None
        if length > n - FRAME_OVERHEAD:
            return "truncated", None
        if length < n - FRAME_OVERHEAD or _crc(value[:-4]) != int.from_bytes(value[-4:],
                                                                              "little"):
            return "corrupt", None
        if (version != FRAME_VERSION or codec != self._codec_id or layout != self.fingerprint
                or key != fkey):
            return "foreign", None
        payload = value[_HEAD.size:-4]
        if self._blob is not None:
            try:
                payload = self._blob.decode(payload, cold)
            except Exception:  # CorruptPageError, or a codec breaking its contract
                return "corrupt", None
        if len(payload) != cold:
            return "corrupt", None
        return "hit", payload

    # -- lookups -------------------------------------------------------------------------------

    def _plan(self, root_key: bytes, tokens: Sequence[Any] | np.ndarray,
              match: Match) -> _Plan | None:
        tpb = self._tpb
        nfull = len(tokens) // tpb
        b0 = match.length // tpb
        if b0 >= nfull:
            return None
        b1 = min(nfull, b0 + self.options.max_blocks)
        part = tokens[b0 * tpb : b1 * tpb]
        data, mm = encode_token_ids(part, b0 * tpb)  # (checked: bad tokens are refused)
        items = None
        if mm:  # digests: their blocks' keys chain past them, as the local tree's do
            log = TokenLog(part)
            rows, _ = log.rows(0, len(part), tpb)
            flat = list(log.items(0, len(part)))
            items = [flat[i : i + tpb] for i in range(0, len(flat), tpb)]
        else:
            rows = np.frombuffer(data, dtype="<i4").reshape(-1, tpb)
        # The local match ended before the prompt's last full block, so its walk hashed
        # past it (a miss or a cut) and left no cursor: the key state after b0 blocks is
        # rebuilt from the prompt in one C call.
        keys: list[bytes] = []
        last = self._tree.key(int(match.nodes[b0 - 1])) if b0 else None
        extend_keys(keys, root_key, part, tpb, b0, key_cursor(root_key, tokens, tpb, b0, last))
        tree = self._tree
        get = tree.index.get
        nodes = np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        have = np.zeros((len(keys), len(self._groups)), dtype=bool)
        live = nodes >= 0
        if live.any():
            have[live] = tree.pages[nodes[live]][:, self._groups] >= 0
        plan = _Plan(b0, keys, nodes, rows, items, have)
        return plan if plan.want else None

    def _get_parts(self, rkeys: list[bytes], plan: _Plan, deadline: float
                   ) -> list[bytes | None]:
        """``get_many`` of a lookup's keys (block by block), in parts of about
        ``_LOOKUP_PART_BYTES`` of frames, one round trip each, all within ``deadline``. A
        part that fails or runs late after one arrived ends the lookup with the values read
        so far (a prefix of the blocks: they are used; ``read_failures`` counts it, and
        lookups are not skipped, since the store answered).

        Raises:
            TierIOError: the first part failed.
        """
        out: list[bytes | None] = []
        groups, cold, want = self._groups, self._cold, plan.want
        lo, n = 0, len(rkeys)
        while lo < n:
            hi, size = lo, 0
            while hi < n and (hi == lo or size < _LOOKUP_PART_BYTES):
                size += cold[groups[want[hi][1]]] + FRAME_OVERHEAD
                hi += 1
            try:
                out += self.tier.get_many(rkeys[lo:hi], deadline=deadline)
            except TierIOError:
                if not out:
                    raise
                self.stats.read_failures += 1
                break
            lo = hi
        return out

    def _round_trip(self, root_key: bytes, plan: _Plan, fetch: bool
                    ) -> tuple[int, dict[tuple[int, int], bytes]]:
        """Ask for the plan's pages in one round trip (one per part of a large lookup:
        :meth:`_get_parts`); returns the extent (blocks after the local match whose
        required groups are all there) and the pages read."""
        if time.monotonic() < self._read_skip_until:
            self.stats.skipped += 1
            return 0, {}
        groups = self._groups
        rkeys = [self.key(root_key, groups[j], plan.keys[i]) for i, j in plan.want]
        deadline = time.monotonic() + self.options.io_deadline_s
        try:
            if fetch:
                values: Sequence[Any] = self._get_parts(rkeys, plan, deadline)
            else:
                values = self.tier.exists_many(rkeys, deadline=deadline).tolist()
        except TierIOError:
            self.stats.read_failures += 1
            self._failed(writes=False)
            return 0, {}
        restarted = self._check_restarts()
        present = plan.have.copy()
        pages: dict[tuple[int, int], bytes] = {}
        st = self.stats
        lost = False  # a miss of a key this manager wrote
        # (values may be a prefix: a lookup cut short by its deadline)
        for (i, j), rkey, value in zip(plan.want, rkeys, values, strict=False):
            g = groups[j]
            if not fetch:
                verdict, page = ("hit", b"") if value else ("miss", None)
            else:
                verdict, page = self.check(value, frame_key(g, plan.keys[i]), self._cold[g])
            if verdict == "hit":
                st.hits += 1
                present[i, j] = True
                if fetch:
                    pages[(i, j)] = page  # type: ignore[assignment]
                continue
            name = _COUNTERS[verdict]
            setattr(st, name, getattr(st, name) + 1)
            if verdict == "miss":
                lost |= self._forget(rkey)
            else:  # a damaged or foreign value: not stored as far as this level can
                # tell, so the block computed again is written again (over it); the key
                # stays counted as own (its bytes are still in the store)
                with self._lock:
                    self._known.pop(rkey, None)
        if lost and not restarted:  # (a restart is acted on already: not a loss too)
            self._lost_own()
        ok = np.asarray(present[:, self._required].all(axis=1))
        extent = int(ok.size) if ok.all() else int(ok.argmin())
        return extent, pages

    def probe(self, root_key: bytes, tokens: Sequence[Any] | np.ndarray, match: Match,
              backoff: int, partial: bool) -> int:
        """Tokens ``create_kv_cache`` would reuse with this level: the same round trip
        (``exists_many``), nothing pulled."""
        plan = self._plan(root_key, sliceable(tokens), match)
        if plan is None:
            return match.length
        self.stats.probes += 1
        extent, _ = self._round_trip(root_key, plan, fetch=False)
        if not extent:
            return match.length
        length = (plan.b0 + extent) * self._tpb
        if backoff:
            length = max(0, length - backoff)
            if not partial:
                length = length // self._tpb * self._tpb
        return max(match.length, length)

    def extend(self, root_key: bytes, tokens: Sequence[Any] | np.ndarray, match: Match,
               rematch: Callable[[], Match]) -> tuple[Match, np.ndarray | None]:
        """Pull the pages the store has for the blocks after ``match`` into a local level
        and match again. Returns the new match and the pages held meanwhile (give them to
        :meth:`release` once the cache holds its own), or ``(match, None)``."""
        tokens = sliceable(tokens)  # (a deque)
        plan = self._plan(root_key, tokens, match)
        if plan is None:
            return match, None
        self.stats.lookups += 1
        extent, pages = self._round_trip(root_key, plan, fetch=True)
        if not extent:
            return match, None
        L = self._levels
        tree = self._tree
        # Keep the local pages of the match and of the extent where they are while room is
        # made for the pulled ones (a cascade could otherwise evict them).
        nids = np.concatenate([match.nodes, plan.nodes[:extent]])
        local = tree.pages[nids[nids >= 0]].reshape(-1)
        local = np.unique(local[local >= 0])
        L.change(local, 0, 1)
        try:
            pulled = self._pull(root_key, plan, extent, pages, match)
        except BaseException:
            L.change(local, 0, -1)
            raise
        held = np.concatenate([local, pulled])
        return (rematch() if len(pulled) else match), held

    def release(self, held: np.ndarray) -> None:
        """Let go of the pages :meth:`extend` held."""
        self._levels.change(held, 0, -1)

    def _pull(self, root_key: bytes, plan: _Plan, extent: int,
              pages: dict[tuple[int, int], bytes], match: Match) -> np.ndarray:
        L = self._levels
        tree = self._tree
        groups = self._groups
        by_store: dict[int, list[tuple[int, int]]] = {}
        for (i, j) in pages:
            if i < extent:
                g = groups[j]
                store = L.cold_store(self._target, g) if self._target else L.gpu_store(g)
                by_store.setdefault(store.index, []).append((i, j))
        placed: list[tuple[int, list[int], np.ndarray]] = []  # (group, blocks, pages)
        try:
            if any(L.all_stores[s].level == 0 for s in by_store):
                # create_kv_cache takes no stream, and the engine's work still queued on its
                # own may write the GPU slots a closed cache just freed: the host waits for all
                # the device's work once, before any pulled page is placed there.
                self._backend.synchronize()
            for s, items in by_store.items():
                store = L.all_stores[s]
                items.sort()
                n = L.capacity(store, len(items))
                if n < len(items):
                    self.stats.unplaced_pages += len(items) - n
                    items = items[:n]
                if not items:
                    continue
                try:
                    L.make_room(store, len(items))
                except OutOfPagesError:
                    self.stats.unplaced_pages += len(items)
                    continue
                for j in sorted({j for _, j in items}):
                    blocks = [i for i, jj in items if jj == j]
                    pids = self._place(store, groups[j], [pages[(i, j)] for i in blocks],
                                       [plan.keys[i] for i in blocks])
                    if pids is not None:
                        placed.append((groups[j], blocks, pids))
            if not placed:
                return np.empty(0, dtype=np.int64)
            # Tree nodes for the blocks that have none (existing nodes are a prefix: a node
            # exists only under its parent).
            last = max(max(blocks) for _, blocks, _ in placed) + 1
            nodes = plan.nodes
            first_new = int(np.argmin(nodes[:last] >= 0)) if (nodes[:last] < 0).any() else last
            if first_new < last:
                if first_new:
                    parent = int(nodes[first_new - 1])
                elif plan.b0:
                    parent = int(match.nodes[plan.b0 - 1])
                else:
                    parent = tree.root(root_key)
                rows = plan.rows[first_new:last]
                items = None if plan.items is None else plan.items[first_new:last]
                nodes = nodes.copy()
                nodes[first_new:last] = tree.add_chain(
                    parent, plan.keys[first_new:last], rows, plan.b0 + first_new,
                    items is not None, items)
            out = []
            blocks_pulled: set[int] = set()
            for g, blocks, pids in placed:
                L.publish(pids, nodes[blocks], g)
                out.append(pids)
                blocks_pulled.update(blocks)
                for i in blocks:
                    rkey = self.key(root_key, g, plan.keys[i])
                    with self._lock:
                        self._remember(rkey)
                        if rkey in self._own:
                            self._own.move_to_end(rkey)
        except BaseException:  # (a sink's interrupt at a publish, a failed write): the
            for _, _, pids in placed:  # pages placed so far let go of (unpublished: freed)
                L.change(pids, 0, -1)
            raise
        pulled = np.concatenate(out)
        self.stats.pulled_pages += len(pulled)
        self.stats.pulled_blocks += len(blocks_pulled)
        L.stats.remote_blocks += len(blocks_pulled)
        return pulled

    def _place(self, store: Store, group: int, payloads: list[bytes],
               keys: list[bytes]) -> np.ndarray | None:
        """New held pages of ``group`` in ``store`` holding ``payloads``; None when the
        local write failed (nothing is left behind)."""
        L = self._levels
        n = len(payloads)
        pids = store.take(group, n, locks=0)
        cold = self._cold[group]
        stage = self._stage(cold, n)
        rows = stage.rows(n)
        for k, payload in enumerate(payloads):
            rows[k] = np.frombuffer(payload, dtype=np.uint8)
        fkeys = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, 32)
        layout = L.layouts[L.pool_group_of(group)]
        slots = L.arena.slot[pids]
        self._after_level_copies(store, slots)
        try:
            self._mover.copy(layout, stage, np.arange(n), store,  # type: ignore[arg-type]
                             slots, keys=fkeys)
        except (TierIOError, CorruptPageError):
            store.change(pids, 0, 0)  # unreferenced and uncommitted: freed
            L.stats.io_failures += 1
            self.stats.unplaced_pages += n
            return None
        L.change(pids, 0, 1)
        return pids

    def _after_level_copies(self, store: Store, slots: np.ndarray) -> None:
        """The host waits for the levels' asynchronous copies that last touched these
        slots (an eviction still reading a slot now reused, an onboard still filling a
        page): this level copies with a mover of its own, which does not know them."""
        fences = self._levels.mover.fences
        if fences.events:
            fences.wait_host(((store, np.asarray(slots, dtype=np.int32)),))

    # -- writes ----------------------------------------------------------------------------

    def committed(self, root_key: bytes, nodes: Sequence[int], stream: Stream | None = None
                  ) -> None:
        """A cache published ``nodes`` (full blocks): queue their GPU pages for writing,
        read after the work queued on ``stream`` (where the engine wrote them) and after
        the levels' own copies of those slots."""
        if self._closing or not len(nodes):
            return
        L = self._levels
        a = L.arena
        tree = self._tree
        nids = np.asarray(nodes, dtype=np.int64)
        work: dict[int, list[tuple[int, bytes, bytes]]] = {}  # store -> (page, rkey, fkey)
        with self._lock:
            known = self._known
            for g in self._groups:
                for nid, pid in zip(nids.tolist(), tree.pages[nids, g].tolist(), strict=True):
                    if pid < 0 or a.level[pid] != 0:
                        continue
                    bkey = tree.key(nid)
                    if bkey is None:
                        continue
                    rkey = self.key(root_key, g, bkey)
                    if rkey in known:
                        continue
                    work.setdefault(int(a.store[pid]), []).append(
                        (pid, rkey, frame_key(g, bkey)))
            room = self.options.write_queue_blocks - len(self._queue)
            room_bytes = self.options.write_queue_bytes - self._queue_bytes
        total = sum(len(v) for v in work.values())
        batch: list[tuple[bytes, bytes, bytes]] = []
        size = 0
        for s, items in work.items():
            store = L.all_stores[s]
            layout = L.layouts[store.pool_group]
            cold = self._codec.cold_page_size(layout)
            # what fits under both bounds of the queue (the rest is dropped, counted)
            items = items[: max(0, min(room - len(batch), (room_bytes - size) // cold))]
            if not items:
                continue
            size += cold * len(items)
            pids = np.asarray([p for p, _, _ in items], dtype=np.int64)
            stage = self._stage(cold, len(items))
            slots = a.slot[pids]
            self._after_level_copies(store, slots)
            self._mover.copy(layout, store, slots, stage,  # type: ignore[arg-type]
                             np.arange(len(items)), stream)
            rows = stage.rows(len(items))
            batch += [(rkey, fkey, rows[k].tobytes())
                      for k, (_, rkey, fkey) in enumerate(items)]
        self.stats.writes_dropped += total - len(batch)
        if not batch:
            return
        with self._lock:
            for rkey, _, _ in batch:
                self._remember(rkey)
            self._queue.extend(batch)
            self._queue_bytes += size
            self._lock.notify_all()
        self.stats.writes_queued += len(batch)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while (not self._queue and not self._closing and not self._resync_due()
                       and not self._renewal_due()):
                    now = time.monotonic()
                    wakes = [max(self._write_skip_until, now + 0.01)] if self._resync else []
                    if self._sentinel_set:  # renewed while idle too
                        wakes.append(max(self._sentinel_renewed + _SENTINEL_RENEW_S,
                                         self._write_skip_until, now + 0.01))
                    self._lock.wait(min(wakes) - now if wakes else None)
                if not self._queue and self._closing:
                    return
                resync = self._resync_due()
                renew = self._renewal_due()
                batch = [self._queue.popleft()
                         for _ in range(min(_WRITE_BATCH, len(self._queue)))]
                self._queue_bytes -= sum(len(page) for _, _, page in batch)
                self._busy = True
            try:
                if resync:
                    self._resync_own()
                if batch:
                    self._write(batch)
                elif renew:
                    try:
                        self._keep_sentinel()
                    except TierIOError:
                        self._failed(writes=True)
            except Exception:  # a writer bug must not kill the thread
                self.stats.write_failures += len(batch)
                self._unknow([k for k, _, _ in batch])  # not stored: written again later
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _write(self, batch: list[tuple[bytes, bytes, bytes]]) -> None:
        st = self.stats
        if time.monotonic() < self._write_skip_until:
            st.write_failures += len(batch)
            self._unknow([k for k, _, _ in batch])
            return
        keys = [k for k, _, _ in batch]
        values = [self._frame(fkey, payload) for _, fkey, payload in batch]
        try:
            self._keep_sentinel()
        except TierIOError:  # (the batch is not sent)
            self._failed(writes=True)
            st.write_failures += len(batch)
            self._unknow(keys)
            return
        try:
            ok = self._writers.put_many(keys, values, deadline=time.monotonic()
                                        + self.options.write_deadline_s)
        except TierIOError as exc:
            self._failed(writes=True)
            st.write_failures += len(batch)
            self._unknow(keys)  # (written again if computed again)
            if exc.maybe_applied:  # (not if unsent, or refused: another's copy)
                self._maybe_stored(keys, values)
            return
        self._check_restarts()
        victims: list[tuple[bytes, int]] = []
        with self._lock:
            own = self._own
            for key, value, stored in zip(keys, values, ok.tolist(), strict=True):
                if not stored:
                    self._known.pop(key, None)
                    continue
                st.written += 1
                st.written_bytes += len(value)
                self._own_bytes += len(value) - own.pop(key, 0)
                own[key] = len(value)
            st.write_failures += len(keys) - int(ok.sum())
            while self._own_bytes > self.quota and own:
                key, size = own.popitem(last=False)
                self._own_bytes -= size
                self._known.pop(key, None)
                victims.append((key, size))
        if victims:
            try:
                self._writers.delete_many([k for k, _ in victims], deadline=time.monotonic()
                                          + self.options.write_deadline_s)
                st.deleted += len(victims)
            except TierIOError:
                self._failed(writes=True)
                with self._lock:  # still in the store: counted again, the first victims
                    # of the next batch's deletes (unless written again meanwhile)
                    for key, size in reversed(victims):
                        if key not in own:
                            own[key] = size
                            own.move_to_end(key, last=False)
                            self._own_bytes += size

    def _maybe_stored(self, keys: list[bytes], values: list[bytes]) -> None:
        """A batch whose write failed or ran past its deadline once sent
        (``TierIOError.maybe_applied``) may have been stored all the same (a paused server
        applies the commands it received when it resumes; a slow link delivers them late):
        its keys are counted as own, as the least recently used, so the quota deletes them
        first (one no-op delete for a key that never landed; a check of the own keys after
        a restart, or a lookup's miss, drops it)."""
        with self._lock:
            own = self._own
            for key, value in zip(reversed(keys), reversed(values), strict=True):
                self._own_bytes += len(value) - own.pop(key, 0)
                own[key] = len(value)
                own.move_to_end(key, last=False)

    def _unknow(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    # -- whole level -----------------------------------------------------------------------

    def statistics(self) -> RemoteStatistics:
        """A copy of the counters, with the own-key totals of now."""
        with self._lock:
            return attrs.evolve(self.stats, own_keys=len(self._own),
                                own_bytes=self._own_bytes)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write was made (or failed), and a check of the own
        keys after a restart too (unless the store is being skipped after a failure; one
        attempt at most: a check that fails is retried later, not waited for); False if
        ``timeout_s`` passed first.

        Raises:
            ArgumentTypeError, InvalidArgumentError: a bad ``timeout_s`` (see
                :func:`wait_seconds`).
        """
        timeout_s = wait_seconds("timeout_s", timeout_s)
        with self._lock:
            start = self._resync_attempts
            return self._lock.wait_for(
                lambda: not self._queue and not self._busy and (
                    not self._resync_due() or self._resync_attempts > start), timeout_s)

    def close(self) -> None:
        """Finish the queued writes (each batch within ``write_deadline_s``), stop the
        writer and close the tier connections (idempotent)."""
        if self._closing and not self._thread.is_alive():
            return
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        # Each batch: its write and, at worst, the sentinel's renewal and rewrite.
        pending = -(-len(self._queue) // _WRITE_BATCH) + 1
        self._thread.join(timeout=min(3 * pending * self.options.write_deadline_s + 1.0,
                                      threading.TIMEOUT_MAX))
        errors = []
        if self._thread.is_alive():  # stuck past every deadline: the rest is abandoned
            with self._lock:
                self.stats.writes_dropped += len(self._queue)
                self._queue.clear()
                self._queue_bytes = 0
        if self._sentinel_tried:  # the sentinel is this manager's alone: not left behind
            # (where a write of it may have landed, known or not)
            try:
                self._writers.delete_many([self._sentinel], deadline=time.monotonic() + 1.0)
            except TierIOError:
                pass
        for close in (self.tier.close, self._writers.close, self._mover.close):
            try:
                close()
            except Exception as exc:  # close the rest all the same
                errors.append(f"{type(exc).__name__}: {exc}")
        if self._stage_buf is not None:
            self._stage_buf.free()
            self._stage_buf = None
        if errors:
            raise TierIOError(f"closing the remote level failed: {'; '.join(errors)}")


def build_remote(pm: KvcmPluginManager, level: LevelConfig, index: int,
                 config: KVCacheManagerConfig, levels: Levels, backend: KernelBackend,
                 codecs: Sequence[PageCodec | None], codec_specs: Sequence[CodecSpec | None],
                 groups: Sequence[int], required: Sequence[int]) -> RemoteLevel:
    """Build the keyed level ``level`` (``levels[index]`` of the configuration) of a
    manager whose own levels are ``config.levels``.

    Raises:
        ConfigError: a bad core option or codec; the tier's own errors for its options.
    """
    opts, tier_opts = remote_options(index, level.options)
    spec = pm.tier(level.tier)
    page = pm.level_codec(level.codec or "raw", f"levels[{index}].codec")
    if page.capabilities.kind is not CodecKind.PAGE:
        raise ConfigError(f"levels[{index}].codec", page.name,
                          "must be a page codec (blob codecs go in 'blob_codec')")
    codec = next((c for c, s in zip(codecs, codec_specs, strict=True)
                  if c is not None and s is not None and s.name == page.name), None)
    if codec is None:
        codec = page.factory({})
    blob = None
    outer = page
    if level.blob_codec is not None:
        outer = pm.level_codec(level.blob_codec, f"levels[{index}].blob_codec")
        if outer.capabilities.kind is not CodecKind.BLOB:
            raise ConfigError(f"levels[{index}].blob_codec", level.blob_codec,
                              "must be a blob codec (such as 'zstd' or 'lz4')")
        blob = outer.factory({})
    fingerprint = layout_fingerprint({
        "layers": config.to_dict()["layers"], "tokens_per_block": config.tokens_per_block,
        "hash": KEY_HASH, "codec": page.name, "blob_codec": level.blob_codec,
        "frame_version": FRAME_VERSION, "remote": 1, "model": opts.model,
        "shard": opts.shard})
    built: list[KeyedTier] = []
    try:
        for _ in range(2):  # reads and writes on their own connections and threads
            tier = make_tier(spec, backend, tier_opts, index)  # errors: levels[i].options.X
            if not isinstance(tier, KeyedTier):
                tier.close()
                raise ConfigError(f"levels[{index}].tier", level.tier,
                                  "declares keyed but is no kvcm_core.tier.KeyedTier")
            built.append(tier)
        return RemoteLevel(index=index, level=level, options=opts, readers=built[0],
                           writers=built[1], levels=levels, backend=backend, codec=codec,
                           codec_id=outer.capabilities.codec_id, blob=blob,
                           fingerprint=fingerprint, groups=groups, required=required,
                           tokens_per_block=config.tokens_per_block)
    except BaseException:
        for tier in built:
            try:
                tier.close()
            except Exception:  # the first error is the one to report
                pass
        raise
