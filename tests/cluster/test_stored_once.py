"""Nothing stored twice: an entry the shared tier holds is never uploaded again, whatever the flight decided.

Real stores: moto S3 over real HTTP (each PUT's key and status seen from botocore's side) and a
file:// remote (each entry file's inode and mtime). Node B's race is made to be won by its compile
while its lookup is held: the entry A uploaded is there, so B's conditional create is refused.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
from cuda.core.utils import InMemoryProgramCache, make_program_cache_key

import tiered_progcache as tpc
from tiered_progcache.stores.objectstore import ObjectStoreCalls
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain.policy import TierPolicy
from tiered_progcache.cluster.flightpolicy import compile_times
from tiered_progcache.compiling.manifest import manifest_key
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import WrapperEntryStore
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from test_flightpolicy import _predicting, decisions  # noqa: F401
from test_singleflight import kernel, options

JOIN_S = 90


class PutLog:
    """(object key, HTTP status) of every PUT the client of ``remote`` made (412: a create the store refused)."""

    def __init__(self, remote: RemoteProgramCache) -> None:
        self.puts: list[tuple[str, int]] = []
        fs = remote.fs
        assert isinstance(fs, ObjectStoreCalls), fs  # a blocking client: the runner calls its pipe_file
        put = fs.pipe_file

        def logged(path: str, value: bytes, **kwargs: Any) -> Any:
            try:
                result = put(path, value, **kwargs)
            except FileExistsError:
                self.puts.append((path, 412))
                raise
            except Exception:
                self.puts.append((path, -1))
                raise
            self.puts.append((path, 200))
            return result

        fs.pipe_file = logged  # the runner's blocking calls look it up on the instance

    def stored(self) -> collections.Counter[str]:
        """PUTs per entry that stored something (2xx): an entry counted twice was rewritten."""
        return collections.Counter("".join(k.rsplit("/", 2)[-2:]) for k, status in self.puts if 200 <= status < 300)


@pytest.fixture(params=["s3", "file"])
def shared(request, tmp_path):
    """A function that opens the same real shared store anew (one call per node)."""
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        return lambda: RemoteProgramCache.from_url(bucket.url, storage_options={
            **bucket.storage_options, "skip_instance_cache": True}, strict=True)
    (tmp_path / "remote").mkdir()
    return lambda: RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}", strict=True)


def _node(tmp_path, name: str, store) -> TieredProgramCache:
    """Every compile short (k = 1e9 round trips of a store taken as 1 s away, a file:// one on this disk
    included): each miss races the shared lookup."""
    far = store if isinstance(store, WrapperEntryStore) else WrapperEntryStore(store, round_trip_s=1.0)
    return TieredProgramCache(tiers=[InMemoryProgramCache(), (far, TierPolicy("remote", write="background",
                                                                              shared=True))],
                              lease_min_compile_rtts=1e9)


def _files(store: RemoteProgramCache, names: list[str]) -> dict[str, tuple[int, int]]:
    import os

    return {n: (os.stat(store.path_for(n)).st_ino, os.stat(store.path_for(n)).st_mtime_ns) for n in names}


def test_a_race_won_by_the_compile_over_an_entry_already_up_rewrites_nothing(tmp_path, shared, decisions):
    source = kernel(340)
    key = make_program_cache_key(code=source, code_type="c++", options=options(), target_type="cubin")
    names = [entry_name(key), entry_name(manifest_key(key))]
    _predicting(compile_times, source, 0.001)
    store_a, store_b = shared(), WrapperEntryStore(shared(), round_trip_s=1.0)
    logs = [PutLog(s) for s in (store_a, store_b.store)] if store_a.location.startswith("s3") else []
    with _node(tmp_path, "a", store_a) as node_a:
        obj = tpc.compile(source, "c++", options(), cache=node_a)
        assert node_a.flush(JOIN_S)
    before = _files(store_a, names) if not logs else None
    lookup = store_b.hold("read_entry", name=entry_name(key), timeout=JOIN_S)  # B's lookup answers late
    with _node(tmp_path, "b", store_b) as node_b:
        try:
            again = tpc.compile(source, "c++", options(), cache=node_b)  # returns while the lookup is held
            assert lookup.arrived.is_set() and not lookup.is_open
            assert node_b.flush(JOIN_S)
        finally:
            lookup.open()
        flight = node_b.stats().flight
        b_writes = node_b.stats()["remote"].writes
    for thread in [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-look-")]:
        thread.join(JOIN_S)
    assert [d.choice for d in decisions] == ["raced_won", "raced_won"] and flight["raced_won"] == 1
    assert bytes(again.code) == bytes(obj.code)
    assert b_writes == 0  # B's conditional creates were refused: nothing counted as written
    assert store_b.calls["create_entry"] == 2 and store_b.calls["write_entry"] == 0  # manifest, cubin
    if logs:
        assert logs[0].stored() == {n: 1 for n in names}  # A's two uploads
        assert logs[1].stored() == {} and [s for _, s in logs[1].puts] == [412, 412]  # B's: refused
    else:
        assert _files(store_a, names) == before  # the same files, never replaced


def test_a_race_whose_lookup_finds_the_entry_after_the_compile_won_forgoes_the_uploads_still_queued(
        tmp_path, shared, decisions):
    """B's compile wins while its uploads queue behind another one under way; then the lookup finds A's
    entry: the cubin's and the manifest's queued uploads are dropped (``forgone``), never sent."""
    source = kernel(341)
    key = make_program_cache_key(code=source, code_type="c++", options=options(), target_type="cubin")
    names = [entry_name(key), entry_name(manifest_key(key))]
    filler = b"f" * 32
    _predicting(compile_times, source, 0.001)
    store_a, store_b = shared(), WrapperEntryStore(shared(), round_trip_s=1.0)
    logs = [PutLog(s) for s in (store_a, store_b.store)] if store_a.location.startswith("s3") else []
    with _node(tmp_path, "a", store_a) as node_a:
        tpc.compile(source, "c++", options(), cache=node_a)
        assert node_a.flush(JOIN_S)
    lookup = store_b.hold("read_entry", name=names[0], timeout=JOIN_S)
    upload = store_b.hold("create_entry", name=entry_name(filler), timeout=JOIN_S)
    with _node(tmp_path, "b", store_b) as node_b:
        try:
            node_b[filler] = b"\x7fELF" + bytes(64)
            assert upload.wait_arrived(JOIN_S)  # under way: B's next uploads queue behind it
            tpc.compile(source, "c++", options(), cache=node_b)  # the compile won: the lookup is held
            lookup.open()
            for thread in [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-look-")]:
                thread.join(JOIN_S)
        finally:
            lookup.open()
            upload.open()
        assert node_b.flush(JOIN_S)
        remote = node_b.stats()["remote"]
    assert [d.choice for d in decisions] == ["raced_won", "raced_won"]
    assert remote.forgone == 2 and remote.writes == 1 and remote.hits == 1  # the filler written
    assert store_b.names("create_entry", "write_entry") == [entry_name(filler)]
    if logs:
        assert [s for _, s in logs[1].puts] == [200]  # the filler's; neither of B's two was sent


def test_a_rejected_entry_is_replaced_by_the_next_upload(tmp_path, shared):
    """A corrupt entry in the shared tier is never returned; the node that rejected it uploads over it."""
    store = shared()
    name = entry_name(b"k" * 32)
    store.write_entry(name, b"\x7fELF" + bytes(64))
    sealed_path = store.path_for(name)
    store.fs.pipe_file(sealed_path, b"not an envelope")  # corrupt it in place
    with _node(tmp_path, "n", store) as node:
        assert node.get(b"k" * 32) is None  # rejected, never returned
        node[b"k" * 32] = b"\x7fELF" + bytes(65)
        assert node.flush(JOIN_S)
    assert store.read_entry(name) == b"\x7fELF" + bytes(65)
    with _node(tmp_path, "m", shared()) as other:
        other[b"k" * 32] = b"\x7fELF" + bytes(66)  # an entry that verifies: never rewritten
        assert other.flush(JOIN_S)
    assert store.read_entry(name) == b"\x7fELF" + bytes(65)


def test_two_nodes_taking_leases_store_each_entry_once(tmp_path, s3_bucket):
    """Two nodes compile the same three kernels at once through the lease (k = 0: never short): on moto
    (real HTTP), every entry and manifest is PUT once and stored once, and the cluster compiles each once."""
    compiled: list[bytes] = []
    stop = tpc.on_compile(lambda e: compiled.append(e.key))
    opened = [RemoteProgramCache.from_url(s3_bucket.url, storage_options={
        **s3_bucket.storage_options, "skip_instance_cache": True}, strict=True) for _ in range(2)]
    logs = [PutLog(store) for store in opened]
    nodes = [TieredProgramCache(tiers=[InMemoryProgramCache(), (store, TierPolicy("remote", write="background",
                                                                                  shared=True))],
                                lease_min_compile_rtts=0.0) for store in opened]
    go = threading.Barrier(2)

    def node(cache: TieredProgramCache) -> None:
        go.wait(JOIN_S)
        for i in (350, 351, 352):
            tpc.compile(kernel(i), "c++", options(), cache=cache)

    threads = [threading.Thread(target=node, args=(cache,)) for cache in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        for cache in nodes:
            assert cache.flush(JOIN_S)
        for t in [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-lease-")]:
            t.join(JOIN_S)
    finally:
        stop()
        for cache in nodes:
            cache.close()
    keys = [make_program_cache_key(code=kernel(i), code_type="c++", options=options(), target_type="cubin")
            for i in (350, 351, 352)]
    names = {entry_name(k) for k in keys} | {entry_name(manifest_key(k)) for k in keys}
    stored = logs[0].stored() + logs[1].stored()
    assert {n: stored[n] for n in names} == dict.fromkeys(names, 1)
    entry_puts = collections.Counter(k for log in logs for k, _ in log.puts if "/leases/" not in k)
    assert sorted(entry_puts.values()) == [1] * 6  # nobody even tried twice
    assert sorted(compiled) == sorted(keys)
