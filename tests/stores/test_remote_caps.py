"""A hostile remote cannot make a reader hold more than about ``max_entry_bytes``.

The envelope header states the entry's length; a reader stops reading at that length
(plus one byte, to see trailing bytes) and never past header + signature + the cap, on
blocking (file://) and async (S3) filesystems alike. A symlink on a file:// remote is
refused without being followed (a link to /dev/zero read until MemoryError before).
A read whose deadline passed stops between chunks instead of reading on in the background.
Each planted object is 64 MiB against a 1 MiB cap.
"""

from __future__ import annotations

import os
import threading
import tracemalloc
import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tiered_progcache.stores.envelope import FIRST_READ_BYTES, HEADER_SIZE, EnvelopeCodec
from tiered_progcache.errors import EntryRejected
from tiered_progcache.stores.remote import READ_CHUNK_BYTES, RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

MiB = 1 << 20
CAP = 1 * MiB
HUGE = 64 * MiB
NAME = entry_name(b"planted")
SIGNED_OVERHEAD = HEADER_SIZE + 32


def _planted_objects() -> dict[str, bytes]:
    """Four hostile objects of 64 MiB each, named by how they lie."""
    honest_but_huge = EnvelopeCodec(max_entry_bytes=HUGE).seal(NAME, bytes(HUGE - HEADER_SIZE))
    small = EnvelopeCodec().seal(NAME, b"tiny")
    at_cap = EnvelopeCodec().seal(NAME, bytes(CAP))  # a header within the cap, then 63 MiB more
    return {
        "garbage": bytes(HUGE),  # no envelope at all
        "header-over-cap": honest_but_huge,
        "small-header-then-junk": small + bytes(HUGE - len(small)),
        "cap-header-then-junk": at_cap + bytes(HUGE - len(at_cap)),
    }


PLANTED = _planted_objects()


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_file_remote_reads_at_most_the_cap_of_a_planted_object(tmp_path, kind):
    remote = RemoteProgramCache.from_url(tmp_path.as_uri(), strict=True, max_entry_bytes=CAP)
    path = tmp_path / "entries" / NAME[:2] / NAME[2:]
    path.parent.mkdir(parents=True)
    path.write_bytes(PLANTED[kind])
    tracemalloc.start()
    try:
        with pytest.raises(EntryRejected):
            remote.read_entry(NAME)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < CAP + SIGNED_OVERHEAD + READ_CHUNK_BYTES  # held at most the cap and one chunk
    assert remote.breaker.consecutive_failures == 0  # a bad entry is the remote's answer, not its failure
    remote.close()


class CountingS3:
    """An s3fs filesystem that counts the bytes its reads return (the filesystem layer, below the tier)."""

    @staticmethod
    def make(storage_options: dict):
        import s3fs

        class Counting(s3fs.S3FileSystem):
            cachable = False
            bytes_read = 0

            async def _cat_file(self, path, start=None, end=None, **kwargs):
                data = await super()._cat_file(path, start=start, end=end, **kwargs)
                type(self).bytes_read += len(data)
                return data

        return Counting(**storage_options)


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_s3_remote_reads_at_most_the_cap_of_a_planted_object(s3_bucket, kind):
    fs = CountingS3.make(s3_bucket.storage_options)
    remote = RemoteProgramCache(fs, f"{s3_bucket.bucket}/{s3_bucket.prefix}", strict=True, max_entry_bytes=CAP)
    s3_bucket.fs.pipe_file(s3_bucket.entry_path(NAME), PLANTED[kind])
    with pytest.raises(EntryRejected):
        remote.read_entry(NAME)
    assert type(fs).bytes_read <= CAP + SIGNED_OVERHEAD + 1  # one ranged GET: never a byte past the largest envelope
    got = remote.read_envelopes([NAME])  # the batched path (warm) is capped too
    assert not got.missing and (isinstance(got.errors.get(NAME), EntryRejected) or len(got.envelopes[NAME]) <= CAP + SIGNED_OVERHEAD + 1)
    assert remote.breaker.consecutive_failures == 0


def test_an_entry_of_exactly_the_cap_is_read_on_both_paths(tmp_path, s3_bucket):
    payload = os.urandom(CAP)
    for remote in (
        RemoteProgramCache.from_url(tmp_path.as_uri(), strict=True, max_entry_bytes=CAP),
        RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, max_entry_bytes=CAP),
        RemoteProgramCache.from_url(f"memory://caps-{uuid.uuid4().hex}/k", max_entry_bytes=CAP),
    ):
        remote.write_entry(NAME, payload)
        assert remote.read_entry(NAME) == payload
        with pytest.raises(ValueError, match="over the"):
            remote.write_entry(NAME, payload + b"!")  # one byte over: refused before it is stored
        assert remote.read_entry(NAME) == payload
        remote.close()


def test_a_symlink_to_dev_zero_on_a_file_remote_is_refused_without_reading(tmp_path):
    remote = RemoteProgramCache.from_url(tmp_path.as_uri(), strict=True)  # the default 1 GiB cap
    path = tmp_path / "entries" / NAME[:2] / NAME[2:]
    path.parent.mkdir(parents=True)
    os.symlink("/dev/zero", path)
    tracemalloc.start()
    try:
        with pytest.raises(EntryRejected, match="symbolic link"):
            remote.read_entry(NAME)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB


def test_a_device_or_fifo_on_a_file_remote_is_refused_without_reading(tmp_path):
    remote = RemoteProgramCache.from_url(tmp_path.as_uri(), strict=True)
    path = tmp_path / "entries" / NAME[:2] / NAME[2:]
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # opening it for reading would block until a writer comes
    with pytest.raises(EntryRejected, match="not a regular file"):
        remote.read_entry(NAME)


class GatedFS(MemoryFileSystem):
    """memory:// whose every ranged read after the first waits for ``gate``; counts reads and remembers the reader."""

    cachable = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.store = {}
        self.pseudo_dirs = [""]
        self.gate = threading.Event()
        self.reads = 0
        self.reader: threading.Thread | None = None

    def cat_file(self, path, start=None, end=None, **kwargs):
        if self.reads:
            assert self.gate.wait(30)
        self.reads += 1
        self.reader = threading.current_thread()
        return super().cat_file(path, start=start, end=end, **kwargs)


def test_a_read_past_its_deadline_stops_between_chunks(tmp_path):
    fs = GatedFS()
    # Written through a remote with time to spare (16 MiB on a loaded machine), read through one with 0.2 s.
    RemoteProgramCache(fs, "/gated", timeout=60, max_entry_bytes=64 * MiB).write_entry(
        NAME, os.urandom(FIRST_READ_BYTES + 8 * READ_CHUNK_BYTES)
    )
    remote = RemoteProgramCache(fs, "/gated", timeout=0.2, max_entry_bytes=64 * MiB)
    with pytest.raises(TimeoutError):
        remote.read_entry(NAME)  # the first range comes, the next chunk waits past the deadline
    remote.close()  # the runner's threads exit once their current call returns
    fs.gate.set()  # the blocked read returns; the worker must stop there, not read 7 more chunks
    fs.reader.join(30)
    assert not fs.reader.is_alive()
    assert fs.reads == 2
