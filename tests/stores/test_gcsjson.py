"""GCS through its JSON API: when it is used, what it answers, what it sends, and what it never says."""

from __future__ import annotations

import base64
import http.server
import json
import os
import queue
import re
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tiered_progcache.stores import gcsjson
from tiered_progcache.stores.gcsjson import DEFAULT_ENDPOINT, GcsJsonCalls, GcsJsonFactory, gcs_config
from tiered_progcache.stores.remote import RemoteProgramCache, _mtime_of
from tiered_progcache.stores.runner import DeferredFilesystemFactory
from tiered_progcache.testing.delayproxy import DelayProxy
from tiered_progcache.testing.servers import BlackholeServer, gcs_bucket, gcs_server  # noqa: F401

from support import in_forked_child, refused_port

pytest.importorskip("urllib3")


@pytest.fixture
def no_gcsfs_tokens(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A home without gcsfs's token cache (``~/.gcs_tokens``)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_options_gcsfs_reads_the_same_way_are_served(no_gcsfs_tokens):
    key_file = no_gcsfs_tokens / "key.json"
    key_file.write_text('{"type": "service_account"}')
    user_file = no_gcsfs_tokens / "user.json"
    user_file.write_text('{"type": "authorized_user"}')
    assert gcs_config({"endpoint_url": "http://127.0.0.1:4443/", "token": "anon", "project": "p",
                       "skip_instance_cache": True, "cache_timeout": 5}, {}) == {
        "endpoint": "http://127.0.0.1:4443", "token": "anon"}
    assert gcs_config({}, {}) == {"endpoint": DEFAULT_ENDPOINT, "token": None}
    for token in ("google_default", "cloud", str(key_file), str(user_file)):
        assert gcs_config({"token": token}, {}) == {"endpoint": DEFAULT_ENDPOINT, "token": token}
    # the emulator's variable, as gcsfs reads it: with or without a scheme
    assert gcs_config({"token": "anon"}, {"STORAGE_EMULATOR_HOST": "localhost:9023"})["endpoint"] == \
        "http://localhost:9023"  # fmt: skip
    assert gcs_config({}, {"STORAGE_EMULATOR_HOST": "https://emu:1/"})["endpoint"] == "https://emu:1"
    assert gcs_config({}, {"STORAGE_EMULATOR_HOST": "EMUX/"})["endpoint"] == "http://EMUX"  # one "/" stripped
    assert gcs_config({"endpoint_url": "https://storage.example.com/"}, {})["endpoint"] == \
        "https://storage.example.com"  # fmt: skip
    assert gcs_config({"endpoint_url": "http://BOX/"}, {})["endpoint"] == "http://BOX"
    assert gcs_config({"endpoint_url": "http://h:2"}, {"STORAGE_EMULATOR_HOST": "emu:1"})["endpoint"] == "http://h:2"


@pytest.mark.parametrize("options, why", [
    ({"requester_pays": True}, "an option only gcsfs honours"),
    ({"session_kwargs": {}}, "aiohttp's session: only gcsfs has one"),
    ({"consistency": "md5"}, "a checksum gcsfs verifies"),
    ({"access": "read_only"}, "a scope of gcsfs's"),
    ({"token": {"type": "authorized_user"}}, "a token given as a mapping"),
    ({"token": "browser"}, "gcsfs's browser flow"),
    ({"token": "/nonexistent/key.json"}, "a key file that is not there"),
    ({"token": os.devnull}, "a key file that is not JSON"),
    ({"endpoint_url": "localhost:4443"}, "an endpoint without its scheme"),
    ({"project": 7}, "a project that is not a string"),
])
def test_what_only_gcsfs_reads_keeps_gcsfs(options, why, no_gcsfs_tokens):
    assert gcs_config(options, {}) is None, why
    assert GcsJsonFactory.serving(DeferredFilesystemFactory.for_url("gs://b/k", options)) is None, why


def test_a_key_file_of_another_type_or_past_a_mebibyte_keeps_gcsfs(no_gcsfs_tokens):
    external = no_gcsfs_tokens / "external.json"
    external.write_text('{"type": "external_account"}')
    assert gcs_config({"token": str(external)}, {}) is None
    big = no_gcsfs_tokens / "big.json"
    big.write_text('{"type": "service_account"' + " " * (1 << 20) + "}")  # read up to 1 MiB: not a whole document
    assert gcs_config({"token": str(big)}, {}) is None
    big.write_text('{"type": "service_account"' + " " * ((1 << 20) - 40) + "}")
    assert gcs_config({"token": str(big)}, {}) is not None


def test_gcsfs_own_token_cache_keeps_gcsfs_where_the_token_is_left_to_it(no_gcsfs_tokens):
    (no_gcsfs_tokens / ".gcs_tokens").write_text("{}")
    assert gcs_config({}, {}) is None
    assert gcs_config({"token": "anon"}, {}) is not None


def test_a_factory_declares_a_blocking_bucket_store_for_gs_urls_only(no_gcsfs_tokens):
    factory = GcsJsonFactory.serving(DeferredFilesystemFactory.for_url("gcs://b/kernels/", {"token": "anon"}))
    assert isinstance(factory, DeferredFilesystemFactory)
    assert (factory.root, factory.protocols, factory.is_async) == ("b/kernels", frozenset({"gs", "gcs"}), False)
    for s3_options in ({}, {"anon": True}):  # options this client would serve, on another scheme: never
        assert GcsJsonFactory.serving(DeferredFilesystemFactory.for_url("s3://b/k", s3_options)) is None


def test_the_tier_on_gcs_uses_the_json_api_and_answers_as_gcsfs_does(gcs_bucket):  # noqa: F811
    remote = RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True)
    fs = remote.fs
    assert isinstance(fs, GcsJsonCalls) and repr(fs) == f"GcsJsonCalls(gs://{gcs_bucket.bucket})"
    path = remote.path_for("ab" * 32)
    for absent in (lambda: fs.cat_file(path, start=0, end=10), lambda: fs.cat_file(path), lambda: fs.info(path),
                   lambda: fs.rm_file(path)):
        with pytest.raises(FileNotFoundError, match=f"^{re.escape(path)}: HTTP 404"):
            absent()
    assert fs.info(gcs_bucket.bucket) == {"name": gcs_bucket.bucket, "type": "directory", "size": 0}
    fs.pipe_file(path, b"0123456789", mode="create")
    with pytest.raises(FileExistsError, match="HTTP 412"):
        fs.pipe_file(path, b"other", mode="create")
    assert (fs.cat_file(path), fs.cat_file(path, start=4, end=100), fs.cat_file(path, start=2, end=5),
            fs.cat_file(path, start=10, end=11), fs.cat_file(path, start=5, end=5), fs.cat_file(path, start=4),
            fs.cat_file(path, end=3)) == (
        b"0123456789", b"456789", b"234", b"", b"", b"456789", b"012")  # past the end: GCS's 416
    info = fs.info(path)
    assert (info["name"], info["size"], info["type"]) == (path, 10, "file") and int(info["generation"]) > 0
    assert _mtime_of(info) is not None and _mtime_of(fs.find(path.rsplit("/", 1)[0], detail=True)[path]) is not None
    assert fs.exists(path) and not fs.exists(path + "x")
    assert gcs_bucket.fs.cat_file(path) == b"0123456789"  # what gcsfs reads back
    fs.pipe_file(path, b"replaced")  # a put replaces
    assert fs.cat_file(path) == b"replaced" and int(fs.info(path)["generation"]) != int(info["generation"])
    odd = f"{gcs_bucket.bucket}/kernels/a key with spaces, ?#%+ and é"
    gcs_bucket.fs.pipe_file(odd, b"written by gcsfs")
    assert fs.cat_file(odd) == b"written by gcsfs"
    assert sorted(fs.find(f"{gcs_bucket.bucket}/kernels")) == sorted([path, odd])
    assert fs.find(f"{gcs_bucket.bucket}/kernels", detail=True)[path]["size"] == 8
    with pytest.raises(ValueError, match="is not in bucket"):
        fs.rm([odd, "another-bucket/key"])  # nothing removed: every path is checked first
    assert fs.exists(odd)
    fs.rm([path, odd, path + "-never-written"])  # an absent one too: the outcome asked for holds
    assert fs.find(f"{gcs_bucket.bucket}/kernels") == []
    fs.pipe_file(path, b"one")
    fs.rm(path)  # one path, as a string
    assert not fs.exists(path)
    with pytest.raises(ValueError, match="is not in bucket"):
        fs.cat_file("another-bucket/key")


