"""SharedEntryStore's own state: what every shared store is configured with, said once."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from tiered_progcache import settings
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.sharedstore import MIN_LIST_TIMEOUT_S


def _remote(**options) -> RemoteProgramCache:
    return RemoteProgramCache.from_url(f"memory://shared-{uuid.uuid4().hex}/kernels", **options)


def test_the_default_request_deadline_is_the_remote_timeout_rows_default():
    assert settings.by_name()["remote_timeout"].default == settings.DEFAULT_REMOTE_TIMEOUT_S == 5.0
    remote = _remote()
    assert remote.timeout == 5.0 and remote.runner.timeout == 5.0
    assert remote._list_timeout == MIN_LIST_TIMEOUT_S == 120.0
    assert _remote(timeout=200)._list_timeout == 200.0


def test_a_store_reads_its_default_deadline_from_the_row(monkeypatch):
    rows = [
        dataclasses.replace(row, default=7.5) if row.name == "remote_timeout" else row for row in settings.SETTINGS
    ]
    monkeypatch.setattr(settings, "SETTINGS", rows)
    assert _remote().timeout == 7.5
    assert _remote(timeout=2).timeout == 2.0


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"timeout": "soon"}, TypeError, "^timeout must be a number of seconds"),
        ({"timeout": 0}, ValueError, "^timeout must be a positive, finite number of seconds"),
        ({"transfer_concurrency": 0}, ValueError, "^transfer_concurrency must be a positive int"),
        ({"transfer_concurrency": True}, ValueError, "^transfer_concurrency must be a positive int"),
        ({"namespace": "other"}, ValueError, "namespace"),
    ],
)
def test_bad_shared_options_are_refused_by_the_base(options, error, message):
    with pytest.raises(error, match=message):
        _remote(**options)


def test_the_base_keeps_what_it_was_given():
    remote = _remote(read_only=False, transfer_concurrency=3, max_entry_bytes=1 << 20, namespace="triton")
    assert (remote.transfer_batch, remote.max_entry_bytes, remote.namespace, remote.read_only) == (3, 1 << 20, "triton", False)
    assert remote.breaker.name == f"remote cache {remote.location}"


def test_the_default_transfer_batch_is_the_transfer_concurrency_rows_default(monkeypatch):
    assert _remote().transfer_batch == settings.by_name()["transfer_concurrency"].default == 64
    rows = [dataclasses.replace(row, default=9) if row.name == "transfer_concurrency" else row for row in settings.SETTINGS]
    monkeypatch.setattr(settings, "SETTINGS", rows)
    assert _remote().transfer_batch == 9
