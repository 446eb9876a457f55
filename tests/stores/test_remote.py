"""The remote tier beyond the mapping contract: layout, names API, read-only, warm/push, deadlines, breaker, bad input."""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid

import pytest
from cuda.core.utils import FileStreamProgramCache
from fsspec.implementations.memory import MemoryFileSystem

from tiered_progcache import EntryRejected, TieredProgramCache, TierUnavailable
from tiered_progcache.chain import transfer
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.envelope import MAGIC, EnvelopeCodec
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.chain.transfer import TransferReport
from tiered_progcache.testing.servers import blackhole_server, moto_server, s3_bucket  # noqa: F401
from tiered_progcache.testing.slowfs import SlowFileSystem
from support import FakeClock


def _payload(n: int, size: int = 2000) -> bytes:
    """``size`` bytes that pass the code-object check (an ELF64 header, e_ehsize 64, no tables, then data): push uploads only those."""
    body = (hashlib.sha256(b"payload-%d" % n).digest() * (size // 32 + 1))[: size - 64]
    return b"\x7fELF\x02\x01" + bytes(46) + b"\x40\x00" + bytes(10) + body


def _memory_url() -> str:
    return f"memory://remote-{uuid.uuid4().hex}/kernels"


class FlakyFileSystem(MemoryFileSystem):
    """memory:// with its own store, a switch that makes every call fail, and a call counter."""

    protocol = "flaky"
    store: dict = {}
    pseudo_dirs = [""]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.broken = False
        self.calls = 0
        self.release = threading.Event()
        self.hang = False

    def _fault(self) -> None:
        self.calls += 1
        if self.hang:
            self.release.wait()
        if self.broken:
            raise ConnectionError("remote is down")

    def cat_file(self, path, *args, **kwargs):
        self._fault()
        return super().cat_file(path, *args, **kwargs)


def _flaky_remote(**kwargs) -> tuple[FlakyFileSystem, RemoteProgramCache]:
    fs = FlakyFileSystem(skip_instance_cache=True)
    FlakyFileSystem.store.clear()
    return fs, RemoteProgramCache(fs, f"/flaky-{uuid.uuid4().hex}", **kwargs)


# -- layout ---------------------------------------------------------------------------


def test_entries_use_cuda_cores_naming_and_hold_envelopes(s3_bucket, tmp_path):
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options)
    remote.write_key(b"kernel key", b"cubin bytes")
    local = FileStreamProgramCache(tmp_path)
    local[b"kernel key"] = b"cubin bytes"
    local_dir = LocalDir.of(local)
    (local_file,) = [local_dir.path_for(e.name) for e in local_dir.iter_entries()]
    name = entry_name(b"kernel key")
    assert s3_bucket.objects() == [s3_bucket.entry_path(name)]
    assert local_file.relative_to(tmp_path).parts == ("entries", name[:2], name[2:])
    blob = s3_bucket.fs.cat_file(s3_bucket.entry_path(name))
    assert blob.startswith(MAGIC) and blob != b"cubin bytes"
    assert local_file.read_bytes() == b"cubin bytes"  # the local tier keeps raw bytes


def test_names_api(s3_bucket):
    remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options)
    names = [entry_name(b"k%d" % n) for n in range(3)]
    for n, name in enumerate(names):
        remote.write_entry(name, _payload(n))
    entries = sorted(remote.iter_entries(), key=lambda e: e.name)
    assert [e.name for e in entries] == sorted(names)
    assert all(e.size > 2000 and e.mtime is not None for e in entries)
    assert remote.read_entry(names[1]) == _payload(1) == remote.read_key(b"k1")
    assert remote.verify_entry(names[1]) is None
    s3_bucket.fs.pipe_file(s3_bucket.entry_path(names[2]), b"garbage")
    assert "magic" in remote.verify_entry(names[2]) or "truncated" in remote.verify_entry(names[2])
    with pytest.raises(EntryRejected):
        remote.read_entry(names[2])
    assert remote.verify_entry(entry_name(b"absent")) == "missing"
    remote.delete_entry(names[0])
    with pytest.raises(KeyError):
        remote.read_entry(names[0])
    with pytest.raises(KeyError):
        remote.delete_entry(names[0])
    with pytest.raises(ValueError):
        remote.read_entry("../../etc/passwd")