def test_a_connection_an_error_answered_on_is_never_sent_another_request(gcs_bucket):  # noqa: F811
    """fake-gcs-server closes the connection after its 416 without saying so: a POST sent on it next (never sent
    twice) fails, unless urllib3 saw the close first (most rounds: hence 50). After an error answer the kept
    connections are dropped, so the next request opens its own."""
    calls = GcsJsonCalls(gcs_bucket.bucket, gcs_config(gcs_bucket.storage_options, {}), {})
    path = f"{gcs_bucket.bucket}/kernels/short"
    calls.pipe_file(path, b"0123456789")
    for _ in range(50):
        assert calls.cat_file(path, start=10, end=11) == b""  # a 416
        calls.pipe_file(path, b"0123456789")
        with pytest.raises(FileExistsError):
            calls.pipe_file(path, b"0123456789", mode="create")  # a 412
        calls.pipe_file(path, b"0123456789")
    assert calls.cat_file(path) == b"0123456789"


def test_a_tier_under_a_deeper_prefix_names_the_bucket_alone(gcs_server):  # noqa: F811
    bucket = gcs_server.new_bucket(prefix="team/a/kernels")
    remote = RemoteProgramCache.from_url(bucket.url, storage_options=bucket.storage_options, strict=True)
    remote.write_entry("ab" * 32, b"deep")
    assert remote.read_entry("ab" * 32) == b"deep" and repr(remote.fs) == f"GcsJsonCalls(gs://{bucket.bucket})"


