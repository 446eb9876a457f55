"""Single-flight across nodes: separate local directories, one shared remote (file:// and moto S3).

Each "node" is a process with its own local cache directory, so node-level locks cannot
help: only the remote lease keeps the compiles at one per kernel.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.cluster.lease import LeaseInfo, RemoteLease, wait_for_lease
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import WrapperEntryStore
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from test_compile import RemoteWithoutAtomicCreate
from test_singleflight import ARCH, Work, BROKEN, collect_outcomes, kernel, options

SPAWN = mp.get_context("spawn")
JOIN_S = 90
LEASE_TTL_S = 2.0
#: The policy under which these tests check the mechanism: every compile takes the lease and every
#: waiter waits for the holder (up to wait_timeout). The default policy compiles short kernels
#: without a lease and stops waiting after about a compile's time (test_flight_policy.py), which on
#: a loaded test machine would let a waiter compile a kernel its holder was still compiling.
WAIT_FOR_HOLDER = {"lease_min_compile_rtts": 0.0}


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path):
    """(url, storage_options) of an empty shared remote."""
    if request.param == "file":
        (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
        return f"file://{tmp_path / 'remote'}", None
    bucket = request.getfixturevalue("s3_bucket")
    return bucket.url, bucket.storage_options


def _log_compiles(log_path: str) -> None:
    def hook(event: tpc.CompileEvent) -> None:
        started = time.time() - event.seconds
        line = f"{os.getpid()} {event.key.hex()} {int(event.ok)} {started:.6f}\n"
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    tpc.on_compile(hook)


def _read_log(log_path: Path) -> list[tuple[str, str, bool, float]]:
    if not log_path.exists():
        return []
    rows = (line.split() for line in log_path.read_text().splitlines())
    return [(p, k, ok == "1", float(t)) for p, k, ok, t in rows]


def _node(local_dir, url, storage_options, log_path, sources, seed, ready, go, results) -> None:
    try:
        _log_compiles(log_path)
        order = list(sources)
        random.Random(seed).shuffle(order)
        with TieredProgramCache(local_dir, remote=url, remote_options=storage_options, **WAIT_FOR_HOLDER) as cache:
            ready.wait(JOIN_S)  # every node at the line (a node still importing would start late)
            go.wait(JOIN_S)
            outcomes = []
            for src in order:
                called = time.time()
                try:
                    obj = tpc.compile(src, "c++", options(), cache=cache, lease_ttl=LEASE_TTL_S, wait_timeout=60)
                    outcomes.append(("ok", bytes(obj.code)[:4] == b"\x7fELF", called, time.time()))
                except Exception as exc:
                    outcomes.append(("error", str(exc)[-300:], called, time.time()))
        results.put(outcomes)
    except BaseException:
        results.put([("crash", traceback.format_exc(), 0.0, 0.0)])


def _start_nodes(n, tmp_path, url, storage_options, log, sources, go):
    """n node processes, each with its cache open and waiting for ``go`` when this returns."""
    results, ready = SPAWN.Queue(), SPAWN.Barrier(n + 1)
    procs = [
        SPAWN.Process(
            target=_node,
            args=(str(tmp_path / f"node{i}"), url, storage_options, str(log), sources, i, ready, go, results),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    ready.wait(JOIN_S)
    return procs, results


def _lease_holder(local_dir, url, storage_options, key_source, taken, ttl=LEASE_TTL_S) -> None:
    """Take the lease for one kernel the way a compiling node would, then hang until SIGKILLed."""
    from cuda.core.utils import make_program_cache_key

    with TieredProgramCache(local_dir, remote=url, remote_options=storage_options) as cache:
        key = make_program_cache_key(code=key_source, code_type="c++", options=options(), target_type="cubin")
        lease = RemoteLease(cache.shared_store.leases(), entry_name(key), ttl)
        assert lease.try_acquire()
        # Renewals before the SIGKILL only move the expiry, which the test reads after it.
        taken.set()
        threading.Event().wait(JOIN_S)


def _lease_paths(url: str, storage_options) -> list[str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()
    try:
        return fs.ls(f"{root.rstrip('/')}/leases")
    except FileNotFoundError:
        return []


def test_four_nodes_compile_each_kernel_once_in_total(tmp_path, remote):
    url, storage_options = remote
    sources = [kernel(i) for i in range(6)]
    log = tmp_path / "compiles.log"
    go = SPAWN.Event()
    procs, results = _start_nodes(4, tmp_path, url, storage_options, log, sources, go)
    go.set()
    collected = collect_outcomes(procs, results)
    assert all(o[:2] == ("ok", True) for outcomes in collected for o in outcomes)
    runs = _read_log(log)
    assert len(runs) == 6, f"{len(runs)} compiles across 4 nodes for 6 kernels"
    assert len({key for _, key, _, _ in runs}) == 6
    assert _lease_paths(url, storage_options) == []  # every lease released


def test_a_killed_lease_holder_delays_the_others_by_at_most_the_lease_ttl(tmp_path, remote):
    url, storage_options = remote
    log = tmp_path / "compiles.log"
    go = SPAWN.Event()
    procs, results = _start_nodes(3, tmp_path, url, storage_options, log, [kernel(42)], go)
    taken = SPAWN.Event()
    holder = SPAWN.Process(target=_lease_holder, args=(str(tmp_path / "holder"), url, storage_options, kernel(42), taken))
    holder.start()
    assert taken.wait(JOIN_S)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(JOIN_S)
    (lease_path,) = _lease_paths(url, storage_options)
    leases = RemoteProgramCache.from_url(url, storage_options=storage_options).leases()
    name = os.path.basename(lease_path)
    lease = RemoteLease(leases, name, LEASE_TTL_S).read()
    assert isinstance(lease, LeaseInfo)
    # As if the holder ran on another node: here its dead PID would end the wait at once
    # (test_lease.py), there only the TTL can.
    doc = json.loads(lease.raw)
    doc["process"]["host"] = "another-node"
    leases.replace(name, json.dumps(doc).encode(), LEASE_TTL_S)
    go.set()
    collected = collect_outcomes(procs, results)

    runs = _read_log(log)
    assert len(runs) == 1, "one node compiles once the dead holder's lease expires"
    (_, _, ok, compile_started) = runs[0]
    assert ok and compile_started >= lease.expires_at - 0.05  # it did wait for the lease
    for ((status, good, called, done),) in collected:
        assert status == "ok" and good
        assert called < lease.expires_at  # each node asked while the dead lease still stood
        # held up by the dead lease until it expired, then one compile and one poll interval
        # (wait_timeout is 60 s: a node that ignored the expiry would finish a minute late)
        assert done - lease.expires_at < 5.0, f"finished {done - lease.expires_at:.2f} s after the lease expired"
    assert _lease_paths(url, storage_options) == []


@pytest.mark.timeout(120)
def test_a_lease_holder_killed_on_this_host_does_not_hold_up_the_next_compile(tmp_path):
    """Its PID is gone, so the lease (an hour's TTL) is broken at once: one compile, no wait for the TTL."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    taken = SPAWN.Event()
    holder = SPAWN.Process(target=_lease_holder, args=(str(tmp_path / "holder"), url, None, kernel(43), taken, 3600.0))
    holder.start()
    assert taken.wait(JOIN_S)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(JOIN_S)
    assert len(_lease_paths(url, None)) == 1
    start = tpc.compile_count()
    with TieredProgramCache(tmp_path / "waiter", remote=url, **WAIT_FOR_HOLDER) as cache:
        obj = tpc.compile(kernel(43), "c++", options(), cache=cache, lease_ttl=3600, wait_timeout=3600)
    assert bytes(obj.code)[:4] == b"\x7fELF" and tpc.compile_count() - start == 1


def test_a_compile_error_on_the_lease_holder_reaches_every_node(tmp_path, remote):
    url, storage_options = remote
    log = tmp_path / "compiles.log"
    go = SPAWN.Event()
    procs, results = _start_nodes(3, tmp_path, url, storage_options, log, [BROKEN], go)
    go.set()
    collected = collect_outcomes(procs, results)
    for ((status, message, _, _),) in collected:
        assert status == "error" and "undeclared_symbol" in message
    runs = _read_log(log)
    # The holder publishes its failure in place of its lease: the cluster compiles the broken kernel once,
    # and every node raises the same error, with the compiler's log.
    assert len(runs) == 1 and not runs[0][2]
    messages = {message for ((_, message, _, _),) in collected}
    assert len(messages) == 1, messages


def test_a_shared_store_without_atomic_create_gets_node_level_single_flight_only(tmp_path):
    """Two nodes, two caches per node, two threads per cache: one compile per node, at the same time."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    remotes = []

    def chain(node: str) -> TieredProgramCache:
        remote = RemoteWithoutAtomicCreate.from_url(url)
        remotes.append(remote)
        return TieredProgramCache(tiers=[
            InMemoryProgramCache(),
            (FileStreamProgramCache(tmp_path / node), TierPolicy("local")),
            (remote, TierPolicy("remote", shared=True)),
        ], **WAIT_FOR_HOLDER)  # never short: the node lock is the case under test, whatever R a loaded machine times

    caches = {node: [chain(node), chain(node)] for node in ("node0", "node1")}
    both_compiling = threading.Barrier(2, timeout=30)
    compiled_on: list[str] = []

    def hold(event: tpc.CompileEvent) -> None:
        compiled_on.append(threading.current_thread().name.split("-")[0])
        both_compiling.wait()  # passes only if the two nodes compile at once: no lease serialises them

    stop = tpc.on_compile(hold)
    start = threading.Barrier(8)
    out: list[bytes] = []

    def work(cache: TieredProgramCache) -> None:
        start.wait(JOIN_S)
        out.append(bytes(tpc.compile(kernel(77), "c++", options(), cache=cache).code))

    threads = [
        threading.Thread(target=work, args=(cache,), name=f"{node}-{i}-{j}")
        for node, pair in caches.items() for i, cache in enumerate(pair) for j in range(2)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
            assert not t.is_alive(), "a thread hung"
    finally:
        stop()
        for pair in caches.values():
            for cache in pair:
                cache.close()
    assert sorted(compiled_on) == ["node0", "node1"]  # one compile per node
    assert len(out) == 8 and len(set(out)) == 1
    assert all(remote.lease_calls == [] for remote in remotes)
    assert _lease_paths(url, None) == []  # no lease object written


def test_the_holder_keeps_the_lease_until_its_upload_lands(tmp_path):
    """Node A compiles; its upload is held. Node B, polling, must see the lease held the whole time
    and get A's entry, never the lease while the entry is not up (which would make it compile)."""
    from cuda.core.utils import make_program_cache_key

    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    remote_a = WrapperEntryStore(RemoteProgramCache.from_url(url))
    upload = remote_a.hold("create_entry", timeout=JOIN_S)  # "the upload has not landed yet" as a state
    node_a = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"), remote_a],
                                **WAIT_FOR_HOLDER)
    start = tpc.compile_count()
    tpc.compile(kernel(55), "c++", options(), cache=node_a, lease_ttl=600)  # returns; the upload waits
    key = make_program_cache_key(code=kernel(55), code_type="c++", options=options(), target_type="cubin")
    name = entry_name(key)

    node_b = TieredProgramCache(tmp_path / "b", remote=url)
    looks = []

    def pause(seconds: float) -> None:  # B's pauses: short, and A's upload is let go on B's third look
        looks.append(seconds)
        if len(looks) == 3:
            upload.open()
        time.sleep(min(seconds, 0.02))

    try:
        lease_b = RemoteLease(node_b.shared_store.leases(), name, 600)
        waited = wait_for_lease(lease_b, lambda: node_b.get(key), timeout=JOIN_S, sleep=pause)
        found, held = waited.found, waited.held
        if held:  # what run_once does next: look again under the lease
            found = node_b.get(key)
            lease_b.release()
        assert found is not None, "B got the lease while A's upload had not landed: B would compile again"
        assert len(looks) >= 3 and tpc.compile_count() - start == 1
    finally:
        upload.open()
        node_a.close()
        node_b.close()