def test_read_only_never_writes_or_deletes():
    url = _memory_url()
    RemoteProgramCache.from_url(url).write_key(b"k", b"v")
    ro = RemoteProgramCache.from_url(url, read_only=True)
    assert ro.read_key(b"k") == b"v"
    for attempt in (
        lambda: ro.write_key(b"k", b"w"),
        lambda: ro.delete_key(b"k"),
        ro.clear,
        lambda: ro.write_entry(entry_name(b"x"), b"x"),
        lambda: transfer.push(LocalDir("/nonexistent"), ro),
    ):
        with pytest.raises(PermissionError):
            attempt()
    assert ro.read_key(b"k") == b"v"


# -- warm and push ------------------------------------------------------------------------


def _fill_remote(remote: RemoteProgramCache, count: int) -> list[str]:
    names = [entry_name(b"warm-%d" % n) for n in range(count)]
    for n, name in enumerate(names):
        remote.write_entry(name, _payload(n))
    return names


@pytest.mark.parametrize("backend", ["s3", "memory"])
def test_warm_fetches_what_local_lacks_verifies_and_reports(backend, request, tmp_path, caplog):
    if backend == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        remote = RemoteProgramCache.from_url(bucket.url, storage_options=bucket.storage_options, transfer_concurrency=8)
    else:
        remote = RemoteProgramCache.from_url(_memory_url(), transfer_concurrency=8)
    names = _fill_remote(remote, 20)
    local = LocalDir(tmp_path)
    local.write_entry(names[0], _payload(0))  # already here: skipped
    bad = names[1]
    remote.fs.pipe_file(remote.path_for(bad), b"TPCE truncated")  # corrupt: never lands locally
    calls = []
    report = transfer.warm(remote, local, progress=lambda done, total: calls.append((done, total)))
    assert isinstance(report, TransferReport)
    assert (report.entries, report.failures, report.skipped) == (18, 1, 1)
    assert f"first: {bad[:12]}: " in caplog.text and "KeyError" not in caplog.text  # why it failed, not "absent"
    assert report.bytes == 18 * 2000 and report.seconds > 0
    assert calls[0] == (0, 19) and calls[-1] == (19, 19) and len(calls) == 4  # one call per batch of 8
    with pytest.raises(KeyError):
        local.read_entry(bad)
    assert all(local.read_entry(name) == _payload(n) for n, name in enumerate(names) if name != bad)
    again = transfer.warm(remote, local)
    assert (again.entries, again.skipped, again.failures) == (0, 19, 1)


def test_warm_of_a_name_the_remote_lacks_counts_a_failure_that_names_it(tmp_path, caplog):
    remote = RemoteProgramCache.from_url(_memory_url())
    names = _fill_remote(remote, 1)
    absent = entry_name(b"never written")
    report = transfer.warm(remote, LocalDir(tmp_path), names=[names[0], absent])
    assert (report.entries, report.failures) == (1, 1)
    assert f"1 of 2 entries failed (first: {absent[:12]}: KeyError: '{absent}')" in caplog.text


def test_warm_named_entries_only(tmp_path):
    remote = RemoteProgramCache.from_url(_memory_url())
    names = _fill_remote(remote, 5)
    report = transfer.warm(remote, LocalDir.of(FileStreamProgramCache(tmp_path)), names=names[:2])
    assert report.entries == 2
    assert {e.name for e in LocalDir(tmp_path).iter_entries()} == set(names[:2])


def test_warm_fetches_concurrently_through_batched_cat(tmp_path):
    """64 entries at 50 ms a request: sequential gets would take 3.2 s."""
    fs = SlowFileSystem(delay_s=0.05)
    fs.mkdir("bench")
    remote = RemoteProgramCache(fs, "bench/kernels", transfer_concurrency=64)
    fs.delay_s = 0.0
    names = _fill_remote(remote, 64)
    fs.delay_s = 0.05
    fs.requests.clear()
    report = transfer.warm(remote, LocalDir(tmp_path))
    assert report.entries == 64 and fs.requests["get"] == 64
    assert {e.name for e in LocalDir(tmp_path).iter_entries()} == set(names)
    assert fs.max_in_flight >= 32, fs.max_in_flight  # sequential gets would never overlap


