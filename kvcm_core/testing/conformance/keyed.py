"""Conformance tests for keyed tiers (stores addressed by key, shared by managers).

Every registered tier whose capabilities say ``keyed`` runs through
:class:`KeyedTierConformance`. Rules beyond the signatures of
:class:`kvcm_core.tier.KeyedTier`:

- values come back byte for byte (any length from 1 byte to a few MiB, any bytes), in key
  order, ``None`` for keys that hold nothing; ``put_many`` overwrites;
- ``put_many`` reads its values only until it returns: the caller may then overwrite or
  free them (the tier keeps no view of them);
- a second instance built from the same options sees what the first stored (the store is
  shared), and ``delete_many`` counts only keys that held a value;
- every call returns by its deadline (plus a small scheduling allowance), with a result
  or :class:`~kvcm_core.errors.TierIOError`, also when the store cannot be reached;
- bad arguments raise ``TypeError``/``ValueError`` before anything is stored; calls on a
  closed tier raise :class:`~kvcm_core.errors.InvalidStateError`; ``close`` is idempotent.

The default :meth:`KeyedTierConformance.tier_options` serve a Redis-protocol store:
``{"url": ...}`` of the server named by the environment variable ``KVCM_TEST_REDIS_URL``,
or of a ``redis-server`` started on a free loopback port for the test session (skipped, with
the reason, where the program is missing). A tier for another store overrides
:meth:`~KeyedTierConformance.tier_options` and
:meth:`~KeyedTierConformance.unreachable_options`::

    class TestMyStore(KeyedTierConformance):
        plugin_name = "mystore"

        def tier_options(self):
            return {"endpoint": ...}
"""

from __future__ import annotations

import gc
import itertools
import mmap
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core.errors import InvalidStateError, TierIOError
from kvcm_core.records import TierSpec
from kvcm_core.testing.conformance import ConformanceBase
from kvcm_core.tier import KeyedTier

__all__ = ["KeyedTierConformance"]

#: Seconds a call may overrun its deadline (thread hand-off and scheduling).
DEADLINE_SLACK_S = 0.25

_SETTINGS = settings(max_examples=10, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture,
                                            HealthCheck.differing_executors])

_sizes = st.one_of(st.integers(1, 64), st.integers(65, 64 << 10),
                   st.sampled_from([1, 16 << 10, 1 << 20]))

_server: Any = None  # the session's redis-server, started on first use


def _session_redis_url() -> str:
    url = os.environ.get("KVCM_TEST_REDIS_URL")
    if url:
        return url
    global _server
    if _server is None:
        from kvcm_core.testing.redis_server import RedisServer, redis_binaries

        found = redis_binaries()
        if isinstance(found, str):
            pytest.skip(found)
        _server = RedisServer()
        import atexit

        atexit.register(_server.stop)
    return str(_server.url)


