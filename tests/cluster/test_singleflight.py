"""Single-flight on one node: threads of a process, and processes sharing a cache directory.

The compiler runs are counted with the helper's ``on_compile`` hook (each process appends
one line per NVRTC run to a shared file), never inferred from timing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
import traceback
from pathlib import Path

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache

ARCH = "sm_90"
SPAWN = mp.get_context("spawn")
JOIN_S = 90


def kernel(i: int) -> str:
    return f'extern "C" __global__ void k{i}(float* a) {{ a[threadIdx.x] *= {i + 1}.0f; }}\n'


BROKEN = 'extern "C" __global__ void broken(float* a) { a[0] = undeclared_symbol; }\n'


def options() -> ProgramOptions:
    return ProgramOptions(arch=ARCH)


class Work:
    """A :class:`~tiered_progcache.cluster.singleflight.Flight` made of three callables, for tests of ``run_once``."""

    def __init__(self, find, produce, adopt) -> None:
        self._find, self._produce, self._adopt = find, produce, adopt

    def find(self, shared_only: bool = False):
        return self._find()

    def produce(self, dropped=None):
        return self._produce()

    def adopt(self, shared, found: bool = False):
        return self._adopt(shared)



def log_compiles(log_path: str) -> None:
    """Append ``<pid> <key hex> <ok>`` to ``log_path`` for each compiler run in this process."""

    def hook(event: tpc.CompileEvent) -> None:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {event.key.hex()} {int(event.ok)}\n".encode())
        finally:
            os.close(fd)

    tpc.on_compile(hook)


def read_log(log_path: Path) -> list[tuple[str, str, bool]]:
    if not log_path.exists():
        return []
    return [(p, k, ok == "1") for p, k, ok in (line.split() for line in log_path.read_text().splitlines())]


def _process_worker(cache_dir: str, log_path: str, sources: list[str], seed: int, barrier, results) -> None:
    try:
        log_compiles(log_path)
        order = list(sources)
        random.Random(seed).shuffle(order)
        with TieredProgramCache(cache_dir) as cache:
            barrier.wait(JOIN_S)
            outcomes = []
            for src in order:
                try:
                    obj = tpc.compile(src, "c++", options(), cache=cache, wait_timeout=60)
                    outcomes.append(("ok", bytes(obj.code)[:4] == b"\x7fELF"))
                except Exception as exc:
                    outcomes.append(("error", type(exc).__name__ + ": " + str(exc)[-200:]))
        results.put((os.getpid(), outcomes))
    except BaseException:
        results.put((os.getpid(), [("crash", traceback.format_exc())]))


def _run_processes(n: int, cache_dir: Path, log_path: Path, sources: list[str]) -> list[list[tuple[str, object]]]:
    barrier = SPAWN.Barrier(n)
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_process_worker, args=(str(cache_dir), str(log_path), sources, seed, barrier, results))
        for seed in range(n)
    ]
    for p in procs:
        p.start()
    return collect_outcomes(procs, results, pick=lambda item: item[1])


def start_and_join(threads: list[threading.Thread]) -> None:
    """Run ``threads`` to the end; one still alive after ``JOIN_S`` is a hang and fails the test."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a thread hung"


def collect_outcomes(procs, results, pick=lambda item: item) -> list:
    """One outcome list per process (``pick`` takes it from the queued item); a hung or crashed process fails the test."""
    try:
        collected = [pick(results.get(timeout=JOIN_S)) for _ in procs]
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                pytest.fail("a process hung")
    for outcomes in collected:
        assert not [o for o in outcomes if o[0] == "crash"], outcomes
    return collected


def test_eight_processes_sixteen_kernels_compile_each_kernel_once(tmp_path):
    sources = [kernel(i) for i in range(16)]
    log = tmp_path / "compiles.log"
    collected = _run_processes(8, tmp_path / "cache", log, sources)
    assert all(outcome == ("ok", True) for outcomes in collected for outcome in outcomes)
    runs = read_log(log)
    assert len(runs) == 16, f"{len(runs)} NVRTC runs for 16 kernels"
    assert len({key for _, key, _ in runs}) == 16
    assert not os.listdir(tmp_path / "cache" / "locks")  # no lock file left behind


