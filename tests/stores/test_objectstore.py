"""S3 through obstore: when it is used, what it answers, and the two places it must not be (a fork, an exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

from tiered_progcache.stores.objectstore import ObjectStoreCalls, ObjectStoreFactory, obstore_config
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.runner import DeferredFilesystemFactory
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from support import in_forked_child, refused_port

pytest.importorskip("obstore")

NO_AWS_FILES = {"AWS_CONFIG_FILE": "/nonexistent/config", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials"}


def test_the_options_obstore_can_say_are_said_to_it():
    options = {"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s", "token": "t",
               "client_kwargs": {"region_name": "eu-west-1"}, "skip_instance_cache": True}
    assert obstore_config("s3", options, NO_AWS_FILES) == {
        "endpoint": "http://127.0.0.1:9000", "access_key_id": "k", "secret_access_key": "s", "session_token": "t",
        "region": "eu-west-1", "client_options": {"allow_http": True}}
    assert obstore_config("s3a", {"anon": True, "client_kwargs": {"endpoint_url": "https://minio:9000"}},
                          NO_AWS_FILES) == {"skip_signature": True, "endpoint": "https://minio:9000",
                                            "region": "us-east-1"}  # an S3-compatible endpoint: any region signs
    assert obstore_config("s3", {}, {**NO_AWS_FILES, "AWS_REGION": "us-west-2"}) == {}  # obstore reads the env
    # botocore's pool size and call timeouts: the runner's threads and deadlines do that work
    assert obstore_config("s3", {"config_kwargs": {"max_pool_connections": 64, "read_timeout": 5}},
                          {**NO_AWS_FILES, "AWS_REGION": "us-west-2"}) == {}


@pytest.mark.parametrize("options, environ, why", [
    ({"profile": "dev"}, NO_AWS_FILES, "an option obstore has no word for"),
    ({"client_kwargs": {"verify": False}}, NO_AWS_FILES, "a client option it has no word for"),
    ({"config_kwargs": {"s3": {"addressing_style": "virtual"}}}, NO_AWS_FILES, "a botocore setting it is not told"),
    ({"key": 7}, NO_AWS_FILES, "a key that is not a string"),
    ({}, {**NO_AWS_FILES, "AWS_PROFILE": "dev", "AWS_REGION": "us-west-2"}, "a profile only botocore reads"),
    ({}, NO_AWS_FILES, "AWS itself with no region: botocore finds the bucket's, object_store would not"),
])
def test_what_only_botocore_reads_keeps_s3fs(options, environ, why):
    assert obstore_config("s3", options, environ) is None, why


def test_an_aws_config_file_keeps_s3fs_unless_the_keys_are_given(tmp_path):
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-west-1\n")
    environ = {"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    assert obstore_config("s3", {"endpoint_url": "http://h:1"}, environ) is None
    assert obstore_config("s3", {"endpoint_url": "http://h:1", "key": "k", "secret": "s"}, environ) is not None


def test_gcs_and_other_schemes_keep_their_fsspec_client():
    assert obstore_config("gs", {"token": "anon"}, NO_AWS_FILES) is None
    assert obstore_config("memory", {}, NO_AWS_FILES) is None
    assert ObjectStoreFactory.serving(DeferredFilesystemFactory.for_url("gs://b/k", {"token": "anon"})) is None
    assert ObjectStoreFactory.serving(DeferredFilesystemFactory.for_url("s3://b/k", {"profile": "dev"})) is None


def test_a_factory_declares_a_blocking_bucket_store_before_it_imports_anything():
    factory = ObjectStoreFactory.serving(
        DeferredFilesystemFactory.for_url("s3://b/kernels/", {"endpoint_url": "http://h:1", "anon": True}))
    assert isinstance(factory, DeferredFilesystemFactory)
    assert (factory.root, factory.protocols, factory.is_async) == ("b/kernels", frozenset({"s3", "s3a"}), False)


def test_the_tier_on_s3_uses_obstore_and_answers_as_fsspec_does(s3_bucket):  # noqa: F811
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
    fs = remote.fs
    assert isinstance(fs, ObjectStoreCalls)
    path = remote.path_for("ab" * 32)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(path, start=0, end=10)
    fs.pipe_file(path, b"0123456789", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"other", mode="create")
    assert (fs.cat_file(path), fs.cat_file(path, start=4, end=100), fs.cat_file(path, start=10, end=11)) == (
        b"0123456789", b"456789", b"")  # past the end: S3's 416, the object ends there
    assert fs.info(path)["size"] == 10 and fs.exists(path) and not fs.exists(path + "x")
    assert list(fs.find(remote.path_for("ab" * 32).rsplit("/", 2)[0])) == [path]
    fs.rm([path])
    assert not fs.exists(path)
    fs.pipe_file(path, b"again")
    fs.rm_file(path)
    assert not fs.exists(path)
    fs.rm_file(path)  # S3 deletes of a miss succeed, as s3fs's do
    with pytest.raises(ValueError, match="is not in bucket"):
        fs.cat_file("another-bucket/key")


def test_a_missing_bucket_is_file_not_found_and_a_refused_port_says_so(moto_server):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="the bucket or directory does not exist"):
        RemoteProgramCache.from_url("s3://tpc-no-such-bucket/k", storage_options=moto_server.storage_options(),
                                    strict=True)
    with refused_port() as port:
        with pytest.raises(ConnectionRefusedError, match=f"127.0.0.1:{port} refused the connection"):
            RemoteProgramCache.from_url("s3://b/k", storage_options={
                "endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"}, strict=True, timeout=5)


def test_a_forked_child_of_a_process_that_made_obstore_requests_uses_s3fs(s3_bucket):  # noqa: F811
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
    remote.write_entry("cd" * 32, b"from the parent")
    assert isinstance(remote.fs, ObjectStoreCalls)

    def child() -> list[str]:
        return [type(remote.fs).__name__, remote.read_entry("cd" * 32).decode()]

    assert in_forked_child(child) == ["S3FileSystem", "from the parent"]


_FORK_AFTER_A_FAILED_REQUEST = r"""
import json, os, sys
from tiered_progcache.stores.objectstore import ObjectStoreFactory
from tiered_progcache.stores.runner import DeferredFilesystemFactory
factory = ObjectStoreFactory.serving(DeferredFilesystemFactory.for_url("s3://b/k", json.loads(sys.argv[1])))
try:
    factory.build().cat_file("b/k/x", start=0, end=8)