def _deadline(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


class KeyedTierConformance(ConformanceBase):
    """The conformance suite of keyed tiers (see module docstring)."""

    kvcm_kind: ClassVar[str] = "tier"
    spec: TierSpec

    @classmethod
    def applies_to(cls, spec: Any) -> bool:
        return bool(spec.capabilities.keyed)

    # -- hooks for subclasses ------------------------------------------------------------

    def tier_options(self) -> dict[str, Any]:
        """Options of a reachable store (see module docstring)."""
        return {"url": _session_redis_url()}

    def unreachable_options(self) -> dict[str, Any] | None:
        """Options naming a store that cannot be reached (None: skip those tests)."""
        import socket

        with socket.socket() as s:  # a port nobody listens on (closed right away)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return {"url": f"redis://127.0.0.1:{port}/0"}

    # -- fixtures ------------------------------------------------------------------------

    @pytest.fixture
    def tier(self, kvcm_plugin_spec: TierSpec) -> Iterator[KeyedTier]:
        self.spec = kvcm_plugin_spec
        t = kvcm_plugin_spec.factory(None, self.tier_options())
        assert isinstance(t, KeyedTier), "a keyed tier must subclass kvcm_core.tier.KeyedTier"
        yield t
        t.close()

    @staticmethod
    def _keys(n: int) -> list[bytes]:
        run = uuid.uuid4().bytes  # fresh keys per test: the store is shared
        return [run + i.to_bytes(4, "little") for i in range(n)]

    # -- tests ---------------------------------------------------------------------------

    @_SETTINGS
    @given(sizes=st.lists(_sizes, min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1))
    def test_values_come_back_byte_for_byte_in_key_order(
            self, tier: KeyedTier, sizes: list[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        keys = self._keys(len(sizes))
        values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        stored = tier.put_many(keys, values, deadline=_deadline())
        assert stored.dtype == bool and stored.all()
        assert tier.get_many(keys, deadline=_deadline()) == values
        assert tier.get_many(keys[::-1], deadline=_deadline()) == values[::-1]

    def test_missing_keys_read_as_none_beside_present_ones(self, tier: KeyedTier) -> None:
        keys = self._keys(4)
        tier.put_many([keys[1], keys[3]], [b"one", b"three"], deadline=_deadline())
        assert tier.get_many(keys, deadline=_deadline()) == [None, b"one", None, b"three"]
        assert tier.exists_many(keys, deadline=_deadline()).tolist() == [False, True, False,
                                                                        True]

    def test_put_overwrites_and_memoryviews_are_stored_as_bytes(self, tier: KeyedTier) -> None:
        (k,) = self._keys(1)
        tier.put_many([k], [b"first"], deadline=_deadline())
        tier.put_many([k], [memoryview(b"xxsecondxx")[2:8]], deadline=_deadline())
        assert tier.get_many([k], deadline=_deadline()) == [b"second"]

    def test_put_reads_its_values_only_until_it_returns(self, tier: KeyedTier) -> None:
        """Once ``put_many`` returns the caller may overwrite or free its values (here
        memoryviews of an anonymous mapping, which cannot be unmapped while any view of
        it lives): what reads back is what they held at the call."""
        keys = self._keys(3)
        sizes = [5, 3000, 70 << 10]  # inside a command's header and sent as buffers of
        rng = np.random.default_rng(18)  # their own
        want = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        memory = mmap.mmap(-1, sum(sizes))
        memory[:] = b"".join(want)
        whole = memoryview(memory)
        bounds = np.cumsum([0, *sizes]).tolist()
        values = [whole[lo:hi] for lo, hi in itertools.pairwise(bounds)]
        assert tier.put_many(keys, values, deadline=_deadline()).all()
        memory[:] = b"\xa5" * len(memory)  # the caller reuses its buffer at once
        assert tier.get_many(keys, deadline=_deadline()) == want
        for view in values:
            view.release()
        whole.release()
        del values
        gc.collect()
        try:
            memory.close()  # BufferError while the tier keeps any view of the values
        except BufferError:
            pytest.fail("the tier still holds a view of the values after put_many returned")
        assert tier.get_many(keys, deadline=_deadline()) == want

    def test_put_expiring_stores_values_as_put_does(self, tier: KeyedTier) -> None:
        keys = self._keys(2)
        stored = tier.put_expiring_many(keys, [b"a", memoryview(b"xbx")[1:2]], ttl_s=60.0,
                                        deadline=_deadline())
        assert stored.dtype == bool and stored.tolist() == [True, True]
        assert tier.get_many(keys, deadline=_deadline()) == [b"a", b"b"]

    def test_delete_counts_only_keys_that_held_a_value(self, tier: KeyedTier) -> None:
        keys = self._keys(3)
        tier.put_many(keys[:2], [b"a", b"b"], deadline=_deadline())
        assert tier.delete_many(keys, deadline=_deadline()) == 2
        assert tier.get_many(keys, deadline=_deadline()) == [None, None, None]
        assert tier.delete_many(keys, deadline=_deadline()) == 0

    def test_a_second_instance_sees_what_the_first_stored(self, tier: KeyedTier) -> None:
        keys = self._keys(2)
        tier.put_many(keys, [b"\x00shared\x00", b"\xff" * 1000], deadline=_deadline())
        other = self.spec.factory(None, self.tier_options())
        try:
            assert other.get_many(keys, deadline=_deadline()) == [b"\x00shared\x00",
                                                                 b"\xff" * 1000]
            assert other.delete_many(keys[:1], deadline=_deadline()) == 1
        finally:
            other.close()
        assert tier.get_many(keys, deadline=_deadline()) == [None, b"\xff" * 1000]

    def test_empty_batches_do_nothing(self, tier: KeyedTier) -> None:
        assert tier.put_many([], [], deadline=_deadline()).tolist() == []
        assert tier.get_many([], deadline=_deadline()) == []
        assert tier.exists_many([], deadline=_deadline()).tolist() == []
        assert tier.delete_many([], deadline=_deadline()) == 0

    def test_bad_arguments_are_refused_before_anything_is_stored(self, tier: KeyedTier) -> None:
        keys = self._keys(2)
        with pytest.raises(ValueError, match="values"):
            tier.put_many(keys, [b"only one"], deadline=_deadline())
        with pytest.raises(TypeError, match="keys"):
            tier.put_many([keys[0], "text"], [b"a", b"b"], deadline=_deadline())  # type: ignore[list-item]
        with pytest.raises(TypeError, match="keys"):
            tier.get_many([b""], deadline=_deadline())
        assert tier.exists_many(keys, deadline=_deadline()).tolist() == [False, False]

    def test_a_past_deadline_returns_at_once(self, tier: KeyedTier) -> None:
        (k,) = self._keys(1)
        start = time.monotonic()
        try:
            tier.get_many([k], deadline=start - 1.0)
        except TierIOError:
            pass
        assert time.monotonic() - start < DEADLINE_SLACK_S
        # The tier is still usable afterwards.
        tier.put_many([k], [b"after"], deadline=_deadline())
        assert tier.get_many([k], deadline=_deadline()) == [b"after"]

    def test_an_unreachable_store_raises_tier_io_error_within_the_deadline(
            self, kvcm_plugin_spec: TierSpec) -> None:
        options = self.unreachable_options()
        if options is None:
            pytest.skip("the subclass names no unreachable store")
        t = kvcm_plugin_spec.factory(None, options)
        try:
            for call in (lambda d: t.get_many([b"k"], deadline=d),
                         lambda d: t.put_many([b"k"], [b"v"], deadline=d),
                         lambda d: t.exists_many([b"k"], deadline=d),
                         lambda d: t.delete_many([b"k"], deadline=d)):
                start = time.monotonic()
                with pytest.raises(TierIOError):
                    call(start + 0.5)
                assert time.monotonic() - start < 0.5 + DEADLINE_SLACK_S
        finally:
            t.close()

    def test_calls_on_a_closed_tier_are_refused_and_close_is_idempotent(
            self, tier: KeyedTier) -> None:
        tier.close()
        tier.close()
        with pytest.raises(InvalidStateError):
            tier.get_many([b"k"], deadline=_deadline())
