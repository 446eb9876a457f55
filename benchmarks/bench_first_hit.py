"""The first ``compile()`` hit in a fresh process: a ``cub::BlockReduce`` kernel against a plain one, side by side.

    python benchmarks/bench_first_hit.py [--runs 7] [--dir DIR] [--parts]

Both entries are compiled into one local cache directory first (so the header scan of
the CUB kernel is persisted in ``<dir>/header-scans``, as a node that compiled it before
leaves it). Then fresh interpreters are spawned, alternately one per kernel, each timing
its first ``tiered_progcache.compile()`` call (a local-directory hit) after the imports.
Prints the median per kernel, their ratio, the files the CUB scan digests and the bytes of
the persisted scans. No asserts: numbers and ratios only. Local directory only (no remote).
``--parts`` also times, inside each first call, cuda-core's key (where NVRTC is loaded on its
first use) and the header-scan memo (the persisted scan read and validated by stat), and within
the memo the file's load and the stat of every path it probed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PLAIN = 'extern "C" __global__ void plain(float* out) { out[threadIdx.x] = 2.0f * threadIdx.x; }\n'
CUB = ('#include <cub/block/block_reduce.cuh>\n'
       'extern "C" __global__ void reduce(const float* in, float* out) {\n'
       '  using R = cub::BlockReduce<float, 128>;\n  __shared__ typename R::TempStorage tmp;\n'
       '  float s = R(tmp).Sum(in[threadIdx.x]);\n  if (threadIdx.x == 0) *out = s;\n}\n')

CHILD = r"""
import json, os, sys, time
import tiered_progcache as tpc
from cuda.core import ProgramOptions
from cuda.pathfinder import find_nvidia_header_directory
src, kind, cache_dir, parts = sys.argv[1], sys.argv[2], sys.argv[3], {}
if sys.argv[4:] == ["parts"]:  # time two calls inside the first compile(): wrapped, not called before the clock
    from tiered_progcache.compiling import headermemo, headerscan, keys, scanmemo
    def timed(module, name, label):
        inner = getattr(module, name)
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - started
        setattr(module, name, call)
    timed(keys, "key_for", "key")
    timed(headerscan, "memoized", "memo")
    timed(scanmemo.ScanMemoStore, "load", "memo: load")
    timed(headermemo, "_unchanged", "memo: stat")
opts = ProgramOptions(arch="sm_90", std="c++17",
                      include_path=[find_nvidia_header_directory("cccl")] if kind == "cub" else None)
cache = tpc.TieredProgramCache(cache_dir)
before = tpc.compile_count()
t = time.perf_counter()
tpc.compile(src, "c++", opts, cache=cache)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "compiled": tpc.compile_count() - before, "parts": parts}))
"""


def _child(src: str, kind: str, cache_dir: str, parts: bool = False) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, src, kind, cache_dir, *(["parts"] if parts else [])],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7, help="fresh processes per kernel (alternating); the median is shown")
    p.add_argument("--dir", default=None, help="cache directory (default: a new temporary one)")
    p.add_argument("--parts", action="store_true",
                   help="also time cuda-core's key (NVRTC's load) and the header-scan memo (its load, its stats) "
                        "inside each first call")
    args = p.parse_args()
    cache_dir = args.dir or tempfile.mkdtemp(prefix="bench-first-hit-")
    for src, kind in ((PLAIN, "plain"), (CUB, "cub")):
        _child(src, kind, cache_dir)  # compiles and stores it (and persists the CUB scan)
    times: dict[str, list[float]] = {"plain": [], "cub": []}
    parts: dict[str, dict[str, list[float]]] = {"plain": {}, "cub": {}}
    for _ in range(args.runs):
        for src, kind in ((PLAIN, "plain"), (CUB, "cub")):
            run = _child(src, kind, cache_dir, args.parts)
            if run["compiled"]:
                raise SystemExit(f"{kind}: the first call compiled; the entry should have been a hit")
            times[kind].append(run["seconds"])
            for label, seconds in run["parts"].items():
                parts[kind].setdefault(label, []).append(seconds)
    plain, cub = statistics.median(times["plain"]), statistics.median(times["cub"])
    scans = os.path.join(cache_dir, "header-scans")
    scan_bytes = sum(os.path.getsize(os.path.join(scans, f)) for f in os.listdir(scans)) if os.path.isdir(scans) else 0

    from cuda.core import ProgramOptions
    from cuda.pathfinder import find_nvidia_header_directory

    from tiered_progcache.compiling.headerscan import header_scan

    cccl = find_nvidia_header_directory("cccl")
    files = {inc: len(header_scan(f"#include <{inc}>\n", ProgramOptions(arch="sm_90", include_path=[cccl])).headers)
             for inc in ("cuda/std/type_traits", "cub/block/block_reduce.cuh", "cub/cub.cuh")}
    print(f"first compile() hit in a fresh process, median of {args.runs}: "
          f"plain {plain * 1e3:.1f} ms, cub::BlockReduce {cub * 1e3:.1f} ms, ratio {cub / plain:.2f}x")
    print(f"persisted header scans: {scan_bytes} bytes; files digested: "
          + ", ".join(f"<{inc}> {n}" for inc, n in files.items()))
    for kind, labels in parts.items():
        if labels:
            print(f"  {kind} parts, median: " + ", ".join(
                f"{label} {statistics.median(values) * 1e3:.1f} ms" for label, values in sorted(labels.items())))


if __name__ == "__main__":
    main()
