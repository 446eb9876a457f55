"""Faults on the remote: a server that dies, corrupt and forged objects, read-only, a full or stuck upload queue."""

from __future__ import annotations

import threading
import time

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.envelope import EnvelopeCodec
from tiered_progcache.stores.store import entry_name
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.testing.servers import moto_server, private_moto_server, s3_bucket  # noqa: F401
from tiered_progcache.testing.slowfs import SlowFileSystem
from support import compile_matmul as _compile

KEY = b"fleet-signing-key-0123456789abcdef"


def _only_entry(bucket) -> tuple[str, str]:
    (path,) = bucket.objects()
    return path, path.rsplit("/", 2)[-2] + path.rsplit("/", 1)[-1]


def test_server_dies_mid_run_compiles_still_finish_in_bounded_time(private_moto_server, tmp_path):
    bucket = private_moto_server.new_bucket()
    chain = TieredProgramCache(
        tmp_path / "node", remote=bucket.url, remote_options=bucket.storage_options, remote_timeout=2, strict=True
    )
    _compile(chain, 16)
    assert chain.flush(timeout=30) and chain.stats()["remote"].writes == 1

    private_moto_server.stop()
    started = time.monotonic()
    cubin = _compile(chain, 32)  # remote read fails (deadline), NVRTC compiles, the upload fails in the background
    assert cubin.startswith(b"\x7fELF")
    assert chain.flush(timeout=30)
    for epilogue in ("relu", "identity"):  # more misses: the breaker opens, later ones are skipped
        _compile(chain, 16 if epilogue == "relu" else 32, epilogue)
        chain.flush(timeout=30)
    elapsed = time.monotonic() - started
    remote = chain.stats()["remote"]
    assert remote.errors + remote.timeouts >= 3, remote
    assert remote.skipped >= 1, remote
    assert remote.hits == 0 and remote.writes == 1
    assert elapsed < 3 * 2 + 10, elapsed  # at most three deadlines (a stopped server refuses), then no more waiting
    assert chain.get(_key_of(chain, 32)) == cubin  # served locally all along
    chain.close()


def _key_of(chain: TieredProgramCache, tile: int) -> bytes:
    from cuda.core.utils import make_program_cache_key

    return make_program_cache_key(
        code=matmul_source(tile), code_type="c++", options=ProgramOptions(std="c++17", arch="sm_90"), target_type="cubin"
    )


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_object_is_never_returned_and_is_overwritten(damage, s3_bucket, tmp_path):
    options = {"remote": s3_bucket.url, "remote_options": s3_bucket.storage_options}
    writer = TieredProgramCache(tmp_path / "a", **options)
    cubin = _compile(writer)
    assert writer.flush(timeout=30)
    path, name = _only_entry(s3_bucket)
    blob = s3_bucket.fs.cat_file(path)
    bad = blob[:-100] + bytes(b ^ 0xFF for b in blob[-100:]) if damage == "flip" else blob[: len(blob) // 2]
    s3_bucket.fs.pipe_file(path, bad)

    reader = TieredProgramCache(tmp_path / "b", **options)
    assert reader.get(_key_of(reader, 16)) is None
    stats = reader.stats()["remote"]
    assert (stats.hits, stats.misses, stats.rejected) == (0, 1, 1)
    assert _compile(reader) == cubin  # recompiled; the corrupt bytes never reached the caller
    assert reader.flush(timeout=30)
    assert s3_bucket.fs.cat_file(path) == blob  # the next store overwrote it (same compile, same envelope)
    assert RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options).verify_entry(name) is None
    writer.close()
    reader.close()


def test_forged_and_unsigned_entries_are_rejected(s3_bucket, tmp_path):
    chain = TieredProgramCache(
        tmp_path / "node", remote=s3_bucket.url, remote_options=s3_bucket.storage_options, signing_key=KEY
    )
    key = _key_of(chain, 16)
    name = entry_name(key)
    path = f"{s3_bucket.bucket}/{s3_bucket.prefix}/entries/{name[:2]}/{name[2:]}"
    s3_bucket.fs.pipe_file(path, EnvelopeCodec(b"attacker's key").seal(name, b"\x7fELF evil kernel"))
    assert chain.get(key) is None
    s3_bucket.fs.pipe_file(path, EnvelopeCodec(None).seal(name, b"\x7fELF evil kernel"))
    assert chain.get(key) is None
    assert chain.stats()["remote"].rejected == 2
    cubin = _compile(chain)
    assert b"evil" not in cubin
    assert chain.flush(timeout=30)
    assert EnvelopeCodec(KEY).open(name, s3_bucket.fs.cat_file(path)) == cubin  # re-signed by the store
    chain.close()


