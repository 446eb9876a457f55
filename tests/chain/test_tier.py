"""tier.py and tiered.as_chain: a tier's identity resolved once, a bare resource made a chain, one failure policy."""

from __future__ import annotations

import logging

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.errors import EntryRejected, TierUnavailable
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.chain.tier import FAILURE_POLICY, FailureKind, Tier, failure_kind
from tiered_progcache.chain.tiered import as_chain, stores_of


def _opts() -> ProgramOptions:
    return ProgramOptions(arch="sm_80", std="c++17")


# -- what a resource is, resolved when the tier is built ------------------------------------------


def test_a_tier_resolves_its_resource_by_name_once(tmp_path):
    local = Tier(FileStreamProgramCache(tmp_path / "local"), TierPolicy("local"))
    assert isinstance(local.local, LocalDir) and local.local.root == tmp_path / "local"
    assert local.entries is local.local and local.location == str(tmp_path / "local")

    memory = Tier(InMemoryProgramCache(), TierPolicy("memory"))
    assert (memory.entries, memory.local, memory.location) == (None, None, "InMemoryProgramCache, this process")

    (tmp_path / "bucket").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri())
    shared = Tier(remote, TierPolicy("remote", shared=True))
    assert shared.entries is remote and shared.local is None and shared.location == remote.location
    with pytest.raises(TypeError, match="^tier 'x' must be a tiered_progcache EntryStore or a cuda.core.utils.ProgramCacheResource, got dict$"):
        Tier({}, TierPolicy("x"))  # type: ignore[arg-type]


def test_a_chain_reads_its_stores_from_what_its_tiers_resolved(tmp_path):
    (tmp_path / "bucket").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri())
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"),
                                   FileStreamProgramCache(tmp_path / "b"), remote]) as chain:  # fmt: skip
        assert chain.local_store is chain.tiers[1].local  # the first local directory, built once
        assert chain.shared_stores == (remote,) and chain.shared_store is remote
        assert stores_of(chain) == tpc.CacheStores(chain.local_store, remote)


# -- a bare resource is a chain of one tier -----------------------------------------------------------


def test_as_chain_keeps_a_chain_and_wraps_a_bare_resource_without_settings_or_threads(tmp_path):
    with TieredProgramCache(tmp_path / "c") as chain:
        assert as_chain(chain) is chain and chain.identity is chain
    memory = InMemoryProgramCache()
    wrapped = as_chain(memory)
    assert [(t.name, t.resource) for t in wrapped.tiers] == [("memory", memory)]
    assert wrapped.identity is memory and wrapped.local_store is None and wrapped.shared_store is None
    assert wrapped.explain_misses is False and wrapped.flight_policy == type(chain.flight_policy)()

    local = as_chain(FileStreamProgramCache(tmp_path / "d"))
    assert local.tiers[0].name == "local" and local.local_store.root == tmp_path / "d"

    (tmp_path / "bucket").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri())
    shared = as_chain(remote)
    (tier,) = shared.tiers
    assert (tier.name, tier.policy.shared, tier.policy.write, tier.writeback) == ("remote", True, "sync", None)
    assert shared.shared_store is remote and stores_of(remote) == tpc.CacheStores(None, remote)
    with pytest.raises(TypeError, match=r"^cache must be a cuda.core ProgramCacheResource \(a TieredProgramCache, say\) or a "
                       "tiered_progcache EntryStore, got object$"):
        as_chain(object())  # type: ignore[arg-type]


class _FailingReads(InMemoryProgramCache):
    def __getitem__(self, key):
        raise OSError("disk on fire")


class _FailingWrites(InMemoryProgramCache):
    def __setitem__(self, key, value):
        raise OSError("read-only file system")


@pytest.fixture
def fresh_bare_rate_limit(monkeypatch):
    """A rate limit no earlier test has used (it is one per process, for every bare resource's chain)."""
    from tiered_progcache.chain import tiered
    from tiered_progcache.stores.ratelimit import RateLimitedLogger

    monkeypatch.setattr(tiered, "_BARE_WARNINGS", RateLimitedLogger(logging.getLogger("tiered_progcache.chain.tier")))


