"""The cross-node single-flight policy: the measurements it plans with, its arithmetic, and compile() following it.

The arithmetic is checked exactly at its boundaries; the integration tests run real NVRTC
against moto S3 behind a real delay proxy (its wire-level request count) and a real
file:// remote, and read the policy's choices from its own hook (``on_flight``). That remote
stands for an NFS share (the mount table the store reads says so), where ``R`` is measured:
on this host's own disk it is 0 (:func:`test_a_directory_on_this_hosts_disk_is_no_distance`).
"""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
from cuda.core import ProgramOptions

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.cluster.flightpolicy import (
    untimed_estimate,
    COMPILE_TIMES_FILE,
    HEADER_BYTES,
    POLL_FLOOR_S,
    CompileTimes,
    FlightDecision,
    FlightPolicy,
    compile_size,
    compile_times,
    on_flight,
)
from tiered_progcache.stores import fsutil
from tiered_progcache.stores.latency import LatencyTracker
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.settings import DEFAULT_COMPILE_TIME_PRIOR_S, DEFAULT_LEASE_MIN_COMPILE_RTTS
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import WrapperEntryStore
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from test_singleflight import Work, kernel, options

JOIN_S = 90


@pytest.fixture(autouse=True)
def nfs_mounts(tmp_path_factory, monkeypatch):
    """A mount table with one NFS root: every file:// remote here is a network share, its ``R`` measured."""
    table = tmp_path_factory.mktemp("mounts") / "mountinfo"
    table.write_text("1 0 0:50 / / rw,relatime - nfs4 fileserver:/export rw\n")
    monkeypatch.setattr(fsutil, "MOUNT_TABLE", str(table))
    return table


@pytest.fixture
def decisions():
    """Every FlightDecision this process reports during the test, in order."""
    seen = []
    stop = on_flight(seen.append)
    yield seen
    stop()


@pytest.fixture
def fresh_compile_times():
    """No compile timed yet in this process: the policy plans with the prior (restored afterwards)."""
    compile_times.clear()
    yield compile_times
    compile_times.clear()


# -- the measurements ------------------------------------------------------------------------------


def test_latency_tracker_keeps_the_median_of_the_last_window():
    tracker = LatencyTracker(window=4)
    assert tracker.median() is None
    for seconds in (0.5, 0.01, 0.03, 0.02, 0.04):  # the 0.5 falls out of the window of 4
        tracker.record(seconds)
    assert tracker.median() == pytest.approx(0.025) and tracker.recorded == 5
    for bad in (-1.0, float("inf"), float("nan")):
        tracker.record(bad)
    assert tracker.recorded == 5


def test_the_documented_defaults_keep_the_last_64_round_trips_and_weigh_the_newest_compile_0_3():
    """docs/cluster.md: R is the median of the last 64 requests; C a running rate, the newest weighing 0.3."""
    tracker = LatencyTracker()
    for _ in range(64):
        tracker.record(1.0)
    for _ in range(32):
        tracker.record(0.0)
    assert tracker.median() == 0.5  # 32 of each kept: one more or less in the window moves it to 1.0 or 0.0
    times = _warm(CompileTimes())
    times.record("c++", "cubin", 1.0, 1)
    times.record("C++", "CUBIN", 2.0, 1)
    assert times.predict("c++", "cubin", 1) == pytest.approx(1.3)


def _warm(times: CompileTimes, *code_types: str) -> CompileTimes:
    """``times`` past the first compile of each code type (``c++`` by default), which is never recorded."""
    for code in code_types or ("c++",):
        assert times.record(code, "cubin", 123.0, 1) is False  # the first compile of a process: not folded
    return times


def test_latency_tracker_counts_exactly_under_many_threads():
    tracker = LatencyTracker()
    barrier = threading.Barrier(16)

    def record() -> None:
        barrier.wait(JOIN_S)
        for _ in range(1000):
            tracker.record(0.03)

    threads = [threading.Thread(target=record) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert tracker.recorded == 16_000 and tracker.median() == 0.03


def test_the_runner_times_each_single_request_and_no_listing_or_batch(tmp_path):
    remote = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}")
    assert remote.wait_ready(30)  # the probe's own requests are timed too
    latency = remote.runner.latency
    before = latency.recorded
    names = [entry_name(b"k%d" % n) for n in range(3)]
    for name in names:
        remote.write_entry(name, b"\x7fELF" + bytes(100))
    for name in names:
        remote.read_entry(name)
    with pytest.raises(KeyError):
        remote.read_entry(entry_name(b"absent"))  # a miss is an answer: one round trip too
    assert latency.recorded - before == 7
    list(remote.iter_entries())
    remote.read_many(names)
    remote.write_many({name: b"\x7fELF" for name in names})
    assert latency.recorded - before == 7  # a listing and two batches are not one round trip each
    assert remote.round_trip_s == latency.median() and remote.round_trip_s > 0