except OSError:
    pass  # refused: the request ran on obstore's runtime all the same
pid = os.fork()
if pid == 0:
    print(type(factory.build(fresh=True)).__name__, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_failed_request_counts_as_the_runtime_started_for_a_forked_child():
    """A request that failed still started obstore's threads: a child forked after it builds s3fs."""
    with refused_port() as port:
        options = json.dumps({"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"})
        done = subprocess.run([sys.executable, "-c", _FORK_AFTER_A_FAILED_REQUEST, options], capture_output=True,
                              text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "S3FileSystem\n"), done.stderr


_FORK_BEFORE_ANY_REQUEST = r"""
import json, os, sys
from tiered_progcache.stores.objectstore import ObjectStoreFactory
from tiered_progcache.stores.runner import DeferredFilesystemFactory
factory = ObjectStoreFactory.serving(DeferredFilesystemFactory.for_url(sys.argv[1], json.loads(sys.argv[2])))
pid = os.fork()
if pid == 0:
    calls = factory.build(fresh=True)
    print(type(calls).__name__, calls.exists(sys.argv[1].split("://")[1] + "/nothing"), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_of_a_process_that_made_none_uses_obstore(s3_bucket):  # noqa: F811
    """A fresh process (no request made) forks: the child's obstore runtime starts in the child and serves it."""
    done = subprocess.run([sys.executable, "-c", _FORK_BEFORE_ANY_REQUEST, s3_bucket.url,
                           json.dumps(s3_bucket.storage_options)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "ObjectStoreCalls False\n"), done.stderr


_EXIT_WITH_A_REQUEST_RETRYING = r"""
import json, sys
from tiered_progcache.stores.remote import RemoteProgramCache
remote = RemoteProgramCache.from_url("s3://b/k", storage_options=json.loads(sys.argv[1]), timeout=0.05)
remote.wait_ready(5)  # the probe's request gave up at its deadline; obstore's own retries are still running
print("exiting", flush=True)
"""


def test_a_process_exits_cleanly_while_an_obstore_request_still_retries():
    """obstore's coroutines would complete from its own threads into an exiting interpreter (SIGABRT); its
    blocking calls on the runner's daemon threads end with them. Ten real processes, each leaving one behind."""
    with refused_port() as port:
        options = json.dumps({"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"})
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        codes = [subprocess.run([sys.executable, "-c", _EXIT_WITH_A_REQUEST_RETRYING, options], env=env,
                                capture_output=True, text=True, timeout=120) for _ in range(10)]
    assert [(done.returncode, done.stdout) for done in codes] == [(0, "exiting\n")] * 10, codes[0].stderr


def test_the_probe_opens_two_connections_for_a_first_hit_beside_its_boot_listing(s3_bucket, moto_server):  # noqa: F811
    """A fresh node's first hit reads its entry while the boot fetch lists: two requests at once, each on a
    connection the probe opened. Behind a proxy with a 200 ms round trip the probe's two asks overlap."""
    from urllib.parse import urlsplit

    from tiered_progcache.testing.delayproxy import DelayProxy

    upstream = urlsplit(moto_server.endpoint_url)
    with DelayProxy(upstream.hostname, upstream.port, rtt_s=0.2, keep_alive=True) as proxy:
        options = dict(s3_bucket.storage_options, endpoint_url=proxy.endpoint_url)
        remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=options)
        assert remote.wait_ready(60)
        assert [sent.path for sent in proxy.sent[:2]] == ["/" + s3_bucket.bucket] * 2
        # Two from the probe; its round-trip sample after it reuses one (or, where obstore's pool has not yet
        # taken an answered connection back, opens a third).
        assert proxy.connections in (2, 3)


def test_a_warm_batch_runs_its_requests_side_by_side_up_to_transfer_concurrency(s3_bucket, moto_server):  # noqa: F811
    """obstore blocks a runner thread per request: a batch of 32 gets 32 threads (``transfer_concurrency``), so
    behind a 200 ms round trip its requests overlap (each on a connection of its own); with 4, at most 4 do."""
    from urllib.parse import urlsplit

    from tiered_progcache.stores.store import entry_name
    from tiered_progcache.testing.delayproxy import DelayProxy

    writer = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
    names = [entry_name(b"side-%d" % n) for n in range(32)]
    assert writer.write_many({name: b"payload" for name in names}).errors == {}
    upstream = urlsplit(moto_server.endpoint_url)
    for concurrency, at_least, at_most in ((32, 16, 32 + 2), (4, 1, 4 + 2)):
        with DelayProxy(upstream.hostname, upstream.port, rtt_s=0.2, keep_alive=True) as proxy:
            options = dict(s3_bucket.storage_options, endpoint_url=proxy.endpoint_url)
            remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=options,
                                                 transfer_concurrency=concurrency)
            assert remote.wait_ready(60)
            before = proxy.connections
            assert set(remote.read_many(names).hits) == set(names)
            assert at_least <= proxy.connections - before + 2 <= at_most, (concurrency, proxy.connections, before)