def test_a_listing_holds_its_prefix_alone_and_follows_its_pages(gcs_bucket, gcs_server):  # noqa: F811
    """Five objects under the prefix, in pages of two: three GETs; a sibling prefix and another directory are not in it."""
    upstream = urlsplit(gcs_server.endpoint_url)
    with DelayProxy(upstream.hostname, upstream.port, keep_alive=True) as proxy:
        config = gcs_config(dict(gcs_bucket.storage_options, endpoint_url=proxy.endpoint_url), {})
        calls = GcsJsonCalls(gcs_bucket.bucket, config, {}, list_page_size=2)
        paths = [f"{gcs_bucket.bucket}/kernels/{n}" for n in range(5)]
        for path in paths + [f"{gcs_bucket.bucket}/kernelsX/0", f"{gcs_bucket.bucket}/other/0"]:
            calls.pipe_file(path, b"x")
        before = proxy.requests
        assert calls.find(f"{gcs_bucket.bucket}/kernels/") == paths
        assert proxy.requests - before == 3
        assert sorted(calls.find(gcs_bucket.bucket)) == sorted(paths + [f"{gcs_bucket.bucket}/kernelsX/0",
                                                                         f"{gcs_bucket.bucket}/other/0"])
        with pytest.raises(FileNotFoundError, match="^tpc-never-made/k: HTTP 404"):
            GcsJsonCalls("tpc-never-made", config, {}).find("tpc-never-made/k")
    assert gcsjson.LIST_PAGE_SIZE == 1000  # GCS's most


def test_a_missing_bucket_is_file_not_found_and_a_refused_port_says_so(gcs_server):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="the bucket or directory does not exist .*tpc-no-such-bucket: HTTP 404"):
        RemoteProgramCache.from_url("gs://tpc-no-such-bucket/k", storage_options=gcs_server.storage_options(),
                                    strict=True)
    with refused_port() as port:
        with pytest.raises(ConnectionRefusedError, match=f"127.0.0.1:{port} refused the connection"):
            RemoteProgramCache.from_url("gs://b/k", storage_options={
                "endpoint_url": f"http://user:hunter2secret@127.0.0.1:{port}", "token": "anon"}, strict=True,
                timeout=5)
        with pytest.raises(ConnectionRefusedError) as refused:
            GcsJsonCalls("b", {"endpoint": f"http://user:hunter2secret@127.0.0.1:{port}", "token": "anon"},
                         {}).cat_file("b/k")
    said = "".join(traceback.format_exception(refused.value))  # what an uncaught one would print, causes and all
    assert "hunter2secret" not in said and "b/k: the endpoint refused the connection" in said, said


