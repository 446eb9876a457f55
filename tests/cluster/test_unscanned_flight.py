"""A kernel no node recorded the headers of: flown by its direct key, its header scan beside its compile.

The promises: the holder starts the compiler before it scans (the scan is off a cold compile's
path), the compile runs once per cluster, node and process (the lease, the node lock and the
threads' flight keyed by the direct key), its entry lands under the key the scan gives with its
header set recorded (the next caller's direct hit), a holder's failure is raised by waiters that
read the same headers and by no other, and a compile the scan cannot key is compiled uncached,
its direct manifest marked so the next caller scans at once.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from pathlib import Path

import pytest
from cuda.core import ProgramOptions

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.cluster.flightpolicy import DEFER_PAST_FILES
from tiered_progcache.compiling import compile as compile_module
from tiered_progcache.compiling import direct, headermemo, headerscan, keys
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from header_support import write_header
from test_flightpolicy import _waiting, decisions  # noqa: F401  (fixture)
from test_singleflight import JOIN_S, collect_outcomes

SPAWN = mp.get_context("spawn")
#: More headers than ``DEFER_PAST_FILES``: a long compile by the policy's estimate (a CCCL kernel reads ~600).
HEADERS = {
    "lib/all.h": "#pragma once\n" + "".join(f'#include "detail/h{i}.h"\n' for i in range(DEFER_PAST_FILES))
                 + '#include "detail/scale.h"\n#define LIB_OFFSET 2\n',
    "lib/detail/scale.h": "#pragma once\n#define LIB_SCALE 3\n",
    **{f"lib/detail/h{i}.h": f"#pragma once\n#define LIB_H{i} {i}\n" for i in range(DEFER_PAST_FILES)},
}
BROKEN_HEADERS = dict(HEADERS, **{"lib/detail/scale.h": "#pragma once\n#define LIB_SCALE not_declared_here\n"})
#: The same headers, one of them making the compiler write a warning into its log.
WARNED = dict(HEADERS, **{"lib/detail/scale.h": '#pragma once\n#warning "tpc-log-check"\n#define LIB_SCALE 3\n'})


def source(i: int) -> str:
    return f'#include <lib/all.h>\nextern "C" __global__ void k{i}(int* o) {{ *o = LIB_SCALE * {i} + LIB_OFFSET; }}\n'


NAMED = ('#include <lib/all.h>\ntemplate <typename T> __global__ void scale(T* o) { *o = T(LIB_SCALE + LIB_OFFSET); }\n'
         "template __global__ void scale<float>(float*);\n")


def tree(root: Path, files: dict[str, str] = HEADERS) -> Path:
    for rel, text in files.items():
        write_header(root / rel, text)
    return root


def opts(root: Path) -> ProgramOptions:
    return ProgramOptions(arch="sm_90", include_path=[str(root)])


def storage(src: str, root: Path) -> bytes:
    return direct.direct_key(src, "c++", opts(root), "cubin", (), None, True)


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    headermemo.clear_memo()
    yield tmp_path
    headermemo.clear_memo()


def test_the_holder_scans_beside_its_compile_and_another_node_hits_by_its_set(work, monkeypatch, events,
                                                                                          caplog):
    root = tree(work / "inc", WARNED)
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    scans_on: list[str] = []  # the thread each whole scan ran on
    real_scan = keys.compile_key

    def watched_scan(*args, **kwargs):
        if not kwargs.get("memo_only") and kwargs.get("max_files") is None:  # the whole scan, not a bounded look
            scans_on.append(threading.current_thread().name)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(keys, "compile_key", watched_scan)
    log = io.StringIO()
    with TieredProgramCache(work / "a", remote=url, explain_misses=True) as node_a, \
            caplog.at_level(logging.INFO, logger="tiered_progcache.compiling.compile"):
        called = time.perf_counter()
        obj = tpc.compile(source(1), "c++", opts(root), cache=node_a, logs=log)
        elapsed = time.perf_counter() - called
        assert node_a.flush(JOIN_S)
        assert node_a.stats().flight["held"] == 1
    assert "tpc-log-check" in log.getvalue()  # the compile begun before the scan still logs to its caller
    (miss,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("miss ")]
    assert "could not explain" not in miss
    assert scans_on == ["tiered-progcache-scan"]  # one whole scan, beside the compile on the caller's thread
    assert len(events) == 1 and 0 < events[0].seconds <= elapsed  # the compiler's wall time, within the call's
    scanned = real_scan(source(1), "c++", opts(root), "cubin")
    assert events[0].key == scanned.key  # counted under the key the scan gives
    headermemo.clear_memo()
    with TieredProgramCache(work / "b", remote=url) as node_b:
        assert node_b.get(scanned.key) == bytes(obj.code)
        (one,) = direct.decode_direct(node_b.get(storage(source(1), root)))
        assert one["key"] == scanned.key.hex()  # its set recorded: the next node verifies, never scans
        hits, scans = direct.direct_counts().hits, headerscan.scans_run()
        again = tpc.compile(source(1), "c++", opts(root), cache=node_b)
    assert bytes(again.code) == bytes(obj.code) and len(events) == 1
    assert direct.direct_counts().hits == hits + 1 and headerscan.scans_run() == scans


def test_threads_arriving_after_the_holders_scan_join_its_flight_and_the_compiler_runs_once(work, events):
    """The holder's compile is held (in the hook: its scan is done by then) until three threads that called
    after it have joined its flight: its scan is not memoized while the flight is under way, so they fly by
    the direct key too rather than by the scan's key (which would run the compiler again)."""
    from tiered_progcache.cluster.singleflight import followers

    root = tree(work / "inc")
    cache = TieredProgramCache(work / "cache")
    flight = direct.direct_key(NAMED, "c++", opts(root), "cubin", ("scale<float>",), None, True)
    got: list[object] = []

    def call() -> None:
        got.append(tpc.compile(NAMED, "c++", opts(root), cache=cache, name_expressions=["scale<float>"]))

    late = [threading.Thread(target=call) for _ in range(3)]

    def hold_until_the_late_ones_follow(event: tpc.CompileEvent) -> None:
        for t in late:
            t.start()
        deadline = threading.Event()
        for _ in range(int(JOIN_S / 0.005)):
            if followers(cache, flight) == 3:
                return
            deadline.wait(0.005)
        raise AssertionError("the threads that called after the holder's scan did not join its flight")

    stop = tpc.on_compile(hold_until_the_late_ones_follow)
    try:
        call()
    finally:
        stop()
    for t in late:
        t.join(JOIN_S)
    assert len(got) == 4 and len({bytes(obj.code) for obj in got}) == 1
    assert all(dict(obj.symbol_mapping) == dict(got[0].symbol_mapping) for obj in got)  # names and all
    assert len(events) == 1
    scans, hits = headerscan.scans_run(), direct.direct_counts().hits
    tpc.compile(NAMED, "c++", opts(root), cache=cache, name_expressions=["scale<float>"])
    assert (headerscan.scans_run(), direct.direct_counts().hits) == (scans, hits)  # its scan memoized once done
    cache.close()