def test_the_holder_releases_once_its_own_upload_lands_not_after_every_later_one(tmp_path):
    """A's entry is uploaded while an upload queued after it is stuck: A's lease goes at once. Until A's upload
    lands the lease stays, seen after the releaser's second look at the upload found it still under way."""
    from cuda.core.utils import make_program_cache_key

    key = make_program_cache_key(code=kernel(56), code_type="c++", options=options(), target_type="cubin")
    name = entry_name(key)
    remote = WrapperEntryStore(RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}"))
    gates = {k: remote.hold("create_entry", name=entry_name(k), timeout=JOIN_S) for k in (key, b"stuck")}
    node_a = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"), remote],
                                **WAIT_FOR_HOLDER)
    wait_uploaded, not_yet, polled = node_a.wait_uploaded, [], threading.Event()

    def counted(k: bytes | str, timeout: float | None = None) -> bool:
        landed = wait_uploaded(k, timeout)
        if k == key and not landed:
            not_yet.append(k)
            if len(not_yet) >= 2:
                polled.set()
        return landed

    node_a.wait_uploaded = counted  # type: ignore[method-assign]
    try:
        tpc.compile(kernel(56), "c++", options(), cache=node_a, lease_ttl=600)  # its upload waits
        node_a[b"stuck"] = b"\x7fELF" + bytes(64)  # queued after it, and stuck
        (releaser,) = [t for t in threading.enumerate() if t.name == f"tiered-progcache-lease-{name[:8]}"]
        assert polled.wait(JOIN_S), "the releaser never looked whether its upload had landed"
        assert releaser.is_alive() and isinstance(RemoteLease(remote.leases(), name, 600).read(), LeaseInfo)
        gates[key].open()
        releaser.join(10)  # the release used to wait for the whole queue: 30 s here
        assert not releaser.is_alive(), "the lease waited for an upload queued after its own"
        assert RemoteLease(remote.leases(), name, 600).read() is None
        assert not node_a.flush(timeout=0)  # the later upload is still stuck
    finally:
        for gate in gates.values():
            gate.open()
        node_a.close()