def test_a_directory_on_this_hosts_disk_is_no_distance(tmp_path, nfs_mounts, monkeypatch, decisions):
    """R is 0 for a file:// remote on a local filesystem (the real mount table says which): whatever its
    requests took, a miss takes the lease, even with k = 1e9. Under an NFS root, the same directory's R is measured."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    share = RemoteProgramCache.from_url(url)
    monkeypatch.setattr(fsutil, "MOUNT_TABLE", "/proc/self/mountinfo")
    real = RemoteProgramCache.from_url(url)
    for store in (share, real):
        assert store.wait_ready(30)
        store.seed_round_trip(1.0)  # a loaded host's request: seconds
    assert share.round_trip_s == share.runner.latency.median() > 0
    assert real.runner.latency.median() > 0
    assert real.round_trip_s == (0.0 if fsutil.on_local_disk(tmp_path) else real.runner.latency.median())
    table = tmp_path / "mountinfo"
    table.write_text(f"1 0 0:50 / / rw - nfs4 fileserver:/export rw\n2 1 0:51 / {tmp_path} rw - xfs /dev/nvme0n1 rw\n")
    monkeypatch.setattr(fsutil, "MOUNT_TABLE", str(table))
    disk = RemoteProgramCache.from_url(url)
    disk.seed_round_trip(1.0)
    assert disk.round_trip_s == 0.0 and disk.runner.latency.median() > 0
    from cuda.core.utils import InMemoryProgramCache

    from tiered_progcache.cluster.singleflight import describe, plan

    with TieredProgramCache(tiers=[InMemoryProgramCache(), disk], lease_min_compile_rtts=1e9) as cache:
        assert plan(cache, 1e-6) == ("lease", 0.0)
        assert describe(cache, 0.5) == (
            "lease: C 500.0 ms >= 1e+09 x R 0.0 ms: one node compiles, the others wait for its entry")


def test_compile_times_are_an_exponentially_weighted_rate_per_code_and_target_type():
    times = _warm(CompileTimes(weight=0.5))
    assert times.predict("c++", "cubin", 1) is None
    assert times.record("c++", "cubin", 1.0, 1) is True
    assert times.predict("C++", "CUBIN", 1) == 1.0  # the first sample folded is the rate
    times.record("c++", "cubin", 0.2, 1)
    times.record("c++", "cubin", 0.2, 1)
    assert times.predict("c++", "cubin", 1) == pytest.approx(0.4)  # 1.0 -> 0.6 -> 0.4
    assert times.predict("c++", "ptx", 1) is None and times.predict("nvvm", "cubin", 1) is None
    assert times.record("c++", "cubin", -1.0, 1) is False
    assert times.predict("c++", "cubin", 1) == pytest.approx(0.4)


def test_the_first_compile_of_each_code_type_in_a_process_teaches_nothing():
    """NVRTC's first use (docs/cluster.md: measured 0.26 s here, 0.4 s on the H200 host) is not the kernel's cost."""
    times = CompileTimes()
    assert times.record("c++", "cubin", 0.45, 1000) is False  # a fresh process's first NVRTC run
    assert times.predict("c++", "cubin", 1000) is None
    assert times.record("c++", "ptx", 0.04, 1000) is True  # the same compiler, another target: past its first use
    assert times.record("nvvm", "cubin", 0.3, 1000) is False  # another compiler: its own first use
    assert times.record("NVVM", "cubin", 0.03, 1000) is True
    times.clear()
    assert times.predict("c++", "ptx", 1000) is None
    assert times.record("c++", "cubin", 0.04, 1000) is True  # clear() forgets rates, not the compiler's first use
    assert CompileTimes().record("c++", "cubin", float("nan"), 1) is False  # a failed compile marks the first use too


def test_compile_records_each_successful_compile_after_the_first(tmp_path, events):
    fresh = CompileTimes()
    import tiered_progcache.compiling.compile as compile_module

    original = compile_module.compile_times
    compile_module.compile_times = fresh
    try:
        with TieredProgramCache(tmp_path) as cache:
            tpc.compile(kernel(301), "c++", options(), cache=cache)
            assert fresh.predict("c++", "cubin", 1000) is None
            tpc.compile(kernel(302), "c++", options(), cache=cache)
    finally:
        compile_module.compile_times = original
    size = compile_size(len(kernel(302)), 0)
    assert fresh.predict("c++", "cubin", size) == pytest.approx(events[1].seconds)


# -- the arithmetic --------------------------------------------------------------------------------


def test_a_compile_is_short_exactly_under_k_round_trips():
    policy = FlightPolicy(lease_min_compile_rtts=4.0)
    assert not policy.short(0.2, 0.05)  # 0.2 s = 4 x 50 ms: the lease
    assert policy.short(0.1999, 0.05)
    assert policy.short(0.1999, None)  # no request timed yet: R counts as UNMEASURED_ROUND_TRIP_S (50 ms)
    assert not policy.short(0.2, None)
    assert not FlightPolicy(lease_min_compile_rtts=0.0).short(0.0, 10.0)  # 0: always the lease
    admitting = FlightPolicy(lease_min_compile_rtts=0.0, min_upload_compile_s=0.5)
    assert admitting.short(0.49, None)  # would not be uploaded: nobody could wait for it
    assert not admitting.short(0.5, 0.0)
    for prior in (DEFAULT_COMPILE_TIME_PRIOR_S, 0.0001, 3.0):  # kept for old configurations: decides nothing
        assert not FlightPolicy(compile_time_prior_s=prior).short(0.2, 0.05)  # the default: 4 round trips
        assert FlightPolicy(compile_time_prior_s=prior).short(0.1999, 0.05)
    cheap = untimed_estimate(compile_size(1143, 0))  # a header-less 1 KiB kernel never timed here: 22.3 ms
    assert FlightPolicy().short(cheap, 0.0056) and not FlightPolicy().short(cheap, 0.0055)  # races over 5.6 ms


def _store_at(tmp_path, *round_trips: float) -> RemoteProgramCache:
    """A real remote whose runner has timed exactly these round trips (seconds)."""
    remote = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}")
    assert remote.wait_ready(60)  # the probe (beside the constructor) has ended
    remote.runner.latency = LatencyTracker()  # forget the probe
    for seconds in round_trips:
        remote.runner.latency.record(seconds)
    return remote


def test_a_waiters_plan_polls_every_round_trip_then_two_percent_of_its_wait(tmp_path):
    store = _store_at(tmp_path, 0.03, 0.05, 0.04)
    now = [100.0]
    plan = FlightPolicy().wait_plan(store, clock=lambda: now[0])
    assert plan.poll_period() == pytest.approx(0.04)
    now[0] += 10.0
    assert plan.poll_period() == pytest.approx(0.2)  # 2% of the 10 s waited


def test_the_poll_period_has_a_floor(tmp_path):
    plan = FlightPolicy().wait_plan(_store_at(tmp_path, 0.0002))
    assert plan.poll_period() == POLL_FLOOR_S


def test_the_policy_comes_from_the_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERED_PROGCACHE_LEASE_MIN_COMPILE_RTTS", "2.5")
    monkeypatch.setenv("TIERED_PROGCACHE_WAIT_PATIENCE", "none")
    monkeypatch.setenv("TIERED_PROGCACHE_COMPILE_TIME_PRIOR_S", "0.25")
    monkeypatch.setenv("TIERED_PROGCACHE_MIN_UPLOAD_COMPILE_S", "0.1")
    monkeypatch.setenv("TIERED_PROGCACHE_DIR", str(tmp_path))
    with TieredProgramCache.from_env() as cache:
        assert cache.flight_policy == FlightPolicy(2.5, None, 0.25, 0.1)
    with TieredProgramCache(tmp_path) as cache:
        assert cache.flight_policy.lease_min_compile_rtts == DEFAULT_LEASE_MIN_COMPILE_RTTS
    for bad, error in (({"lease_min_compile_rtts": -1}, ValueError), ({"wait_patience": "1"}, TypeError),
                       ({"compile_time_prior_s": 0}, ValueError)):
        with pytest.raises(error, match=next(iter(bad))):
            TieredProgramCache(tmp_path, **bad)


# -- compile() following the policy, on real remotes ------------------------------------------------


def _released(name: str) -> None:
    """Join the holder's background release of lease ``name`` (its thread is named after it), if any."""
    for thread in threading.enumerate():
        if thread.name == f"tiered-progcache-lease-{name[:8]}":
            thread.join(JOIN_S)
            assert not thread.is_alive(), "the lease was never released"


@pytest.fixture
def slow_s3(s3_bucket):
    """moto S3 behind a 50 ms delay proxy that keeps connections alive and counts HTTP requests."""
    from tiered_progcache.testing.delayproxy import DelayProxy

    host, port = s3_bucket.storage_options["endpoint_url"].split("//")[1].split(":")
    with DelayProxy(host, int(port), rtt_s=0.05, keep_alive=True) as proxy:
        yield proxy, {**s3_bucket.storage_options, "endpoint_url": proxy.endpoint_url}, s3_bucket.url


def _predicting(times: CompileTimes, source: str, seconds: float) -> None:
    """Make ``times`` predict ``seconds`` for a header-less c++ -> cubin compile of ``source``."""
    times.record("c++", "cubin", seconds, compile_size(len(source), 0))  # a first compile is not recorded
    times.record("c++", "cubin", seconds, compile_size(len(source), 0))


@pytest.mark.parametrize("predicted, headers, choice, requests", [
    (0.01, 0, "raced_won", 3), (10.0, 0, "held", 7), (None, 0, "raced_won", 3), (None, 64, "held", 8),
])
def test_a_short_compile_races_the_lookup_and_a_long_or_unknown_one_takes_the_lease(
    tmp_path, slow_s3, decisions, fresh_compile_times, predicted, headers, choice, requests
):
    """At a 50 ms round trip, 0.01 s is under the default four round trips, 10 s over; a never-timed
    compile is predicted from its size: header-less, 22 ms (short, it races); reading 64 headers,
    1.07 s (long: it takes the lease). Requests on the wire: raced: the look (beside the compile), the
    conditional creates of the manifest and the cubin (3); held: look, lease create, look under the
    lease, the two uploads, lease read and delete by the release (7); with headers, the direct
    manifest's read before the scan and its upload after the compile, less the look before the lease:
    no manifest means no node compiled it, and the look under the lease asks (8)."""
    proxy, storage_options, url = slow_s3
    include = tmp_path / "include"
    include.mkdir()
    for i in range(headers):
        (include / f"h{i}.h").write_text(f"#define H{i} {i}\n")
    source = "".join(f'#include "h{i}.h"\n' for i in range(headers)) + kernel(310)
    opts = ProgramOptions(arch="sm_90", include_path=[str(include)]) if headers else options()
    if predicted is not None:
        _predicting(fresh_compile_times, source, predicted)
    with TieredProgramCache(tmp_path / "cache", remote=url, remote_options=storage_options,
                            boot_fetch_bytes=0) as cache:  # the flight's requests alone, no listing beside them
        cache.get(b"a first request, so the round trip is known")
        before = proxy.requests
        obj = tpc.compile(source, "c++", opts, cache=cache)
        (decision,) = decisions
        assert cache.flush(JOIN_S)
        _released(decision.name)
        for thread in threading.enumerate():  # the look beside the compile, if still under way
            if thread.name.startswith("tiered-progcache-look-"):
                thread.join(JOIN_S)
        seen = proxy.requests - before
        assert cache.shared_store.leases().read(decision.name) is None
    assert bytes(obj.code)[:4] == b"\x7fELF"
    expected = predicted if predicted is not None else untimed_estimate(compile_size(len(source), headers))
    assert (decision.choice, decision.estimate_s) == (choice, pytest.approx(expected))
    assert cache.stats().flight[choice] == 1 and sum(cache.stats().flight.values()) == 1
    assert decision.round_trip_s >= 0.05
    assert seen == requests


@pytest.mark.parametrize("recorded", [False, True])
def test_a_key_no_node_recorded_is_first_asked_for_under_the_lease(tmp_path, s3_bucket, decisions,
                                                                     fresh_compile_times, recorded):
    """No direct manifest on the store: no node compiled this source with these options, so the entry
    is not looked up before the lease; the look under the lease is the first to ask (one round trip, not
    two). A manifest whose set does not hold here (a header edited since) proves nothing of the kind:
    the entry is looked up before the lease, as any key is."""
    from tiered_progcache.testing.delayproxy import DelayProxy

    include = tmp_path / "include"
    include.mkdir()
    for i in range(64):  # 64 headers: predicted at about 1 s, so the compile takes the lease
        (include / f"h{i}.h").write_text(f"#define H{i} {i}\n")
    source = "".join(f'#include "h{i}.h"\n' for i in range(64)) + kernel(330)
    opts = ProgramOptions(arch="sm_90", include_path=[str(include)])
    host, port = s3_bucket.storage_options["endpoint_url"].split("//")[1].split(":")
    with DelayProxy(host, int(port), keep_alive=True) as proxy:
        remote = {"remote": s3_bucket.url, "boot_fetch_bytes": 0,
                  "remote_options": {**s3_bucket.storage_options, "endpoint_url": proxy.endpoint_url}}
        if recorded:  # another node compiled it, then a header changed: its set does not hold here
            with TieredProgramCache(tmp_path / "a", **remote) as node_a:
                tpc.compile(source, "c++", opts, cache=node_a)
            (include / "h7.h").write_text("#define H7 77\n")
            decisions.clear()
            fresh_compile_times.clear()  # node B plans as a new node: the prior, so it takes the lease
        with TieredProgramCache(tmp_path / "b", **remote) as node_b:
            before = len(proxy.sent)
            tpc.compile(source, "c++", opts, cache=node_b)
            (decision,) = decisions
            _released(decision.name)
        sent = [(r.method, r.path) for r in proxy.sent[before:]]
    name = decision.name
    entry = f"/entries/{name[:2]}/{name[2:]}"
    lease = next(i for i, (method, path) in enumerate(sent) if method == "PUT" and path.endswith(f"/leases/{name}"))
    looked = [i for i, (method, path) in enumerate(sent) if method == "GET" and path.endswith(entry)]
    assert decision.choice == "held"
    assert [i < lease for i in looked] == ([True, False] if recorded else [False])


