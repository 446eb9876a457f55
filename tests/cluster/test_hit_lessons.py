"""What a node learns from the entries it is served, and the lease path of a kernel it cannot predict.

A node whose first kernel of a kind is a hit learns that kind's compile time from the entry's
manifest (a seed, bounded, replaced by its own first compile), so its next kernels race; a kernel
it cannot predict sends its shared lookup and its lease create together, and its look under the
lease beside its compile. Real NVRTC, moto S3 behind the delay proxy, real processes where the
behaviour is cross-process, file:// remotes with gated reads where an order must be pinned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, make_program_cache_key

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.cluster.flightpolicy import (
    COMPILE_TIMES_FILE,
    MAX_LESSONS_IN_FLIGHT,
    CompileTimes,
    HitLessons,
    compile_times,
    hit_lessons,
)
from tiered_progcache.compiling.manifest import manifest_key
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import LeaseStore
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from test_flightpolicy import _released, decisions, fresh_compile_times, slow_s3  # noqa: F401
from test_singleflight import kernel, options

JOIN_S = 90
KIND = ("c++", "cubin")


# -- CompileTimes.learn and HitLessons, each bound pinned --------------------------------------------


def test_a_hit_seeds_an_unknown_kind_only_and_never_moves_an_estimate_this_node_timed():
    times = CompileTimes()
    assert times.learn("c++", "cubin", 0.5, 1000)
    assert times.predict("c++", "cubin", 2000) == pytest.approx(1.0)
    assert not times.learn("c++", "cubin", 1e-6, 1000)  # a second lesson: ignored
    assert times.predict("c++", "cubin", 2000) == pytest.approx(1.0)
    own = CompileTimes()
    own.record("c++", "cubin", 2.0, 1000)
    assert not own.learn("c++", "cubin", 1e-6, 1000)  # timed here: a hit teaches nothing
    assert own.predict("c++", "cubin", 1000) == pytest.approx(2.0)


@pytest.mark.parametrize("seconds, size", [(-0.001, 1000), (3600.001, 1000), (float("nan"), 1000),
                                           (float("inf"), 1000), (0.5, 0), (0.5, -5)])
def test_a_lesson_outside_0_to_3600_s_or_without_a_size_is_ignored(seconds, size):
    times = CompileTimes()
    assert not times.learn("c++", "cubin", seconds, size)
    assert times.predict("c++", "cubin", 1000) is None
    assert times.learn("c++", "cubin", 3600.0, 1000) and times.learn("ptx", "cubin", 0.0, 1)  # the edges count


def test_a_forged_lesson_lasts_until_the_nodes_first_own_compile_of_the_kind_which_replaces_it(tmp_path):
    """A manifest claiming 1 microsecond for a heavy kernel makes the node race the next one; that
    compile's time replaces the lesson outright (not folded in at weight 0.3), in this process and
    in the next one that loads what this one saved."""
    times = CompileTimes()
    assert times.learn("c++", "cubin", 1e-6, 1000)
    times.save(tmp_path)
    times.record("c++", "cubin", 2.0, 1000)
    assert times.predict("c++", "cubin", 1000) == pytest.approx(2.0)
    assert times.estimate("c++", "cubin") == pytest.approx(2.0)
    times.record("c++", "cubin", 1.0, 1000)  # from then on, the running mean of its own compiles
    assert times.estimate("c++", "cubin") == pytest.approx(2.0 + 0.3 * (1.0 - 2.0))
    fresh = CompileTimes()
    fresh.load(tmp_path)  # the next process: still a lesson
    assert fresh.predict("c++", "cubin", 1000) == pytest.approx(1e-6)
    fresh.record("c++", "cubin", 2.0, 1000)
    assert fresh.predict("c++", "cubin", 1000) == pytest.approx(2.0)


def test_lessons_run_one_per_key_and_at_most_the_bound_at_once_and_wait_waits_for_them():
    times = CompileTimes()
    lessons = HitLessons(times)
    gate = threading.Event()

    def gated() -> float:
        assert gate.wait(JOIN_S)
        return 0.25

    keys = [b"key-%d" % i for i in range(MAX_LESSONS_IN_FLIGHT + 1)]
    started = [lessons.start(KIND, k, gated, 1000) for k in keys]
    assert started == [True] * MAX_LESSONS_IN_FLIGHT + [False]
    assert not lessons.start(KIND, keys[0], gated, 1000)  # one read per key
    assert lessons.in_flight(KIND) == MAX_LESSONS_IN_FLIGHT and lessons.in_flight(("ptx", "cubin")) == 0
    lessons.wait(KIND, 0.0)  # a zero bound returns at once, the reads still under way
    assert lessons.in_flight() == MAX_LESSONS_IN_FLIGHT and times.predict("c++", "cubin", 1000) is None
    waiter = threading.Thread(target=lessons.wait, args=(KIND, JOIN_S))
    waiter.start()
    gate.set()
    waiter.join(JOIN_S)
    assert not waiter.is_alive() and lessons.in_flight() == 0
    assert times.predict("c++", "cubin", 2000) == pytest.approx(0.5)


def test_a_lesson_whose_read_fails_or_finds_nothing_teaches_nothing_and_costs_nothing_else():
    times = CompileTimes()
    lessons = HitLessons(times)

    def failing() -> float:
        raise OSError("the remote went away")

    learned = []
    assert lessons.start(KIND, b"a", failing, 1000, on_learned=lambda: learned.append(1))
    assert lessons.start(KIND, b"b", lambda: None, 1000, on_learned=lambda: learned.append(1))
    lessons.wait(KIND, JOIN_S)
    assert times.predict("c++", "cubin", 1000) is None and learned == [] and lessons.in_flight() == 0


# -- compile(): a node whose first kernel is a hit, on real remotes ----------------------------------


NODE_B = textwrap.dedent(
    """
    import json, sys
    import tiered_progcache as tpc
    from tiered_progcache import TieredProgramCache
    from tiered_progcache.cluster import flightpolicy
    from tiered_progcache.cluster.flightpolicy import compile_times, hit_lessons, on_flight
    from test_singleflight import kernel, options

    # As for a kernel that reads a library's headers: a kind never timed is predicted long from its size.
    flightpolicy.UNTIMED_FIXED_S = float("inf")

    local_dir, url, storage_options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    seen = []
    on_flight(lambda d: seen.append(d.choice))
    # k = 1e9 round trips: once a compile time is known, this node races whatever it takes
    with TieredProgramCache(local_dir, remote=url, remote_options=storage_options,
                            lease_min_compile_rtts=1e9, boot_fetch_bytes=0) as cache:  # each kernel asked for
        cache.get(b"a first request, so the round trip is known")
        tpc.compile(kernel(620), "c++", options(), cache=cache)   # a hit: node A compiled it
        hit_lessons.wait(("c++", "cubin"), 60)                     # its manifest read, off the hit's path
        learned = compile_times.predict("c++", "cubin", 1000)
        with open(f"{local_dir}/compile-times.json") as fh:
            saved = json.load(fh)
        tpc.compile(kernel(621), "c++", options(), cache=cache)
    print(json.dumps({"choices": seen, "learned": learned, "saved": saved}))
    """
)


def test_a_node_whose_first_kernel_is_a_hit_races_its_second(tmp_path, slow_s3, decisions, fresh_compile_times):
    """Node A (this process) compiles two kernels into the bucket; node B, a fresh process with its own
    directory, compiles the first (a hit) and then the second. B has timed nothing, yet its second
    kernel races: it learned A's compile time from the first entry's manifest, and kept it."""
    proxy, storage_options, url = slow_s3
    with TieredProgramCache(tmp_path / "a", remote=url, remote_options=storage_options) as node_a:
        for i in (620, 621):
            tpc.compile(kernel(i), "c++", options(), cache=node_a)
        assert node_a.flush(JOIN_S)
        for d in decisions:
            _released(d.name)
    a_seconds = compile_times.estimate("c++", "cubin")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, "-c", NODE_B, str(tmp_path / "b"), url, json.dumps(storage_options)],
                          capture_output=True, text=True, timeout=JOIN_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    b = json.loads(done.stdout.splitlines()[-1])
    assert b["choices"][0] == "found" and len(b["choices"]) == 2  # the first: the lookup beside the lease create
    assert b["choices"][1] in ("raced", "raced, found")
    assert b["learned"] is not None and a_seconds is not None
    assert b["saved"]["kinds"]["c++/cubin"]["learned"] is True  # kept for B's next process, as a lesson
    assert (tmp_path / "b" / COMPILE_TIMES_FILE).exists()


class GatedRemote(RemoteProgramCache):
    """A real file:// remote whose reads of chosen keys, and whose lease creates, wait for ``gate``.

    ``arrived`` is released once per gated request that has reached the store: "the request is
    under way" as a state a test can wait for.
    """

    gated: set[bytes]
    gate: threading.Event
    arrived: threading.Semaphore
    creates: list[str]

    def __getitem__(self, key):
        if bytes(key) in self.gated:
            self.arrived.release()
            assert self.gate.wait(JOIN_S)
        return super().__getitem__(key)

    def get(self, key, default=None):
        if bytes(key) in self.gated:
            self.arrived.release()
            assert self.gate.wait(JOIN_S)
        return super().get(key, default)

    def leases(self):
        inner = super().leases()
        return None if inner is None else GatedLeases(inner, self)


class GatedLeases(LeaseStore):
    """The remote's lease store, its create held at the remote's gate (everything else passed through)."""

    def __init__(self, inner: LeaseStore, remote: GatedRemote) -> None:
        self._inner, self._remote = inner, remote

    @property
    def location(self) -> str:
        return self._inner.location

    @property
    def atomic_create(self) -> bool:
        return self._inner.atomic_create

    def create(self, name: str, document: bytes, ttl_s: float) -> bool:
        self._remote.creates.append(name)
        if self._remote.gate_creates:
            self._remote.arrived.release()
            assert self._remote.gate.wait(JOIN_S)
        return self._inner.create(name, document, ttl_s)

    def read(self, name: str) -> bytes | None:
        return self._inner.read(name)

    def replace(self, name: str, document: bytes, ttl_s: float) -> None:
        self._inner.replace(name, document, ttl_s)

    def delete(self, name: str) -> None:
        self._inner.delete(name)


def _gated_node(tmp_path, node: str, gated: set[bytes], gate_creates: bool) -> tuple[TieredProgramCache, GatedRemote]:
    (tmp_path / "remote").mkdir(exist_ok=True)
    remote = GatedRemote.from_url(f"file://{tmp_path / 'remote'}")
    remote.gated, remote.gate, remote.arrived, remote.creates = gated, threading.Event(), threading.Semaphore(0), []
    remote.gate_creates = gate_creates
    cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / node), remote])
    return cache, remote


def _key(source: str) -> bytes:
    return make_program_cache_key(code=source, code_type="c++", options=options(), target_type="cubin")


def test_an_unknown_kernel_sends_its_lookup_and_its_lease_create_before_either_answers(
    tmp_path, decisions, fresh_compile_times, events
):
    """Both requests are held at the store until both have arrived: a path that waits for the lookup
    before it creates the lease never gets there. Then one compile, reported held, lease released."""
    source = kernel(622)
    node, remote = _gated_node(tmp_path, "a", {_key(source)}, gate_creates=True)
    out: list[object] = []
    caller = threading.Thread(target=lambda: out.append(tpc.compile(source, "c++", options(), cache=node)))
    caller.start()
    try:
        both = remote.arrived.acquire(timeout=20) and remote.arrived.acquire(timeout=20)
        assert both, "the lookup and the lease create were not under way together"
    finally:
        remote.gate.set()
        caller.join(JOIN_S)
    try:
        assert [d.choice for d in decisions] == ["held"] and len(events) == 1 and len(out) == 1
        assert node.flush(JOIN_S)
        _released(decisions[0].name)
        assert node.shared_store.leases().read(decisions[0].name) is None
    finally:
        node.close()


def test_a_hit_of_an_unknown_kernel_returns_while_its_manifest_read_is_under_way_and_learns_when_it_lands(
    tmp_path, decisions, fresh_compile_times, events
):
    """Node A fills the remote; node B (never timed a compile) is served the entry while its read of the
    manifest is held at the store: compile() returns the hit then, and the estimate arrives with the read.
    The lease B's create made beside the lookup is released behind it."""
    source = kernel(623)
    (tmp_path / "remote").mkdir()  # a missing file:// root is an error, not created
    with TieredProgramCache(tmp_path / "a", remote=f"file://{tmp_path / 'remote'}") as node_a:
        tpc.compile(source, "c++", options(), cache=node_a)
        assert node_a.flush(JOIN_S)
        _released(decisions[0].name)
    compile_times.clear()
    del decisions[:], events[:]
    node_b, remote = _gated_node(tmp_path, "b", {manifest_key(_key(source))}, gate_creates=False)
    try:
        obj = tpc.compile(source, "c++", options(), cache=node_b)  # returns: the manifest read is still held
        assert remote.arrived.acquire(timeout=0)  # it was under way
        assert bytes(obj.code)[:4] == b"\x7fELF" and events == []
        assert [d.choice for d in decisions] == ["found"] and len(remote.creates) == 1
        assert compile_times.predict("c++", "cubin", 1000) is None  # not learned yet
        remote.gate.set()
        hit_lessons.wait(KIND, JOIN_S)
        assert compile_times.predict("c++", "cubin", 1000) is not None
        for releaser in [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-unlease-")]:
            releaser.join(JOIN_S)
        assert node_b.shared_store.leases().read(decisions[0].name) is None
    finally:
        remote.gate.set()
        node_b.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_waits_for_none_of_its_parents_lessons():
    """The parent's reading threads do not exist in a forked child: the child has no lesson under way
    (a compile there would otherwise wait the lesson bound for a read that never lands)."""
    gate = threading.Event()
    assert hit_lessons.start(KIND, b"fork-test", lambda: None if gate.wait(JOIN_S) else None, 1000)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once
            os._exit(0 if hit_lessons.in_flight() == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert hit_lessons.in_flight(KIND) == 1  # the parent's read is still under way
    finally:
        gate.set()
        hit_lessons.wait(KIND, JOIN_S)
