"""A fleet of nodes on one shared remote: compiles, wall time and requests, at several round-trip times.

    python benchmarks/bench_fleet.py [--nodes 8] [--kernels 12] [--rtt-ms 0,10,30,50] [--remote s3|file]
                                     [--repeat 1] [--decisions FILE] [--workload matmul|cccl|failing]

``--workload cccl``: the kernels are ``benchmarks/cccl_kernels.py``'s ``cub::BlockReduce`` kernel
(variants), heavy (seconds, thousands of headers), each node's first compile in a fresh process:
rows ``alone`` and ``cold`` only. ``--workload failing``: a kernel with a syntax error; rows
``alone`` and ``cold``; the ``errors`` column is when the first and the last node had the error.

Each node is a real process (spawn) with its own local directory; all nodes start together
(a barrier) and each compiles the same K distinct kernels (the sample matmul, variants) through
``tiered_progcache.compile()`` in its own shuffled order. Every node loads NVRTC before the
barrier (one throwaway compile outside the cache), so no row pays the library's load.

Rows, per round-trip time:

- ``alone``: no remote; every node compiles every kernel (N x K compiler runs);
- ``cold``: an empty remote, the flight policy of the settings (``TIERED_PROGCACHE_*`` variables
  apply, e.g. ``TIERED_PROGCACHE_LEASE_MIN_COMPILE_RTTS``; otherwise the defaults);
- ``cold, always wait``: the same with ``lease_min_compile_rtts=0, wait_patience=None``
  (every compile takes the lease, every waiter waits for its holder: the pre-policy rule);
- ``cold, k=X`` (``--compare-k``): the same with ``lease_min_compile_rtts=X``;
- ``warm``: fresh nodes (empty local directories) on the remote the cold row filled,
  compiling the K kernels (one remote look each);
- ``warm + prefetch``: the same, each node first calling ``cache.warm()`` (one listing,
  one concurrent batch of GETs), then compiling;
- ``warm, 1 node`` and ``warm + prefetch, 1 node``: one such node on its own (the N nodes
  above boot together and here share 2 CPUs with the object store).

Columns: compiler runs in the fleet; wall seconds from the barrier to the last node done;
p50 and max per node of the time to hold all K kernels; HTTP requests per ``compile()``
call, from the barrier until every node has exited, so uploads, lease requests, polls and
prefetch included (moto behind ``testing.delayproxy.DelayProxy`` with keep-alive counts
them; blank for file://); ``R ms``, the median round trip the nodes' policy saw (the
injected RTT plus moto's and the client's own time); and the flight policy's choices
(``tiered_progcache.cluster.flightpolicy.on_flight``), with the estimate in round trips (C/R)
where it compiled without a lease, and the wait where a waiter gave up.

``--remote s3``: moto S3 in its own process behind the delay proxy (RTT injected per
request). ``--remote file``: a ``file://`` directory, 0 ms only (the GPU host has no moto;
a local path has no round trip to inject). No asserts: it reports.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

ARCH = "sm_90"
ALWAYS_WAIT = {"lease_min_compile_rtts": 0.0, "wait_patience": None}


BROKEN_KERNEL = 'extern "C" __global__ void fleet_broken(float* x) { x[0] = undeclared_symbol; }\n'


def kernel_sources(k: int, salt: str, workload: str = "matmul") -> list[str]:
    """K distinct kernels: the sample matmul's four specialisations (or the CUB kernel, or a broken one),
    each made distinct by a comment."""
    if workload == "cccl":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from cccl_kernels import CUB_KERNEL

        return [CUB_KERNEL + f"\n// fleet kernel {i} {salt}\n" for i in range(k)]
    if workload == "failing":
        return [BROKEN_KERNEL + f"// fleet kernel {i} {salt}\n" for i in range(k)]
    from tiered_progcache.samples import matmul_source

    variants = [(t, e) for t in (16, 32) for e in ("identity", "relu")]
    return [matmul_source(*variants[i % 4]) + f"\n// fleet kernel {i} {salt}\n" for i in range(k)]


def _include_path(workload: str) -> list[str] | None:
    if workload != "cccl":
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cccl_kernels import cccl_dir

    found = cccl_dir()
    if found is None:
        raise SystemExit("--workload cccl: CCCL's headers are not installed (cuda.pathfinder finds none)")
    return [found]


# -- one node ----------------------------------------------------------------------------------------


def _node(local_dir: str, remote: dict[str, Any] | None, sources: list[str], seed: int, prefetch: bool,
          barrier, results, include_path: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.ERROR)
    from cuda.core import Program, ProgramOptions

    import tiered_progcache as tpc
    from tiered_progcache import TieredProgramCache
    from tiered_progcache.cluster.flightpolicy import on_flight

    options = ProgramOptions(arch=ARCH, std="c++17", include_path=include_path)
    warmup = Program('extern "C" __global__ void fleet_warmup() {}', "c++", options)
    warmup.compile("cubin")  # load NVRTC before the clock starts, outside the cache
    warmup.close()
    del warmup  # now: cuda-core's Program.__dealloc__ fails at interpreter exit
    decisions: list[dict[str, Any]] = []
    on_flight(lambda d: decisions.append(d.as_dict()))
    order = list(sources)
    random.Random(seed).shuffle(order)
    cache = TieredProgramCache.from_env(local_dir=local_dir, **(remote or {}))  # other settings: the environment
    if remote is not None:
        cache.get(b"a first request: connections and the round trip, as a running node has them")
    barrier.wait()
    started = time.time()
    prefetched = cache.warm().entries if prefetch else 0
    warmed = time.time()
    errors: list[float] = []
    for src in order:
        try:
            tpc.compile(src, "c++", options, cache=cache)
        except Exception:  # the failing workload: when this node had the error
            errors.append(time.time())
    done = time.time()
    results.put({"compiles": tpc.compile_count(), "started": started, "done": done, "decisions": decisions,
                 "prefetched": prefetched, "prefetch_s": warmed - started, "errors": errors})
    cache.close()  # uploads drain here, after the clock


def run_fleet(
    n: int, sources: list[str], remote: dict[str, Any] | None, prefetch: bool = False,
    requests: Callable[[], int | None] = lambda: None, include_path: list[str] | None = None,
) -> dict[str, Any]:
    """Start n nodes together; what they did, the fleet's wall time from the barrier, and the
    remote requests from the barrier until every node has exited (its uploads and releases included)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        barrier = ctx.Barrier(n + 1)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_node, args=(os.path.join(tmp, f"node{i}"), remote, sources, i, prefetch, barrier, results,
                                            include_path))
            for i in range(n)
        ]
        for p in procs:
            p.start()
        barrier.wait(120)
        started = time.time()
        before = requests()  # each node's connection probe and first look are in already
        done = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        after = requests()
    per_node = [d["done"] - d["started"] for d in done]
    errors = [t - started for d in done for t in d["errors"]]
    return {
        "errors": (min(errors), max(errors), len(errors)) if errors else None,
        "compiles": sum(d["compiles"] for d in done),
        "wall": max(d["done"] for d in done) - started,
        "p50": statistics.median(per_node),
        "max": max(per_node),
        "decisions": [x for d in done for x in d["decisions"]],
        "prefetched": sum(d["prefetched"] for d in done),
        "prefetch_p50": statistics.median(d["prefetch_s"] for d in done),
        "requests": None if before is None or after is None else after - before,
    }