def test_a_waiter_gives_up_on_a_stuck_holder_after_its_wait_timeout_and_compiles_itself(
    tmp_path, decisions, fresh_compile_times
):
    """Node A holds the lease and its compile is held until node B is done: B waits its ``wait_timeout``
    (0.3 s), compiles itself and counts ``gave_up``; A's lease stays A's."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    node_a = TieredProgramCache(tmp_path / "a", remote=url, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(tmp_path / "b", remote=url, lease_min_compile_rtts=0.0)
    a_compiling, b_done = threading.Event(), threading.Event()
    runs: list[str] = []

    def hold_node_a(event: tpc.CompileEvent) -> None:
        runs.append(threading.current_thread().name)
        if threading.current_thread().name == "node-a":
            a_compiling.set()
            assert b_done.wait(JOIN_S)

    stop = tpc.on_compile(hold_node_a)
    node_a_thread = threading.Thread(
        target=tpc.compile, args=(kernel(320), "c++", options()), kwargs={"cache": node_a}, name="node-a"
    )
    try:
        node_a_thread.start()
        assert a_compiling.wait(JOIN_S)
        started = time.monotonic()
        tpc.compile(kernel(320), "c++", options(), cache=node_b, wait_timeout=0.3)
        took = time.monotonic() - started
        b_done.set()
        node_a_thread.join(JOIN_S)
    finally:
        b_done.set()
        stop()
        node_a.close()
        node_b.close()
    assert runs == ["node-a", "MainThread"], decisions
    by_choice = {d.choice: d for d in decisions}
    assert set(by_choice) == {"held", "gave_up"}
    gave_up = by_choice["gave_up"]
    # B returned while A still held the lease (A waits for b_done): it gave up after its wait, then compiled. The
    # wait's own bound (its timeout, on a stepped clock) is test_lease's; here the wall only says it came first.
    assert 0 < gave_up.waited_s < took and 0.3 < took < JOIN_S and node_b.stats().flight["gave_up"] == 1


def test_a_live_holder_is_waited_for(tmp_path, decisions, fresh_compile_times):
    """The same stuck holder, let go once B is seen waiting: one compile.

    Deterministic under any load: B starts only once A holds the lease and is compiling, A is let go
    only once B is inside its wait (its lease read), and A releases only once its entry is up, so B,
    seeing the release, finds the entry behind it ("waited"), never a lease of its own ("found")."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    node_a = TieredProgramCache(tmp_path / "a", remote=url, lease_min_compile_rtts=0.0)  # the lease, whatever R
    node_b = TieredProgramCache(tmp_path / "b", remote=url, lease_min_compile_rtts=0.0)
    # Both probes answered before the first kernel.
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)
    a_compiling, let_go = threading.Event(), threading.Event()
    runs: list[str] = []

    def hold_node_a(event: tpc.CompileEvent) -> None:
        runs.append(threading.current_thread().name)
        if threading.current_thread().name == "node-a":
            a_compiling.set()
            assert let_go.wait(JOIN_S)

    stop = tpc.on_compile(hold_node_a)
    node_a_thread = threading.Thread(
        target=tpc.compile, args=(kernel(321), "c++", options()), kwargs={"cache": node_a}, name="node-a"
    )
    out = []
    node_b_thread = threading.Thread(
        target=lambda: out.append(tpc.compile(kernel(321), "c++", options(), cache=node_b)), name="node-b"
    )
    try:
        node_a_thread.start()
        assert a_compiling.wait(JOIN_S)
        node_b_thread.start()
        (held,) = decisions  # A's, reported before it compiled
        assert _waiting(node_b, held.name)
        node_b_thread.join(2.0)  # a live holder: B still waits
        assert node_b_thread.is_alive()
        let_go.set()
        node_b_thread.join(JOIN_S)
        node_a_thread.join(JOIN_S)
    finally:
        let_go.set()
        stop()
        node_a.close()
        node_b.close()
    assert sorted(d.choice for d in decisions) == ["held", "waited"], decisions
    assert runs == ["node-a"] and len(out) == 1


def _waiting(cache: TieredProgramCache, name: str) -> bool:
    """Block until some thread has read lease ``name`` through ``cache``'s lease store at least twice."""
    leases = cache.shared_store.leases()
    reads = threading.Semaphore(0)
    original = leases.read

    def counting_read(lease_name: str):
        data = original(lease_name)
        if lease_name == name:
            reads.release()
        return data

    leases.read = counting_read  # type: ignore[method-assign]
    try:
        return reads.acquire(timeout=JOIN_S) and reads.acquire(timeout=JOIN_S)
    finally:
        leases.read = original  # type: ignore[method-assign]


# -- the small parts, each pinned ------------------------------------------------------------------


@pytest.mark.parametrize("weight", [0, -0.1, 1.0001, 2])
def test_compile_times_refuse_a_weight_outside_0_exclusive_to_1(weight):
    with pytest.raises(ValueError, match="weight must be in"):
        CompileTimes(weight=weight)


def test_a_weight_of_one_keeps_the_newest_compile_only():
    times = _warm(CompileTimes(weight=1))
    times.record("c++", "cubin", 5.0, 1)
    times.record("c++", "cubin", 0.5, 1)
    assert times.predict("c++", "cubin", 1) == 0.5


def test_with_no_round_trip_timed_the_plan_polls_at_the_floor(tmp_path):
    assert FlightPolicy().wait_plan(_store_at(tmp_path)).poll_period() == POLL_FLOOR_S


def test_a_decision_is_logged_at_info_when_a_waiter_gave_up_and_debug_otherwise(caplog):
    from tiered_progcache.cluster.flightpolicy import FlightDecision, report

    caplog.set_level(logging.DEBUG, logger="tiered_progcache.cluster.flightpolicy")
    report(FlightDecision("ab" * 32, "gave_up", 0.25, 0.0305, waited_s=0.5))
    report(FlightDecision("cd" * 32, "held", 1.5, None))
    report(FlightDecision("cd" * 32, "held", None, None))
    report(FlightDecision("cd" * 32, "held", None, 0.0999))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "entry abababababababab: gave_up (C 0.250 s, R 30.5 ms, waited 0.500 s)"),
        (logging.DEBUG, "entry cdcdcdcdcdcdcdcd: held (C 1.500 s, R unknown, waited 0.000 s)"),
        (logging.DEBUG, "entry cdcdcdcdcdcdcdcd: held (C unknown, R unknown, waited 0.000 s)"),
        (logging.DEBUG, "entry cdcdcdcdcdcdcdcd: held (C unknown, R 99.9 ms, waited 0.000 s)"),
    ]


def test_a_hook_gets_each_decision_until_unsubscribed_and_a_failing_hook_is_logged(caplog):
    from tiered_progcache.cluster.flightpolicy import FlightDecision, report

    seen: list[FlightDecision] = []
    stop = on_flight(seen.append)

    def broken(decision: FlightDecision) -> None:
        raise RuntimeError("hook bug")

    stop_broken = on_flight(broken)
    first = FlightDecision("ef" * 32, "raced_won", 0.01, 0.05)
    counted: list[str] = []
    report(first, counted.append)
    assert counted == ["raced_won"]
    stop()
    stop()  # twice: harmless
    stop_broken()
    report(FlightDecision("ef" * 32, "held", 2.0, 0.05))
    assert seen == [first]
    assert first.as_dict() == {"name": "ef" * 32, "choice": "raced_won", "estimate_s": 0.01, "round_trip_s": 0.05,
                               "waited_s": 0.0}  # what bench_fleet --decisions writes
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"on_flight hook {broken!r} failed"]


@pytest.mark.parametrize("window", [0, -1, True, 1.5, "4"])
def test_latency_tracker_refuses_a_window_that_is_not_a_positive_int(window):
    with pytest.raises(ValueError, match="window must be a positive int"):
        LatencyTracker(window=window)