def test_a_bare_resource_that_fails_its_reads_costs_a_compile_not_an_error(caplog, events, fresh_bare_rate_limit):
    """Deliberate (docs/architecture.md, "A bare resource"): before, the OSError reached the caller."""
    cache = _FailingReads()
    with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
        obj = tpc.compile(matmul_source(16), "c++", _opts(), cache=cache)
        again = tpc.compile(matmul_source(16), "c++", _opts(), cache=cache)
    assert bytes(obj.code)[:4] == b"\x7fELF" and bytes(again.code) == bytes(obj.code)
    assert len(events) == 2  # each call missed and compiled; nothing raised
    assert len(cache) == 2  # the entry and its manifest were stored (writes work)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == "tier memory failed a read (counted as a miss): OSError('disk on fire')"
    assert len(warnings) == 1  # one rate limit for every call's chain around the resource


def test_a_bare_resource_that_fails_its_writes_keeps_the_compile(caplog, events, fresh_bare_rate_limit):
    cache = _FailingWrites()
    with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
        obj = tpc.compile(matmul_source(32), "c++", _opts(), cache=cache)
    assert bytes(obj.code)[:4] == b"\x7fELF" and len(events) == 1 and len(cache) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "tier memory failed a write (dropped): OSError('read-only file system')"  # the manifest's and the entry's: one line
    ]


def test_explain_names_a_bare_resource_as_a_chain_names_it(tmp_path):
    report = tpc.explain(matmul_source(16), "c++", _opts(), cache=FileStreamProgramCache(tmp_path / "e"))
    assert not report.hit and "is in no tier" in str(report)
    tpc.compile(matmul_source(16), "c++", _opts(), cache=FileStreamProgramCache(tmp_path / "e"))
    hit = tpc.explain(matmul_source(16), "c++", _opts(), cache=FileStreamProgramCache(tmp_path / "e"))
    assert (hit.hit, hit.tier, hit.location) == (True, "local", str(tmp_path / "e"))


# -- the failure policy: one classification, one table ---------------------------------------------


@pytest.mark.parametrize(("exc", "kind"), [
    (KeyError("k"), FailureKind.MISS),
    (EntryRejected("bad digest"), FailureKind.REJECTED),
    (type("OtherMiss", (KeyError,), {})("k"), FailureKind.MISS),
    (TierUnavailable("cooling down"), FailureKind.SKIPPED),
    (TimeoutError("slow"), FailureKind.TIMEOUT),
    (ConnectionError("reset"), FailureKind.ERROR),
    (OSError("gone"), FailureKind.ERROR),
    (TypeError("a bug in the tier"), FailureKind.ERROR),
])  # fmt: skip
def test_each_exception_has_one_kind(exc, kind):
    assert failure_kind(exc) is kind


def test_the_table_says_what_every_kind_does_for_every_operation():
    assert set(FAILURE_POLICY) == {"read", "write", "delete", "clear", "count", "close", "measure"}
    for operation, outcomes in FAILURE_POLICY.items():
        expected = set(FailureKind) - ({FailureKind.MISS, FailureKind.REJECTED} if operation == "delete" else set())
        assert set(outcomes) == expected, operation  # a delete's KeyError is "not held", never a failure
    counters = {op: {k.name: o.counter for k, o in outcomes.items()} for op, outcomes in FAILURE_POLICY.items()}
    assert counters["read"] == {"MISS": None, "REJECTED": "rejected", "SKIPPED": "skipped", "TIMEOUT": "timeouts",
                                "ERROR": "errors"}  # fmt: skip
    assert counters["write"] == {"MISS": "errors", "REJECTED": "errors", "SKIPPED": "skipped",
                                 "TIMEOUT": "timeouts", "ERROR": "errors"}  # fmt: skip
    assert counters["delete"] == {"SKIPPED": "skipped", "TIMEOUT": "timeouts", "ERROR": "errors"}
    assert set(counters["clear"].values()) == {"errors"}
    assert set(counters["count"].values()) == set(counters["close"].values()) == {None}


@pytest.fixture
def events():
    seen: list[tpc.CompileEvent] = []
    stop = tpc.on_compile(seen.append)
    yield seen
    stop()