# -- the remote ---------------------------------------------------------------------------------------


def _serve_moto(conn) -> None:  # a child process, as a real remote would be
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
    conn.recv()
    server.stop()


def _warm_up(fs, path: str) -> None:
    """Each request kind the cache sends, once, before any row: moto loads each operation's code on its
    first use (a real S3 has no such cost), which the first row measured would otherwise pay."""
    fs.pipe_file(f"{path}/entry", b"x" * 64)
    fs.cat_file(f"{path}/entry")
    fs.cat_file(f"{path}/entry", start=0, end=8)
    fs.info(f"{path}/entry")
    fs.ls(path)
    try:
        fs.pipe_file(f"{path}/lease", b"lease", mode="create")
    except (FileExistsError, TypeError, ValueError):  # TypeError/ValueError: an s3fs without conditional create
        pass
    fs.rm(f"{path}/entry")
    fs.rm(f"{path}/lease")
    try:
        fs.cat_file(f"{path}/missing")
    except FileNotFoundError:
        pass


class S3Remote:
    """moto in its own process behind a keep-alive delay proxy; a fresh prefix per cold run."""

    def __init__(self) -> None:
        import s3fs

        from tiered_progcache.testing.delayproxy import DelayProxy

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_moto, args=(child,), daemon=True)
        self._proc.start()
        host, port = self._conn.recv()
        self.proxy = DelayProxy(host, port, keep_alive=True).start()
        self.options = {
            "endpoint_url": self.proxy.endpoint_url, "key": "bench", "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"}, "config_kwargs": {"max_pool_connections": 64},
        }  # fmt: skip
        self.bucket = f"fleet-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(**self.options)
        fs.call_s3("create_bucket", Bucket=self.bucket)
        _warm_up(fs, f"{self.bucket}/warm-up")

    def set_rtt(self, rtt_s: float) -> None:
        self.proxy.rtt_s = rtt_s

    def new_prefix(self) -> dict[str, Any]:
        return {"remote": f"s3://{self.bucket}/{uuid.uuid4().hex[:8]}", "remote_options": self.options}

    def count(self) -> int | None:
        """HTTP requests the proxy has forwarded so far."""
        return self.proxy.requests

    def close(self) -> None:
        self.proxy.close()
        self._conn.send("stop")
        self._proc.join(10)


