"""The shared ProgramCacheResource (by key, as a chain's one tier), EntryStore and LeaseStore contracts, run against
the remote tier on four fsspec backends."""

from __future__ import annotations

import contextlib
import uuid

import fsspec
import pytest

from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.testing import EntryStoreTests, LeaseStoreTests, ProgramCacheContract, keyed_chain
from tiered_progcache.testing.servers import gcs_bucket, gcs_server, moto_server, s3_bucket  # noqa: F401

from support import FileBackDoor, FsspecBackDoor


class TestRemoteOnMemory(ProgramCacheContract):
    @pytest.fixture
    def cache(self):
        remote = RemoteProgramCache.from_url(f"memory://contract-{uuid.uuid4().hex}/kernels", strict=True)
        with keyed_chain(remote) as c:
            yield c
            c.clear()  # memory:// is one store per process


class TestRemoteOnLocalPath(ProgramCacheContract):
    @pytest.fixture
    def cache(self, tmp_path):
        with keyed_chain(RemoteProgramCache.from_url((tmp_path / "nfs").as_uri(), strict=True)) as c:
            yield c


class TestRemoteOnS3(ProgramCacheContract):
    @pytest.fixture
    def cache(self, s3_bucket):
        remote = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True)
        with keyed_chain(remote) as c:
            yield c


class TestRemoteOnGCS(ProgramCacheContract):
    @pytest.fixture
    def cache(self, gcs_bucket):
        remote = RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True)
        with keyed_chain(remote) as c:
            yield c


class TestRemoteSignedCompressed(ProgramCacheContract):
    """Signing and zstd change the bytes on the wire, never what the mapping API returns."""

    @pytest.fixture
    def cache(self, s3_bucket):
        pytest.importorskip("zstandard")
        with keyed_chain(RemoteProgramCache.from_url(
            s3_bucket.url,
            storage_options=s3_bucket.storage_options,
            signing_key=b"contract-signing-key-0123456789ab",
            compression="zstd",
            strict=True,
        )) as c:
            yield c


# -- EntryStore and LeaseStore contracts, each backend with its back door and a read-only twin ---------


class _OnMemory:
    """memory:// (one store per process: a fresh root per test), seen through a raw MemoryFileSystem."""

    @pytest.fixture
    def url(self):
        url = f"memory://store-{uuid.uuid4().hex}/kernels"
        yield url
        raw = fsspec.filesystem("memory")
        with contextlib.suppress(FileNotFoundError):
            raw.rm(raw._strip_protocol(url), recursive=True)

    @pytest.fixture
    def store(self, url):
        with RemoteProgramCache.from_url(url, strict=True) as s:
            yield s

    @pytest.fixture
    def read_only_store(self, url, store):
        with RemoteProgramCache.from_url(url, read_only=True, strict=True) as s:
            yield s

    @pytest.fixture
    def back_door(self, url):
        raw = fsspec.filesystem("memory")
        return FsspecBackDoor(raw, raw._strip_protocol(url))


class _OnLocalPath:
    """A file:// remote on a local directory, seen with os calls alone."""

    @pytest.fixture
    def store(self, tmp_path):
        with RemoteProgramCache.from_url((tmp_path / "nfs").as_uri(), strict=True) as s:
            yield s

    @pytest.fixture
    def read_only_store(self, tmp_path, store):
        with RemoteProgramCache.from_url((tmp_path / "nfs").as_uri(), read_only=True, strict=True) as s:
            yield s

    @pytest.fixture
    def back_door(self, tmp_path):
        return FileBackDoor(tmp_path / "nfs")


class _OnBucket:
    """A bucket on a real test server (moto S3 over HTTP, fake-gcs-server), seen through the server's own client."""

    @pytest.fixture
    def store(self, bucket):
        with RemoteProgramCache.from_url(bucket.url, storage_options=bucket.storage_options, strict=True) as s:
            yield s

    @pytest.fixture
    def read_only_store(self, bucket, store):
        with RemoteProgramCache.from_url(bucket.url, storage_options=bucket.storage_options, read_only=True,
                                         strict=True) as s:
            yield s

    @pytest.fixture
    def back_door(self, bucket):
        return FsspecBackDoor(bucket.fs, f"{bucket.bucket}/{bucket.prefix}")


class _OnS3(_OnBucket):
    @pytest.fixture
    def bucket(self, s3_bucket):
        return s3_bucket


class _OnGCS(_OnBucket):
    @pytest.fixture
    def bucket(self, gcs_bucket):
        return gcs_bucket


class TestRemoteStoreOnMemory(_OnMemory, EntryStoreTests):
    pass


class TestRemoteStoreOnLocalPath(_OnLocalPath, EntryStoreTests):
    pass


class TestRemoteStoreOnS3(_OnS3, EntryStoreTests):
    pass


class TestRemoteStoreOnGCS(_OnGCS, EntryStoreTests):
    pass


class TestRemoteLeasesOnMemory(_OnMemory, LeaseStoreTests):
    pass


class TestRemoteLeasesOnLocalPath(_OnLocalPath, LeaseStoreTests):
    pass


class TestRemoteLeasesOnS3(_OnS3, LeaseStoreTests):
    pass


class TestRemoteLeasesOnGCS(_OnGCS, LeaseStoreTests):
    pass


def test_server_clients_are_recent_enough():
    """The extras pin s3fs/gcsfs >= 2025.1 (conditional create, batched cat); check what is installed."""
    from importlib.metadata import version

    for dist in ("s3fs", "gcsfs"):
        pytest.importorskip(dist)
        year, month = (int(part) for part in version(dist).split(".")[:2])
        assert (year, month) >= (2025, 1), f"{dist} {version(dist)} is older than 2025.1"