def test_a_password_in_the_endpoint_never_reaches_the_message():
    with refused_port() as port:
        with pytest.raises(ConnectionRefusedError) as refused:
            RemoteProgramCache.from_url("s3://b/k", storage_options={
                "endpoint_url": f"http://user:hunter2secret@127.0.0.1:{port}", "key": "k", "secret": "s"},
                strict=True, timeout=5)
    said = "".join(traceback.format_exception(refused.value))  # what an uncaught one would print, causes and all
    assert "hunter2secret" not in said and "user:***@127.0.0.1" in said, said


@pytest.mark.timeout(60, method="thread")  # unbounded, the call blocks in obstore where no signal reaches it
def test_no_request_outlives_the_request_timeout_on_a_server_that_never_answers():
    """A server that accepts and never answers would hold a runner thread for good; obstore's own limit frees it.
    The library's limit is 10 minutes (docs/remote-format.md); here 0.3 s, so the hang ends within the test."""
    import datetime

    from tiered_progcache.stores import objectstore
    from tiered_progcache.testing.servers import BlackholeServer

    assert objectstore.REQUEST_TIMEOUT == datetime.timedelta(minutes=10)
    hole = BlackholeServer()
    try:
        config = obstore_config("s3", {"endpoint_url": hole.endpoint_url, "key": "k", "secret": "s"}, NO_AWS_FILES)
        calls = ObjectStoreCalls("b", config, {}, request_timeout=datetime.timedelta(seconds=0.3))
        with pytest.raises(OSError, match="(?i)timed? ?out"):
            calls.cat_file("b/k", start=0, end=8)
    finally:
        hole.close()