def test_read_only_chain_sends_no_write_to_the_server(s3_bucket, tmp_path):
    seeded = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options)
    seeded.write_key(b"seeded key", b"seeded cubin")
    before = {p: s3_bucket.fs.info(p)["ETag"] for p in s3_bucket.objects()}
    chain = TieredProgramCache(
        tmp_path / "fleet", remote=s3_bucket.url, remote_options=s3_bucket.storage_options, remote_read_only=True
    )
    assert chain.get(b"seeded key") == b"seeded cubin"  # the read went to the server
    assert chain.stats()["remote"].hits == 1
    _compile(chain)  # a miss everywhere: compiled and stored, locally only
    chain[b"another"] = b"bytes"
    del chain[b"seeded key"]
    assert chain.flush(timeout=5)
    chain.close()
    after = {p: s3_bucket.fs.info(p)["ETag"] for p in s3_bucket.objects()}
    assert after == before  # nothing added, replaced or deleted
    assert chain.stats()["remote"].writes == 0


def _gated_chain(tmp_path, gate: threading.Event, max_pending_uploads: int) -> tuple[SlowFileSystem, TieredProgramCache]:
    fs = SlowFileSystem(write_gate=gate)
    fs.mkdir("bucket")
    remote = RemoteProgramCache(fs, "bucket/kernels", timeout=60)
    chain = TieredProgramCache(
        tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path), remote],
        max_pending_uploads=max_pending_uploads,
    )
    return fs, chain


def test_full_write_back_queue_drops_and_counts_never_blocks(tmp_path):
    gate = threading.Event()
    fs, chain = _gated_chain(tmp_path, gate, max_pending_uploads=2)
    try:
        chain[b"k0"] = b"v0"
        assert fs.writes_started.wait(10)  # k0's upload is in flight, held at the gate
        chain[b"k1"] = b"v1"
        chain[b"k2"] = b"v2"  # the queue (2) is now full
        chain[b"k1"] = b"v1 again"  # coalesced with the queued k1: not a drop
        started = time.monotonic()
        chain[b"k3"] = b"v3"  # dropped, at once
        assert time.monotonic() - started < 1.0
        assert chain.stats()["remote"].dropped == 1
        assert all(chain.get(b"k%d" % n) is not None for n in range(4))  # local tiers hold everything
    finally:
        gate.set()
    assert chain.flush(timeout=30)
    remote = chain.shared_store
    assert sorted(e.name for e in remote.iter_entries()) == sorted(entry_name(b"k%d" % n) for n in range(3))
    assert remote.read_key(b"k1") == b"v1 again"
    assert chain.stats()["remote"].writes == 3
    chain.close()


def test_flush_times_out_while_an_upload_is_stuck(tmp_path):
    gate = threading.Event()
    fs, chain = _gated_chain(tmp_path, gate, max_pending_uploads=8)
    try:
        chain[b"k"] = b"v"
        assert fs.writes_started.wait(10)
        started = time.monotonic()
        assert chain.flush(timeout=0.2) is False
        assert 0.15 < time.monotonic() - started < 5
    finally:
        gate.set()
    assert chain.flush(timeout=30) is True
    assert chain.shared_store.read_key(b"k") == b"v"
    chain.close()


def test_slow_remote_times_out_then_is_skipped(tmp_path):
    fs = SlowFileSystem()
    fs.mkdir("bucket")
    remote = RemoteProgramCache(fs, "bucket/kernels", timeout=0.2, breaker=CircuitBreaker(3, 60))
    assert remote.wait_ready(60)  # the probe answered before the store hangs
    # No boot fetch: its listing would hang to the listing's deadline (120 s) past this test, into the next.
    chain = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path), remote],
                               boot_fetch_bytes=0)
    fs.delay_s = 3600  # every request now hangs; the deadline cancels it
    started = time.monotonic()
    for n in range(5):
        assert chain.get(b"k%d" % n) is None
    assert time.monotonic() - started < 3 * 0.2 + 3
    stats = chain.stats()["remote"]
    assert (stats.misses, stats.timeouts, stats.skipped) == (5, 3, 2)
    fs.delay_s = 0
    chain.close(timeout=5)