def test_a_compile_error_reaches_every_process_and_nobody_hangs(tmp_path):
    log = tmp_path / "compiles.log"
    collected = _run_processes(4, tmp_path / "cache", log, [BROKEN, kernel(0)])
    for outcomes in collected:
        errors = [o for o in outcomes if o[0] == "error"]
        assert len(errors) == 1 and "undeclared_symbol" in errors[0][1]
        assert ("ok", True) in outcomes  # and the good kernel after it still works
    runs = read_log(log)
    assert [ok for _, _, ok in runs].count(True) == 1  # the good kernel: once
    # An error is never cached nor shared across processes: each process compiles the
    # broken kernel itself, once (serially, under the node lock), and gets its own error.
    failed = sorted(pid for pid, _, ok in runs if not ok)
    assert len(failed) == 4 and len(set(failed)) == 4


# -- threads -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", ["memory-only", "tiered"])
def test_threads_compiling_one_kernel_run_the_compiler_once(tmp_path, chain):
    cache = InMemoryProgramCache() if chain == "memory-only" else TieredProgramCache(tmp_path)
    seen = []
    stop = tpc.on_compile(seen.append)
    barrier = threading.Barrier(8)
    out: list[bytes] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait(JOIN_S)
            out.append(bytes(tpc.compile(kernel(99), "c++", options(), cache=cache).code))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    try:
        start_and_join(threads)
    finally:
        stop()
        cache.close()
    assert not errors
    assert len(seen) == 1
    assert len(out) == 8 and len(set(out)) == 1


def test_threads_waiting_on_a_failing_compile_all_get_its_error(tmp_path):
    """The compile is held (in the hook) until all five other threads have joined its flight:
    then exactly one compiler run, and its error reaches all six threads."""
    from tiered_progcache.cluster.singleflight import followers

    cache = InMemoryProgramCache()
    seen = []

    def hold_until_everyone_waits(event: tpc.CompileEvent) -> None:
        seen.append(event)
        deadline = time.monotonic() + JOIN_S
        while followers(cache, event.key) < 5:
            assert time.monotonic() < deadline, "the other threads never joined the flight"
            time.sleep(0.001)

    stop = tpc.on_compile(hold_until_everyone_waits)
    barrier = threading.Barrier(6)
    errors: list[str] = []

    def work() -> None:
        barrier.wait(JOIN_S)
        try:
            tpc.compile(BROKEN, "c++", options(), cache=cache)
        except Exception as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=work) for _ in range(6)]
    try:
        start_and_join(threads)
    finally:
        stop()
    assert len(errors) == 6 and all("undeclared_symbol" in e for e in errors)
    assert len(seen) == 1


