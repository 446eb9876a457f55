"""The chain against cuda-core's own caches and against compiling, measured side by side in one run.

    python benchmarks/bench_tiers.py [--rounds 5] [--quick]

Each pair is timed interleaved (A, B, A, B, ...) over several rounds and the median
round is reported, so a noisy neighbour hits both sides alike. Ratios are ours /
baseline (lower is better) except "uncached compile", which is compile / hit (higher
is better). The ``compile() hit`` rows need CCCL's headers (cuda.pathfinder) and
compile two CCCL kernels once (a few seconds); their baseline is a ``compile()`` hit
of the sample kernel without an include path, on the same cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from cuda.core import Program, ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, make_program_cache_key

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.compiling import headermemo, headerwatch
from tiered_progcache.stores.codeobject import check_code_object
from tiered_progcache.samples import matmul_source

from cccl_kernels import CUB_KERNEL, CUDA_STD_KERNEL, cccl_dir


def per_call_us(fn: Callable[[], object], calls: int, setup: Callable[[], object] | None = None) -> float:
    """Mean microseconds per call of ``fn``; ``setup`` runs before each call, outside the clock."""
    if setup is None:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) / calls * 1e6
    total = 0.0
    for _ in range(calls):
        setup()
        started = time.perf_counter()
        fn()
        total += time.perf_counter() - started
    return total / calls * 1e6


def project_headers(root: Path, count: int) -> Path:
    """``count`` chained headers (h0.h includes h1.h ...), settled an hour back as in an installed tree."""
    inc = root / "project"
    inc.mkdir()
    old = time.time() - 3600
    for i in range(count):
        nxt = f'#include "h{i + 1}.h"\n' if i + 1 < count else ""
        (inc / f"h{i}.h").write_text(f"#pragma once\n{nxt}#define H{i} {i}\n")
        os.utime(inc / f"h{i}.h", (old, old))
    return inc


def side_by_side(ours, baseline, rounds: int) -> tuple[float, float]:
    a, b = [], []
    for _ in range(rounds):
        a.append(ours())
        b.append(baseline())
    return statistics.median(a), statistics.median(b)


def include_path_hits(cache, plain_options, plain_source, n: int, rounds: int) -> list[tuple]:
    """compile() hits of real CCCL kernels with include_path against a compile() hit with none."""
    cccl = cccl_dir()
    if cccl is None:
        return [("compile() hit with include_path: CCCL headers not found (skipped)", 0.0, 0.0, 0.0, "<= 1.5x")]

    def plain() -> None:
        tpc.compile(plain_source, "c++", plain_options, cache=cache)

    options = ProgramOptions(std="c++17", arch="sm_90", include_path=[cccl])
    rows = []
    for label, source in (("<cuda/std/type_traits>", CUDA_STD_KERNEL), ("cub::BlockReduce", CUB_KERNEL)):
        def hit() -> None:
            tpc.compile(source, "c++", options, cache=cache)

        plain()
        hit()  # compiles; scans the headers
        hit()  # validates the scan once by stat, then watches it
        hashed = headermemo.files_hashed()
        ours, base = side_by_side(lambda: per_call_us(hit, n), lambda: per_call_us(plain, n), rounds)
        assert headermemo.files_hashed() == hashed, "a warm hit read headers"
        rows.append((f"compile() hit, include_path, {label} vs no include path", ours, base, ours / base, "<= 1.5x"))
        previous = headerwatch.replace_watcher(None)  # the stat path, for context: every probed path re-statted
        try:
            headermemo.clear_memo()  # scans made under the watcher keep their watch: start over without one
            hit()
            ours, base = side_by_side(lambda: per_call_us(hit, max(1, n // 10)), lambda: per_call_us(plain, n), rounds)
        finally:
            headerwatch.replace_watcher(previous)
        probed = max(len(s.checks) for s in headermemo._scan_memo.values())
        rows.append((f"  same, without inotify ({probed} paths stat'ed per hit)", ours, base, ours / base, "(context)"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer calls per round (smoke run)")
    args = p.parse_args()
    scale = 10 if args.quick else 1

    source = matmul_source(16)
    options = ProgramOptions(std="c++17", arch="sm_90")
    cubin = bytes(Program(source, "c++", options).compile("cubin").code)
    key = make_program_cache_key(code=source, code_type="c++", options=options, target_type="cubin")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        chain = TieredProgramCache(root / "chain")
        chain[key] = cubin
        memory_tier = chain.tier("memory").resource
        core_memory = InMemoryProgramCache()
        core_memory[key] = cubin
        core_files = FileStreamProgramCache(root / "core")
        core_files[key] = cubin

        rows = []
        n = 200_000 // scale
        ours, base = side_by_side(
            lambda: per_call_us(lambda: chain.get(key), n),
            lambda: per_call_us(lambda: core_memory.get(key), n),
            args.rounds,
        )
        rows.append(("memory hit: chain.get vs InMemoryProgramCache.get", ours, base, ours / base, "<= 1.3x"))

        n = 2_000 // scale
        ours, base = side_by_side(
            lambda: per_call_us(lambda: chain.get(key), n, setup=memory_tier.clear),
            lambda: per_call_us(lambda: core_files.get(key), n),
            args.rounds,
        )
        rows.append(("disk hit (memory cold, incl. promotion) vs FileStreamProgramCache.get", ours, base, ours / base, "<= 1.1x"))
        ours, base = side_by_side(
            lambda: per_call_us(lambda: check_code_object(cubin, unknown_ok=True), n),
            lambda: per_call_us(lambda: core_files.get(key), n),
            args.rounds,
        )
        rows.append(("  of which the code-object check (in the disk hit above)", ours, base, ours / base, "(context)"))

        def miss_then_promote() -> None:
            memory_tier.get(key)
            memory_tier[key] = cubin

        inherent = statistics.median(
            per_call_us(miss_then_promote, n, setup=memory_tier.clear) for _ in range(args.rounds)
        )
        rows.append(("  of which the memory miss + the promotion write (InMemoryProgramCache)", inherent, base, inherent / base, "(context)"))

        n = 2_000 // scale
        core_compile_cache = InMemoryProgramCache()
        Program(source, "c++", options).compile("cubin", cache=core_compile_cache)
        ours, base = side_by_side(
            lambda: per_call_us(lambda: Program(source, "c++", options).compile("cubin", cache=chain), n),
            lambda: per_call_us(lambda: Program(source, "c++", options).compile("cubin", cache=core_compile_cache), n),
            args.rounds,
        )
        rows.append(("Program.compile hit: chain vs InMemoryProgramCache", ours, base, ours / base, "(context)"))
        hit_us = ours

        # compile() hits (memory tier, header memo warm): the key with an include path and
        # portable keys (the default) against no include path, and against portable_keys=False
        inc = project_headers(root, 3)
        inc_source = '#include "h0.h"\n' + source
        inc_options = ProgramOptions(std="c++17", arch="sm_90", include_path=[str(inc)])

        def plain_hit() -> None:
            tpc.compile(source, "c++", options, cache=chain)

        def portable_hit() -> None:
            tpc.compile(inc_source, "c++", inc_options, cache=chain)

        def path_keyed_hit() -> None:
            tpc.compile(inc_source, "c++", inc_options, cache=chain, portable_keys=False)

        for warm_up in (plain_hit, portable_hit, path_keyed_hit):
            warm_up()
        n = 20_000 // scale
        ours, base = side_by_side(lambda: per_call_us(portable_hit, n), lambda: per_call_us(plain_hit, n), args.rounds)
        rows.append(("compile() hit: include_path (3 headers, portable keys) vs no include", ours, base, ours / base,
                     "(context)"))
        ours, base = side_by_side(lambda: per_call_us(portable_hit, n), lambda: per_call_us(path_keyed_hit, n),
                                  args.rounds)
        rows.append(("compile() hit, include_path: portable keys vs portable_keys=False", ours, base, ours / base,
                     "<= 1.1x"))
        rows.extend(include_path_hits(chain, options, source, 2_000 // scale, args.rounds))

        n = max(1, 20 // scale)
        compile_us = statistics.median(
            per_call_us(lambda: Program(source, "c++", options).compile("cubin"), n) for _ in range(args.rounds)
        )
        rows.append(("uncached compile / Program.compile(cache=chain) hit", compile_us, hit_us, compile_us / hit_us, ">= 1000x"))
        chain.close()

    print(f"{'measurement':<72} {'ours us':>10} {'baseline us':>12} {'ratio':>9}  target")
    for name, a, b, ratio, target in rows:
        print(f"{name:<72} {a:>10.2f} {b:>12.2f} {ratio:>8.2f}x  {target}")
    print(f"(median of {args.rounds} interleaved rounds; sample kernel: matmul tile 16, {len(cubin)} byte cubin)")


if __name__ == "__main__":
    main()