def _node(local_dir, url, storage_options, root, log_path, sources, ready, results) -> None:
    try:
        def log(event: tpc.CompileEvent) -> None:
            with open(log_path, "a", encoding="ascii") as fh:
                fh.write(f"{os.getpid()} {event.key.hex()}\n")

        tpc.on_compile(log)
        os.chdir(os.path.dirname(local_dir))
        with TieredProgramCache(local_dir, remote=url, remote_options=storage_options) as cache:
            ready.wait(JOIN_S)
            codes = [bytes(tpc.compile(src, "c++", opts(Path(root)), cache=cache, wait_timeout=60).code)
                     for src in sources]
        results.put([("ok", codes)])
    except BaseException:
        results.put([("crash", traceback.format_exc())])


@pytest.mark.parametrize("remote", ["file", "s3"])
def test_nodes_compile_each_kernel_nobody_recorded_once_in_total(work, request, remote):
    """Three node processes, each its own local directory, the same two header-reading kernels at once:
    two compiler runs in all, every node with the same code."""
    if remote == "file":
        (work / "remote").mkdir()
        url, storage_options = f"file://{work / 'remote'}", None
    else:
        bucket = request.getfixturevalue("s3_bucket")
        url, storage_options = bucket.url, bucket.storage_options
    root = tree(work / "inc")
    log = work / "compiles.log"
    ready, results = SPAWN.Barrier(3), SPAWN.Queue()
    sources = [source(3), source(4)]
    procs = [SPAWN.Process(target=_node, args=(str(work / f"node{i}" / "cache"), url, storage_options, str(root),
                                               str(log), sources, ready, results)) for i in range(3)]
    for i, p in enumerate(procs):
        (work / f"node{i}").mkdir()
        p.start()
    collected = collect_outcomes(procs, results)
    assert len({tuple(outcomes[0][1]) for outcomes in collected}) == 1
    runs = log.read_text().split("\n")[:-1]
    assert len(runs) == 2, runs
    assert len({line.split()[1] for line in runs}) == 2