def test_a_cache_closed_right_after_its_compile_has_released_the_lease_when_close_returns(tmp_path, cleanup,
                                                                                          monkeypatch):
    """close() drains the upload, then waits for the lease's release before it closes the tiers: the next node
    finds no lease to wait on (a release left running could meet a closed store and leave the lease to expire).
    The release is held until close() waits on the thread that makes it."""
    from cuda.core.utils import make_program_cache_key

    release, may_release = RemoteLease.release, threading.Event()

    def held_release(lease: RemoteLease) -> None:
        may_release.wait(JOIN_S)
        release(lease)

    monkeypatch.setattr(RemoteLease, "release", held_release)
    keep = TieredProgramCache.keep_until_closed

    def kept_until_joined(cache: TieredProgramCache, thread: threading.Thread) -> None:
        join = thread.join
        thread.join = lambda timeout=None: (may_release.set(), join(timeout))[1]  # type: ignore[method-assign]
        keep(cache, thread)

    monkeypatch.setattr(TieredProgramCache, "keep_until_closed", kept_until_joined)

    key = make_program_cache_key(code=kernel(57), code_type="c++", options=options(), target_type="cubin")
    name = entry_name(key)
    remote = WrapperEntryStore(RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}"))
    upload = remote.hold("create_entry", name=name, timeout=JOIN_S)
    node_a = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"), remote],
                                **WAIT_FOR_HOLDER)
    tpc.compile(kernel(57), "c++", options(), cache=node_a, lease_ttl=600)  # returns; its upload waits
    closer = cleanup.thread(node_a.close)
    upload.open()
    try:
        closer.join(JOIN_S)
        assert may_release.is_set() and not closer.is_alive()
        assert RemoteLease(remote.leases(), name, 600).read() is None, "close() returned with the lease still held"
    finally:
        may_release.set()


