"""The ``redis`` tier: a keyed level on a Redis server or Redis Cluster, shared by any number
of managers in any number of processes and machines.

It stores values (the core's checksummed cold frames) under keys (the core's block keys):
every batch is one pipeline (``SET``, ``GET``, ``EXISTS``, ``PEXPIRE``, ``UNLINK``) on the
tier's own connection, cut into pipelines of at most ``pipeline_bytes`` of values, so a
batch costs one round trip per pipeline whatever its length. A standalone server over plain
TCP is reached through the tier's own small RESP connection (values received into one
reusable buffer and sliced out of it); a cluster and TLS (``rediss://``) go through the
``redis`` client package (with ``hiredis`` when installed). A Redis Cluster
(``cluster = true``, reached through any node's URL) spreads the keys over its primaries.
The slot map is read when the client is built; the tier does not follow a redirection
within a call.

Error replies: only four are about one key, and make that key a miss (``get_many``,
``exists_many``) or a refused write (``put_many``) while the call goes on and the client
is kept: ``-WRONGTYPE`` (a key of another type), ``-OOM`` (a ``SET`` past ``maxmemory``
with eviction off), and ``-ASK`` and ``-TRYAGAIN`` (the key's slot is being migrated:
re-reading the slot map cannot help, the key is simply not served this time). Every other
error reply fails the whole call with :class:`~kvcm_core.errors.TierIOError` (counted in
``errors``) and drops the client, so the next call reconnects and re-reads the topology
from every node seen so far: ``-MOVED``, ``-CLUSTERDOWN``, ``-MASTERDOWN``, ``-READONLY``
(a failover, graceful or not, a primary turned replica), ``-LOADING``, ``-BUSY`` (a long
Lua script or function), ``-NOAUTH``, ``-NOPERM``, ``-MISCONF``, ``-ERR`` and any other:
the server could not answer for the key, so the key's absence is unknown (a level must not
take it as "not in the store"). The same holds for a standalone server.

Deadlines: each call runs on the tier's I/O thread and the caller waits at most until the
call's deadline. A call that runs past it, or that cannot reach the store, raises
:class:`~kvcm_core.errors.TierIOError`; a timed-out call's connection is closed (which
unblocks the I/O thread) and the next call opens a new one. A call whose deadline passed
before it was sent (or before the I/O thread took it up) raises the same and touches no
connection: a healthy one is not closed for it. A call is never sent once its caller gave
up on it (a slow connect or hand-shake) or once the tier is closed, and a connection still
in its hand-shake is shut down when its caller gives up or the tier is closed: ``close()``
leaves no connection behind. Nothing read back is
interpreted here (no pickle): values are returned as bytes, and the core verifies them.

Capacity is the store's: run Redis with ``maxmemory`` and an LRU policy (``allkeys-lru``);
what Redis evicts is simply not found later.

Restarts: every connection the tier opens (plain, through the client package, to each
cluster node) asks the server for ``INFO server`` and records its ``run_id`` by address;
:meth:`RedisTier.store_instances` returns them. A server restarted (empty, or reloaded from
its persistence) has a new ``run_id``, which tells the core to check the keys it counts as
its own against the store (docs/remote.md, "Restarts"). Where ``INFO`` is refused (an ACL
user without it) the connection is used all the same and the address has no ``run_id``
(the tier cannot tell a restart there).

Deletes use ``UNLINK``; where the server refuses it (renamed away with ``rename-command``,
or an ACL without it) the tier uses ``DEL`` from then on. Likewise ``renew_many`` uses
``PEXPIRE`` and, where that is refused, answers as ``exists_many`` from then on (nothing
expires: ``put_expiring_many`` then writes no expiry, and the keys renewed when the refusal
is found lose theirs, by ``PERSIST``).

Options:
    url: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS). Required.
    cluster: the URL names a node of a Redis Cluster (bool, default false).
    namespace: prefix of every key (``"<namespace>:" + key``; default ``"kvcm"``), to keep
        several deployments apart on one store. The core's keys already separate
        geometries and codecs (layout fingerprint), models and tensor/pipeline-parallel
        shards (the level's required ``model`` and ``shard`` options, folded into the
        fingerprint) and tenants (reuse scope).
    connect_timeout_s: seconds to open a connection, in (0, 3600] (default 1.0).
    pipeline_bytes: value bytes per pipeline (default 8 MiB).
"""

from __future__ import annotations