@pytest.mark.parametrize("same_headers", [True, False])
def test_a_holders_failure_is_raised_by_waiters_that_read_the_same_headers_and_by_no_other(
    work, decisions, events, same_headers  # noqa: F811
):
    """Node A's compile fails on its headers while node B waits for A's lease on the direct key (the same
    source and options, its headers at another root: the same direct key). With the same headers B raises
    A's error without a compiler run; with headers of its own that compile, B compiles them and gets its code."""
    from cuda.core._utils.cuda_utils import NVRTCError

    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    root_a = tree(work / "a" / "inc", BROKEN_HEADERS)
    root_b = tree(work / "b" / "inc", BROKEN_HEADERS if same_headers else WARNED)  # another root, as on a node
    node_a = TieredProgramCache(work / "ca", remote=url, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(work / "cb", remote=url, lease_min_compile_rtts=0.0)
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)
    lease_name = entry_name(storage(source(5), root_a))
    assert lease_name == entry_name(storage(source(5), root_b))  # one flight for both nodes

    def hold_until_b_waits(event: tpc.CompileEvent) -> None:  # runs on the thread that counts A's compile
        if threading.current_thread().name == "node-a":
            assert _waiting(node_b, lease_name)

    stop = tpc.on_compile(hold_until_b_waits)
    outcome: dict[str, object] = {}
    log_b = io.StringIO()

    def node(name: str, cache: TieredProgramCache, root: Path) -> None:
        try:
            outcome[name] = bytes(tpc.compile(source(5), "c++", opts(root), cache=cache, lease_ttl=1.0,
                                              logs=log_b if name == "b" else None).code)
        except Exception as exc:
            outcome[name] = exc

    a = threading.Thread(target=node, args=("a", node_a, root_a), name="node-a")
    try:
        a.start()
        while not decisions:  # A reports "held" before it compiles; B starts once A holds the lease
            assert a.is_alive() or decisions
            threading.Event().wait(0.005)
        node("b", node_b, root_b)
        a.join(JOIN_S)
    finally:
        stop()
        node_a.close()
        node_b.close()
    assert type(outcome["a"]) is NVRTCError and "not_declared_here" in str(outcome["a"])
    if same_headers:
        assert type(outcome["b"]) is NVRTCError and str(outcome["b"]) == str(outcome["a"])
        assert [e.ok for e in events] == [False]
        assert sorted(d.choice for d in decisions) == ["failed", "held"]
    else:
        assert isinstance(outcome["b"], bytes) and outcome["b"][:4] == b"\x7fELF"
        assert "tpc-log-check" in log_b.getvalue()  # its compiler log reached its caller
        assert [e.ok for e in events] == [False, True]
        assert sorted(d.choice for d in decisions) == ["gave_up", "held"]


