"""Real Redis servers on loopback for tests, benchmarks and the simulator.

:class:`RedisServer` runs one standalone ``redis-server``; :class:`RedisClusterServers`
runs a cluster of primaries with one replica each, created with ``redis-cli --cluster
create``. Both start on free loopback ports in a private temporary directory, with
persistence off, and stop (and remove their directory) on ``stop()`` or at the end of a
``with`` block. They need the ``redis-server`` and ``redis-cli`` programs (Debian:
``apt-get install redis-server redis-tools``); :func:`redis_binaries` says whether they
are there and, if not, why.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["RedisClusterServers", "RedisServer", "redis_binaries"]

_START_TIMEOUT_S = 10.0


def redis_binaries() -> tuple[str, str] | str:
    """``(redis-server, redis-cli)`` paths, or the reason they cannot be used."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        missing = [n for n, p in (("redis-server", server), ("redis-cli", cli)) if p is None]
        return (f"{' and '.join(missing)} not found on PATH (Debian: apt-get install "
                "redis-server redis-tools)")
    return server, cli


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int, *, with_bus: bool) -> list[int]:
    """``n`` free loopback ports (and their cluster bus ports, ``port + 10000``)."""
    rng = random.Random()
    ports: list[int] = []
    for _ in range(2000):
        # Below Linux's ephemeral range (32768 and up by default), bus ports included: a
        # client socket of this or another process cannot take the port meanwhile.
        p = rng.randrange(10000, 22000)
        if p in ports or (with_bus and p + 10000 in ports):
            continue
        if _port_free(p) and (not with_bus or _port_free(p + 10000)):
            ports.append(p)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"could not find {n} free loopback ports")


def _find_prctl() -> object | None:
    """libc's ``prctl`` (Linux), looked up once at import in the parent: the child of a
    fork in a threaded process must not load libraries or import modules before
    ``exec`` (a lock held by another thread at the fork would never be released)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl: the server outlives a killed parent
        return None


_PRCTL = _find_prctl()
_PR_SET_PDEATHSIG = 1
_SIGKILL = int(signal.SIGKILL)


def _die_with_parent() -> None:
    """In the child before ``exec`` (Linux): SIGKILL when the parent dies, so that a test
    run killed (SIGTERM, SIGKILL) leaves no server behind; elsewhere nothing. (Linux sends
    it when the thread that started the server exits: start servers from a thread that
    outlives them, as the main thread does.) Only calls the ``prctl`` found at import."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)  # type: ignore[operator]


def _cli(cli: str, port: int, *args: str, timeout: float = 5.0) -> str:
    out = subprocess.run([cli, "-h", "127.0.0.1", "-p", str(port), *args],
                         capture_output=True, text=True, timeout=timeout, check=False)
    return out.stdout + out.stderr