import concurrent.futures as cf
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from kvcm_core import hookimpl
from kvcm_core.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidStateError,
    TierIOError,
)
from kvcm_core.records import Availability, Medium, TierCapabilities, TierSpec
from kvcm_core.tier import KeyedTier

__all__ = ["CAPABILITIES", "RedisTier"]

CAPABILITIES = TierCapabilities(device_accessible=False, medium=Medium.REMOTE,
                                persistent=True, shared=True, keyed=True)

#: The longest ``connect_timeout_s`` (an hour, as a storage level's ``io_deadline_s``): a
#: socket cannot wait for ever (``inf`` overflows its clock).
MAX_CONNECT_TIMEOUT_S = 3600

_OPTIONS = ("url", "cluster", "namespace", "connect_timeout_s", "pipeline_bytes")
_T = TypeVar("_T")
_MGET_KEYS = 256  # keys per MGET (standalone servers reached through TLS)
_READ_BUFFER = 4 << 20  # initial receive buffer of a plain connection
_IOV_MAX = 512  # buffers per gathering write (Linux allows 1024)
_HEAP_PRIME = 16 << 20  # see _prime_heap


_MAX_TTL_S = 10 ** 15  # (ms past the server's clock must stay under 2^63)


def _check_ttl(ttl_s: Any) -> None:
    """Raise :class:`InvalidArgumentError` (naming ``ttl_s``) unless it is seconds > 0, at
    most :data:`_MAX_TTL_S` (not NaN, not infinite, not past what ``PX`` takes)."""
    if (not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool)
            or not 0 < ttl_s <= _MAX_TTL_S):
        raise InvalidArgumentError(
            f"ttl_s={ttl_s!r}: must be seconds > 0 and at most {_MAX_TTL_S}")


def _ms(ttl_s: float) -> bytes:
    return b"%d" % max(1, round(ttl_s * 1000))


class _Abandoned(Exception):
    """(I/O thread) The call's caller has given up (its deadline passed) or the tier was
    closed: nothing more is sent for it, and no connection it opened is kept by a closed
    tier."""


def _availability() -> Availability:
    try:
        import redis  # noqa: F401
    except ImportError:
        return Availability(False, "the 'redis' package is not installed "
                                   "(pip install 'kvcm[redis]')")
    return Availability(True)