def test_a_long_kernel_the_scan_cannot_key_is_compiled_uncached_and_the_next_node_scans_at_once(work, events):
    """Past the bound, then a computed include the scan cannot resolve: compiled (counted as uncacheable),
    no entry stored, and a direct manifest of no set left, so the next node scans once and compiles
    uncached without a bounded look or a flight by direct key."""
    root = tree(work / "inc")
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    write_header(work / "work" / "v.h", "#define V 1\n")
    src = '#include <lib/all.h>\n#define STR(x) #x\n#include STR(v.h)\n' + \
        'extern "C" __global__ void k(int* o) { *o = V + LIB_SCALE; }\n'
    declined = compile_module.declined_count()
    scans = []
    for node in ("a", "b"):
        headermemo.clear_memo()
        before = headerscan.scans_run()
        with TieredProgramCache(work / node, remote=url) as cache:
            assert bytes(tpc.compile(src, "c++", opts(root), cache=cache).code)[:4] == b"\x7fELF"
            assert cache.flush(JOIN_S)
            marker = cache.get(direct.direct_key(src, "c++", opts(root), "cubin", (), None, True))
            assert marker is not None and direct.decode_direct(marker) == []
            assert all(cache.get(e.key) is None for e in events)  # nothing stored under a key
        scans.append(headerscan.scans_run() - before)
    assert scans == [2, 1]  # a: the bounded look, then the whole scan beside the compile; b: the scan alone
    assert compile_module.declined_count() - declined == 2 and len(events) == 2


def test_a_waiter_gets_the_holders_entry_through_the_set_it_recorded_names_and_all(  # noqa: F811
    work, decisions, events, monkeypatch
):
    """Node B waits on A's lease by direct key (its own scan beside the wait held back until its call ends), then
    verifies the set A recorded on its own copy of the headers and takes A's entry, its symbol map too: one
    compiler run; each node one counted lookup (A a miss, B a hit); the direct manifest under the key
    ``extra_digest`` is part of."""
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    root_a, root_b = tree(work / "a" / "inc"), tree(work / "b" / "inc")
    b_done = threading.Event()
    _hold_scans_of(monkeypatch, root_b, b_done)
    node_a = TieredProgramCache(work / "ca", remote=url, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(work / "cb", remote=url, lease_min_compile_rtts=0.0)
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)
    extra = b"the caller's own digest"
    lease_name = entry_name(direct.direct_key(NAMED, "c++", opts(root_a), "cubin", ("scale<float>",), extra, True))

    def hold_until_b_waits(event: tpc.CompileEvent) -> None:
        if threading.current_thread().name == "node-a":
            assert _waiting(node_b, lease_name)

    stop = tpc.on_compile(hold_until_b_waits)
    hits: list[compile_module.HitEvent] = []
    stop_hits = compile_module.on_hit(hits.append)
    got: dict[str, object] = {}

    def node(name: str, cache: TieredProgramCache, root: Path) -> None:
        got[name] = tpc.compile(NAMED, "c++", opts(root), cache=cache, name_expressions=["scale<float>"],
                                extra_digest=extra)

    a = threading.Thread(target=node, args=("a", node_a, root_a), name="node-a")
    scans = headerscan.scans_run()
    try:
        a.start()
        while not decisions:
            assert a.is_alive() or decisions
            threading.Event().wait(0.005)
        node("b", node_b, root_b)
        b_done.set()
        a.join(JOIN_S)
        _join_scans()
        stats_a, stats_b = node_a.stats(), node_b.stats()
        # A: the bounded look and the whole scan beside its compile; B: the bounded look, then A's set verified
        # (its own scan, let go after its call, finds that set memoized)
        assert headerscan.scans_run() - scans == 3
    finally:
        stop()
        stop_hits()
        node_a.close()
        node_b.close()
    assert [d.choice for d in decisions] == ["held", "waited"] and len(events) == 1
    assert [h.key for h in hits] == [events[0].key]  # B's hit, told to the hooks once
    assert bytes(got["b"].code) == bytes(got["a"].code)
    assert dict(got["b"].symbol_mapping) == dict(got["a"].symbol_mapping) and "scale<float>" in got["b"].symbol_mapping
    # one counted lookup each (the memory tier sees every one): A's a miss, B's a hit
    assert (stats_a["memory"].misses, stats_a.hits, stats_a.misses) == (1, 0, 1)
    assert (stats_b["memory"].misses, stats_b.hits, stats_b.misses) == (1, 1, 0)
    assert stats_a.compiling.saved_seconds == 0 and stats_b.compiling.saved_seconds > 0  # B's hit saved a compile