@pytest.mark.timeout(60, method="thread")
def test_no_request_outlives_its_read_timeout_on_a_server_that_never_answers():
    """The library's limit is 10 minutes, far past the runner's deadlines; here 0.3 s, so the hang ends in the test."""
    assert (gcsjson.READ_TIMEOUT_S, gcsjson.CONNECT_TIMEOUT_S) == (600.0, 30.0)
    hole = BlackholeServer()
    try:
        calls = GcsJsonCalls("b", {"endpoint": hole.endpoint_url, "token": "anon"}, {}, read_timeout_s=0.3)
        with pytest.raises(TimeoutError, match="b/k: .*timed out"):
            calls.cat_file("b/k")  # a GET, tried twice: 0.6 s
        with pytest.raises(TimeoutError, match="b/k: .*timed out"):
            calls.pipe_file("b/k", b"x")  # a POST, once
    finally:
        hole.close()


_FRESH_PROCESS = r"""
import json, sys
from tiered_progcache.stores.remote import RemoteProgramCache
remote = RemoteProgramCache.from_url(sys.argv[1], storage_options=json.loads(sys.argv[2]), strict=True)
remote.write_entry("ef" * 32, b"a cubin")
assert remote.read_entry("ef" * 32) == b"a cubin"
print(type(remote.fs).__name__, sorted(m for m in ("gcsfs", "aiohttp", "google.auth", "fsspec.asyn") if m in sys.modules))
"""


def test_a_fresh_process_on_gcs_imports_neither_gcsfs_nor_aiohttp(gcs_bucket):  # noqa: F811
    """gcsfs's import (aiohttp, google-auth) is what a fresh process is spared: with anonymous access, urllib3 only."""
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, gcs_bucket.url,
                           json.dumps(gcs_bucket.storage_options)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "GcsJsonCalls []\n"), done.stderr


def test_a_forked_child_builds_its_own_client(gcs_bucket):  # noqa: F811
    remote = RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True)
    remote.write_entry("cd" * 32, b"from the parent")
    parent = id(remote.fs)

    def child() -> list[Any]:
        return [type(remote.fs).__name__, id(remote.fs) != parent, remote.read_entry("cd" * 32).decode()]

    assert in_forked_child(child) == ["GcsJsonCalls", True, "from the parent"]


# -- credentials: a key file, its token from a token endpoint on loopback -------------------------------

_TOKEN = "ya29.not-a-real-token-4f1d"


