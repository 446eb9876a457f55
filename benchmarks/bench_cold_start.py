"""A cold cache under load, and what header digests cost on a warm hit, measured side by side.

    python benchmarks/bench_cold_start.py [--kernels 12] [--procs 1,2,4,8] [--repeat 3] [--quick]

Part 1: N processes start together (a barrier) on one empty cache directory, each
compiling the same K kernels (the sample matmul, K variants) in its own order, with
single-flight (``tiered_progcache.compiling.compile``) and without (``single_flight=False``, what
``Program.compile(cache=...)`` does), alternately, ``--repeat`` times; the median run
is shown. Compiles are counted by the helper's hook in each process; wall time runs
from the barrier to the last process done.

Part 2: the in-process cost of a warm hit (memory tier) through ``compile()`` with
include paths against the same call without, once the header memo is warm: with
inotify vouching for the headers (the default where it is available), and with the
stat path (every probed path re-statted on every call), side by side.

Part 3: the first ``compile()`` hit of a ``cub::BlockReduce`` kernel in a FRESH process
(a spawned interpreter; the entry is in the local directory already), with the header
scan persisted in ``<dir>/header-scans`` by an earlier process and without it (the
directory removed before each run), alternately; and, in separate processes, how much
of that first hit is ``header_digest`` itself.

Part 4: where a cold scan's time goes: for each CCCL kernel, the files read and paths
probed, and, over those files, reading + hashing against parsing for includes. (The
what-if this part used to print, ``__has_include(param)`` inside a ``#define`` not forcing
the whole-directory fallback, is what the scanner does since issue 18.)

No asserts: it prints numbers and ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.compiling import headerwatch
from tiered_progcache.samples import matmul_source

from cccl_kernels import CUB_KERNEL, CUDA_STD_KERNEL, cccl_dir

ARCH = "sm_90"


def kernel_sources(k: int) -> list[str]:
    variants = [(t, e) for t in (16, 32) for e in ("identity", "relu")]
    return [matmul_source(*variants[i % 4]) + f"\n// variant {i}\n" for i in range(k)]


def _worker(cache_dir: str, sources: list[str], single_flight: bool, seed: int, barrier, results) -> None:
    import random

    order = list(sources)
    random.Random(seed).shuffle(order)
    options = ProgramOptions(arch=ARCH, std="c++17")
    with TieredProgramCache(cache_dir) as cache:
        barrier.wait()
        for src in order:
            tpc.compile(src, "c++", options, cache=cache, single_flight=single_flight)
        results.put((tpc.compile_count(), time.time()))


def cold_start(n: int, sources: list[str], single_flight: bool) -> tuple[int, float]:
    """(compiler runs in total, wall seconds) for n processes on one cold directory."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        barrier = ctx.Barrier(n + 1)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(os.path.join(tmp, "cache"), sources, single_flight, i, barrier, results))
            for i in range(n)
        ]
        for p in procs:
            p.start()
        barrier.wait()
        started = time.time()
        done = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    return sum(c for c, _ in done), max(t for _, t in done) - started