def test_an_entry_stored_without_its_set_is_taken_and_its_set_recorded_nothing_rewritten(work, events):
    """A node that finds the entry under the scan's key but no direct manifest (it was lost, or the entry
    came without one): the holder's look after its scan and compile finds it, the set is recorded again,
    and the entry on the store is not written a second time (its file is the one the first node wrote)."""
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    root = tree(work / "inc")
    extra = b"the caller's own digest"
    with TieredProgramCache(work / "first", remote=url) as first:
        made = tpc.compile(source(6), "c++", opts(root), cache=first, extra_digest=extra)
        assert first.flush(JOIN_S)
        manifest_key = direct.direct_key(source(6), "c++", opts(root), "cubin", (), extra, True)
        del first[manifest_key]  # gone from every tier: the entry stays
        assert first.flush(JOIN_S)
    key = events[0].key
    name = entry_name(key)
    entry_file = work / "remote" / "entries" / name[:2] / name[2:]
    written = entry_file.stat().st_mtime_ns
    headermemo.clear_memo()
    with TieredProgramCache(work / "second", remote=url) as second:
        again = tpc.compile(source(6), "c++", opts(root), cache=second, extra_digest=extra)
        assert second.flush(JOIN_S)
        (one,) = direct.decode_direct(second.get(manifest_key))
        stats = second.stats()
    assert bytes(again.code) == bytes(made.code) and one["key"] == key.hex()
    assert entry_file.stat().st_mtime_ns == written  # not rewritten
    assert [e.key for e in events] == [key, key]  # the compile run beside the scan, counted, its output unused
    assert (stats["memory"].misses, stats.hits, stats.flight["held"]) == (1, 1, 1)


def _compile_on_a_node(local_dir: str, root: str, cwd: str, results) -> None:
    """One process of a node: compile the kernel, and say how (scans, direct hits, compiler runs)."""
    try:
        os.chdir(cwd)
        with TieredProgramCache(local_dir) as cache:
            scans, hits, runs = headerscan.scans_run(), direct.direct_counts().hits, tpc.compile_count()
            tpc.compile(source(7), "c++", opts(Path(root)), cache=cache)
            results.put((headerscan.scans_run() - scans, direct.direct_counts().hits - hits, tpc.compile_count() - runs))
    except BaseException:
        results.put(traceback.format_exc())


def test_the_next_process_on_the_node_takes_the_holders_scan_from_its_local_directory(work):
    """The holder's scan, memoized once its flight is over, is persisted in the local directory at exit: the
    node's next process validates it by stat (no scan, no direct manifest read, no compile)."""
    root = tree(work / "inc")
    results = SPAWN.Queue()
    seen = []
    for _ in range(2):
        p = SPAWN.Process(target=_compile_on_a_node, args=(str(work / "cache"), str(root), str(work / "work"), results))
        p.start()
        seen.append(results.get(timeout=JOIN_S))
        p.join(JOIN_S)
    assert seen == [(2, 0, 1), (0, 0, 0)]  # the bounded look and the scan beside the compile; then the memo


def test_a_long_kernel_whose_set_cannot_be_recorded_is_stored_and_its_manifest_marked(work, events):
    """A header spelled by an absolute path in a header: the scan keys it, but no set is recorded (the
    set's paths are by root); the entry is stored and a direct manifest of no set is left, so the next
    caller scans at once (and finds the entry by the scan's key)."""
    root = tree(work / "inc")
    absolute = write_header(work / "elsewhere" / "abs.h", "#pragma once\n#define ABS_VAL 1\n")
    write_header(root / "lib" / "with_abs.h", f'#pragma once\n#include <lib/all.h>\n#include "{absolute}"\n')
    src = '#include <lib/with_abs.h>\nextern "C" __global__ void k(int* o) { *o = ABS_VAL + LIB_SCALE; }\n'
    with TieredProgramCache(work / "cache") as cache:
        obj = tpc.compile(src, "c++", opts(root), cache=cache)
        marker = cache.get(direct.direct_key(src, "c++", opts(root), "cubin", (), None, True))
        assert marker is not None and direct.decode_direct(marker) == []
        assert cache.get(events[0].key) == bytes(obj.code)