class _Node:
    """One redis-server process."""

    def __init__(self, server: str, cli: str, port: int, workdir: Path,
                 extra: list[str]) -> None:
        self.port, self.cli = port, cli
        self.dir = Path(tempfile.mkdtemp(prefix=f"{port}-", dir=workdir))
        args = [server, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--protected-mode", "yes",
                "--daemonize", "no", "--logfile", str(self.dir / "redis.log"), *extra]
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} exited: {log}")
            if "PONG" in _cli(self.cli, self.port, "ping", timeout=2.0):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer in time")

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class _Servers:
    """Common start/stop of a set of nodes in one temporary directory."""

    def __init__(self) -> None:
        found = redis_binaries()
        if isinstance(found, str):
            raise RuntimeError(found)
        self._server, self._cli = found
        self._workdir = Path(tempfile.mkdtemp(prefix="kvcm-redis-"))
        self.nodes: list[_Node] = []

    def _start(self, ports: list[int], extra: list[str]) -> None:
        try:
            for p in ports:
                self.nodes.append(_Node(self._server, self._cli, p, self._workdir, extra))
            deadline = time.monotonic() + _START_TIMEOUT_S
            for node in self.nodes:
                node.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def _start_on_free_ports(self, n: int, extra: list[str], *, with_bus: bool) -> list[int]:
        """:meth:`_start` on ``n`` free ports, again on others (up to three times) when
        another process took one between the check and the server's bind."""
        for attempt in range(3):
            ports = _free_ports(n, with_bus=with_bus)
            try:
                self._start(ports, extra)
                return ports
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
                self.nodes = []
                self._workdir.mkdir(parents=True, exist_ok=True)
        raise AssertionError("unreachable")

    def cli(self, port: int, *args: str) -> str:
        """``redis-cli -p PORT ARGS...``'s output."""
        return _cli(self._cli, port, *args)

    def stop(self) -> None:
        """Stop every node and remove the directory (idempotent)."""
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> _Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(_Servers):
    """One standalone server on a free loopback port.

    Args:
        maxmemory: ``maxmemory`` in bytes (0: no limit); with it the server evicts least
            recently used keys (``allkeys-lru``), as a shared KV level should be run.
    """

    def __init__(self, maxmemory: int = 0) -> None:
        super().__init__()
        extra = ["--maxmemory", str(maxmemory)]
        if maxmemory:
            extra += ["--maxmemory-policy", "allkeys-lru"]
        self._start_on_free_ports(1, extra, with_bus=False)
        self.port = self.nodes[0].port
        self.url = f"redis://127.0.0.1:{self.port}/0"

        self._extra = extra

    def kill(self) -> None:
        """Kill the server (SIGKILL)."""
        self.nodes[0].kill()

    def restart(self, keep_data: bool = False) -> None:
        """Start the server again on the same port (a new process, with a new
        ``run_id``): empty, or with ``keep_data`` holding what it held (saved to an RDB
        file first and loaded at start, as a server with persistence would)."""
        extra = self._extra
        if keep_data:
            old = self.nodes[0]
            if "OK" not in self.cli(self.port, "save"):
                raise RuntimeError(f"redis-server on port {self.port} could not SAVE")
            extra = [*extra, "--dir", str(old.dir)]  # later --dir wins: its dump.rdb
        self.nodes[0].kill()
        self.nodes[0] = _Node(self._server, self._cli, self.port, self._workdir, extra)
        self.nodes[0].wait_ready(time.monotonic() + _START_TIMEOUT_S)