def test_a_zero_duration_counts_and_an_infinite_one_does_not():
    tracker = LatencyTracker(window=1)
    tracker.record(0.0)
    assert (tracker.recorded, tracker.median()) == (1, 0.0)
    times = _warm(CompileTimes(weight=1))
    times.record("c++", "cubin", 0.0, 1)
    assert times.predict("c++", "cubin", 1) == 0.0
    for bad in (float("inf"), float("nan"), -0.5):
        assert times.record("c++", "cubin", bad, 1) is False
    assert times.predict("c++", "cubin", 1) == 0.0


# -- issue 17: races, persisted compile times, failures once per cluster, clamped leases ----------


def _race_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-race-")]


def test_a_short_compile_races_and_the_lookup_that_answers_first_wins_and_the_compile_is_dropped(
    tmp_path, slow_s3, decisions, events
):
    """Node W fills the remote; node Y predicts the kernel short (0.01 s against 50 ms): its compile runs
    beside the lookup, held (its hook) until the lookup has answered. Y returns W's entry, and its own
    compile, once let go, stores nothing: one request on the wire, the look."""
    proxy, storage_options, url = slow_s3
    with TieredProgramCache(tmp_path / "w", remote=url, remote_options=storage_options) as node_w:
        tpc.compile(kernel(330), "c++", options(), cache=node_w)
        assert node_w.flush(JOIN_S)
        _released(decisions[0].name)  # W's lease read and delete are off the wire before Y starts
    compile_times.clear()
    _predicting(compile_times, kernel(330), 0.01)
    del decisions[:]
    lookup_won = threading.Event()
    stop_flight = on_flight(lambda d: lookup_won.set() if d.choice == "raced_found" else None)
    stop_hook = tpc.on_compile(lambda e: lookup_won.wait(JOIN_S))
    try:
        with TieredProgramCache(tmp_path / "y", remote=url, remote_options=storage_options,
                                boot_fetch_bytes=0) as node_y:  # the race's lookup, not the boot fetch, answers
            node_y.get(b"a first request, so the round trip is known")
            before, compiled_before = proxy.requests, len(events)
            obj = tpc.compile(kernel(330), "c++", options(), cache=node_y)
            for thread in _race_threads():
                thread.join(JOIN_S)
            assert node_y.flush(JOIN_S)
            seen = proxy.requests - before
    finally:
        stop_flight()
        stop_hook()
    assert bytes(obj.code)[:4] == b"\x7fELF"
    assert [d.choice for d in decisions] == ["raced_found"]
    assert node_y.stats().flight["raced_found"] == 1
    assert len(events) - compiled_before == 1  # the race did run the compiler
    assert seen == 1  # the look; the dropped compile uploaded nothing