class FileRemote:
    """A file:// directory: no round trip to inject, so 0 ms only."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-fleet-remote-")

    def set_rtt(self, rtt_s: float) -> None:
        if rtt_s:
            raise ValueError("a file:// remote has no round trip to inject; use --rtt-ms 0")

    def new_prefix(self) -> dict[str, Any]:
        root = Path(self._tmp.name) / uuid.uuid4().hex[:8]
        root.mkdir()  # a missing file:// root is an error, never created by the cache
        return {"remote": f"file://{root}"}

    def count(self) -> int | None:
        return None

    def close(self) -> None:
        self._tmp.cleanup()


# -- the table ------------------------------------------------------------------------------------------


def _choices(decisions: list[dict[str, Any]]) -> str:
    counts = collections.Counter(d["choice"] for d in decisions)
    text = " ".join(f"{choice} {n}" for choice, n in sorted(counts.items())) or "-"
    ratios = [d["estimate_s"] / d["round_trip_s"] for d in decisions
              if d["choice"] == "short" and d["round_trip_s"] and d["estimate_s"] is not None]
    if ratios:  # where the policy compiled instead of taking a lease: the estimate in round trips
        text += f" (short at C/R {min(ratios):.1f}-{max(ratios):.1f})"
    ratios = [d["estimate_s"] / d["round_trip_s"] for d in decisions
              if d["choice"].startswith("raced") and d["round_trip_s"] and d["estimate_s"] is not None]
    if ratios:
        text += f" (raced at C/R {min(ratios):.1f}-{max(ratios):.1f})"
    waits = [d["waited_s"] for d in decisions if d["choice"] == "gave up"]
    if waits:
        text += f" (gave up after {min(waits):.2f}-{max(waits):.2f} s)"
    return text


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--kernels", type=int, default=12)
    p.add_argument("--rtt-ms", default=None,
                   help="round-trip times to inject, comma-separated (default 0,10,30,50 for s3, 0 for file)")
    p.add_argument("--remote", choices=("s3", "file"), default="s3")
    p.add_argument("--repeat", type=int, default=1, help="runs per row; the run with the median wall is shown")
    p.add_argument("--decisions", metavar="FILE", help="write every flight decision as a JSON line here")
    p.add_argument("--compare-k", default="", metavar="LIST",
                   help="extra cold rows with lease_min_compile_rtts set to each of these (e.g. 1,2,8)")
    p.add_argument("--workload", choices=("matmul", "cccl", "failing"), default="matmul",
                   help="the kernels: sample matmuls (default), the heavy CUB kernel, or one with a syntax error")
    args = p.parse_args()
    rtt_ms = args.rtt_ms if args.rtt_ms is not None else ("0,10,30,50" if args.remote == "s3" else "0")
    rtts = [float(x) / 1e3 for x in rtt_ms.split(",")]
    cold_rows: list[tuple[str, dict[str, Any]]] = [("cold", {}), ("cold, always wait", ALWAYS_WAIT)]
    cold_rows += [(f"cold, k={k}", {"lease_min_compile_rtts": float(k)}) for k in args.compare_k.split(",") if k]
    n, k = args.nodes, args.kernels
    include_path = _include_path(args.workload)
    if args.workload != "matmul":
        cold_rows = [("cold", {})]
    remote = S3Remote() if args.remote == "s3" else FileRemote()
    log = open(args.decisions, "w") if args.decisions else None
    started = time.perf_counter()
    print(f"fleet: {n} nodes x {k} kernels ({args.workload}), remote {args.remote}, "
          f"{os.cpu_count()} CPUs, median of {args.repeat} run(s) per row")
    print(f"{'RTT':>5}  {'row':<24} {'compiles':>8} {'wall s':>7} {'vs alone':>8} {'node p50':>8} {'max':>6} "
          f"{'req/lookup':>10} {'R ms':>5}  choices")
    try:
        for rtt in rtts:
            remote.set_rtt(rtt)
            runs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            warm_prefix: dict[str, Any] | None = None
            for _ in range(args.repeat):
                salt = uuid.uuid4().hex[:8]
                sources = kernel_sources(k, salt, args.workload)
                runs["alone"].append(run_fleet(n, sources, None, include_path=include_path))
                if args.workload == "cccl":  # one node alone, in the same run: the heavy rows' yardstick
                    runs["alone, 1 node"].append(run_fleet(1, sources, None, include_path=include_path))
                for name, extra in cold_rows:
                    prefix = {**remote.new_prefix(), **extra}
                    runs[name].append(run_fleet(n, sources, prefix, requests=remote.count, include_path=include_path))
                    if name == "cold":
                        warm_prefix = {key: prefix[key] for key in ("remote", "remote_options") if key in prefix}
                        warm_sources = sources
                assert warm_prefix is not None
                if args.workload != "matmul":
                    continue
                for name, nodes, prefetch in (("warm", n, False), ("warm + prefetch", n, True),
                                              ("warm, 1 node", 1, False), ("warm + prefetch, 1 node", 1, True)):
                    runs[name].append(run_fleet(nodes, warm_sources, warm_prefix, prefetch, remote.count))
            alone_wall = _median_run(runs["alone"])["wall"]
            shown = [name for name in ("alone", "alone, 1 node", *(row for row, _ in cold_rows), "warm",
                                       "warm + prefetch", "warm, 1 node", "warm + prefetch, 1 node") if runs[name]]
            for name in shown:
                run = _median_run(runs[name])
                requests, lookups = run["requests"], (1 if name.endswith("1 node") else n) * k
                per_lookup = "" if requests is None else f"{requests / lookups:.2f}"
                seen = [d["round_trip_s"] for d in run["decisions"] if d["round_trip_s"] is not None]
                observed = f"{statistics.median(seen) * 1e3:.0f}" if seen else ""
                print(f"{rtt * 1e3:>3.0f}ms  {name:<24} {run['compiles']:>8} {run['wall']:>7.2f} "
                      f"{run['wall'] / alone_wall:>7.2f}x {run['p50']:>8.3f} {run['max']:>6.3f} {per_lookup:>10} "
                      f"{observed:>5}  {_choices(run['decisions'])}"
                      + (f" (the prefetch: p50 {run['prefetch_p50']:.3f} s)" if run["prefetched"] else "")
                      + (" (errors: {} at {:.2f}-{:.2f} s, spread {:.2f} s)".format(
                          run["errors"][2], run["errors"][0], run["errors"][1], run["errors"][1] - run["errors"][0])
                         if run["errors"] else "")
                      + (f" (vs 1 node alone: {run['wall'] / _median_run(runs['alone, 1 node'])['wall']:.2f}x)"
                         if runs["alone, 1 node"] and name != "alone, 1 node" else ""))
                if log is not None:
                    for d in run["decisions"]:
                        log.write(json.dumps({"rtt_ms": rtt * 1e3, "row": name, **d}) + "\n")
    finally:
        remote.close()
        if log is not None:
            log.close()
    print("choices: raced = compiled beside the lookup, no lease (raced, found: the lookup won); failed = raised "
          "the holder's published failure; held = took the lease and compiled; waited = got another node's entry; found = it was there "
          "once the lease was ours (or the lookup beside an unknown kernel's lease create found it); short = under the lease threshold, compiled without one; gave up = waited "
          "the patience, then compiled")
    print(f"({sys.platform}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"{time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