def per_call_us(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def interleaved(case, baseline, calls: int, rounds: int = 9) -> tuple[float, float]:
    """Median us per call of ``case`` and ``baseline``, timed in alternating rounds (noise hits both)."""
    a, b = [], []
    for _ in range(rounds):
        a.append(per_call_us(case, calls))
        b.append(per_call_us(baseline, calls))
    return statistics.median(a), statistics.median(b)


def _project_headers(root: Path, count: int) -> Path:
    inc = root / "project"
    inc.mkdir()
    for i in range(count):
        nxt = f'#include "h{i + 1}.h"\n' if i + 1 < count else ""
        (inc / f"h{i}.h").write_text(f"#pragma once\n{nxt}#define H{i} {i}\n")
    old = time.time() - 3600  # settled headers, as in a real tree
    for f in inc.iterdir():
        os.utime(f, (old, old))
    return inc


def warm_hits(calls: int) -> list[tuple[str, float, float, str]]:
    """(case, us per warm hit, us per baseline hit in the same rounds, how it was validated)."""
    from tiered_progcache.compiling import headermemo

    rows = []
    cache = InMemoryProgramCache(max_size_bytes=None)
    base_src = matmul_source(16)
    plain = ProgramOptions(arch=ARCH, std="c++17")

    def baseline() -> None:
        tpc.compile(base_src, "c++", plain, cache=cache)

    def case(name: str, src: str, options: ProgramOptions) -> None:
        def call() -> None:
            tpc.compile(src, "c++", options, cache=cache)

        for watched in (True, False):
            previous = None if watched else headerwatch.replace_watcher(None)
            try:
                headermemo.clear_memo()
                call()  # compiles (or hits), scans
                started = time.perf_counter()
                call()  # validates the scan by stat once (and watches it, where a watcher is)
                setup_ms = (time.perf_counter() - started) * 1e3
                hashed = headermemo.files_hashed()
                counts = headermemo.validation_counts()
                us, base_us = interleaved(call, baseline, calls if watched else max(1, calls // 20))
                after = headermemo.validation_counts()
                assert headermemo.files_hashed() == hashed, "a warm hit rehashed headers"
            finally:
                if not watched:
                    headerwatch.replace_watcher(previous)
            per_call = (after.paths_statted - counts.paths_statted) / max(1, (after.by_watch - counts.by_watch)
                                                                          + (after.by_stat - counts.by_stat))
            how = (f"inotify, {per_call:.0f} paths stat'ed per call; second use (stat once + watch) {setup_ms:.1f} ms"
                   if watched else f"stat path, {per_call:.0f} paths stat'ed per call")
            rows.append((name if watched else "  same, without inotify", us, base_us, how))
        headermemo.clear_memo()

    baseline()
    with tempfile.TemporaryDirectory(prefix="bench-inc-") as tmp:
        inc = _project_headers(Path(tmp), 3)
        case("include_path, 3 project headers", '#include "h0.h"\n' + base_src,
             ProgramOptions(arch=ARCH, std="c++17", include_path=[str(inc)]))
    cccl = cccl_dir()
    if cccl is not None:
        opts = ProgramOptions(arch=ARCH, std="c++17", include_path=[cccl])
        case("include_path, CCCL <cuda/std/...>", CUDA_STD_KERNEL, opts)
        case("include_path, cub::BlockReduce", CUB_KERNEL, opts)
    return rows


_FRESH_CHILD = r"""
import json, sys, time
from cuda.core import ProgramOptions
import tiered_progcache as tpc
from tiered_progcache.compiling import headermemo, headerscan
cache_dir, cccl, source, what = sys.argv[1:5]
options = ProgramOptions(arch="sm_90", std="c++17", include_path=[cccl])
cache = tpc.TieredProgramCache(cache_dir)
started = time.perf_counter()
if what == "digest":
    headerscan.header_scan(source, options, memo_dir=cache.local_store.header_scans_dir)  # the scan compile() makes
else:
    tpc.compile(source, "c++", options, cache=cache)
ms = (time.perf_counter() - started) * 1e3
print(json.dumps([ms, tpc.compile_count(), headermemo.files_hashed()]))
"""


def fresh_process_first_hit(repeat: int) -> list[tuple[str, float, int, int]] | None:
    """(case, median ms, most compiles, most headers read) of the first CUB compile() hit in new processes."""
    cccl = cccl_dir()
    if cccl is None:
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    results: dict[tuple[str, bool], list[tuple[float, int, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fresh-") as tmp:
        cache_dir = os.path.join(tmp, "cache")
        scans = os.path.join(cache_dir, "header-scans")

        def child(what: str) -> tuple[float, int, int]:
            out = subprocess.run([sys.executable, "-c", _FRESH_CHILD, cache_dir, cccl, CUB_KERNEL, what],
                                 check=True, capture_output=True, text=True, env=env, cwd=tmp).stdout
            ms, compiles, hashed = json.loads(out)
            return ms, compiles, hashed

        child("compile")  # compiles once: every later process hits
        for _ in range(repeat):
            for what in ("compile", "digest"):
                for persisted in (True, False):
                    if not persisted:
                        shutil.rmtree(scans, ignore_errors=True)
                    results.setdefault((what, persisted), []).append(child(what))  # (re)writes the memo
    rows = []
    for (what, persisted), runs in results.items():
        ms = statistics.median(r[0] for r in runs)
        label = ("first compile() hit" if what == "compile" else "  of which the header scan") + (
            ", scan persisted" if persisted else ", no persisted scan")
        rows.append((label, ms, max(r[1] for r in runs), max(r[2] for r in runs)))
    return rows


def scan_anatomy() -> list[str]:
    """Lines describing a cold scan of each CCCL kernel: files, paths, hash vs parse time."""
    import hashlib

    from tiered_progcache.compiling import headerlex, headermemo, headerscan

    cccl = cccl_dir()
    if cccl is None:
        return []
    options = ProgramOptions(arch=ARCH, std="c++17", include_path=[cccl])
    lines = []

    def cold_scan(source: str) -> tuple[int, int, float]:
        headermemo.clear_memo()
        hashed = headermemo.files_hashed()
        started = time.perf_counter()
        headerscan.header_digest(source, options)
        ms = (time.perf_counter() - started) * 1e3
        (result,) = headermemo._scan_memo.values()
        return headermemo.files_hashed() - hashed, len(result.checks), ms

    for label, source in (("<cuda/std/...>", CUDA_STD_KERNEL), ("cub::BlockReduce", CUB_KERNEL)):
        read, probed, ms = cold_scan(source)
        (result,) = headermemo._scan_memo.values()
        files = [path for path, sig in result.checks if sig is not None and sig[0] == "f"]
        started = time.perf_counter()
        contents = []
        for path in files:
            with open(path, "rb") as fh:
                contents.append(fh.read())
            hashlib.sha256(contents[-1]).digest()
        hash_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        for data in contents:
            headerlex.parse_includes(data)
        parse_ms = (time.perf_counter() - started) * 1e3
        lines.append(f"  {label:<18} cold scan {ms:7.1f} ms: {read} files read, {probed} paths probed; "
                     f"over those files read+sha256 {hash_ms:.1f} ms, parse {parse_ms:.1f} ms")
    headermemo.clear_memo()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", type=int, default=12)
    p.add_argument("--procs", default="1,2,4,8")
    p.add_argument("--repeat", type=int, default=3, help="cold-start runs per cell; the median is shown")
    p.add_argument("--quick", action="store_true", help="fewer kernels and calls (smoke run)")
    args = p.parse_args()
    k = 4 if args.quick else args.kernels
    procs = [int(x) for x in args.procs.split(",")]
    sources = kernel_sources(k)

    print(f"cold start: {k} kernels (sample matmul variants) per process, {os.cpu_count()} CPUs, arch {ARCH}, "
          f"median of {1 if args.quick else max(1, args.repeat)} runs")
    print(f"{'procs':>5} | {'compiles: single-flight':>23} {'without':>8} | "
          f"{'wall s: single-flight':>21} {'without':>8} | {'wall ratio':>10}")
    repeat = 1 if args.quick else max(1, args.repeat)
    for n in procs:
        with_sf, without = [], []
        for _ in range(repeat):
            with_sf.append(cold_start(n, sources, single_flight=True))
            without.append(cold_start(n, sources, single_flight=False))
        (c_sf, w_sf), (c_no, w_no) = (sorted(runs, key=lambda r: r[1])[len(runs) // 2] for runs in (with_sf, without))
        print(f"{n:>5} | {c_sf:>23} {c_no:>8} | {w_sf:>21.2f} {w_no:>8.2f} | {w_sf / w_no:>9.2f}x")

    print()
    print("warm hit through compile() (memory tier, header memo warm), against the same call")
    print("without include path (baseline), timed in alternating rounds:")
    for name, us, base_us, how in warm_hits(300 if args.quick else 2000):
        print(f"  {name:<34} {us:9.1f} us  vs {base_us:6.1f} us  {us / base_us:7.2f}x  ({how})")

    fresh = fresh_process_first_hit(1 if args.quick else max(1, args.repeat))
    if fresh is not None:
        print()
        print(f"first compile() hit of the cub::BlockReduce kernel in a new process (entry on disk), "
              f"median of {1 if args.quick else max(1, args.repeat)} processes each:")
        for label, ms, compiles, hashed in fresh:
            print(f"  {label:<50} {ms:8.1f} ms  (compiles {compiles}, headers read {hashed})")

    anatomy = scan_anatomy()
    if anatomy:
        print()
        print("where a cold scan's time goes (this process, memo cleared):")
        for line in anatomy:
            print(line)


if __name__ == "__main__":
    main()