class _GoogleOnLoopback(http.server.ThreadingHTTPServer):
    """Google's token endpoint and a bucket that answers only a bearer of :data:`_TOKEN`, on one loopback port."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.grants: list[dict[str, list[str]]] = []
        self.flaky: list[str] = []  # how the next requests for ``flaky`` go wrong: a status, or "drop" (no answer)
        self.sent_of_endless: queue.Queue[int] = queue.Queue()  # bytes of each "endless" body written before the
        #                                                          client let go, put once its writer is done
        self.connections: list[int] = []  # the client port each request for ``flaky`` came from
        self.endless_bytes = 4 << 30  # the length an "endless" answer states and writes while the client reads
        self.seen: list[str] = []  # the method of each request for ``flaky``
        self.paths: list[str] = []  # the path of every GET
        self.deleting = 0  # DELETEs in flight now, and the most at once
        self.most_deleting = 0
        self.deletes_meet = threading.Barrier(gcsjson.DELETE_CONCURRENCY, timeout=60)
        self.authorizations: list[str | None] = []
        self.refuse_grants = False
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _GoogleOnLoopback
    protocol_version = "HTTP/1.1"  # connections kept between requests, as GCS keeps them

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _flaky(self) -> bool:
        """A request for the object ``flaky``, answered as :attr:`_GoogleOnLoopback.flaky` says; True if sent."""
        with self.server.lock:
            self.server.seen.append(self.command)
            self.server.connections.append(self.client_address[1])
            plan = self.server.flaky.pop(0) if self.server.flaky else None
        if plan == "drop":
            self.close_connection = True  # the connection closed, no answer
        elif plan == "endless":  # a hostile server: a 4 GiB body, the range ignored, written on
            self.send_response(200)                 # until the client stops reading
            self.send_header("content-length", str(self.server.endless_bytes))
            self.end_headers()
            sent, chunk = 0, b"x" * (1 << 16)
            try:
                while sent < self.server.endless_bytes:
                    self.wfile.write(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            self.close_connection = True
            self.server.sent_of_endless.put(sent)
        elif plan is not None and plan.startswith("sized:"):  # the object's metadata, padded to exactly N bytes
            head = json.dumps({"name": "flaky", "size": "3", "generation": "9", "pad": ""}).encode()
            body = head[:-2] + b"p" * (int(plan[len("sized:"):]) - len(head)) + head[-2:]
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif plan == "cut":  # the answer's head, and a body cut short: the connection closes after 3 of 10 bytes
            self.send_response(200)
            self.send_header("content-length", "10")
            self.end_headers()
            self.wfile.write(b"012")
            self.close_connection = True
        elif plan == "whole":  # a server that ignores a range and sends the whole object
            self.send_response(200)
            self.send_header("content-length", "10")
            self.end_headers()
            self.wfile.write(b"0123456789")
        elif plan is not None:
            self._answer(int(plan), {"error": {"code": int(plan), "message": "busy"}})
        else:
            self._answer(200, {"name": "flaky", "size": "3", "generation": "9"})
        return True

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        if urlsplit(self.path).path.startswith("/upload/"):
            self._flaky()
            return
        form = parse_qs(body.decode())
        with self.server.lock:
            self.server.grants.append(form)
        if self.server.refuse_grants:
            self._answer(400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature." + "x" * 600})
        else:
            self._answer(200, {"access_token": _TOKEN, "expires_in": 3600, "token_type": "Bearer"})

    def do_DELETE(self) -> None:  # noqa: N802
        """Each DELETE held until ``DELETE_CONCURRENCY`` of them are in flight together (a broken meeting: a 400)."""
        with self.server.lock:
            self.server.deleting += 1
            self.server.most_deleting = max(self.server.most_deleting, self.server.deleting)
        try:
            self.server.deletes_meet.wait()
            met = True
        except threading.BrokenBarrierError:
            met = False
        with self.server.lock:
            self.server.deleting -= 1
        if met:
            self.send_response(204)
            self.send_header("content-length", "0")
            self.end_headers()
        else:
            self._answer(400, {"error": {"code": 400, "message": "fewer deletes at once than asked"}})

    def do_GET(self) -> None:  # noqa: N802
        path = urlsplit(self.path).path
        with self.server.lock:
            self.server.paths.append(path)
        if path.endswith("/o/flaky"):
            self._flaky()
            return
        if path.startswith("/computeMetadata/v1/"):  # the metadata server of a VM (the ``cloud`` token)
            self._metadata(path)
            return
        with self.server.lock:
            self.server.authorizations.append(self.headers.get("authorization"))
        if path.endswith("/o/forbidden"):
            self._answer(403, {"error": {"code": 403, "message": "caller does not have storage.objects.get access"}})
        elif self.headers.get("authorization") != f"Bearer {_TOKEN}":
            self._answer(401, {"error": {"code": 401, "message": "Anonymous caller"}})
        else:
            self._answer(200, {"name": "k", "size": "3", "updated": "2026-12-07T10:00:00Z", "generation": "7"})


    def _metadata(self, path: str) -> None:
        if self.headers.get("metadata-flavor") != "Google":
            self._answer(403, {"error": "Missing Metadata-Flavor header"})
            return
        with self.server.lock:
            self.server.grants.append({"metadata": [path]})
        if path.endswith("/service-accounts/default/token"):
            doc: object = {"access_token": _TOKEN, "expires_in": 3600, "token_type": "Bearer"}
        elif path.endswith("/service-accounts/default/"):
            doc = {"email": "vm@p.iam.gserviceaccount.com", "scopes": [gcsjson.SCOPE], "aliases": ["default"]}
        else:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("metadata-flavor", "Google")
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def google_on_loopback() -> Iterator[_GoogleOnLoopback]:
    server = _GoogleOnLoopback()
    yield server
    server.shutdown()
    server.server_close()


def _key_file(tmp_path: Any, token_uri: str) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path = tmp_path / "service-account.json"
    path.write_text(json.dumps({"type": "service_account", "project_id": "p", "private_key_id": "k1",
                                "private_key": pem, "client_email": "cache@p.iam.gserviceaccount.com",
                                "client_id": "1", "token_uri": f"{token_uri}/token"}))
    return str(path)


def _user_key_file(tmp_path: Any, token_uri: str) -> str:
    path = tmp_path / "user.json"
    path.write_text(json.dumps({"type": "authorized_user", "client_id": "c1", "client_secret": "user-secret-9d2",
                                "refresh_token": "refresh-7f3e", "token_uri": f"{token_uri}/token"}))
    return str(path)


def _scope_of(grant: dict[str, list[str]]) -> str | None:
    """The scope a service account's signed assertion asks for (its JWT's ``scope`` claim); None in another grant."""
    if "assertion" not in grant:
        return None
    payload = grant["assertion"][0].split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))).get("scope")


def test_a_key_file_token_is_fetched_once_and_sent_with_every_request(google_on_loopback, tmp_path, caplog):
    pytest.importorskip("google.auth")
    pytest.importorskip("cryptography")
    key_file = _key_file(tmp_path, google_on_loopback.url)
    calls = GcsJsonCalls("b", {"endpoint": google_on_loopback.url, "token": key_file}, {"token": key_file})
    threads = [threading.Thread(target=lambda: [calls.info("b/k") for _ in range(5)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(google_on_loopback.grants) == 1  # one refresh for every thread
    assert google_on_loopback.grants[0]["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
    assert _scope_of(google_on_loopback.grants[0]) == gcsjson.SCOPE  # objects' read and write, nothing more
    assert google_on_loopback.authorizations == [f"Bearer {_TOKEN}"] * 20
    with pytest.raises(PermissionError, match="b/forbidden: HTTP 403: caller does not have") as refused:
        calls.info("b/forbidden")
    said = "".join(traceback.format_exception(refused.value)) + repr(calls) + caplog.text
    assert _TOKEN not in said and "PRIVATE KEY" not in said, said


def test_a_user_key_file_gives_user_credentials_that_ask_for_no_scope(tmp_path):
    """A user's refresh token refuses a scope it was not granted: gcsfs asks for none, nor does this client. (Its
    refresh goes to Google's own token endpoint whatever the file says, which no test here can reach.)"""
    pytest.importorskip("google.auth")
    import google.oauth2.credentials

    loaded = gcsjson._Credentials(_user_key_file(tmp_path, "http://127.0.0.1:1"), None)._load()
    assert isinstance(loaded, google.oauth2.credentials.Credentials)
    assert (loaded.refresh_token, loaded.client_id, loaded.scopes) == ("refresh-7f3e", "c1", None)