def test_a_raced_compile_that_answers_first_is_stored_and_uploaded_and_takes_no_lease(tmp_path, decisions, events):
    """Every compile predicted short (k = 1e9 round trips): a miss on the remote, the compile's result
    is the answer, stored locally and uploaded as usual, and no lease object is ever written."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    _predicting(compile_times, kernel(331), 0.05)
    with TieredProgramCache(tmp_path / "a", remote=url, lease_min_compile_rtts=1e9) as node_a:
        node_a.get(b"a first request, so the round trip is known")
        obj = tpc.compile(kernel(331), "c++", options(), cache=node_a)
        assert node_a.flush(JOIN_S)
    with TieredProgramCache(tmp_path / "b", remote=url) as node_b:  # a node that never compiles it
        again = tpc.compile(kernel(331), "c++", options(), cache=node_b)
    assert [d.choice for d in decisions] == ["raced_won"] and len(events) == 1  # node B: a hit, no flight
    assert bytes(again.code) == bytes(obj.code)  # node B got node A's upload
    leases_dir = tmp_path / "remote" / "leases"
    assert not leases_dir.exists() or not any(leases_dir.iterdir())


def test_a_raced_compile_that_answers_first_is_returned_while_the_lookup_is_still_under_way(tmp_path, decisions, events):
    """The race's lookup is held mid-read; the compile (predicted short) answers, and compile() returns
    then, not when the lookup comes back: a race costs the faster of the two, never the slower."""
    from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, make_program_cache_key

    (tmp_path / "remote").mkdir()
    remote = WrapperEntryStore(RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}"))
    source = kernel(332)
    held = make_program_cache_key(code=source, code_type="c++", options=options(), target_type="cubin")
    lookup = remote.hold("read_entry", name=entry_name(held), timeout=JOIN_S)  # "still under way" as a state
    _predicting(compile_times, source, 0.001)
    node = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"), remote],
                              lease_min_compile_rtts=1e9, boot_fetch_bytes=0)  # fmt: skip
    node.get(b"a first request, so the round trip is known")
    returned: list[object] = []
    caller = threading.Thread(target=lambda: returned.append(tpc.compile(source, "c++", options(), cache=node)))
    caller.start()
    try:
        caller.join(JOIN_S)
        assert returned, "compile() waited for the lookup although its compile had answered"
        assert lookup.arrived.is_set() and not lookup.is_open  # the lookup was under way all along
    finally:
        lookup.open()
        caller.join(JOIN_S)
        node.close()
    assert [d.choice for d in decisions] == ["raced_won"] and len(events) == 1
    assert bytes(returned[0].code)[:4] == b"\x7fELF"


def test_the_prediction_scales_with_the_source_and_the_headers_it_reads():
    times = _warm(CompileTimes())
    assert times.predict("c++", "cubin", 1000) is None  # nothing timed: the size-based guess plans it
    times.record("c++", "cubin", 0.02, compile_size(2000, 0))
    assert times.predict("C++", "CUBIN", compile_size(2000, 0)) == pytest.approx(0.02)
    assert times.predict("c++", "cubin", compile_size(4000, 0)) == pytest.approx(0.04)
    heavy = compile_size(500, 1000)  # a CUB kernel: a short source reading a thousand headers
    assert heavy == 500 + 1000 * HEADER_BYTES and times.predict("c++", "cubin", heavy) > 1.0
    assert times.predict("ptx", "cubin", 1000) is None
    assert compile_size(0, -3) == 1  # never zero, never negative


def test_a_fresh_process_on_a_node_that_compiled_before_predicts_from_its_local_directory(tmp_path):
    """The node's compile times persist in its local directory: a new process (a real one) predicts
    the same; a corrupt or absurd file predicts nothing."""
    import json as _json
    import subprocess
    import sys

    with TieredProgramCache(tmp_path / "node") as cache:
        tpc.compile(kernel(332), "c++", options(), cache=cache)
        tpc.compile(kernel(335), "c++", options(), cache=cache)  # the process's first compile may not count
    size = compile_size(len(kernel(333)), 0)
    here = compile_times.predict("c++", "cubin", size)
    assert here is not None
    script = ("import sys; from tiered_progcache import TieredProgramCache; import importlib; "
              "c = importlib.import_module('tiered_progcache.cluster.singleflight'); "
              "print(repr(c.predict(TieredProgramCache(sys.argv[1]), 'c++', 'cubin', int(sys.argv[2]))))")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "node"), str(size)], capture_output=True,
                         text=True, timeout=JOIN_S, check=True)
    assert float(run.stdout.strip()) == pytest.approx(here)
    times_file = tmp_path / "node" / COMPILE_TIMES_FILE
    for bad in ("{", _json.dumps({"format": "tiered-progcache/compile-times", "version": 1,
                                   "kinds": {"c++/cubin": {"s_per_byte": -1.0}}}),
                _json.dumps({"format": "other", "kinds": {}})):
        times_file.write_text(bad)
        fresh = CompileTimes()
        fresh.load(tmp_path / "node")
        assert fresh.predict("c++", "cubin", size) is None


def _hold_until_waiting(waiter: TieredProgramCache):
    """An on_compile hook that holds the compiling thread until ``waiter`` is inside its wait for the lease."""

    def hook(event: tpc.CompileEvent) -> None:
        if threading.current_thread().name == "node-a":
            assert _waiting(waiter, entry_name(event.key))

    return hook


@pytest.mark.parametrize("same_key", [True, False])
def test_a_failed_holder_publishes_its_error_and_its_waiter_raises_the_same_error(
    tmp_path, decisions, events, same_key
):
    """Node A's compile of a broken kernel fails while node B waits for A's lease. Signed with one key,
    B raises the same exception type and message (the compiler log) without compiling: one run. With
    another key B cannot verify A's record, so it does not trust it: it compiles itself once the record's
    short life (here the 1 s lease TTL) is over, and gets its own error."""
    from cuda.core._utils.cuda_utils import NVRTCError

    from test_singleflight import BROKEN

    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    node_a = TieredProgramCache(tmp_path / "a", remote=url, signing_key=b"k" * 32, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(tmp_path / "b", remote=url, signing_key=b"k" * 32 if same_key else b"j" * 32,
                                lease_min_compile_rtts=0.0)  # the lease whatever R a loaded machine times
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)  # both probes answered
    stop = tpc.on_compile(_hold_until_waiting(node_b))
    errors: dict[str, BaseException] = {}

    def node(name: str, cache: TieredProgramCache) -> None:
        try:
            tpc.compile(BROKEN, "c++", options(), cache=cache, lease_ttl=1.0)
        except Exception as exc:
            errors[name] = exc

    a = threading.Thread(target=node, args=("a", node_a), name="node-a")
    try:
        a.start()
        while not decisions:  # A reports "held" before it compiles; B starts once A holds the lease
            assert a.is_alive() or decisions
            threading.Event().wait(0.005)
        node("b", node_b)
        a.join(JOIN_S)
    finally:
        stop()
        node_a.close()
        node_b.close()
    assert type(errors["a"]) is NVRTCError and type(errors["b"]) is NVRTCError
    assert "undeclared_symbol" in str(errors["b"])
    if same_key:
        assert str(errors["b"]) == str(errors["a"])
        assert [e.ok for e in events] == [False]  # the cluster ran the compiler once
        assert sorted(d.choice for d in decisions) == ["failed", "held"]
    else:
        assert [e.ok for e in events] == [False, False]
        assert sorted(d.choice for d in decisions) == ["held", "held"]


def test_a_planted_lease_with_an_absurd_estimate_costs_one_compile_and_one_lease_ttl(tmp_path, decisions, events):
    """A lease nobody renews claiming a 1e6 s compile and an expiry in 33658 AD: a default waiter breaks
    it one lease TTL (here 1 s) after it saw it, and compiles once; its wait_timeout (300 s) is not spent.
    ``lease_min_compile_rtts=0`` pins the lease case: the default races a kernel predicted under four of the
    store's round trips, and on a loaded machine a file:// round trip can be that long.
    """
    import json as _json
    import socket

    from tiered_progcache.compiling.keys import compile_key

    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    key = compile_key(kernel(334), "c++", options(), "cubin", (), None).key
    planted = {"format": "tiered-progcache/lease", "version": 1, "holder": "another-node:1", "token": "planted",
               "acquired_at": time.time(), "expires_at": 1e12, "compile_estimate_s": 1e6}
    with TieredProgramCache(tmp_path / "node", remote=url, lease_min_compile_rtts=0) as cache:
        assert cache.shared_store.leases().create(entry_name(key), _json.dumps(planted).encode(), 60)
        obj = tpc.compile(kernel(334), "c++", options(), cache=cache, lease_ttl=1.0)
    assert bytes(obj.code)[:4] == b"ELF" and len(events) == 1
    (decision,) = decisions
    assert decision.choice == "held" and 1.0 <= decision.waited_s < 300


def test_compile_times_saved_are_loaded_back_exactly_and_never_over_what_this_process_measured(tmp_path):
    import json as _json

    times = _warm(CompileTimes(), "c++", "ptx")
    times.record("c++", "cubin", 0.5, 1000)
    times.record("ptx", "cubin", 0.2, 10)
    times.note_round_trip("s3://bucket/cache", 0.031)
    times.note_round_trip("s3://other", None)  # nothing measured: nothing kept
    times.note_round_trip("s3://absurd", 3600.5)
    times.save(tmp_path)
    doc = _json.loads((tmp_path / COMPILE_TIMES_FILE).read_text())
    assert doc == {"format": "tiered-progcache/compile-times", "version": 2,
                   "kinds": {"c++/cubin": {"s_per_byte": 0.0005}, "ptx/cubin": {"s_per_byte": 0.02}},
                   "round_trips": {"s3://bucket/cache": 0.031}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [COMPILE_TIMES_FILE]  # nothing staged left behind
    fresh = _warm(CompileTimes(), "ptx")
    fresh.record("ptx", "cubin", 0.9, 10)
    fresh.note_round_trip("s3://bucket/cache", 0.002)
    fresh.load(tmp_path)
    assert fresh.predict("c++", "cubin", 2000) == pytest.approx(1.0)
    assert fresh.predict("ptx", "cubin", 10) == pytest.approx(0.9)  # its own wins
    assert fresh.round_trip("s3://bucket/cache") == 0.002 and fresh.round_trip("s3://other") is None
    other = CompileTimes()
    other.load(tmp_path)
    assert other.round_trip("s3://bucket/cache") == 0.031
    times.save(tmp_path / "missing")  # made with the library's modes, as every write into a local directory
    again = CompileTimes()
    again.load(tmp_path / "missing")
    assert again.round_trip("s3://bucket/cache") == times.round_trip("s3://bucket/cache") == 0.031
    assert (tmp_path / "missing").stat().st_mode & 0o002 == 0  # never world-writable


@pytest.mark.parametrize("value, loaded", [
    (0.0, 0.0), (3600.0, 3600.0), (3600, 3600.0), (3600.5, None), (True, None), (float("nan"), None),
    (float("inf"), None), ("1", None), (-0.001, None),
])
def test_a_persisted_value_loads_only_if_it_is_a_plausible_number(tmp_path, value, loaded):
    import json as _json

    doc = {"format": "tiered-progcache/compile-times", "version": 2,  # the bad kinds first: each is skipped
           "kinds": {"noslash": {"s_per_byte": 1.0}, "ptx/cubin": "not a dict", "c++/cubin": {"s_per_byte": value}},
           "round_trips": {"s3://b": value}}
    (tmp_path / COMPILE_TIMES_FILE).write_text(_json.dumps(doc))
    times = CompileTimes()
    times.load(tmp_path)
    assert times.predict("c++", "cubin", 1) == loaded and times.round_trip("s3://b") == loaded
    assert times.predict("ptx", "cubin", 1) is None and times.predict("noslash", "", 1) is None
    for unread in (_json.dumps({**doc, "kinds": ["c++/cubin"], "round_trips": ["s3://b"]}),
                   _json.dumps({**doc, "format": "other"}), _json.dumps([doc]),
                   " " * 65536 + _json.dumps(doc)):  # lists, another format, over the 64 KiB read
        (tmp_path / COMPILE_TIMES_FILE).write_text(unread)
        other = CompileTimes()
        other.load(tmp_path)
        assert other.predict("c++", "cubin", 1) is None and other.round_trip("s3://b") is None


def test_a_compile_times_file_is_read_up_to_64_kib_exactly(tmp_path):
    import json as _json

    doc = _json.dumps({"format": "tiered-progcache/compile-times", "version": 2,
                       "kinds": {"c++/cubin": {"s_per_byte": 0.5}}})
    for size, loaded in ((65536, 0.5), (65537, None)):  # whole within the bound; one byte over: cut, not read
        (tmp_path / COMPILE_TIMES_FILE).write_text(" " * (size - len(doc)) + doc)
        times = CompileTimes()
        times.load(tmp_path)
        assert times.predict("c++", "cubin", 1) == loaded, size


def test_a_save_that_cannot_rename_raises_oserror_and_leaves_nothing_staged(tmp_path):
    (tmp_path / COMPILE_TIMES_FILE).mkdir()  # the rename onto a directory fails
    times = _warm(CompileTimes())
    times.record("c++", "cubin", 0.1, 10)
    with pytest.raises(OSError):
        times.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [COMPILE_TIMES_FILE]


def test_a_sized_compile_folds_its_rate_and_a_sizeless_or_bad_one_does_not():
    times = _warm(CompileTimes(weight=0.5))
    times.record("C++", "CUBIN", 1.0, 100)
    times.record("c++", "cubin", 3.0, 100)
    assert times.predict("c++", "cubin", 100) == pytest.approx(2.0)
    assert times.record("c++", "cubin", 5.0, 0) is False and times.record("c++", "cubin", 5.0, -1) is False
    assert times.predict("c++", "cubin", 100) == pytest.approx(2.0)
    times.record("c++", "cubin", 0.0, 1)  # the smallest size there is does count
    assert times.predict("c++", "cubin", 100) == pytest.approx(1.0)
    times.clear()
    assert times.predict("c++", "cubin", 100) is None


def test_a_new_process_knows_r_before_its_first_kernel_from_what_the_node_measured(tmp_path):
    """The round trip a node measured is kept per store in its local directory and seeds the next process's
    store (one sample beside its probe), so the first kernel's case is planned against it."""
    from tiered_progcache.cluster import singleflight

    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    with TieredProgramCache(tmp_path / "node", remote=url) as cache:
        location = cache.shared_store.location
    times = CompileTimes()
    times.note_round_trip(location, 0.25)
    times.save(tmp_path / "node")
    with TieredProgramCache(tmp_path / "node", remote=url) as cache:
        assert cache.shared_store.wait_ready(60)  # the probe and its round-trip sample (beside the constructor)
        latency = cache.shared_store.runner.latency
        latency.__init__()  # forget the probe: only what the node persisted
        singleflight._loaded.discard(str(tmp_path / "node"))
        singleflight._seeded.discard((str(tmp_path / "node"), location))
        compile_times.clear()
        assert singleflight.predict(cache, "c++", "cubin", 1000) == pytest.approx(untimed_estimate(1000))
        assert cache.shared_store.round_trip_s == 0.25 and latency.recorded == 1
        singleflight.predict(cache, "c++", "cubin", 1000)
        assert latency.recorded == 1  # seeded once per process and store
        latency.__init__()  # a store that has timed nothing: R is what the node persisted for it
        assert cache.shared_store.round_trip_s is None and singleflight.round_trip(cache.shared_store) == 0.25
        latency.record(0.25)
        assert singleflight.plan(cache, 0.9) == ("short", 0.25) and singleflight.plan(cache, 1.1) == ("lease", 0.25)
        assert singleflight.describe(cache, 0.9) == (
            "short: C 900.0 ms < 4 x R 250.0 ms: the compile races the shared lookup, no lease")
        assert singleflight.describe(cache, 1.1) == (
            "lease: C 1100.0 ms >= 4 x R 250.0 ms: one node compiles, the others wait for its entry")