def test_without_single_flight_threads_each_compile(tmp_path):
    """The control for the tests above: the same race with single_flight=False compiles more than once."""
    cache = InMemoryProgramCache()
    seen = []
    stop = tpc.on_compile(seen.append)
    gate = threading.Barrier(4)

    def hold(event: tpc.CompileEvent) -> None:
        gate.wait(JOIN_S)  # no compile finishes until all four have run: a guaranteed stampede

    stop_hold = tpc.on_compile(hold)
    threads = [
        threading.Thread(target=tpc.compile, args=(kernel(98), "c++", options()), kwargs={"cache": cache, "single_flight": False})
        for _ in range(4)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    finally:
        stop_hold()
        stop()
    assert len(seen) == 4


def test_a_thread_waiting_on_a_stuck_leader_gives_up_after_wait_timeout_and_compiles_itself():
    """The leader's compile is held (in the hook); a follower with wait_timeout=0.2 must not wait for it."""
    cache = InMemoryProgramCache()
    leader_in = threading.Event()
    let_go = threading.Event()
    runs: list[str] = []

    def hold_the_first(event: tpc.CompileEvent) -> None:
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            leader_in.set()
            assert let_go.wait(JOIN_S)

    stop = tpc.on_compile(hold_the_first)
    out: dict[str, bytes] = {}

    def compile_as(name: str, wait_timeout: float) -> None:
        out[name] = bytes(tpc.compile(kernel(97), "c++", options(), cache=cache, wait_timeout=wait_timeout).code)

    leader = threading.Thread(target=compile_as, args=("leader", 300), name="leader")
    follower = threading.Thread(target=compile_as, args=("follower", 0.2), name="follower")
    try:
        leader.start()
        assert leader_in.wait(JOIN_S)
        follower.start()
        follower.join(JOIN_S)
        assert not follower.is_alive(), "the follower waited past its wait_timeout"
        assert leader.is_alive() and runs == ["leader", "follower"]  # it compiled itself, the leader still held
    finally:
        let_go.set()
        leader.join(JOIN_S)
        stop()
    assert out["leader"] == out["follower"]


def test_a_race_runs_the_lookup_and_the_work_on_threads_named_for_them():
    """A raced miss returns what ``produce`` made; each side runs on a thread named for what it does and the entry."""
    from tiered_progcache.cluster.singleflight import run_once
    from tiered_progcache.stores.store import entry_name

    cache = TieredProgramCache(tiers=[InMemoryProgramCache()])
    looked = threading.Event()
    threads = {}

    def find() -> None:
        threads["find"] = threading.current_thread()
        looked.set()
        return None

    def produce() -> tuple[str, str]:
        threads["produce"] = threading.current_thread()
        return "made", "shared"

    work = Work(find=find, produce=produce, adopt=lambda shared: shared)
    assert run_once(cache, b"raced key", work, wait_timeout=30, lease_ttl=60, case="short") == "made"
    assert looked.wait(JOIN_S)
    short = entry_name(b"raced key")[:8]
    assert (threads["produce"].name, threads["produce"].daemon) == (f"tiered-progcache-race-{short}", False)
    assert (threads["find"].name, threads["find"].daemon) == (f"tiered-progcache-look-{short}", True)


def test_a_follower_whose_leader_was_interrupted_takes_its_own_turn():
    """The leader stops on a BaseException (as KeyboardInterrupt would): its follower does the work itself."""
    from tiered_progcache.cluster.singleflight import followers, run_once

    class Interrupted(BaseException):
        pass

    cache = TieredProgramCache(tiers=[InMemoryProgramCache()])
    key = b"interrupted key"
    entered, go = threading.Event(), threading.Event()
    outcomes = {}

    def interrupted() -> tuple[str, str]:
        entered.set()
        assert go.wait(JOIN_S)
        raise Interrupted()

    def leader() -> None:
        try:
            run_once(cache, key, Work(find=lambda: None, produce=interrupted, adopt=lambda s: s),
                     wait_timeout=JOIN_S, lease_ttl=60)
        except Interrupted:
            outcomes["leader"] = "interrupted"

    def follower() -> None:
        outcomes["follower"] = run_once(cache, key, Work(find=lambda: None, produce=lambda: ("mine", "shared"),
                                                         adopt=lambda s: s), wait_timeout=JOIN_S, lease_ttl=60)

    lead = threading.Thread(target=leader)
    lead.start()
    assert entered.wait(JOIN_S)
    follow = threading.Thread(target=follower)
    follow.start()
    deadline = time.monotonic() + JOIN_S
    while followers(cache, key) < 1 and time.monotonic() < deadline:
        threading.Event().wait(0.001)  # polling a condition, not timing a race
    go.set()
    for t in (lead, follow):
        t.join(JOIN_S)
    assert outcomes == {"leader": "interrupted", "follower": "mine"}


@pytest.mark.parametrize("remote", [False, True], ids=["node-lock", "lease"])
def test_a_miss_that_compiles_is_one_lookup_though_the_flight_looks_again(tmp_path, remote):
    """The look again under the node lock or the lease is the same lookup: hits + misses = compile() calls."""
    shared = {"remote": (tmp_path / "bucket").as_uri(), "create_remote_root": True, "lease_min_compile_rtts": 0.0,
              "boot_fetch_bytes": 0} if remote else {}
    with TieredProgramCache(tmp_path / "node", strict=True, **shared) as cache:
        tpc.compile(kernel(7), "c++", options(), cache=cache)  # a miss: it compiles under the lock (and lease)
        tpc.compile(kernel(7), "c++", options(), cache=cache)  # a memory hit
        stats = cache.stats()
        tiers = ["memory", "local", "remote"] if remote else ["memory", "local"]
        assert [(stats[t].hits, stats[t].misses) for t in tiers] == [(1, 1)] + [(0, 1)] * (len(tiers) - 1)
        if remote:
            assert cache.flight_counts.snapshot()["held"] == 1