_COMPILE_THEN_EXIT = r"""
import sys, threading
import tiered_progcache as tpc
from cuda.core import ProgramOptions
cache = tpc.TieredProgramCache(sys.argv[1], remote=sys.argv[2], lease_min_compile_rtts=0.0)
compiler = threading.Thread(target=tpc.compile, args=(sys.argv[3], "c++", ProgramOptions(arch=sys.argv[4])),
                            kwargs={"cache": cache}, daemon=True)  # a daemon's compile: its release is not one
compiler.start()
compiler.join()
"""  # and exits at once: no close(), no flush


def test_a_process_that_exits_right_after_its_compile_releases_its_lease(tmp_path):
    """The release waits for the upload on a thread the interpreter waits for at exit (not a daemon, whoever
    compiled): a process that returns from compile() and ends leaves its entry on the store and no lease."""
    import subprocess
    import sys

    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    done = subprocess.run([sys.executable, "-c", _COMPILE_THEN_EXIT, str(tmp_path / "node"), url, kernel(58), ARCH],
                          capture_output=True, text=True, timeout=JOIN_S)
    assert done.returncode == 0, done.stderr
    assert _lease_paths(url, None) == [], "the lease outlived its process"
    with TieredProgramCache(tmp_path / "other", remote=url) as other:
        assert tpc.compile(kernel(58), "c++", options(), cache=other) is not None
        assert other.stats().hits == 1  # the exiting process's entry, from the store


class UnsealingRemote(RemoteProgramCache):
    """A real file:// remote that cannot seal a record, as a store without an envelope."""

    def seal_record(self, name: str, payload: bytes) -> bytes:
        raise RuntimeError("no envelope here")


def test_a_failure_that_cannot_be_sealed_releases_the_lease_and_says_why(tmp_path, caplog):
    """The holder's work fails and its record cannot be sealed: the error reaches the caller, the lease is
    deleted (its waiters retry rather than wait out its TTL), and the warning names the entry and the cause."""
    from tiered_progcache.cluster.singleflight import run_once

    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"),
                                      UnsealingRemote.from_url(url)], **WAIT_FOR_HOLDER)
    key = b"the failing kernel's key"

    def produce() -> tuple[object, object]:
        assert len(_lease_paths(url, None)) == 1  # held while it works
        raise ValueError("the compile failed")

    caplog.set_level("WARNING", logger="tiered_progcache.cluster.singleflight")
    try:
        with pytest.raises(ValueError, match="^the compile failed$"):
            run_once(cache, key, Work(find=lambda: None, produce=produce, adopt=lambda shared: shared),
                     wait_timeout=30, lease_ttl=600)
    finally:
        cache.close()
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.cluster.singleflight"] == [
        f"could not seal the failure of {entry_name(key)[:16]}: RuntimeError('no envelope here')"]
    assert _lease_paths(url, None) == []