def test_push_uploads_what_remote_lacks(s3_bucket, tmp_path):
    local = FileStreamProgramCache(tmp_path)
    for n in range(6):
        local[b"push-%d" % n] = _payload(n)
    remote = RemoteProgramCache.from_url(
        s3_bucket.url, storage_options=s3_bucket.storage_options, signing_key=b"s" * 32, transfer_concurrency=4
    )
    remote.write_key(b"push-0", _payload(0))
    calls = []
    report = transfer.push(LocalDir.of(local), remote, progress=lambda done, total: calls.append((done, total)))
    assert (report.entries, report.bytes, report.failures, report.skipped) == (5, 5 * 2000, 0, 1)
    assert calls == [(0, 5), (4, 5), (5, 5)]
    reader = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, signing_key=b"s" * 32)
    assert all(reader.read_key(b"push-%d" % n) == _payload(n) for n in range(6))
    assert transfer.push(LocalDir.of(local), remote).entries == 0
    only = transfer.push(LocalDir.of(local), remote, names=[entry_name(b"push-1")])
    assert (only.entries, only.skipped) == (0, 1)


def test_push_to_a_file_url_stages_and_renames(tmp_path):
    local = FileStreamProgramCache(tmp_path / "local")
    local[b"k"] = _payload(0)
    remote = RemoteProgramCache.from_url((tmp_path / "nfs").as_uri())
    assert transfer.push(LocalDir.of(local), remote).entries == 1
    assert remote.read_key(b"k") == _payload(0)
    assert list((tmp_path / "nfs" / "tmp").iterdir()) == []  # staged file renamed into place


# -- deadlines and the breaker -------------------------------------------------------------


def test_async_request_that_never_answers_times_out(blackhole_server):
    pytest.importorskip("s3fs")
    options = {"endpoint_url": blackhole_server.endpoint_url, "key": "k", "secret": "s"}
    with pytest.raises(TimeoutError, match="no answer within 0.3"):
        RemoteProgramCache.from_url("s3://bucket/x", storage_options=options, timeout=0.3, strict=True)


def test_blocking_request_that_never_returns_times_out():
    fs, remote = _flaky_remote(timeout=0.2)
    fs.hang = True
    try:
        with pytest.raises(TimeoutError):
            remote.read_key(b"k")
    finally:
        fs.release.set()


def test_breaker_opens_after_repeated_failures_and_probes_after_cooldown():
    clock = FakeClock()
    fs, remote = _flaky_remote(breaker=CircuitBreaker(failure_threshold=2, cooldown_s=30, clock=clock))
    remote.write_key(b"k", b"v")
    fs.broken = True
    for _ in range(2):
        with pytest.raises(ConnectionError):
            remote.read_key(b"k")
    calls = fs.calls
    with pytest.raises(TierUnavailable):
        remote.read_key(b"k")
    assert fs.calls == calls and remote.breaker.state == "open"  # skipped: no request made
    clock.now += 31
    assert remote.breaker.state == "half-open"
    with pytest.raises(ConnectionError):  # the probe goes out, fails: open for another cooldown
        remote.read_key(b"k")
    with pytest.raises(TierUnavailable):
        remote.read_key(b"k")
    clock.now += 31
    fs.broken = False
    assert remote.read_key(b"k") == b"v"  # the probe succeeds: closed again
    assert remote.breaker.state == "closed"


def test_a_miss_or_a_rejected_entry_is_not_a_failure():
    fs, remote = _flaky_remote(breaker=CircuitBreaker(failure_threshold=1, cooldown_s=30))
    fs.pipe_file(remote.path_for(entry_name(b"bad")), b"junk")
    for _ in range(3):
        with pytest.raises(KeyError):
            remote.read_key(b"absent")
        with pytest.raises(EntryRejected):
            remote.read_key(b"bad")
    assert remote.breaker.state == "closed"


# -- construction: strict, degrade, bad input ----------------------------------------------------


def test_missing_bucket_strict_is_an_error(moto_server):
    options = moto_server.storage_options()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RemoteProgramCache.from_url("s3://no-such-bucket-here/k", storage_options=options, strict=True)


