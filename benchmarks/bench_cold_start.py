"""A cold cache under load, and what header digests cost on a warm hit, measured side by side.

    python benchmarks/bench_cold_start.py [--kernels 12] [--procs 1,2,4,8] [--repeat 3] [--quick]

Part 1: N processes start together (a barrier) on one empty cache directory, each
compiling the same K kernels (the sample matmul, K variants) in its own order, with
single-flight (``tiered_progcache.compile``) and without (``single_flight=False``, what
``Program.compile(cache=...)`` does), alternately, ``--repeat`` times; the median run
is shown. Compiles are counted by the helper's hook in each process; wall time runs
from the barrier to the last process done.

Part 2: the in-process cost of a warm hit (memory tier) through ``compile()`` with
include paths against the same call without, once the header memo is warm. The
headers are re-statted on every call by default (``header_recheck_s=0``); the last
rows show the cost when a scan may be trusted for a second.

No asserts: it prints numbers and ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.samples import matmul_source

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


def _cccl_dir() -> str | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cccl")
    except Exception:
        d = None
    if d and os.path.isfile(os.path.join(d, "cuda", "std", "type_traits")):
        return d
    return None


def warm_hits(calls: int) -> list[tuple[str, float, float, int]]:
    """(case, us per warm hit, us per baseline hit in the same rounds, paths stat'ed per call)."""
    from tiered_progcache import headers

    rows = []
    cache = InMemoryProgramCache(max_size_bytes=None)
    base_src = matmul_source(16)
    plain = ProgramOptions(arch=ARCH, std="c++17")

    def baseline() -> None:
        tpc.compile(base_src, "c++", plain, cache=cache)

    def case(name: str, src: str, options: ProgramOptions, recheck: float = 0.0) -> None:
        def call() -> None:
            tpc.compile(src, "c++", options, cache=cache, header_recheck_s=recheck)

        call()  # compiles, warms the memo
        call()
        hashed = headers.files_hashed()
        us, base_us = interleaved(call, baseline, calls)
        assert headers.files_hashed() == hashed, "a warm hit rehashed headers"
        probed = 0 if recheck else max((len(s.checks) for s in headers._scan_memo.values()), default=0)
        rows.append((name, us, base_us, probed))

    baseline()
    with tempfile.TemporaryDirectory(prefix="bench-inc-") as tmp:
        inc = _project_headers(Path(tmp), 3)
        headers.clear_memo()
        case("include_path, 3 project headers", '#include "h0.h"\n' + base_src,
             ProgramOptions(arch=ARCH, std="c++17", include_path=[str(inc)]))
    cccl = _cccl_dir()
    if cccl is not None:
        src = "#include <cuda/std/type_traits>\n#include <cuda/std/limits>\n" + base_src
        opts = ProgramOptions(arch=ARCH, std="c++17", include_path=[cccl])
        headers.clear_memo()
        case("include_path, CCCL <cuda/std/...>", src, opts)
        case("  same, header_recheck_s=1", src, opts, recheck=1.0)
    return rows


def cold_process_scan_ms() -> float | None:
    """First header scan of a CCCL include in a process (memo empty): what a new rank pays once."""
    from tiered_progcache import headers

    cccl = _cccl_dir()
    if cccl is None:
        return None
    headers.clear_memo()
    opts = ProgramOptions(arch=ARCH, std="c++17", include_path=[cccl])
    started = time.perf_counter()
    headers.header_digest("#include <cub/block/block_reduce.cuh>\n", opts)
    return (time.perf_counter() - started) * 1e3


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
    print("without include path (baseline), timed in alternating rounds; headers are re-statted every call:")
    for name, us, base_us, probed in warm_hits(300 if args.quick else 2000):
        extra = f"  ({probed} paths stat'ed per call)" if probed else ""
        print(f"  {name:<34} {us:8.1f} us  vs {base_us:6.1f} us   {us / base_us:5.2f}x{extra}")
    cold = cold_process_scan_ms()
    if cold is not None:
        print(f"  first scan in a new process, <cub/block/block_reduce.cuh> (memo cold): {cold:.1f} ms")


if __name__ == "__main__":
    main()