def test_a_refused_grant_is_a_permission_error_that_names_no_secret(google_on_loopback, tmp_path, caplog):
    pytest.importorskip("google.auth")
    pytest.importorskip("cryptography")
    google_on_loopback.refuse_grants = True
    key_file = _key_file(tmp_path, google_on_loopback.url)
    calls = GcsJsonCalls("b", {"endpoint": google_on_loopback.url, "token": key_file}, {})
    with pytest.raises(PermissionError, match="b/k: no GCS token: RefreshError: .*invalid_grant") as refused:
        calls.info("b/k")
    assert google_on_loopback.authorizations == []  # nothing asked of the bucket without a token
    first = str(refused.value).split("no GCS token: RefreshError: ", 1)[1]
    assert len(first) == 300 and first.endswith("x")  # google-auth's words, their first 300 characters
    said = "".join(traceback.format_exception(refused.value)) + caplog.text
    assert "PRIVATE KEY" not in said and open(key_file).read()[:80] not in said, said


_NO_CREDENTIALS = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tiered_progcache.stores.gcsjson import GcsJsonCalls, gcs_config
options = json.loads(sys.argv[2])
calls = GcsJsonCalls(sys.argv[1], gcs_config(options), options)
try:
    calls.info(sys.argv[1])
    calls.info(sys.argv[1])
    print("anonymous")