def test_a_thread_that_joined_the_flight_of_a_kernel_compiled_uncached_gets_its_code_and_names(work, events):
    """The holder compiles a kernel its scan declined (uncached); a thread that joined its flight meanwhile
    takes that compile's code and symbol map (one compiler run), as threads share any flight's outcome."""
    from tiered_progcache.cluster.singleflight import followers

    root = tree(work / "inc")
    write_header(work / "work" / "v.h", "#define V 1\n")
    src = '#include <lib/all.h>\n#define STR(x) #x\n#include STR(v.h)\n' + \
        "template <typename T> __global__ void scale(T* o) { *o = T(V + LIB_SCALE); }\n" + \
        "template __global__ void scale<float>(float*);\n"
    cache = TieredProgramCache(work / "cache")
    flight = direct.direct_key(src, "c++", opts(root), "cubin", ("scale<float>",), None, True)
    got: list[object] = []

    def call() -> None:
        got.append(tpc.compile(src, "c++", opts(root), cache=cache, name_expressions=["scale<float>"]))

    follower = threading.Thread(target=call)

    def hold_until_it_follows(event: tpc.CompileEvent) -> None:
        follower.start()
        for _ in range(int(JOIN_S / 0.005)):
            if followers(cache, flight) == 1:
                return
            threading.Event().wait(0.005)
        raise AssertionError("the second thread did not join the flight")

    stop = tpc.on_compile(hold_until_it_follows)
    try:
        call()
    finally:
        stop()
    follower.join(JOIN_S)
    assert len(got) == 2 and bytes(got[0].code) == bytes(got[1].code) and len(events) == 1
    assert "scale<float>" in got[1].symbol_mapping
    cache.close()


def test_a_scan_of_headers_written_too_recently_to_vouch_for_is_not_memoized(work, events):
    """Headers modified within the racy window: the holder's scan is not memoized after its flight (a stat
    cannot vouch for them yet), as a scan of them never is."""
    root = work / "inc"
    for rel, text in HEADERS.items():
        write_header(root / rel, text, mtime=None)
    with TieredProgramCache(work / "cache") as cache:
        tpc.compile(source(8), "c++", opts(root), cache=cache)
    assert len(events) == 1
    assert keys.compile_key(source(8), "c++", opts(root), "cubin", memo_only=True) is None


def _join_scans() -> None:
    """Wait for the scans flights started on threads of their own (a waiter's may outlast its call)."""
    for thread in threading.enumerate():
        if thread.name == "tiered-progcache-scan":
            thread.join(JOIN_S)
            assert not thread.is_alive()


def _count_compiler_runs(monkeypatch) -> list[str]:
    """Every compiler run ``compile()`` starts from now on, counted or not (the name of the thread it ran on)."""
    runs: list[str] = []
    real_program = compile_module.Program

    def program(*args, **kwargs):
        runs.append(threading.current_thread().name)
        return real_program(*args, **kwargs)

    monkeypatch.setattr(compile_module, "Program", program)
    return runs


def _hold_scans_of(monkeypatch, root: Path, until: threading.Event) -> None:
    """Hold every whole scan of headers under ``root`` (a waiter's, beside its wait) until ``until`` is set."""
    real_scan = keys.compile_key

    def held_scan(*args, **kwargs):
        if not kwargs.get("memo_only") and kwargs.get("max_files") is None and str(root) in args[2].include_path:
            assert until.wait(JOIN_S)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(keys, "compile_key", held_scan)