def test_missing_bucket_default_degrades_then_recovers(moto_server, caplog, tmp_path):
    clock = FakeClock()
    bucket = f"tpc-late-{uuid.uuid4().hex[:12]}"
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.stores.remote"):
        remote = RemoteProgramCache.from_url(
            f"s3://{bucket}/k",
            storage_options=moto_server.storage_options(),
            breaker=CircuitBreaker(cooldown_s=30, clock=clock),
        )
        assert remote.wait_ready(60)  # the probe runs beside the constructor
    assert "does not exist" in caplog.text and "continuing without it" in caplog.text
    with pytest.raises(TierUnavailable):
        remote.read_key(b"k")
    chain = TieredProgramCache(tiers=[FileStreamProgramCache(tmp_path), remote])
    chain[b"k"] = b"v"  # works local-only
    assert chain.get(b"k") == b"v"
    import s3fs

    s3fs.S3FileSystem(**moto_server.storage_options()).call_s3("create_bucket", Bucket=bucket)
    clock.now += 31
    with pytest.raises(KeyError):  # the probe reaches the new bucket: a plain miss
        remote.read_key(b"k")
    remote.write_key(b"k", b"v")
    assert remote.read_key(b"k") == b"v"


def test_local_path_remote_read_only_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        RemoteProgramCache.from_url((tmp_path / "absent").as_uri(), read_only=True, strict=True)
    RemoteProgramCache.from_url((tmp_path / "created").as_uri(), strict=True)
    assert (tmp_path / "created").is_dir()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"url": "nosuchscheme://bucket/x"}, ValueError, "unknown URL scheme"),
        ({"url": "nosuchscheme::s3://bucket/x"}, ValueError, "unknown URL scheme 'nosuchscheme'"),
        ({"url": ""}, ValueError, "non-empty"),
        ({"url": "s3://"}, ValueError, "no bucket"),
        ({"storage_options": '{"anon": true}'}, TypeError, "mapping"),
        ({"timeout": -1}, ValueError, "positive"),
        ({"timeout": 0}, ValueError, "positive"),
        ({"timeout": float("inf")}, ValueError, "finite"),
        ({"compression": "gzip"}, ValueError, "compression"),
        ({"signing_key": b""}, ValueError, "empty"),
    ],
)
def test_bad_input(kwargs, error, match):
    if kwargs.get("url") == "s3://":
        pytest.importorskip("s3fs")
    kwargs = {"url": _memory_url(), **kwargs}
    with pytest.raises(error, match=match):
        RemoteProgramCache.from_url(kwargs.pop("url"), **kwargs)


def test_signing_key_str_and_bytes_agree():
    url = _memory_url()
    RemoteProgramCache.from_url(url, signing_key="secret-key").write_key(b"k", b"v")
    assert RemoteProgramCache.from_url(url, signing_key=b"secret-key").read_key(b"k") == b"v"
    with pytest.raises(EntryRejected):
        RemoteProgramCache.from_url(url, signing_key=b"other-key").read_key(b"k")


def test_envelope_codec_is_the_one_on_the_wire():
    url = _memory_url()
    remote = RemoteProgramCache.from_url(url, signing_key=b"k" * 32)
    remote.write_key(b"key", b"value")
    blob = remote.fs.cat_file(remote.path_for(entry_name(b"key")))
    assert EnvelopeCodec(b"k" * 32).open(entry_name(b"key"), blob) == b"value"


def test_chain_warm_and_push_delegate_to_transfer(s3_bucket, tmp_path):
    options = {"remote": s3_bucket.url, "remote_options": s3_bucket.storage_options}
    ci = TieredProgramCache(tmp_path / "ci", **options)
    FileStreamProgramCache(tmp_path / "ci")[b"built in CI"] = _payload(7)  # on disk, never uploaded
    assert ci.shared_store.verify_entry(entry_name(b"built in CI")) == "missing"
    assert ci.push().entries == 1
    node = TieredProgramCache(tmp_path / "node", **options)
    seen = []
    report = node.warm(progress=lambda done, total: seen.append((done, total)))
    assert (report.entries, seen[-1]) == (1, (1, 1))
    assert node.get(b"built in CI") == _payload(7)
    stats = node.stats()
    assert (stats["local"].hits, stats["remote"].lookups) == (1, 0)  # warmed: no network on the lookup
    with pytest.raises(ValueError, match="needs a remote"):
        TieredProgramCache(tmp_path / "alone").warm()
    ci.close()
    node.close()