except PermissionError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("token, said", [(None, "anonymous\n"), ("google_default", "refused: ")])
def test_without_credentials_token_none_goes_anonymous_and_google_default_is_refused(gcs_bucket, google_on_loopback,
                                                                                     tmp_path, token,
                                                                                     said):  # noqa: F811
    """As gcsfs ends its search: no default credentials (no key file; the metadata server on loopback is not a VM's),
    then anonymous, searched for once for two requests; ``google_default`` insists on them."""
    pytest.importorskip("google.auth")
    host = google_on_loopback.url.split("://", 1)[1]
    env = {**os.environ, "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path), "GCE_METADATA_HOST": host,
           "GCE_METADATA_IP": host}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    options = {"endpoint_url": gcs_bucket.storage_options["endpoint_url"], "token": token}
    done = subprocess.run([sys.executable, "-c", _NO_CREDENTIALS, gcs_bucket.bucket, json.dumps(options)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(said), (done.stdout, done.stderr)
    if token is None:
        assert "no Google credentials found: GCS requests go anonymous" in done.stderr
        assert google_on_loopback.paths == ["/"], google_on_loopback.paths  # one look for a VM, for both requests
    else:
        assert "no GCS token: DefaultCredentialsError" in done.stdout


_WITH_CREDENTIALS = r"""
import json, sys
from tiered_progcache.stores.gcsjson import GcsJsonCalls, gcs_config
options = json.loads(sys.argv[1])
calls = GcsJsonCalls("b", gcs_config(options), options)
print(calls.info("b/k")["generation"], calls.info("b/k")["size"])
"""


@pytest.mark.parametrize("token, how", [
    ("cloud", "the VM's metadata server"),
    ("google_default", "Google's default credentials: the key file GOOGLE_APPLICATION_CREDENTIALS names"),
    (None, "left to the search gcsfs makes: the same default credentials"),
])
def test_a_token_from_the_metadata_server_or_the_default_credentials_is_sent(google_on_loopback, tmp_path, token,
                                                                             how):
    """Each in a fresh process (google-auth reads where the metadata server is when it is imported)."""
    pytest.importorskip("google.auth")
    pytest.importorskip("cryptography")
    host = google_on_loopback.url.split("://", 1)[1]
    env = {**os.environ, "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path), "GCE_METADATA_HOST": host,
           "GCE_METADATA_IP": host}
    if token == "cloud":
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    else:
        env["GOOGLE_APPLICATION_CREDENTIALS"] = _key_file(tmp_path, google_on_loopback.url)
    options = {"endpoint_url": google_on_loopback.url, "token": token}
    done = subprocess.run([sys.executable, "-c", _WITH_CREDENTIALS, json.dumps(options)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "7 3\n"), (how, done.stderr)
    assert google_on_loopback.authorizations == [f"Bearer {_TOKEN}"] * 2, how
    granted = [grant for grant in google_on_loopback.grants if "metadata" not in grant or
               grant["metadata"][0].endswith("/token")]
    assert len(granted) == 1, (how, google_on_loopback.grants)  # one token for both requests
    if token != "cloud":
        assert _scope_of(granted[0]) == gcsjson.SCOPE, how


def test_a_get_is_sent_again_after_a_busy_answer_or_a_lost_one_and_a_post_is_not(google_on_loopback):
    """A 503 says nothing was done, and a GET repeated does what the first did: at most two more. A POST whose
    answer was lost is not sent again (a create would find its own object), nor one answered 503."""
    server = google_on_loopback
    calls = GcsJsonCalls("b", {"endpoint": server.url, "token": "anon"}, {})
    assert gcsjson.RETRIED_STATUSES == (408, 429, 500, 502, 503, 504)
    for busy in gcsjson.RETRIED_STATUSES:
        server.flaky[:], server.seen[:] = [str(busy), "drop"], []
        assert calls.info("b/flaky")["size"] == 3 and server.seen == ["GET"] * 3, busy
    server.flaky[:], server.seen[:] = ["501"], []
    with pytest.raises(OSError, match="b/flaky: HTTP 501: busy"):
        calls.info("b/flaky")  # not one to retry
    assert server.seen == ["GET"]
    server.flaky[:], server.seen[:] = ["503"] * 3, []
    with pytest.raises(OSError, match="b/flaky: HTTP 503: busy"):
        calls.info("b/flaky")
    assert server.seen == ["GET"] * 3 and server.flaky == []  # the first and two more
    server.flaky[:], server.seen[:] = ["drop", "drop"], []
    with pytest.raises(OSError, match="^b/flaky: ProtocolError: .*(Connection aborted|RemoteDisconnected)") as lost:
        calls.info("b/flaky")  # a lost answer: sent once more, lost again
    assert type(lost.value) is OSError and server.seen == ["GET"] * 2  # not a timeout, not a refusal
    for status, kind in ((400, OSError), (401, PermissionError), (403, PermissionError)):
        server.flaky[:], server.seen[:] = [str(status)], []
        with pytest.raises(kind, match=f"^b/flaky: HTTP {status}: busy") as refused:
            calls.info("b/flaky")
        assert type(refused.value) is kind and server.seen == ["GET"], status
    server.flaky[:] = ["whole", "whole"]
    assert (calls.cat_file("b/flaky", start=2, end=5), calls.cat_file("b/flaky", start=4)) == (b"234", b"456789")
    for plans, sends in ((["cut"], 2), (["503", "cut"], 3), (["cut", "503"], 3)):
        server.flaky[:], server.seen[:] = [*plans, "whole"], []
        assert calls.cat_file("b/flaky", start=0, end=10) == b"0123456789" and server.seen == ["GET"] * sends, plans
    server.flaky[:], server.seen[:] = ["cut", "cut", "whole"], []
    with pytest.raises(OSError, match="^b/flaky: .*IncompleteRead"):
        calls.cat_file("b/flaky", start=0, end=10)  # a body cut short is a lost answer: sent again once
    assert server.seen == ["GET"] * 2
    for plan in ("503", "drop", "cut"):
        server.flaky[:], server.seen[:] = [plan], []
        with pytest.raises(OSError):
            calls.pipe_file("b/flaky", b"x")
        assert server.seen == ["POST"], plan


@pytest.mark.timeout(120, method="thread")
def test_a_server_that_sends_more_than_asked_is_read_no_further_than_the_request_needs(google_on_loopback):
    """A hostile endpoint answers a lease's 64 KiB range with a 4 GiB object, and a metadata read with 4 GiB: the range
    reads its 64 KiB (the object from its start, as from a server that ignores ranges), the metadata read is refused
    past ``MAX_ANSWER_BYTES``; each drops its connection with the rest unread, and the next request is answered."""
    server = google_on_loopback
    calls = GcsJsonCalls("b", {"endpoint": server.url, "token": "anon"}, {})
    assert gcsjson.MAX_ANSWER_BYTES == 16 << 20 and gcsjson.MAX_OBJECT_BYTES == (1 << 30) + 88 + 32
    server.flaky[:] = ["endless"]
    assert calls.cat_file("b/flaky", start=0, end=64 * 1024) == b"x" * (64 * 1024)
    server.flaky[:] = ["endless"]
    with pytest.raises(OSError, match=f"^b/flaky: an answer over the {16 << 20} bytes this request reads$"):
        calls.info("b/flaky")
    server.flaky[:] = [f"sized:{16 << 20}", f"sized:{(16 << 20) + 1}"]  # the bound itself is read, a byte more is not
    assert calls.info("b/flaky")["size"] == 3
    with pytest.raises(OSError, match=f"^b/flaky: an answer over the {16 << 20} bytes this request reads$"):
        calls.info("b/flaky")
    server.connections[:] = []
    assert [calls.info("b/flaky")["size"] for _ in range(3)] == [3, 3, 3]  # (a dropped connection would read the rest)
    assert len(set(server.connections)) == 1  # an answer read to its end leaves its connection for the next request
    # Written before the client let go: what it read (64 KiB + 1, 16 MiB + 1) plus what the sockets' buffers took
    ranged, metadata = sorted(server.sent_of_endless.get(timeout=60) for _ in range(2))  # (in any order)
    assert ranged < 16 << 20 and metadata < 48 << 20, (ranged, metadata)


def test_deletes_go_sixteen_at_once_and_never_more(google_on_loopback):
    """The bound the docs state: each DELETE is held until 16 are in flight together, so fewer at once never
    finishes (a 400 after a minute); more at once is counted where the 17th arrives before the 16 are let go."""
    calls = GcsJsonCalls("b", {"endpoint": google_on_loopback.url, "token": "anon"}, {})
    calls.rm([f"b/k/{n}" for n in range(32)])
    assert (gcsjson.DELETE_CONCURRENCY, google_on_loopback.most_deleting) == (16, 16)