def _check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    for key in options:
        if key not in _OPTIONS:
            raise ConfigError(f"redis.options.{key}", options[key],
                              f"unknown option; known: {', '.join(_OPTIONS)}")
    url = options.get("url")
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
        raise ConfigError("redis.options.url", url,
                          "required: a redis://host:port/db or rediss://... URL")
    try:
        db = urllib.parse.unquote(urllib.parse.urlsplit(url).path).strip("/")
    except ValueError:  # a broken host: refused when the URL is parsed
        db = ""
    if db and not db.isdigit():  # (the client package would silently use database 0)
        raise ConfigError("redis.options.url", url,
                          f"the database (the URL's path, {db!r}) must be a number, as in "
                          "redis://host:6379/0")
    cluster = options.get("cluster", False)
    if not isinstance(cluster, bool):
        raise ConfigError("redis.options.cluster", cluster, "must be true or false")
    namespace = options.get("namespace", "kvcm")
    if not isinstance(namespace, str) or not namespace or any(c.isspace() for c in namespace):
        raise ConfigError("redis.options.namespace", namespace,
                          "must be a non-empty string without spaces")
    timeout = options.get("connect_timeout_s", 1.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or \
            not 0 < timeout <= MAX_CONNECT_TIMEOUT_S:  # (also refuses nan)
        raise ConfigError("redis.options.connect_timeout_s", timeout,
                          f"must be a number of seconds in (0, {MAX_CONNECT_TIMEOUT_S}]")
    chunk = options.get("pipeline_bytes", 8 << 20)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError("redis.options.pipeline_bytes", chunk, "must be an int >= 1")
    return {"url": url, "cluster": cluster, "namespace": namespace.encode() + b":",
            "connect_timeout_s": float(timeout), "pipeline_bytes": chunk}


def _parts(commands: list[list[Any]]) -> list[Any]:
    """Commands in the Redis protocol (RESP arrays of bulk strings) as a list of buffers:
    headers are joined into the buffers between the values, which are not copied."""
    parts: list[Any] = []
    head: list[bytes] = []
    for args in commands:
        head.append(b"*%d\r\n" % len(args))
        for a in args:
            if len(a) < 1024:  # keys and small values travel inside the headers
                head += (b"$%d\r\n" % len(a), a, b"\r\n")
                continue
            head.append(b"$%d\r\n" % len(a))
            parts += (b"".join(head), a)
            head = [b"\r\n"]
    parts.append(b"".join(head))
    return parts


def _pack(commands: list[list[Any]]) -> bytes:
    """Commands in the Redis protocol, in one buffer (one socket write for the batch)."""
    return b"".join(_parts(commands))


def _run_id(info: object) -> str | None:
    """The ``run_id`` in the reply of ``INFO server`` (None if there is none)."""
    if isinstance(info, bytes | bytearray):
        for line in bytes(info).splitlines():
            if line.startswith(b"run_id:"):
                return line[7:].strip().decode("ascii", "replace") or None
    return None


# The only error replies about one key (its code, the reply's first word): that key is a
# miss or a refused write and the call goes on. Every other error reply fails the call
# and drops the client (see the module docstring).
_KEY_ERRORS = (b"WRONGTYPE", b"OOM", b"ASK", b"TRYAGAIN")


def _is_key_error(redis: Any, exc: Exception) -> bool:
    """Whether ``exc``, an error reply read through the ``redis`` package, is one of
    :data:`_KEY_ERRORS` (the package strips the code of the replies it knows into an
    exception class, and keeps the others' in the message)."""
    e = redis.exceptions
    if isinstance(exc, e.MovedError):  # a MovedError is an AskError
        return False
    oom = getattr(e, "OutOfMemoryError", None)
    if isinstance(exc, (e.AskError, e.TryAgainError) + ((oom,) if oom is not None else ())):
        return True
    if type(exc) is not e.ResponseError:  # another known code (BUSY is not one)
        return False
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code.encode("ascii", "replace") in _KEY_ERRORS


def _refuses(redis: Any, exc: BaseException | None, verb: bytes) -> bool:
    """Whether ``exc`` is the server refusing the command ``verb`` itself (an unknown
    command: renamed or disabled; or an ACL's ``-NOPERM``), not failing one call."""
    if not isinstance(exc, redis.ResponseError):
        return False
    text = str(exc).lower()
    return verb.decode().lower() in text and ("unknown command" in text or "noperm" in text
                                              or "no permissions" in text)


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, bytes) or not k:
            raise TypeError(f"keys[{i}]={k!r}: keys must be non-empty bytes")
    return out


_heap_primed = False


def _prime_heap() -> None:
    """Allocate and free one large buffer, once per process.

    Values read back are ``bytes`` of 16 KiB to 1 MiB, allocated by ``malloc`` and freed in
    batches. glibc returns the top of its heap to the system whenever more than its trim
    threshold (128 KiB at start) is free there, and the next batch then faults every page
    in again: reading a 64 KiB value cost about ten times its copy. Freeing a buffer that
    was too large for the heap (an ``mmap``) makes glibc raise both thresholds to that
    size (its own dynamic rule), after which batches of values reuse heap memory. Other
    allocators ignore this."""
    global _heap_primed
    if not _heap_primed:
        _heap_primed = True
        bytearray(_HEAP_PRIME)  # allocated and freed at once