def _b_while_a_holds(work: Path, decisions, src: str, extra: bytes | None, b_done: threading.Event) -> dict:  # noqa: F811
    """Node A holds the flight of ``src`` by its direct key until B waits (each node its own copy of the headers,
    ``<work>/a/inc`` and ``<work>/b/inc``); B's call on this thread, ``b_done`` set as it ends. What each got, and
    under ``"sets"`` the direct manifest's sets once A's uploads are in."""
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    roots = {"a": tree(work / "a" / "inc"), "b": tree(work / "b" / "inc")}
    node_a = TieredProgramCache(work / "ca", remote=url, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(work / "cb", remote=url, lease_min_compile_rtts=0.0)
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)
    manifest = direct.direct_key(src, "c++", opts(roots["a"]), "cubin", (), extra, True)
    stop = tpc.on_compile(_hold_until_waiting(node_b, entry_name(manifest)))

    def call(name: str, cache: TieredProgramCache) -> bytes:
        try:
            return bytes(tpc.compile(src, "c++", opts(roots[name]), cache=cache, extra_digest=extra).code)
        finally:
            if name == "b":
                b_done.set()

    try:
        got = _a_then_b(decisions, node_a, node_b, call)
        assert node_a.flush(JOIN_S)
        _join_scans()
        got["sets"] = direct.read_sets(node_b, manifest)
    finally:
        stop()
        node_a.close()
        node_b.close()
    return got


def test_a_waiter_takes_the_holders_entry_by_its_own_scans_key_before_any_set_is_recorded(
    work, decisions, events, monkeypatch  # noqa: F811
):
    """B's scan runs while it waits, so B asks for the entry by the key it gives: B holds A's entry while A has
    recorded no header set yet (A's record waits for B's result here), one compiler run in all."""
    b_done = threading.Event()
    real_record = direct.record

    def record_after_b(*args, **kwargs):
        if threading.current_thread().name == "node-a":
            assert b_done.wait(JOIN_S)  # B's call must end without a set to match
        return real_record(*args, **kwargs)

    monkeypatch.setattr(direct, "record", record_after_b)
    runs = _count_compiler_runs(monkeypatch)
    got = _b_while_a_holds(work, decisions, source(10), None, b_done)
    assert got["b"] == got["a"] and isinstance(got["b"], bytes) and len(events) == 1
    assert runs == ["node-a"]  # the compiler started beside the scan is the one counted and stored
    assert [d.choice for d in decisions] == ["held", "waited"]
    assert [s["key"] for s in got["sets"]] == [events[0].key.hex()]  # recorded after B's hit


def test_a_waiter_whose_own_scan_is_not_done_takes_the_entry_through_the_set_the_holder_recorded(
    work, decisions, events, monkeypatch  # noqa: F811
):
    """B's scan beside its wait has not finished (held here until B's call ends): B reads the direct manifest at
    its looks meanwhile and takes A's entry through the set A recorded (its key with the caller's ``extra_digest``),
    verified on its own files."""
    b_done = threading.Event()
    _hold_scans_of(monkeypatch, work / "b" / "inc", b_done)
    got = _b_while_a_holds(work, decisions, source(11), b"own", b_done)
    assert got["b"] == got["a"] and isinstance(got["b"], bytes) and len(events) == 1
    assert [d.choice for d in decisions] == ["held", "waited"]
    assert [s["key"] for s in got["sets"]] == [events[0].key.hex()]


def _hold_until_waiting(node_b: TieredProgramCache, lease_name: str):
    def hook(event: tpc.CompileEvent) -> None:  # runs on the thread that counts A's compile
        if threading.current_thread().name == "node-a":
            assert _waiting(node_b, lease_name)

    return hook


def _a_then_b(decisions, node_a, node_b, call) -> dict[str, object]:  # noqa: F811
    """A's call on a thread; B's, once A holds the lease, on this one: what each got (or raised)."""
    outcome: dict[str, object] = {}

    def node(name: str, cache: TieredProgramCache) -> None:
        try:
            outcome[name] = call(name, cache)
        except Exception as exc:
            outcome[name] = exc

    a = threading.Thread(target=node, args=("a", node_a), name="node-a")
    a.start()
    while not decisions:
        assert a.is_alive() or decisions
        threading.Event().wait(0.005)
    node("b", node_b)
    a.join(JOIN_S)
    return outcome


