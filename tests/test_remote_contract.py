"""The shared ProgramCacheResource and EntryStore contracts, run against the remote tier on four fsspec backends."""

from __future__ import annotations

import uuid

import pytest

from tiered_progcache.remote import RemoteProgramCache
from tiered_progcache.testing import EntryStoreTests, ProgramCacheContract
from tiered_progcache.testing.servers import gcs_bucket, gcs_server, moto_server, s3_bucket  # noqa: F401


class TestRemoteOnMemory(ProgramCacheContract):
    @pytest.fixture
    def cache(self):
        with RemoteProgramCache.from_url(f"memory://contract-{uuid.uuid4().hex}/kernels", strict=True) as c:
            yield c
            c.clear()  # memory:// is one store per process


class TestRemoteOnLocalPath(ProgramCacheContract):
    @pytest.fixture
    def cache(self, tmp_path):
        with RemoteProgramCache.from_url((tmp_path / "nfs").as_uri(), strict=True) as c:
            yield c


class TestRemoteOnS3(ProgramCacheContract):
    @pytest.fixture
    def cache(self, s3_bucket):
        with RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True) as c:
            yield c


class TestRemoteOnGCS(ProgramCacheContract):
    @pytest.fixture
    def cache(self, gcs_bucket):
        with RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True) as c:
            yield c


class TestRemoteSignedCompressed(ProgramCacheContract):
    """Signing and zstd change the bytes on the wire, never what the mapping API returns."""

    @pytest.fixture
    def cache(self, s3_bucket):
        pytest.importorskip("zstandard")
        with RemoteProgramCache.from_url(
            s3_bucket.url,
            storage_options=s3_bucket.storage_options,
            signing_key=b"contract-signing-key-0123456789ab",
            compression="zstd",
            strict=True,
        ) as c:
            yield c


class TestRemoteStoreOnMemory(EntryStoreTests):
    @pytest.fixture
    def store(self):
        with RemoteProgramCache.from_url(f"memory://store-{uuid.uuid4().hex}/kernels", strict=True) as s:
            yield s
            s.clear()


class TestRemoteStoreOnLocalPath(EntryStoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        with RemoteProgramCache.from_url((tmp_path / "nfs").as_uri(), strict=True) as s:
            yield s


class TestRemoteStoreOnS3(EntryStoreTests):
    @pytest.fixture
    def store(self, s3_bucket):
        with RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True) as s:
            yield s


class TestRemoteStoreOnGCS(EntryStoreTests):
    @pytest.fixture
    def store(self, gcs_bucket):
        with RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True) as s:
            yield s


def test_server_clients_are_recent_enough():
    """The extras pin s3fs/gcsfs >= 2025.1 (conditional create, batched cat); check what is installed."""
    from importlib.metadata import version

    for dist in ("s3fs", "gcsfs"):
        pytest.importorskip(dist)
        year, month = (int(part) for part in version(dist).split(".")[:2])
        assert (year, month) >= (2025, 1), f"{dist} {version(dist)} is older than 2025.1"