class _Plain:
    """A plain TCP connection to a standalone server (what every batch uses there): the
    commands of a batch are sent in one write; the replies are received into one reusable
    buffer and each value is sliced out of it, one copy from the kernel and one into the
    returned ``bytes`` (the client library's reader makes three, and reading 64 KiB values
    through it took about twice the time).

    Args:
        url: parsed ``redis://`` URL parts (``redis.connection.parse_url``).
        connect_timeout_s: seconds to connect.
        error: the exception class for a broken connection or protocol.
        reply_error: the exception class for an error reply (the server answered;
            default ``error``).
        opening: called with the socket once it is connected, before the hand-shake (the
            tier keeps it to shut it down if it is closed meanwhile); may raise.
    """

    def __init__(self, url: Mapping[str, Any], connect_timeout_s: float,
                 error: type[Exception], reply_error: type[Exception] | None = None,
                 opening: Callable[[socket.socket], None] | None = None) -> None:
        self._error = error
        self._reply_error = reply_error = reply_error or error
        self.error_replies = 0  # error replies read (key errors too)
        _prime_heap()
        self._buf = bytearray(_READ_BUFFER)
        self._have = self._pos = 0
        sock = socket.create_connection((url.get("host", "localhost"), url.get("port", 6379)),
                                        timeout=connect_timeout_s)
        try:
            if opening is not None:
                opening(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock  # (the hand-shake below keeps the connect timeout)
            hello: list[list[bytes]] = []
            if url.get("password") is not None:
                who = [url["username"].encode()] if url.get("username") else []
                hello.append([b"AUTH", *who, str(url["password"]).encode()])
            if url.get("db"):
                hello.append([b"SELECT", str(url["db"]).encode()])
            if hello:
                sock.sendall(_pack(hello))
                for _ in hello:
                    if self._reply() is None:
                        raise error("the server refused AUTH or SELECT")
            # which server process this is (None where INFO is refused, e.g. by an ACL:
            # an error reply is one line, read whole, so the connection stays usable)
            sock.sendall(_pack([[b"INFO", b"server"]]))
            try:
                self.run_id = _run_id(self._reply())
            except reply_error:
                self.run_id = None
            sock.settimeout(None)  # from here the caller's deadline is kept by the tier
        except BaseException:
            sock.close()
            raise

    def stale(self) -> bool:
        """Whether the idle connection can no longer be used: between batches nothing may
        be readable, so anything readable is the server's end of it (a restart, a
        timeout)."""
        try:  # poll, not select: select refuses descriptors past 1024 (busy servers)
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0)) or self._have != self._pos
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Shut the socket down (which also wakes a thread blocked reading it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _fill(self, need: int) -> None:
        """Receive until ``need`` bytes are buffered past the read position."""
        if self._have - self._pos >= need:
            return
        buf = self._buf
        if self._pos + need > len(buf):
            rest = self._have - self._pos
            if need > len(buf):
                self._buf = buf = buf[self._pos:self._have] + bytearray(
                    max(need, 2 * len(buf)) - rest)
            else:
                buf[:rest] = buf[self._pos:self._have]
            self._have, self._pos = rest, 0
        view = memoryview(buf)
        try:
            while self._have - self._pos < need:
                got = self._sock.recv_into(view[self._have:])
                if not got:
                    raise self._error("the server closed the connection")
                self._have += got
        finally:
            view.release()

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._pos, self._have)
            if end >= 0:
                line = self._buf[self._pos:end]
                self._pos = end + 2
                return line  # type: ignore[return-value]  # a bytearray: compared, parsed
            self._fill(self._have - self._pos + 1)

    def _reply(self) -> bytes | int | None:
        """One reply: a bulk string's bytes, a status's text (``b"OK"``), an integer, or
        None for a nil or an error reply (``-OOM`` for a SET past ``maxmemory`` with
        eviction off, ``-WRONGTYPE`` for a GET of another type)."""
        line = self._line()
        kind = line[:1]
        if kind == b":":
            return int(line[1:])
        if kind == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            self._fill(n + 2)
            pos = self._pos
            value = bytes(memoryview(self._buf)[pos:pos + n])
            self._pos = pos + n + 2
            return value
        if kind == b"+":
            return bytes(line[1:])
        if kind == b"-":
            self.error_replies += 1
            if line[1:].split(b" ", 1)[0] not in _KEY_ERRORS:
                # the connection is dropped by the caller: its unread replies don't matter
                raise self._reply_error(f"the server answered {bytes(line[:100])!r}")
            return None  # about this key only: a miss or a refused write
        raise self._error(f"unexpected reply {line[:40]!r}")

    def call(self, parts: list[Any], n: int) -> list[bytes | int | None]:
        """Send the buffers ``parts`` (``n`` commands) with one gathering write (values are
        not copied into one buffer first) and read their ``n`` replies."""
        sock = self._sock
        views = [memoryview(p) for p in parts]
        while views:
            sent = sock.sendmsg(views[:_IOV_MAX])
            while sent:  # drop what was sent; a partly sent buffer keeps its rest
                first = views[0]
                if sent >= len(first):
                    sent -= len(first)
                    views.pop(0)
                else:
                    views[0] = first[sent:]
                    sent = 0
        out: list[bytes | int | None] = []
        failed: Exception | None = None
        for _ in range(n):  # every reply read: the caller can tell if all were refused
            try:
                out.append(self._reply())
            except self._reply_error as exc:
                failed = failed or exc
                out.append(None)
        if failed is not None:
            raise failed
        return out


