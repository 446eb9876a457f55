"""One fresh node on an empty store against the same node compiling alone: what the cluster costs one node.

    python benchmarks/bench_one_node.py [--stores gcs,redis,s3] [--rtt-ms 50] [--kernels 12] [--runs 12]
                                        [--tree DIR ...]

Each round, for each variant in turn, a fresh node process (empty local directory, NVRTC not
loaded, nothing imported but ``tiered_progcache`` and ``cuda.core``) builds its cache and compiles the
same cheap kernels through ``compile()``: ``alone`` with no remote, then on a new (empty) prefix of
the store with this tree's library and with each ``--tree`` (another checkout's directory, whose
``tiered_progcache`` the node imports instead). The store's client library (redis-py, s3fs, gcsfs)
is imported on the clock, by the cache's construction, as in a process that never imported it
itself; the ``client imported before`` row beside it is the same node with the client imported
before the clock, as an application that uses the library itself would have. One node, so the fleet's races and leases are out
of it: what is left is the node's own cost of the shared tier (its probe, lookups, uploads and
their threads). Nothing warms a server but the nodes' own requests. Prints per variant the median wall from the cache's construction to the last
kernel, its ratio to alone, the process's CPU seconds and each kernel's median ms. Stores as in
``bench_fleet.py``, behind the delay proxy. No asserts.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fleet  # noqa: E402  (the stores and kernels of the fleet benchmark)


def _node(spec: dict[str, Any], results: Any) -> None:
    if spec["tree"]:
        sys.path.insert(0, spec["tree"])
    from cuda.core import ProgramOptions

    import tiered_progcache as tpc

    if spec["client_imported"]:
        bench_fleet.import_client(spec["remote"].get("remote"))
    options = ProgramOptions(arch=bench_fleet.ARCH, std="c++17")
    started, cpu_started = time.perf_counter(), time.process_time()
    cache = tpc.TieredProgramCache.from_env(local_dir=spec["local_dir"], **spec["remote"])
    kernels = []
    for source, _ in spec["sources"]:
        begun = time.perf_counter()
        tpc.compile(source, "c++", options, cache=cache)
        kernels.append(time.perf_counter() - begun)
    results.put((time.perf_counter() - started, time.process_time() - cpu_started, kernels, tpc.compile_count()))
    cache.close()  # uploads drain here, after the clock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="gcs,redis,s3")
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--kernels", type=int, default=12)
    p.add_argument("--runs", type=int, default=12, help="rounds; each runs every variant once, in turn")
    p.add_argument("--tree", action="append", default=[], help="another checkout to compare (repeatable)")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    for store_name in args.stores.split(","):
        store = {"gcs": bench_fleet.GCSStore, "s3": bench_fleet.S3Store, "redis": bench_fleet.RedisStore}[store_name]()
        try:
            store.set_rtt(args.rtt_ms / 1e3)
            variants = [("alone", None, False), ("this tree", "", False),
                        ("this tree, client imported before", "", True)] + [(tree, tree, False) for tree in args.tree]
            runs: dict[str, list[Any]] = {name: [] for name, _, _ in variants}
            for round_ in range(args.runs):
                sources = bench_fleet.kernel_sources("cheap", args.kernels, 0, 0, f"one{os.getpid()}r{round_}")
                for name, tree, client_imported in variants:
                    with tempfile.TemporaryDirectory(prefix="bench-one-node-") as tmp:
                        results = ctx.Queue()
                        spec = {"local_dir": os.path.join(tmp, "node"), "sources": sources, "tree": tree or "",
                                "remote": {} if tree is None else store.new_prefix(), "client_imported": client_imported}
                        proc = ctx.Process(target=_node, args=(spec, results), daemon=True)
                        proc.start()
                        runs[name].append(results.get(timeout=300))
                        proc.join(60)
            alone = statistics.median(r[0] for r in runs["alone"])
            print(f"{store_name} at {args.rtt_ms:g} ms, {args.kernels} cheap kernels, median of {args.runs} rounds:")
            for name, rows in runs.items():
                wall = statistics.median(r[0] for r in rows)
                cpu = statistics.median(r[1] for r in rows)
                per_kernel = " ".join(f"{statistics.median(r[2][i] for r in rows) * 1e3:.0f}"
                                      for i in range(args.kernels))
                print(f"  {name:34s} wall {wall * 1e3:5.0f} ms ({wall / alone:.2f}x)  cpu {cpu * 1e3:5.0f} ms  "
                      f"NVRTC {rows[0][3]}  per kernel {per_kernel}")
        finally:
            store.close()


if __name__ == "__main__":
    main()
