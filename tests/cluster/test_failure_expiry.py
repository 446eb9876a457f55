"""Issue 28 item 20: a signed failure record binds its own expiry into what is signed.

Before, its lifetime was only the unsigned lease document's, so someone who can write the bucket
could replay a captured signed failure under a fresh lease and keep a kernel failing across the
cluster. Now :meth:`FailureRecord.open` refuses a record past its sealed expiry, one whose expiry was
edited (the signature breaks), and one with no sealed expiry at all.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from tiered_progcache.cluster.flightfailure import FailureRecord, failure_record_name
from tiered_progcache.cluster.lease import FAILURE_TTL_S, LeaseInfo, RemoteLease
from tiered_progcache.stores.remote import RemoteProgramCache

NAME = "ab" * 32
KEY = b"failure-record-signing-key-0020"


@pytest.fixture
def store(tmp_path):
    remote = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}", create_root=True, signing_key=KEY)
    yield remote
    remote.close()


def _record() -> FailureRecord:
    return FailureRecord.of(RuntimeError("NVRTC_ERROR_COMPILATION: syntax error"))


def test_a_record_opens_until_its_sealed_expiry_and_never_after(store):
    sealed = _record().seal(store, NAME, now=1000.0)
    opened = FailureRecord.open(store, NAME, sealed, now=1000.0 + FAILURE_TTL_S - 0.001)
    assert opened is not None and opened.message == "NVRTC_ERROR_COMPILATION: syntax error"
    assert FailureRecord.open(store, NAME, sealed, now=1000.0 + FAILURE_TTL_S) is None
    assert FailureRecord.open(store, NAME, sealed, now=1000.0 + 3600) is None


def test_the_expiry_is_inside_what_is_signed(store):
    sealed = _record().seal(store, NAME, ttl_s=4, now=2000.0)
    payload = json.loads(store.open_record(failure_record_name(NAME), sealed))
    assert payload["expires_at"] == 2004.0
    payload["expires_at"] = 10.0**12  # a fresh expiry, written by someone without the key
    unsigned = RemoteProgramCache.from_url(f"file://{store.root}", create_root=True)  # no key: cannot sign
    try:
        forged = unsigned.seal_record(failure_record_name(NAME), json.dumps(payload, sort_keys=True).encode())
    finally:
        unsigned.close()
    with pytest.raises(Exception, match="unsigned|signature"):
        store.open_record(failure_record_name(NAME), forged)
    assert FailureRecord.open(store, NAME, forged, now=2001.0) is None  # refused: not signed with the key


def test_a_record_without_a_sealed_expiry_is_refused(store, caplog):
    old = {"format": "tiered-progcache/compile-failure", "version": 1, "entry": NAME, "module": "builtins",
           "qualname": "RuntimeError", "message": "boom"}  # fmt: skip
    sealed = store.seal_record(failure_record_name(NAME), json.dumps(old, sort_keys=True).encode())
    with caplog.at_level(logging.WARNING):
        assert FailureRecord.open(store, NAME, sealed) is None
    assert "no sealed expiry" in caplog.text


def test_a_captured_record_replayed_under_a_fresh_lease_is_refused(store):
    """The attacker's move: publish an old signed record with a lease whose (unsigned) expiry is fresh."""
    captured = _record().seal(store, NAME, now=time.time() - 3600)  # sealed an hour ago, expired since
    attacker = RemoteLease(store.leases(), NAME, 60)
    assert attacker.try_acquire() and attacker.publish_failure(captured, ttl_s=FAILURE_TTL_S)
    info = RemoteLease(store.leases(), NAME, 60).read()
    assert isinstance(info, LeaseInfo) and info.failure == captured and not info.expired()  # the lease looks fresh
    assert FailureRecord.open(store, NAME, info.failure) is None
    fresh = _record().seal(store, NAME)  # a record sealed now opens: the check is the record's own expiry
    assert FailureRecord.open(store, NAME, fresh) is not None


def test_a_record_carries_its_inputs_sealed_and_one_without_them_opens_with_none(store):
    """What the failed work read beyond its key (a flight by direct key: the header digest) is inside what is
    signed: a waiter compares it with its own. A record sealed without one opens with "" (any key's own)."""
    sealed = FailureRecord.of(RuntimeError("boom"), "d1" * 32).seal(store, NAME)
    assert FailureRecord.open(store, NAME, sealed).inputs == "d1" * 32
    forged = sealed.replace(b"d1" * 32, b"d2" * 32)
    assert forged != sealed and FailureRecord.open(store, NAME, forged) is None  # the signature breaks
    assert FailureRecord.open(store, NAME, _record().seal(store, NAME)).inputs == ""
    plain = {"format": "tiered-progcache/compile-failure", "version": 2, "entry": NAME, "module": "builtins",
             "qualname": "RuntimeError", "message": "boom", "expires_at": time.time() + 5}  # fmt: skip
    without = store.seal_record(failure_record_name(NAME), json.dumps(plain, sort_keys=True).encode())
    assert FailureRecord.open(store, NAME, without).inputs == ""
    plain["inputs"] = 7
    odd = store.seal_record(failure_record_name(NAME), json.dumps(plain, sort_keys=True).encode())
    assert FailureRecord.open(store, NAME, odd) is None  # not a string: refused