class RedisClusterServers(_Servers):
    """A Redis Cluster of ``primaries`` primaries with one replica each, on loopback.

    Args:
        primaries: number of primaries (at least 3, as Redis requires).
        node_timeout_ms: ``cluster-node-timeout``: how soon a dead primary's replica takes
            over (short, so that failover tests run quickly).
    """

    def __init__(self, primaries: int = 3, node_timeout_ms: int = 1000) -> None:
        super().__init__()
        extra = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                 "--cluster-config-file", "nodes.conf",
                 "--cluster-require-full-coverage", "no", "--repl-diskless-sync-delay", "0"]
        self.primaries = primaries
        ports = self._start_on_free_ports(2 * primaries, extra, with_bus=True)
        try:
            out = subprocess.run(
                [self._cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=30, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]}"
                                   f"{out.stderr[-2000:]}")
            self.wait_ok()
            self.wait_replicas()
        except BaseException:
            self.stop()
            raise
        self.url = f"redis://127.0.0.1:{ports[0]}/0"

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and knows its role."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self.cli(n.port, "cluster", "info") for n in self.nodes if n.alive]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok in time")

    def wait_replicas(self, timeout: float = 20.0) -> None:
        """Wait until every live replica is in sync with its primary (a replica that never
        synced cannot take over) and no more nodes than the cluster's primaries call
        themselves primary: just after ``--cluster create`` a node still waiting for its
        ``CLUSTER REPLICATE`` reports ``role:master`` with no slots."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [self.cli(n.port, "info", "replication") for n in self.nodes if n.alive]
            masters = sum("role:master" in i for i in infos)
            if masters <= self.primaries and all(
                    "role:master" in i or "master_link_status:up" in i for i in infos):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster's replicas did not sync in time")

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Wait until every live replica has received everything its primary wrote so far:
        for each live primary, its ``master_repl_offset`` now is reached by the ``offset``
        of every replica it lists (``slaveN:...,offset=N``) in ``INFO replication``.
        Replication is asynchronous: call this before killing a primary whose writes its
        replica must keep."""
        targets: dict[int, int] = {}
        for port in self.primary_ports():
            m = re.search(r"master_repl_offset:(\d+)", self.cli(port, "info", "replication"))
            if m is not None:
                targets[port] = int(m.group(1))
        deadline = time.monotonic() + timeout
        while targets:
            for port, want in list(targets.items()):
                info = self.cli(port, "info", "replication")
                offsets = [int(o) for o in re.findall(r"^slave\d+:.*?offset=(\d+)", info,
                                                      re.MULTILINE)]
                if offsets and min(offsets) >= want:
                    del targets[port]
            if not targets:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"replicas of the primaries on ports {sorted(targets)} "
                                   f"did not catch up in {timeout} s")
            time.sleep(0.05)

    def replica_of(self, primary: int) -> int:
        """The port of a live replica of the primary on ``primary``."""
        for n in self.nodes:
            if n.alive and n.port != primary and re.search(
                    rf"master_port:{primary}\s", self.cli(n.port, "info", "replication")):
                return n.port
        raise ValueError(f"no live replica of the primary on port {primary}")

    def wait_bus_links(self, timeout: float = 20.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and, in ``CLUSTER
        NODES``, sees every other live node ``connected`` with no ``handshake``,
        ``noaddr``, ``fail?`` or ``fail`` flag: the cluster bus links are up, as a manual
        failover needs (the replica and its primary talk over the bus)."""
        deadline = time.monotonic() + timeout
        while True:
            live = [n for n in self.nodes if n.alive]
            ok = True
            for n in live:
                if "cluster_state:ok" not in self.cli(n.port, "cluster", "info"):
                    ok = False
                    break
                seen = 0
                for line in self.cli(n.port, "cluster", "nodes").splitlines():
                    fields = line.split()
                    if len(fields) < 8 or "myself" in fields[2]:
                        continue
                    flags = fields[2].split(",")
                    if any(f in flags for f in ("handshake", "noaddr", "fail?", "fail")):
                        continue
                    if fields[7] == "connected":
                        seen += 1
                if seen < len(live) - 1:
                    ok = False
                    break
            if ok:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError("the Redis cluster's bus links did not come up in time")
            time.sleep(0.1)

    def failover_gracefully(self, replica: int, timeout: float = 60.0,
                            retry_s: float = 6.0) -> None:
        """``CLUSTER FAILOVER`` on the replica on ``replica``: it takes over its primary's
        slots with its primary's agreement (nothing lost); the old primary stays up as its
        replica and answers ``-MOVED`` for those slots. Waits first until the cluster bus
        links are up (:meth:`wait_bus_links`), sends ``CLUSTER FAILOVER`` again every
        ``retry_s`` seconds while the replica has not taken over (a manual failover times
        out after about 5 s, as it can when asked right after the cluster formed), and then
        waits until the cluster is ok; ``timeout`` bounds the whole."""
        deadline = time.monotonic() + timeout
        self.wait_bus_links(max(0.1, deadline - time.monotonic()))
        while True:
            out = self.cli(replica, "cluster", "failover")
            if "OK" not in out:
                raise RuntimeError(f"CLUSTER FAILOVER on port {replica}: {out.strip()}")
            attempt_end = min(deadline, time.monotonic() + retry_s)
            while "role:master" not in self.cli(replica, "info", "replication"):
                if time.monotonic() >= attempt_end:
                    break
                time.sleep(0.05)
            else:
                break
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the replica on port {replica} did not take over")
        self.wait_ok(max(0.1, deadline - time.monotonic()))

    def primary_ports(self) -> list[int]:
        """Ports of the live nodes that are primaries now."""
        out = []
        for n in self.nodes:
            if n.alive and "role:master" in self.cli(n.port, "info", "replication"):
                out.append(n.port)
        return out

    def kill_port(self, port: int) -> None:
        """Kill the node on ``port`` (SIGKILL)."""
        for n in self.nodes:
            if n.port == port:
                n.kill()
                return
        raise ValueError(f"no node on port {port}")

    def wait_failover(self, primaries: int, timeout: float = 20.0) -> None:
        """After a primary was killed: wait until ``primaries`` live primaries serve every
        slot again (a replica took over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.primary_ports()) >= primaries:
                self.wait_ok(max(0.1, deadline - time.monotonic()))
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster did not fail over in time")