def test_each_store_of_a_node_directory_is_seeded_once_with_what_the_node_measured_for_it(tmp_path):
    """One local directory, two shared stores: each store's first kernel is planned against the round trip the
    node persisted for that store (the seed is remembered per directory and store, not once per process)."""
    from tiered_progcache.cluster import singleflight

    urls = []
    for remote in ("one", "two"):
        (tmp_path / remote).mkdir()
        urls.append(f"file://{tmp_path / remote}")
    times = CompileTimes()
    for url, rtt in zip(urls, (0.25, 0.5)):
        with TieredProgramCache(tmp_path / "node", remote=url) as cache:
            times.note_round_trip(cache.shared_store.location, rtt)
    times.save(tmp_path / "node")
    compile_times.clear()
    for url, rtt in zip(urls, (0.25, 0.5)):
        with TieredProgramCache(tmp_path / "node", remote=url) as cache:
            assert cache.shared_store.wait_ready(60)  # the probe (beside the constructor) has ended
            latency = cache.shared_store.runner.latency
            latency.__init__()  # forget the probe: only what the node persisted
            singleflight.predict(cache, "c++", "cubin", 1000)
            assert (cache.shared_store.round_trip_s, latency.recorded) == (rtt, 1)


def test_every_constant_of_the_policy_is_pinned():
    """The table in flightpolicy.py and docs/cluster.md: one value each, with its reason there."""
    from tiered_progcache.cluster import flightpolicy as fp
    from tiered_progcache.stores.latency import LATENCY_WINDOW

    assert (fp.POLL_FLOOR_S, fp.POLL_GROWTH, fp.COMPILE_TIME_WEIGHT, fp.HEADER_BYTES) == (0.01, 0.02, 0.3, 8192)
    assert (fp.UNTIMED_FIXED_S, fp.UNTIMED_SECONDS_PER_BYTE, fp.MAX_PERSISTED_S) == (0.02, 2e-6, 3600.0)
    assert fp.UNMEASURED_ROUND_TRIP_S == 0.05
    assert (fp.UPLOAD_FLUSH_TIMEOUT_S, fp.EXIT_POLL_S, LATENCY_WINDOW, DEFAULT_LEASE_MIN_COMPILE_RTTS) == (
        30.0, 0.1, 64, 4.0)
    assert fp.DECISIONS == ("raced_won", "raced_found", "held", "waited", "found_under_lease", "failed",
                            "gave_up", "no_lease")
    assert fp.DEFER_PAST_FILES == 64
    assert fp.RACE_MIN_CPU_SHARE == 0.5
    # its reason: a kernel past that many headers is over 1 s by the untimed estimate, the lease below R = 0.25 s
    past = fp.untimed_estimate(fp.compile_size(0, fp.DEFER_PAST_FILES + 1))
    assert past > 1.0 and past > DEFAULT_LEASE_MIN_COMPILE_RTTS * 0.25


def _cache_at(tmp_path, round_trip_s: float) -> TieredProgramCache:
    """A chain in front of a real file:// remote whose round trip is timed at ``round_trip_s``."""
    from cuda.core.utils import InMemoryProgramCache

    (tmp_path / "remote").mkdir(exist_ok=True)
    return TieredProgramCache(tiers=[InMemoryProgramCache(), _store_at(tmp_path, round_trip_s)])


def test_a_store_without_leases_gets_one_look_then_the_work_and_counts_no_lease(tmp_path, decisions):
    """The node case (no atomic create, read-only, down): under the node lock, one look, then the work."""
    from tiered_progcache.cluster.singleflight import run_once

    cache = _cache_at(tmp_path, 0.05)
    looks, made = [], []

    def produce() -> tuple[str, str]:
        made.append(1)
        return "made", "shared"

    try:
        work = Work(find=lambda: looks.append(1), produce=produce, adopt=lambda shared: shared)
        assert run_once(cache, b"node key", work, wait_timeout=30, lease_ttl=60, case="node", estimate_s=0.01) == "made"
        assert (looks, made) == ([1], [1])
        assert decisions == [FlightDecision(entry_name(b"node key"), "no_lease", 0.01, 0.05)]
        found = Work(find=lambda: ("found", "shared"), produce=produce, adopt=lambda shared: shared)
        assert run_once(cache, b"node key", found, wait_timeout=30, lease_ttl=60, case="node") == "found"
        assert made == [1] and len(decisions) == 1  # a hit under the node lock: no work, nothing to count
        assert cache.stats().flight == {**dict.fromkeys(cache.stats().flight, 0), "no_lease": 1}
    finally:
        cache.close()


class _Dropping(Work):
    """A flight whose work waits until the race drops it (the lookup answered first)."""

    def __init__(self, seen: threading.Event) -> None:
        super().__init__(find=lambda: ("found", "shared"), produce=None, adopt=lambda shared: shared)
        self.seen = seen
        self.adopted: list[tuple[str, bool]] = []

    def produce(self, dropped=None):
        assert dropped.wait(JOIN_S)
        self.seen.set()
        return "made", "shared"

    def adopt(self, shared, found: bool = False):
        self.adopted.append((shared, found))
        return "adopted"


def test_a_raced_lookup_that_answers_first_is_reported_with_the_estimate_and_round_trip(tmp_path, decisions):
    from tiered_progcache.cluster.singleflight import run_once

    cache = _cache_at(tmp_path, 0.05)
    dropped_seen = threading.Event()
    try:
        work = _Dropping(dropped_seen)
        assert run_once(cache, b"raced key", work, wait_timeout=30, lease_ttl=60, estimate_s=0.01,
                        case="short") == "adopted"
        assert work.adopted == [("shared", True)]  # the lookup's entry, adopted as a hit
        assert dropped_seen.wait(JOIN_S)
        assert decisions == [FlightDecision(entry_name(b"raced key"), "raced_found", 0.01, 0.05)]
    finally:
        cache.close()


def test_a_hit_right_after_taking_the_lease_is_counted_found_under_lease_with_the_time_it_took(tmp_path, decisions):
    """Another process of this node stored the entry just before this one took the lease: no work."""
    from tiered_progcache.cluster.singleflight import run_once

    cache = _cache_at(tmp_path, 0.05)
    try:
        work = Work(find=lambda: ("found", "shared"), produce=lambda: pytest.fail("no work after a hit"),
                    adopt=lambda shared: shared)
        assert run_once(cache, b"found key", work, wait_timeout=30, lease_ttl=60, estimate_s=5.0) == "found"
        assert cache.stats().flight["found_under_lease"] == 1
    finally:
        cache.close()
    (decision,) = decisions
    assert (decision.name, decision.choice, decision.estimate_s, decision.round_trip_s) == (
        entry_name(b"found key"), "found_under_lease", 5.0, 0.05)
    assert 0 < decision.waited_s < 30


def test_a_waiter_that_gets_the_holders_entry_is_counted_waited(tmp_path, decisions):
    from tiered_progcache.cluster.lease import RemoteLease
    from tiered_progcache.cluster.singleflight import run_once

    cache = _cache_at(tmp_path, 0.05)
    name = entry_name(b"waited key")
    another_node = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}")  # (its requests are not timed here)
    holder = RemoteLease(another_node.leases(), name, 60)
    assert holder.try_acquire()
    looks = []

    def find() -> tuple[str, str] | None:  # the holder's entry is up at the waiter's second look
        looks.append(1)
        return ("theirs", "shared") if len(looks) >= 2 else None

    try:
        work = Work(find=find, produce=lambda: pytest.fail("a waiter that got the entry does no work"),
                    adopt=lambda shared: shared)
        assert run_once(cache, b"waited key", work, wait_timeout=30, lease_ttl=60, estimate_s=5.0) == "theirs"
        assert cache.stats().flight["waited"] == 1
    finally:
        holder.release()
        cache.close()
    (decision,) = decisions
    assert (decision.name, decision.choice, decision.estimate_s, decision.round_trip_s) == (
        name, "waited", 5.0, 0.05)
    assert 0 < decision.waited_s < 30


