"""One new node joining a warm store: when it holds each kernel, against compiling them alone.

    python benchmarks/bench_new_node.py [--stores gcs,redis,s3] [--rtt-ms 50] [--kernels 12] [--runs 3]

Per store, one fresh node process fills a new prefix (cold); then, ``--runs`` times, a fresh node
process (empty local directory, NVRTC not loaded, nothing imported but ``tiered_progcache`` and
``cuda.core``: the cache imports the store's client library on the clock; ``--client-imported``: before
it, as an application that uses that library itself would) compiles the same kernels through ``compile()`` on the warm
store, beside a fresh node compiling them with no remote (``alone``), alternately. Prints, per run,
the ms from the cache's construction until the boot fetch's batch landed and until the node held
all its kernels, its NVRTC runs and flight decisions; then the medians and their ratio to alone.
No asserts. Stores as in ``bench_fleet.py``, behind the delay proxy; nothing warms a server but the
cold node's own requests (as the cluster's earlier nodes would have).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fleet  # noqa: E402  (the stores and kernels of the fleet benchmark)

STORES = {"gcs": bench_fleet.GCSStore, "redis": bench_fleet.RedisStore, "s3": bench_fleet.S3Store}


def _node(spec: dict[str, Any], results) -> None:
    """A fresh node: construct the cache, compile every kernel, report when the batch landed and each kernel's end."""
    logging.basicConfig(level=logging.ERROR)
    from cuda.core import ProgramOptions

    import tiered_progcache as tpc

    remote = spec["remote"]
    if remote and spec["client_imported"]:
        bench_fleet.import_client(remote["remote"])
    landed: list[float] = []

    class _BatchLanded(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("boot fetch from"):
                landed.append(time.perf_counter())

    fetch_log = logging.getLogger("tiered_progcache.chain.bootfetch")
    fetch_log.setLevel(logging.INFO)
    fetch_log.propagate = False
    fetch_log.addHandler(_BatchLanded())
    options = ProgramOptions(arch=bench_fleet.ARCH, std="c++17")
    started = time.perf_counter()
    cache = tpc.TieredProgramCache.from_env(local_dir=spec["local_dir"], **remote)
    for source in spec["sources"]:
        tpc.compile(source, "c++", options, cache=cache)
    held = time.perf_counter()
    flight = {name: n for name, n in cache.stats().flight.items() if n}
    results.put({"held_ms": (held - started) * 1e3, "nvrtc": tpc.compile_count(), "decisions": flight,
                 "landed_ms": (landed[0] - started) * 1e3 if landed else None})
    cache.close()


def _run(remote: dict[str, Any], sources: list[str], client_imported: bool = False) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-new-node-") as tmp:
        results = ctx.Queue()
        proc = ctx.Process(target=_node, args=({"local_dir": os.path.join(tmp, "node"), "remote": remote,
                                                "sources": sources, "client_imported": client_imported}, results),
                           daemon=True)
        proc.start()
        row = results.get(timeout=600)
        proc.join(120)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="gcs,redis,s3")
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--kernels", type=int, default=12)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--client-imported", action="store_true",
                   help="the node imports the store's client library before the clock (a variant: run it beside)")
    args = p.parse_args()
    for name in args.stores.split(","):
        store = STORES[name]()
        try:
            store.set_rtt(args.rtt_ms / 1e3)
            remote = store.new_prefix()
            sources = [src for src, _ in bench_fleet.kernel_sources("cheap", args.kernels, 0, 0,
                                                                     f"new-node-{os.getpid()}-{name}")]
            _run(remote, sources)  # the cold node that fills the prefix
            held, alone = [], []
            for i in range(args.runs):
                row = _run(remote, sources, args.client_imported)
                solo = _run({}, sources)
                held.append(row["held_ms"])
                alone.append(solo["held_ms"])
                landed = "-" if row["landed_ms"] is None else f"{row['landed_ms']:.0f} ms"
                print(f"{name} {args.rtt_ms:g} ms run {i + 1}: batch landed {landed}, all {args.kernels} held "
                      f"{row['held_ms']:.0f} ms, NVRTC {row['nvrtc']}, {row['decisions']}; alone "
                      f"{solo['held_ms']:.0f} ms")
            h, a = statistics.median(held), statistics.median(alone)
            print(f"{name} {args.rtt_ms:g} ms: median held {h:.0f} ms, alone {a:.0f} ms, {h / a:.2f}x")
        finally:
            store.close()


if __name__ == "__main__":
    main()