def test_a_waiter_whose_headers_the_recorded_set_does_not_hold_for_compiles_its_own_once_the_lease_is_free(
    work, decisions, events  # noqa: F811
):
    """B waits on A's lease by direct key; A's set does not hold on B's headers (one differs): B scans once,
    looks its own key up once (a counted miss), keeps waiting, then takes the lease and compiles its own."""
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    root_a, root_b = tree(work / "a" / "inc"), tree(work / "b" / "inc", WARNED)
    node_a = TieredProgramCache(work / "ca", remote=url, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(work / "cb", remote=url, lease_min_compile_rtts=0.0)
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)
    roots = {"a": root_a, "b": root_b}
    stop = tpc.on_compile(_hold_until_waiting(node_b, entry_name(storage(source(9), root_a))))
    try:
        got = _a_then_b(decisions, node_a, node_b,
                        lambda name, cache: bytes(tpc.compile(source(9), "c++", opts(roots[name]), cache=cache).code))
        stats_b = node_b.stats()
    finally:
        stop()
        node_a.close()
        node_b.close()
    assert all(isinstance(code, bytes) for code in got.values()) and len(events) == 2
    assert events[0].key != events[1].key  # two header sets, two entries
    assert [d.choice for d in decisions] == ["held", "held"]
    assert (stats_b["memory"].misses, stats_b.misses) == (1, 1)  # its polls after the first look are not lookups


def test_a_waiter_on_a_kernel_its_holder_compiled_uncached_compiles_it_uncached_too(  # noqa: F811
    work, decisions, events, monkeypatch
):
    """A's scan declines (a computed include) past the bound; B waits on A's lease, its own scan beside the wait
    declines too, and B compiles uncached at once: while A still holds the lease (A's compile waits for B's call
    here), without taking it in turn."""
    (work / "remote").mkdir()
    url = f"file://{work / 'remote'}"
    root = tree(work / "inc")
    write_header(work / "work" / "v.h", "#define V 1\n")
    src = '#include <lib/all.h>\n#define STR(x) #x\n#include STR(v.h)\n' + \
        'extern "C" __global__ void k(int* o) { *o = V + LIB_SCALE; }\n'
    node_a = TieredProgramCache(work / "ca", remote=url, lease_min_compile_rtts=0.0)
    node_b = TieredProgramCache(work / "cb", remote=url, lease_min_compile_rtts=0.0)
    assert node_a.shared_store.wait_ready(60) and node_b.shared_store.wait_ready(60)
    declined = compile_module.declined_count()
    b_done = threading.Event()
    a_waited: list[bool] = []  # (a hook's exception is swallowed: kept here instead)

    def a_after_b(event: tpc.CompileEvent) -> None:  # runs on the thread that counts each compile
        if threading.current_thread().name == "node-a":
            a_waited.append(b_done.wait(JOIN_S))

    def call(name: str, cache: TieredProgramCache) -> bytes:
        try:
            return bytes(tpc.compile(src, "c++", opts(root), cache=cache).code)
        finally:
            if name == "b":
                b_done.set()

    stop = tpc.on_compile(a_after_b)
    runs = _count_compiler_runs(monkeypatch)
    try:
        got = _a_then_b(decisions, node_a, node_b, call)
    finally:
        stop()
        node_a.close()
        node_b.close()
    assert all(isinstance(code, bytes) and code[:4] == b"\x7fELF" for code in got.values())
    assert len(events) == 2 and compile_module.declined_count() - declined == 2
    assert a_waited == [True]  # B was done before A's compile was
    assert len(runs) == 2 and runs.count("node-a") == 1  # one compiler run each: A's begun beside its scan, counted
    assert [d.choice for d in decisions] == ["held"]  # B's wait ended at its own scan: no decision