def test_a_kind_never_timed_is_predicted_at_20_ms_plus_2_us_per_byte_of_its_size():
    """The bounds docs/cluster.md states: the 1,143-byte header-less matmul 22.3 ms; each header 16.4 ms."""
    assert untimed_estimate(compile_size(1143, 0)) == pytest.approx(0.020 + 2e-6 * 1143)
    assert untimed_estimate(compile_size(300, 1)) - untimed_estimate(compile_size(300, 0)) == pytest.approx(0.016384)
    assert untimed_estimate(0) == pytest.approx(0.020002)  # a size is at least one byte
    assert compile_times.predict("c++", "cubin", 1143) is None  # used only where nothing of the kind was timed


def test_describe_says_each_case_and_why_word_for_word(tmp_path):
    """What ``explain`` prints per case: the case, C, and R against the threshold (or why there is no lease)."""
    from cuda.core.utils import InMemoryProgramCache

    from tiered_progcache.chain.policy import TierPolicy
    from tiered_progcache.cluster.singleflight import describe, plan

    alone = TieredProgramCache(tiers=[InMemoryProgramCache()])
    assert plan(alone, 0.02) == ("node", None)
    assert describe(alone, 0.02) == "node: no shared tier, the node lock only (C 20.0 ms)"
    (tmp_path / "remote").mkdir()
    unknown = TieredProgramCache(tiers=[InMemoryProgramCache(), _store_at(tmp_path)], lease_min_compile_rtts=2.0)
    assert plan(unknown, 0.0999) == ("short", None)
    assert describe(unknown, 0.0999) == (
        "short: C 99.9 ms < 2 x R unknown, 50 ms assumed: the compile races the shared lookup, no lease")
    assert plan(unknown, 0.1) == ("lease", None)
    assert describe(unknown, 0.1) == (
        "lease: C 100.0 ms >= 2 x R unknown, 50 ms assumed: one node compiles, the others wait for its entry")
    read_only = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}", read_only=True)
    assert read_only.wait_ready(60)  # the probe's own sample is in: the tracker below holds only 50 ms
    read_only.runner.latency = LatencyTracker()
    read_only.runner.latency.record(0.05)
    node = TieredProgramCache(tiers=[InMemoryProgramCache(), (read_only, TierPolicy("remote", shared=True,
                                                                                     read_only=True))])
    assert plan(node, 1.0) == ("node", 0.05)
    assert describe(node, 1.0) == ("node: the shared store takes no lease (no atomic create, read-only or down): "
                                   "node lock only (C 1000.0 ms, R 50.0 ms)")
    admitting = TieredProgramCache(tiers=[InMemoryProgramCache(), _store_at(tmp_path, 0.01)],
                                   min_upload_compile_s=0.5)
    assert plan(admitting, 0.4) == ("short", 0.01)
    assert describe(admitting, 0.4) == ("short: C 400.0 ms < min_upload_compile_s (not uploaded): the compile races "
                                        "the shared lookup, no lease")
    assert describe(admitting, 0.5) == "lease: C 500.0 ms >= 4 x R 10.0 ms: one node compiles, the others wait for its entry"
    racing = TieredProgramCache(tiers=[InMemoryProgramCache(), _store_at(tmp_path, 0.01)])
    assert describe(racing, 0.005) == "short: C 5.0 ms < 4 x R 10.0 ms: the compile races the shared lookup, no lease"
    for cache in (alone, unknown, node, admitting, racing):
        cache.close()


def test_describe_says_a_short_compile_looks_first_where_every_cpu_is_busy(tmp_path, measured_cpu):
    from cuda.core.utils import InMemoryProgramCache

    from tiered_progcache.cluster.singleflight import describe

    _busy(measured_cpu, 0.25)
    busy = TieredProgramCache(tiers=[InMemoryProgramCache(), _store_at(tmp_path, 0.01)], min_upload_compile_s=0.5)
    try:
        assert describe(busy, 0.005) == ("short: C 5.0 ms < min_upload_compile_s (not uploaded): CPUs busy (compiles "
                                         "got 0.25 of one): the node lock, one look, the compile on a miss, no lease")
        assert describe(busy, 0.5) == ("lease: C 500.0 ms >= 4 x R 10.0 ms: one node compiles, the others wait for "
                                       "its entry")
        for share in (None, 0.5):  # none measured, and exactly half a CPU: not busy
            if share is None:
                measured_cpu.clear()
            else:
                _busy(measured_cpu, share)
            assert describe(busy, 0.005) == ("short: C 5.0 ms < min_upload_compile_s (not uploaded): the compile "
                                             "races the shared lookup, no lease")
    finally:
        busy.close()


def test_at_exactly_the_upload_threshold_a_short_compile_is_short_by_its_round_trips(tmp_path):
    from cuda.core.utils import InMemoryProgramCache

    from tiered_progcache.cluster.singleflight import describe

    (tmp_path / "remote").mkdir()
    cache = TieredProgramCache(tiers=[InMemoryProgramCache(), _store_at(tmp_path, 1.0)], min_upload_compile_s=0.5)
    assert describe(cache, 0.5) == "short: C 500.0 ms < 4 x R 1000.0 ms: the compile races the shared lookup, no lease"
    cache.close()


@pytest.mark.parametrize("found, made, outcome", [
    (None, ValueError("compile failed"), "raises"),        # a miss and a failed compile: the compile's error
    (OSError("lookup failed"), ("made", "shared"), "made"),  # a failed lookup is a miss: the compile's result
    (("found", "shared"), ValueError("compile failed"), "shared"),  # a failed compile loses to a hit (adopted)
])
def test_a_race_hands_each_sides_failure_to_the_right_place(tmp_path, decisions, found, made, outcome):
    def side(value):
        def call():
            if isinstance(value, Exception):
                raise value
            return value
        return call

    _run_short(_cache_at(tmp_path, 0.05), b"race key", Work(find=side(found), produce=side(made),
                                                             adopt=lambda shared: shared), outcome)


def _run_short(cache: TieredProgramCache, key: bytes, work, outcome: str) -> None:
    """``run_once`` of ``work`` in the short case, then ``cache`` closed: it returns ``outcome``, or with
    ``"raises"`` raises the work's ``ValueError("compile failed")``."""
    from tiered_progcache.cluster.singleflight import run_once

    try:
        if outcome == "raises":
            with pytest.raises(ValueError, match="compile failed"):
                run_once(cache, key, work, wait_timeout=30, lease_ttl=60, case="short", estimate_s=0.01)
        else:
            assert run_once(cache, key, work, wait_timeout=30, lease_ttl=60, case="short", estimate_s=0.01) == outcome
    finally:
        cache.close()


# -- where every CPU is busy ---------------------------------------------------------------------------


def _busy(times: CompileTimes, share: float) -> None:
    """Make ``times`` hold ``share`` as the CPU share its compiles got (past a first compile, which is not folded)."""
    times.clear()
    times.record("c++", "(no target)", 1.0, 1)  # past the first compile, no rate a kernel of this test is planned by
    assert times.note_cpu("c++", 1.0, share) and times.cpu_share() == share  # the first share measured is the mean


def test_a_compiles_cpu_share_is_a_running_mean_from_the_second_compile_of_its_code_type_on():
    times = CompileTimes()
    assert times.note_cpu("c++", 1.0, 0.2) is False  # no c++ compile recorded yet: the first one loads the compiler
    _warm(times)
    assert times.cpu_share() is None and times.cpu_bound() is False
    assert times.note_cpu("nvvm", 1.0, 0.2) is False  # another code type's first compile
    assert times.note_cpu("C++", 1.0, 0.2) is True
    assert times.cpu_share() == 0.2 and times.cpu_bound() is True
    assert times.note_cpu("c++", 0.5, 0.5) is True
    assert times.cpu_share() == pytest.approx(0.2 + 0.3 * 0.8)
    assert times.note_cpu("c++", 2.0, 2.0) is True
    assert times.cpu_share() == pytest.approx(0.44 + 0.3 * 0.56) and times.cpu_bound() is False
    for seconds, cpu_seconds in ((0.0, 0.0), (-1.0, 0.5), (math.inf, 1.0), (math.nan, 1.0), (1.0, -0.1),
                                 (1.0, math.inf), (1.0, math.nan)):
        assert times.note_cpu("c++", seconds, cpu_seconds) is False, (seconds, cpu_seconds)
    assert times.cpu_share() == pytest.approx(0.608)
    assert times.note_cpu("c++", 1.0, 0.0) is True  # a compile that got no CPU at all is a share of 0
    times.clear()
    assert times.cpu_share() is None and times.cpu_bound() is False
    assert times.note_cpu("c++", 1.0, 0.7) is True  # a first use stays behind after clear()


def test_every_cpu_is_busy_exactly_under_half_a_cpu():
    times = _warm(CompileTimes(weight=1.0))
    times.note_cpu("c++", 1.0, 0.5)
    assert times.cpu_bound() is False
    times.note_cpu("c++", 1.0, 0.4999)
    assert times.cpu_bound() is True


