"""A delete sticks: ``del cache[k]`` while k's background upload is under way leaves no entry on a shared tier.

Real shared stores (moto S3 over HTTP, a real redis-server); the race is forced with
events, not sleeps: the upload is taken off the queue and held inside the tier's write
(at a ``WrapperEntryStore`` gate: it arrives, then waits to be let go) while the delete
runs. The delete logs that it waits for that upload; a handler on that record lets the upload go on, so
the delete is in its wait when the upload lands. On a51b919 the delete did not wait: it
returned at once, the upload landed after it, and another node was served k.
"""

from __future__ import annotations

import hashlib
import logging

import pytest
from cuda.core.utils import InMemoryProgramCache, ProgramCacheResource

from tiered_progcache import DeleteFailed, TieredProgramCache, TierPolicy
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import EntryStore
from tiered_progcache.testing import Gate, WrapperEntryStore
from tiered_progcache.testing.redis_server import redis_server, redis_url  # noqa: F401  (fixtures)
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401  (fixtures)

KEY = b"raced-key"
VALUE = b"\x7fELF\x02\x01" + bytes(58) + hashlib.sha256(b"raced").digest() * 20


def _held(store: EntryStore) -> tuple[WrapperEntryStore, Gate]:
    """``store`` with each write, once the worker has it, held inside the tier's write until the gate opens."""
    wrapped = WrapperEntryStore(store)
    return wrapped, wrapped.hold("create_entry", timeout=60)


class _OpenOnRecord(logging.Handler):
    """Opens ``gate`` when a record containing ``text`` is logged (the delete says it waits)."""

    def __init__(self, gate: Gate, text: str) -> None:
        super().__init__(logging.INFO)
        self.gate, self.text = gate, text

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.gate.open()


@pytest.fixture(params=["s3", "redis"])
def shared_store(request):
    """A function that opens the same real shared store anew (one call per node)."""
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        return lambda: RemoteProgramCache.from_url(bucket.url, storage_options=bucket.storage_options, strict=True)
    pytest.importorskip("redis")
    from tiered_progcache.stores.redis_store import RedisProgramCache

    url = request.getfixturevalue("redis_url")
    return lambda: RedisProgramCache.from_url(url, strict=True)


def _node(store: ProgramCacheResource) -> TieredProgramCache:
    return TieredProgramCache(
        tiers=[InMemoryProgramCache(), (store, TierPolicy("remote", write="background", shared=True))]
    )


@pytest.fixture
def upload_released_by_the_delete_wait(caplog):
    """Attach the handler that lets a held upload go on once a delete says it waits for it."""
    caplog.set_level(logging.INFO, logger="tiered_progcache.chain.tier")
    handlers = []

    def attach(upload: Gate) -> None:
        handler = _OpenOnRecord(upload, "a delete waits for the upload")
        logging.getLogger("tiered_progcache.chain.tier").addHandler(handler)
        handlers.append(handler)

    yield attach
    for handler in handlers:
        logging.getLogger("tiered_progcache.chain.tier").removeHandler(handler)


def test_a_delete_racing_an_upload_under_way_leaves_no_entry_for_another_node(
    shared_store, upload_released_by_the_delete_wait, caplog
):
    held, upload = _held(shared_store())
    upload_released_by_the_delete_wait(upload)
    node = _node(held)
    node[KEY] = VALUE
    assert upload.wait_arrived(30)  # the upload is under way, held mid-write
    del node[KEY]
    delete_waited = upload.is_open  # the handler let the upload land while the delete waited
    upload.open()  # without the wait: the upload lands only now, after the delete returned
    assert node.flush(30)
    other = _node(shared_store())
    assert other.get(KEY) is None  # not served: the delete came after the upload
    assert delete_waited
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.tier"] == [
        "tier remote: a delete waits for the upload of the same entry under way"
    ]
    assert node.get(KEY) is None
    assert node.stats()["remote"].writes == 1  # the upload did land, and was deleted after
    node.close()
    other.close()


def test_a_delete_whose_upload_stays_under_way_past_the_wait_says_the_entry_may_still_be_served(
    shared_store, monkeypatch
):
    monkeypatch.setattr("tiered_progcache.chain.tier.DELETE_UPLOAD_WAIT_S", 0.01)
    held, upload = _held(shared_store())
    node = _node(held)
    node[KEY] = VALUE
    assert upload.wait_arrived(30)
    with pytest.raises(DeleteFailed) as raised:
        del node[KEY]
    assert raised.value.tiers == ("remote",)
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert str(raised.value.__cause__) == ("tier remote: an upload of the entry was still under way 0.01 s after the "
                                           "delete began; it may land after the delete")  # fmt: skip
    assert node.stats()["remote"].timeouts == 1
    assert node.tiers[0].resource.get(KEY) is None  # the memory tier let it go
    upload.open()
    assert node.flush(30)
    assert _node(shared_store()).get(KEY) == VALUE  # what DeleteFailed warned of: the upload landed after
    node.close()


def test_a_delete_of_a_queued_upload_cancels_it_without_waiting(shared_store):
    """Two writes queued behind one held upload: deleting the second cancels it; it never reaches the store."""
    held, upload = _held(shared_store())
    node = _node(held)
    node[b"first"] = VALUE
    assert upload.wait_arrived(30)
    node[KEY] = VALUE  # queued behind the held one
    del node[KEY]  # cancelled from the queue: no wait, so no release needed
    upload.open()
    assert node.flush(30)
    other = _node(shared_store())
    assert other.get(KEY) is None and other.get(b"first") == VALUE
    assert node.stats()["remote"].writes == 1
    node.close()
    other.close()
