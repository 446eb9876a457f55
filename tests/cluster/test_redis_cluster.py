"""Cluster single-flight on Redis: four node processes, separate local directories, one Redis lease (SET NX PX) per kernel."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import traceback
from pathlib import Path

import pytest

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.cluster.lease import RemoteLease
from tiered_progcache.compiling.manifest import manifest_name
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.redis_server import redis_server, redis_url  # noqa: F401

from test_singleflight import collect_outcomes, kernel, log_compiles, options
from test_singleflight_cluster import WAIT_FOR_HOLDER

pytest.importorskip("redis")

SPAWN = mp.get_context("spawn")
JOIN_S = 90
LEASE_TTL_S = 2.0


def _node(local_dir: str, url: str, log_path: str, sources: list[str], seed: int, go, results) -> None:
    try:
        log_compiles(log_path)
        order = list(sources)
        random.Random(seed).shuffle(order)
        with TieredProgramCache(local_dir, remote=url, strict=True, **WAIT_FOR_HOLDER) as cache:
            assert cache.shared_store.leases().atomic_create
            go.wait(JOIN_S)
            outcomes = []
            for src in order:
                obj = tpc.compile(src, "c++", options(), cache=cache, lease_ttl=LEASE_TTL_S, wait_timeout=60)
                outcomes.append(("ok", bytes(obj.code)[:4] == b"\x7fELF"))
        results.put(outcomes)
    except BaseException:
        results.put([("crash", traceback.format_exc())])


def _run_nodes(n: int, tmp_path: Path, url: str, sources: list[str]) -> list[tuple[str, str]]:
    log = tmp_path / "compiles.log"
    go, results = SPAWN.Event(), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_node, args=(str(tmp_path / f"node{i}"), url, str(log), sources, i, go, results))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    go.set()
    collected = collect_outcomes(procs, results)
    assert collected == [[("ok", True)] * len(sources)] * n, collected
    return [tuple(line.split()[:2]) for line in log.read_text().splitlines()] if log.exists() else []


def test_four_nodes_one_kernel_one_nvrtc_run(tmp_path, redis_url, redis_server):
    runs = _run_nodes(4, tmp_path, redis_url, [kernel(7)])
    assert len(runs) == 1, f"{len(runs)} NVRTC runs across 4 nodes for one kernel"
    client = redis_server.client()
    assert client.keys("tiered-progcache:leases:*") == []  # released
    ((_, key_hex),) = runs
    name = entry_name(bytes.fromhex(key_hex))
    held = sorted(k.decode().rsplit(":", 1)[1] for k in client.keys("tiered-progcache:entries:*"))
    assert held == sorted([name, manifest_name(name)])  # the cubin and its manifest
    client.close()


def test_four_nodes_six_kernels_six_nvrtc_runs(tmp_path, redis_url, redis_server):
    runs = _run_nodes(4, tmp_path, redis_url, [kernel(i) for i in range(6)])
    assert len(runs) == 6 and len({key for _, key in runs}) == 6


def _holder(local_dir: str, url: str, key_source: str, taken) -> None:
    from cuda.core.utils import make_program_cache_key

    with TieredProgramCache(local_dir, remote=url) as cache:
        key = make_program_cache_key(code=key_source, code_type="c++", options=options(), target_type="cubin")
        assert RemoteLease(cache.shared_store.leases(), entry_name(key), LEASE_TTL_S).try_acquire()
        taken.set()
        threading.Event().wait(JOIN_S)


def test_a_killed_holders_lease_carries_its_ttl_in_redis_and_the_others_compile_once(tmp_path, redis_url, redis_server):
    taken = SPAWN.Event()
    holder = SPAWN.Process(target=_holder, args=(str(tmp_path / "holder"), redis_url, kernel(42), taken))
    holder.start()
    assert taken.wait(JOIN_S)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(JOIN_S)
    client = redis_server.client()
    (lease_key,) = client.keys("tiered-progcache:leases:*")
    assert 0 < client.pttl(lease_key) <= LEASE_TTL_S * 1000  # Redis drops an abandoned lease on its own
    runs = _run_nodes(3, tmp_path, redis_url, [kernel(42)])
    assert len(runs) == 1
    assert client.keys("tiered-progcache:leases:*") == []
    client.close()