def test_compile_measures_each_compiles_share_of_a_cpu_on_the_thread_that_ran_it(
        tmp_path, measured_cpu, events, monkeypatch):
    """Two compiles (the first of a process is not folded, whether or not this one is): each is noted with the
    wall time its event reports and its thread's CPU time, no more than that wall time; a share in (0, 1]."""
    noted = []
    note = measured_cpu.note_cpu
    monkeypatch.setattr(measured_cpu, "note_cpu", lambda *args: noted.append(args) or note(*args))
    with TieredProgramCache(tmp_path / "cache") as cache:
        tpc.compile(kernel(340), "c++", options(), cache=cache)
        tpc.compile(kernel(341), "c++", options(), cache=cache)
    assert [(code, seconds) for code, seconds, _ in noted] == [("c++", e.seconds) for e in events]
    assert all(0.0 < cpu_seconds <= seconds for _, seconds, cpu_seconds in noted)
    share = measured_cpu.cpu_share()
    assert share is not None and 0.0 < share <= 1.0


class _Recorded:
    """A flight whose verbs record each call (``find``'s ``shared_only`` too), in order."""

    def __init__(self, found, made) -> None:
        self.found, self.made, self.calls = found, made, []

    def find(self, shared_only: bool = False):
        self.calls.append(("find", shared_only))
        if isinstance(self.found, Exception):
            raise self.found
        return self.found

    def produce(self, dropped=None):
        self.calls.append(("produce", dropped))
        if isinstance(self.made, Exception):
            raise self.made
        return self.made

    def adopt(self, shared, found: bool = False):
        self.calls.append(("adopt", shared, found))
        return "adopted"


@pytest.mark.parametrize("found, made, outcome, calls, choice", [
    (("found", "shared"), ("made", "made"), "found", ["find"], "raced_found"),
    (None, ("made", "made"), "made", ["find", "produce"], "raced_won"),
    (None, ValueError("compile failed"), "raises", ["find", "produce"], "raced_won"),
])
def test_where_every_cpu_is_busy_a_short_compile_looks_first_and_compiles_only_on_a_miss(
        tmp_path, decisions, measured_cpu, found, made, outcome, calls, choice):
    """On this thread, one after the other: one look (every tier: another process of the node may have just
    stored it), then (on a miss) the work, never dropped; no thread of a race is started."""
    _busy(measured_cpu, 0.25)
    work = _Recorded(found, made)
    threads_before = set(threading.enumerate())
    _run_short(_cache_at(tmp_path, 0.05), b"busy key", work, outcome)
    assert work.calls[0] == ("find", False) and [call[0] for call in work.calls] == calls
    assert all(call[1] is None for call in work.calls if call[0] == "produce")  # nothing can drop it
    assert [d.choice for d in decisions] == [choice]
    assert not [t for t in set(threading.enumerate()) - threads_before
                if t.name.startswith(("tiered-progcache-race-", "tiered-progcache-look-"))]


def test_where_every_cpu_is_busy_a_kernel_the_remote_holds_runs_no_compiler_and_one_it_lacks_one(
        tmp_path, slow_s3, decisions, events, measured_cpu):
    """Node W fills the remote; node Y, whose compiles got a quarter of a CPU, predicts both kernels short: the one W
    stored comes from one request (the look) and no compiler run, the one nobody stored from the look, one compiler
    run and its uploads. (Racing, the first would have run the compiler too: the lookup cannot stop it.)"""
    proxy, storage_options, url = slow_s3
    with TieredProgramCache(tmp_path / "w", remote=url, remote_options=storage_options) as node_w:
        stored = tpc.compile(kernel(342), "c++", options(), cache=node_w)
        assert node_w.flush(JOIN_S)
        _released(decisions[0].name)
    _busy(measured_cpu, 0.25)
    _predicting(measured_cpu, kernel(342), 0.01)
    del decisions[:], events[:]
    with TieredProgramCache(tmp_path / "y", remote=url, remote_options=storage_options,
                            boot_fetch_bytes=0) as node_y:
        node_y.get(b"a first request, so the round trip is known")
        before = proxy.requests
        found = tpc.compile(kernel(342), "c++", options(), cache=node_y)
        looked = proxy.requests - before
        assert [d.choice for d in decisions] == ["raced_found"] and events == []
        made = tpc.compile(kernel(343), "c++", options(), cache=node_y)
        assert node_y.flush(JOIN_S)
    for thread in _race_threads():  # (none: a compile racing its lookup would run on one)
        thread.join(JOIN_S)
    assert looked == 1
    assert bytes(found.code) == bytes(stored.code)
    assert [d.choice for d in decisions] == ["raced_found", "raced_won"] and len(events) == 1
    assert bytes(made.code)[:4] == b"\x7fELF"
    assert node_y.stats().flight["raced_found"] == 1 and node_y.stats().flight["raced_won"] == 1


def test_a_race_asks_the_shared_tiers_alone_and_a_lookup_that_fails_first_waits_for_the_compile(
        tmp_path, decisions):
    """Racing (no CPU share measured): the lookup on its thread asks the shared tiers only (the nearby ones were
    asked before the flight); one that fails before the compile answers is a miss, and the compile's result wins."""
    lookup_failed = threading.Event()

    class FailingLookup(_Recorded):
        def find(self, shared_only: bool = False):
            try:
                return super().find(shared_only)
            finally:
                lookup_failed.set()

        def produce(self, dropped=None):
            assert lookup_failed.wait(JOIN_S)  # the lookup's failure comes first
            return super().produce(dropped)

    work = FailingLookup(OSError("lookup failed"), ("made", "made"))
    _run_short(_cache_at(tmp_path, 0.05), b"race key", work, "made")
    assert ("find", True) in work.calls and [call[0] for call in work.calls if call[0] != "find"] == ["produce"]
    assert [d.choice for d in decisions] == ["raced_won"]


def test_the_short_cases_change_of_order_is_logged_once_each_way(caplog):
    times = _warm(CompileTimes(weight=1.0))
    with caplog.at_level(logging.INFO, logger="tiered_progcache.cluster.flightpolicy"):
        times.note_cpu("c++", 1.0, 0.9)  # racing, as before any share was measured: nothing to say
        times.note_cpu("c++", 1.0, 0.3)
        times.note_cpu("c++", 1.0, 0.2)
        times.note_cpu("c++", 1.0, 0.5)
        times.note_cpu("c++", 1.0, 0.6)
    assert [r.getMessage() for r in caplog.records] == [
        "compiles here got 0.30 of a CPU lately: every CPU is busy, a short compile looks up before it compiles",
        "compiles here got 0.50 of a CPU lately: a short compile races its lookup again",
    ]
    fresh = _warm(CompileTimes())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiered_progcache.cluster.flightpolicy"):
        fresh.note_cpu("c++", 4.0, 1.0)  # the first share measured, and busy
    assert [r.getMessage() for r in caplog.records] == [
        "compiles here got 0.25 of a CPU lately: every CPU is busy, a short compile looks up before it compiles"]


def test_where_every_cpu_is_busy_the_processes_of_a_node_compile_a_short_kernel_once(
        tmp_path, decisions, events, measured_cpu, monkeypatch):
    """Two chains on one local directory, as two processes of a node are (each its own flights), compile one
    short kernel at once. B's look on its node's tiers misses while A compiles; B then waits on the node lock
    A holds, and finds A's entry in the local directory: one compiler run on the node, no lease."""
    from tiered_progcache.cluster import locks

    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    _busy(measured_cpu, 0.1)  # (A's own compile, folded in, leaves it under half a CPU)
    lock_files_opened = threading.Semaphore(0)
    open_lock_fd = locks._open_lock_fd

    def counted_open(dir_fd: int, filename: str) -> int:
        fd = open_lock_fd(dir_fd, filename)
        lock_files_opened.release()
        return fd

    monkeypatch.setattr(locks, "_open_lock_fd", counted_open)
    node_a, node_b = (TieredProgramCache(tmp_path / "node", remote=url, lease_min_compile_rtts=1e9,
                                         boot_fetch_bytes=0) for _ in range(2))
    got: dict[str, object] = {}
    b_thread = threading.Thread(target=lambda: got.setdefault("b", tpc.compile(kernel(344), "c++", options(),
                                                                               cache=node_b)))

    def while_a_compiles(event) -> None:  # on A's thread, A's node lock held, nothing of A's stored yet
        if b_thread.ident is None:
            b_thread.start()
            assert lock_files_opened.acquire(timeout=JOIN_S)  # A's
            assert lock_files_opened.acquire(timeout=JOIN_S)  # B's: its look missed, it waits on the lock

    stop = tpc.on_compile(while_a_compiles)
    try:
        got["a"] = tpc.compile(kernel(344), "c++", options(), cache=node_a)
        b_thread.join(JOIN_S)
    finally:
        stop()
        node_a.close()
        node_b.close()
    assert len(events) == 1 and bytes(got["b"].code) == bytes(got["a"].code)
    assert [d.choice for d in decisions] == ["raced_won", "raced_found"]
    leases_dir = tmp_path / "remote" / "leases"
    assert not leases_dir.exists() or not any(leases_dir.iterdir())