class RedisTier(KeyedTier):
    """A keyed tier on Redis (see module docstring).

    Args:
        backend: unused (values travel through host memory).
        options: see the module docstring.

    Raises:
        ConfigError: a bad or unknown option, or the ``redis`` package is missing.
    """

    capabilities = CAPABILITIES

    def __init__(self, backend: Any = None, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, options or {})
        self._opts = _check_options(self.options)
        try:
            import redis
        except ImportError as exc:
            raise ConfigError("levels[].tier", "redis", "needs the 'redis' package "
                              "(pip install 'kvcm[redis]')") from exc
        self._redis = redis
        self._client: Any = None
        self._plain: _Plain | None = None  # standalone server over plain TCP
        self._opening: socket.socket | None = None  # a plain connection in its hand-shake
        self._deadline = 0.0  # (I/O thread) the deadline of the call it runs
        self._state: dict[str, bool] = {"sent": False, "gave_up": False}  # (its state)
        try:
            parsed = redis.connection.parse_url(self._opts["url"])
        except ValueError as exc:  # a port out of range or not a number, a broken host
            raise ConfigError("redis.options.url", self._opts["url"], str(exc)) from exc
        self._raw_url = None if self._opts["cluster"] or "connection_class" in parsed \
            or "path" in parsed else parsed
        self._nodes: list[tuple[str, int]] = []  # cluster nodes seen (to reconnect through)
        self._instances: dict[str, str] = {}  # server address -> its run_id, last seen
        self._lock = threading.Lock()  # guards _client between the caller and the I/O thread
        self._io = cf.ThreadPoolExecutor(1, thread_name_prefix="kvcm-redis")
        self._closed = False
        self._delete = b"UNLINK"  # DEL where UNLINK is refused (see delete_many)
        self._renew = True  # False where PEXPIRE is refused (see renew_many)
        self.timeouts = 0  # calls that ran past their deadline
        self.errors = 0  # calls that could not reach the store

    # -- connection -------------------------------------------------------------------------

    def _connect(self) -> Any:
        with self._lock:
            if self._client is not None:
                return self._client
            nodes = list(self._nodes)
        # Built outside the lock: connecting to a dead node may take connect_timeout_s,
        # and a caller whose deadline passed must be able to drop the client meanwhile.
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        o, r = self._opts, self._redis
        # No retries inside the client: the caller's deadline decides, and the core treats
        # what cannot be read in time as lost.
        kw: dict[str, Any] = {"socket_connect_timeout": o["connect_timeout_s"],
                              "retry": Retry(NoBackoff(), 0),
                              "redis_connect_func": self._on_connect}
        if not o["cluster"]:
            client = r.Redis.from_url(o["url"], **kw)
        elif not nodes:
            client = r.cluster.RedisCluster.from_url(o["url"], **kw)
        else:  # after a failure: every node seen so far, not only the URL's
            kw.update(r.connection.parse_url(o["url"]))
            for k in ("host", "port", "db"):
                kw.pop(k, None)
            client = r.cluster.RedisCluster(
                startup_nodes=[r.cluster.ClusterNode(h, p) for h, p in nodes], **kw)
        with self._lock:
            if o["cluster"]:
                seen = {(n.host, n.port) for n in client.get_nodes()}
                self._nodes = sorted(seen | set(self._nodes))
            closed = self._closed
            if self._client is None and not closed:
                self._client = client
                return client
            other = self._client
        client.close()
        if closed:  # closed meanwhile: the client is not kept, the call not made
            raise _Abandoned
        return other

    def _on_connect(self, conn: Any) -> None:
        """Each new connection of the client package: its usual set-up (a cluster client
        has made it already), then the server's ``run_id``."""
        if not self._opts["cluster"]:
            conn.on_connect()
        try:
            conn.send_command("INFO", "server")
            info = conn.read_response()
        except self._redis.ResponseError:  # INFO refused: the tier cannot tell
            return
        where = f"{getattr(conn, 'host', '')}:{getattr(conn, 'port', '')}"
        self._saw(getattr(conn, "path", None) or where, _run_id(info))

    def _saw(self, where: str, run_id: str | None) -> None:
        if run_id is not None:
            with self._lock:
                self._instances[where] = run_id

    def store_instances(self) -> dict[str, str]:
        """Each server address reached -> the ``run_id`` of the server last found there."""
        with self._lock:
            return dict(self._instances)

    def _plain_connection(self) -> _Plain:
        with self._lock:
            if self._plain is not None and not self._plain.stale():
                return self._plain
            stale, self._plain = self._plain, None
        if stale is not None:
            stale.close()
        url = self._raw_url
        try:
            plain = _Plain(url, self._opts["connect_timeout_s"],  # type: ignore[arg-type]
                           self._redis.ConnectionError, self._redis.ResponseError,
                           self._opening_socket)
        finally:
            with self._lock:
                self._opening = None
        self._saw(f"{url.get('host', 'localhost')}:{url.get('port', 6379)}",  # type: ignore[union-attr]
                  plain.run_id)
        with self._lock:
            closed = self._closed
            if self._plain is None and not closed:
                self._plain = plain
                return plain
            other = self._plain
        plain.close()
        if closed:  # closed during the hand-shake: the connection is not kept
            raise _Abandoned
        return other

    def _opening_socket(self, sock: socket.socket) -> None:
        """A plain connection's socket, connected, before its hand-shake: kept so that
        :meth:`close` can shut it down."""
        with self._lock:
            if self._closed:
                raise _Abandoned
            self._opening = sock

    def _go_on(self, send: bool = True) -> None:
        """(I/O thread, before a call's commands are sent) Raise :class:`_Abandoned` if
        the caller gave up meanwhile (a slow connect or hand-shake) or the tier was
        closed: the caller was told the call failed, so it must not be made. Else, with
        ``send``, mark the call sent (see :meth:`_call`)."""
        with self._lock:
            state = self._state
            if self._closed or state["gave_up"] or time.monotonic() >= self._deadline:
                raise _Abandoned
            state["sent"] = state["sent"] or send

    def _drop_client(self) -> None:
        """Close every connection (unblocks an I/O thread stuck on a dead server). A plain
        connection still in its hand-shake is shut down only at :meth:`close`: a caller
        that gave up leaves it to finish (:meth:`_go_on` stops the abandoned call), so
        the next call finds it made, on a link where the hand-shake alone takes longer
        than one call's deadline."""
        with self._lock:
            client, self._client = self._client, None
            plain, self._plain = self._plain, None
            opening = self._opening if self._closed else None
        if opening is not None:
            try:  # (shut down, not closed: the I/O thread closes it as the hand-shake fails)
                opening.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if plain is not None:
            plain.close()
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken client must not raise
                pass

    def _call(self, what: str, fn: Callable[[Any], _T], deadline: float) -> _T:
        if self._closed:
            raise InvalidStateError("the redis tier is closed")

        # sent: the commands may have reached the server (a failed write may have been
        # applied: TierIOError.maybe_applied); gave_up: the caller's deadline passed
        state = {"sent": False, "gave_up": False}

        def run() -> _T:
            with self._lock:
                self._deadline, self._state = deadline, state
            self._go_on(send=False)
            return fn(None if self._raw_url is not None else self._connect())

        def failed(msg: str, applied: bool) -> TierIOError:
            err = TierIOError(f"redis: {what} {msg}")
            err.maybe_applied = applied
            return err

        if deadline <= time.monotonic():  # out of time before it is sent: no connection
            self.timeouts += 1  # is touched (a healthy one must not be dropped for it)
            raise failed("ran past its deadline (before it was sent)", False)
        future = self._io.submit(run)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            self.timeouts += 1
            with self._lock:  # (nothing is sent for it from now on: _go_on)
                state["gave_up"] = True
            if not future.cancel():  # (one that never started used no connection)
                self._drop_client()
            raise failed("ran past its deadline", state["sent"]) from None
        except _Abandoned:  # (a caller that waits still: the race at its deadline, a close)
            self.timeouts += 1
            raise failed("was abandoned: " + (
                "the tier was closed" if self._closed else "it ran past its deadline"),
                False) from None
        except (self._redis.RedisError, self._redis.exceptions.RedisClusterException,
                OSError) as exc:
            self.errors += 1
            self._drop_client()
            # every reply an error (-NOREPLICAS, -READONLY...): nothing was stored
            refused = getattr(exc, "kvcm_all_refused", False)
            raise failed(f"failed: {exc}", state["sent"] and not refused) from exc

    def _groups(self, client: Any, keys: list[bytes]) -> list[tuple[Any, list[int]]]:
        """Key indices by the connection pool that serves them: one pool standalone, the
        owning primary's in a cluster."""
        if not self._opts["cluster"]:
            return [(client.connection_pool, list(range(len(keys))))]
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, k in enumerate(keys):
            node = client.get_node_from_key(k)
            if node is None or node.redis_connection is None:
                raise self._redis.exceptions.ConnectionError(f"no node serves key {k!r}")
            entry = by_node.setdefault(node.name, (node.redis_connection.connection_pool, []))
            entry[1].append(i)
        return list(by_node.values())

    def _run(self, client: Any, keys: list[bytes], command: Callable[[int], list[Any]],
             sizes: Sequence[int] | None = None) -> list[Any]:
        """Send ``command(i)`` for every key, pipelined: per connection, commands are packed
        into one buffer of at most ``pipeline_bytes`` of values and sent with one write,
        then the replies are read in order. An error reply about the key only (``-WRONGTYPE``,
        ``-OOM``, ``-ASK``, ``-TRYAGAIN``: :data:`_KEY_ERRORS`) becomes that key's
        exception (a miss or a refused write; the client is kept); every other error reply
        (``-MOVED``, ``-CLUSTERDOWN``, ``-READONLY``, ``-BUSY``, ``-NOAUTH``, ``-ERR``...)
        fails the call once the part's replies are read, as does a broken connection
        (:meth:`_call` counts it in ``errors`` and drops the client)."""
        replies: list[Any] = [None] * len(keys)
        limit = self._opts["pipeline_bytes"]
        if self._raw_url is not None:
            return self._run_plain(keys, command, sizes)
        answered = refused = 0  # replies read, error replies among them
        for pool, idx in self._groups(client, keys):
            conn = pool.get_connection()
            try:
                self._go_on()
                lo = 0
                while lo < len(idx):
                    hi, size = lo, 0
                    while hi < len(idx) and (hi == lo or size < limit):
                        size += sizes[idx[hi]] if sizes is not None else 0
                        hi += 1
                    part = idx[lo:hi]
                    conn.send_packed_command([_pack([command(i) for i in part])],
                                             check_health=False)
                    failed: Exception | None = None
                    for i in part:
                        try:
                            replies[i] = conn.read_response()
                        except self._redis.ResponseError as exc:
                            refused += 1
                            if _is_key_error(self._redis, exc):
                                replies[i] = exc
                            else:
                                failed = failed or exc
                        answered += 1
                    if failed is not None:
                        failed.kvcm_all_refused = refused == answered  # type: ignore[attr-defined]
                        raise failed  # (the rest is not sent)
                    lo = hi
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        return replies

    def _run_plain(self, keys: list[bytes], command: Callable[[int], list[Any]],
                   sizes: Sequence[int] | None) -> list[Any]:
        """:meth:`_run` on the plain connection of a standalone server."""
        conn = self._plain_connection()
        self._go_on()  # (the connection is kept: nothing was sent on it)
        limit = self._opts["pipeline_bytes"]
        out: list[Any] = []
        base = conn.error_replies
        try:
            lo = 0
            while lo < len(keys):
                hi, size = lo, 0
                while hi < len(keys) and (hi == lo or size < limit):
                    size += sizes[hi] if sizes is not None else 0
                    hi += 1
                try:
                    out += conn.call(_parts([command(i) for i in range(lo, hi)]), hi - lo)
                except self._redis.ResponseError as exc:  # (the rest is not sent)
                    exc.kvcm_all_refused = conn.error_replies - base == hi  # type: ignore[attr-defined]
                    raise
                lo = hi
        except BaseException:
            self._drop_plain()  # its stream may be mid-reply: never reuse it
            raise
        return out

    # -- the keyed-tier contract ------------------------------------------------------------

    def _full(self, keys: Sequence[bytes]) -> list[bytes]:
        ns = self._opts["namespace"]
        return [ns + k for k in _check_keys(keys)]

    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview], *,
                 deadline: float) -> np.ndarray:
        full = self._full(keys)
        if len(values) != len(full):
            raise ValueError(f"{len(full)} keys but {len(values)} values: one value per key")
        if not full:
            return np.zeros(0, dtype=bool)
        sizes = [len(v) for v in values]
        res = self._call(f"put of {len(full)} values",
                         lambda c: self._run(c, full, lambda i: [b"SET", full[i], values[i]],
                                             sizes), deadline)
        return np.fromiter((r == b"OK" for r in res), dtype=bool, count=len(full))

    @property
    def expires(self) -> bool:
        """False once the server refused ``PEXPIRE`` (see :meth:`renew_many`)."""
        return self._renew

    def put_expiring_many(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview],
                          *, ttl_s: float, deadline: float) -> np.ndarray:
        """``SET key value PX ms``: each value with its expiry in one command (no value
        without an expiry, whatever happens to the call). Where ``PEXPIRE`` was refused
        (see :meth:`renew_many`), a plain ``SET``: renewals cannot push an expiry back."""
        full = self._full(keys)
        if len(values) != len(full):
            raise ValueError(f"{len(full)} keys but {len(values)} values: one value per key")
        _check_ttl(ttl_s)
        if not full:
            return np.zeros(0, dtype=bool)
        px = [b"PX", _ms(ttl_s)] if self._renew else []
        sizes = [len(v) for v in values]
        res = self._call(f"put of {len(full)} expiring values",
                         lambda c: self._run(c, full, lambda i: [b"SET", full[i], values[i], *px],
                                             sizes), deadline)
        return np.fromiter((r == b"OK" for r in res), dtype=bool, count=len(full))

    def get_many(self, keys: Sequence[bytes], *, deadline: float) -> list[bytes | None]:
        full = self._full(keys)
        if not full:
            return []

        def get(c: Any) -> list[Any]:
            if self._opts["cluster"] or self._raw_url is not None:
                # One GET each (per primary in a cluster), pipelined.
                return self._run(c, full, lambda i: [b"GET", full[i]])
            out: list[Any] = []  # TLS: one MGET per chunk: one reply to parse
            for lo in range(0, len(full), _MGET_KEYS):
                out.extend(c.mget(full[lo:lo + _MGET_KEYS]))
            return out

        res = self._call(f"get of {len(full)} keys", get, deadline)
        return [r if isinstance(r, bytes) else None for r in res]

    def exists_many(self, keys: Sequence[bytes], *, deadline: float) -> np.ndarray:
        full = self._full(keys)
        if not full:
            return np.zeros(0, dtype=bool)
        res = self._call(f"exists of {len(full)} keys",
                         lambda c: self._run(c, full, lambda i: [b"EXISTS", full[i]]), deadline)
        return np.fromiter((r == 1 for r in res), dtype=bool, count=len(full))

    def renew_many(self, keys: Sequence[bytes], *, ttl_s: float, deadline: float
                   ) -> np.ndarray:
        """``PEXPIRE`` each key (which also counts as a use for ``allkeys-lru``)."""
        full = self._full(keys)
        _check_ttl(ttl_s)
        if not full:
            return np.zeros(0, dtype=bool)
        if not self._renew:  # PEXPIRE refused before: what exists_many can say
            return self.exists_many(keys, deadline=deadline)
        ms = _ms(ttl_s)
        try:
            res = self._call(f"renew of {len(full)} keys",
                             lambda c: self._run(c, full, lambda i: [b"PEXPIRE", full[i], ms]),
                             deadline)
        except TierIOError as exc:
            # PEXPIRE renamed away or refused by an ACL: keys then neither expire nor are
            # touched, as with a store that cannot expire keys (KeyedTier's default), and
            # the writes that renew a sentinel first go on
            if not _refuses(self._redis, exc.__cause__, b"PEXPIRE"):
                raise
            # a key written with an expiry (put_expiring_many, before this was known) would
            # expire for want of renewals: its writer writes it again (expires is False)
            self._renew = False
            return self.exists_many(keys, deadline=deadline)
        return np.fromiter((r == 1 for r in res), dtype=bool, count=len(full))

    def delete_many(self, keys: Sequence[bytes], *, deadline: float) -> int:
        full = self._full(keys)
        if not full:
            return 0
        while True:
            verb = self._delete

            def delete(c: Any, verb: bytes = verb) -> list[Any]:
                return self._run(c, full, lambda i: [verb, full[i]])

            try:
                res = self._call(f"delete of {len(full)} keys", delete, deadline)
            except TierIOError as exc:
                # UNLINK renamed away (rename-command) or refused by an ACL: DEL does the
                # same (it frees the value on the server's main thread), from now on
                if verb == b"DEL" or not _refuses(self._redis, exc.__cause__, verb):
                    raise
                self._delete = b"DEL"
                continue
            return sum(r for r in res if isinstance(r, int))

    def _drop_plain(self) -> None:
        with self._lock:
            plain, self._plain = self._plain, None
        if plain is not None:
            plain.close()

    def close(self) -> None:
        """Close the connections (one in its hand-shake too) and stop the I/O thread
        (idempotent; a call stuck on a dead server is abandoned, and nothing more is sent
        for it)."""
        if self._closed:
            return
        self._closed = True
        self._drop_client()
        self._io.shutdown(wait=False, cancel_futures=True)


@hookimpl
def kvcm_tiers() -> Iterator[TierSpec]:
    yield TierSpec(
        name="redis",
        factory=RedisTier,
        description="A Redis server or Redis Cluster shared by managers (keyed, pipelined)",
        capabilities=CAPABILITIES,
        availability=_availability,
    )