def test_an_upload_that_does_not_land_releases_the_lease_after_the_flush_timeout_and_says_so(
        tmp_path, monkeypatch, caplog):
    """The holder's upload is stuck: its lease is released after ``UPLOAD_FLUSH_TIMEOUT_S`` anyway (waiters
    then compile: slower, never wrong), with a warning naming the entry and the timeout."""
    from cuda.core.utils import make_program_cache_key

    from tiered_progcache.chain import exitbudget
    from tiered_progcache.cluster import flightpolicy

    class RecordingBudget(exitbudget.ExitBudget):
        """An exit budget of its own, recording each thread it is asked to wait for."""

        def __init__(self) -> None:
            super().__init__()
            self.joined: list[tuple[str, bool]] = []

        def join(self, thread: threading.Thread) -> bool:
            self.joined.append((thread.name, thread.daemon))
            return super().join(thread)

    budget = RecordingBudget()
    monkeypatch.setattr(exitbudget, "PROCESS", budget)
    monkeypatch.setattr(flightpolicy, "UPLOAD_FLUSH_TIMEOUT_S", 1.0)
    key = make_program_cache_key(code=kernel(57), code_type="c++", options=options(), target_type="cubin")
    name = entry_name(key)
    stuck = threading.Event()

    class StuckUploadRemote(RemoteProgramCache):
        """A real file:// remote whose upload of ``key`` waits until the test ends: it never lands meanwhile."""

        def create_entry(self, entry, payload) -> bool:  # an upload is a conditional create
            if entry == name:
                assert stuck.wait(JOIN_S)
            return super().create_entry(entry, payload)

    remote = StuckUploadRemote.from_url(f"file://{tmp_path / 'remote'}")
    node_a = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "a"), remote],
                                **WAIT_FOR_HOLDER)
    caplog.set_level("WARNING", logger="tiered_progcache.cluster.singleflight")
    try:
        tpc.compile(kernel(57), "c++", options(), cache=node_a, lease_ttl=600)  # its upload never lands
        (releaser,) = [t for t in threading.enumerate() if t.name == f"tiered-progcache-lease-{name[:8]}"]
        releaser.join(20)
        assert not releaser.is_alive(), "the lease waited past the flush timeout for an upload that never lands"
        assert RemoteLease(remote.leases(), name, 600).read() is None
        assert not node_a.wait_uploaded(key, 0)  # released while the upload is still stuck
        # the release ran on a daemon thread that exit waits for only within the exit budget
        assert budget.joined == [(f"tiered-progcache-release-{name[:8]}", True)]
    finally:
        stuck.set()
        node_a.close()
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.cluster.singleflight"] == [
        f"upload of {name[:16]} did not land within 1 s of the compile"]


class RemoteWithoutLeases(RemoteProgramCache):
    """A real file:// remote that declares it holds no leases."""

    def leases(self):
        return None


@pytest.mark.parametrize("remote_class, says", [
    (RemoteWithoutLeases, "shared store {} holds no leases: node-level single-flight only"),
    (RemoteWithoutAtomicCreate, "shared store {}/leases has no atomic create-if-absent: node-level single-flight only"),
])
def test_a_store_that_cannot_hold_leases_is_said_once_per_store(tmp_path, caplog, remote_class, says):
    """Node-level single-flight only, and a warning naming each such store once (not once per compile)."""
    from tiered_progcache.cluster.singleflight import run_once

    caplog.set_level("WARNING", logger="tiered_progcache.cluster.singleflight")
    locations = []
    for store in ("one", "two", "one"):
        (tmp_path / store).mkdir(exist_ok=True)
        remote = remote_class.from_url(f"file://{tmp_path / store}")
        cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"), remote])
        try:
            work = Work(find=lambda: None, produce=lambda: ("made", "shared"), adopt=lambda shared: shared)
            assert run_once(cache, b"key", work, wait_timeout=30, lease_ttl=60) == "made"
        finally:
            cache.close()
        locations.append(remote.location)
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.cluster.singleflight"] == [
        says.format(location) for location in locations[:2]]
