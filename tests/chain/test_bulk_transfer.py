"""``warm``, ``push`` and the waits of one chain: what they move, what they report, what they say when the chain
cannot do them. Real ``file://`` remotes and cuda-core's local directory."""

from __future__ import annotations

import logging
import threading

import pytest
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import tiered
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.slowfs import SlowFileSystem

KEYS = [bytes([n]) * 32 for n in range(3)]


@pytest.fixture
def remote_url(tmp_path):
    root = tmp_path / "remote"
    root.mkdir()
    with TieredProgramCache(tmp_path / "other-node", remote=root.as_uri()) as other:
        for n, key in enumerate(KEYS):
            other[key] = b"cubin-%d" % n
        assert other.flush(60)
    return root.as_uri()


def _local_names(cache: TieredProgramCache) -> set[str]:
    return {entry.name for entry in cache.local_store.iter_entries()}


def test_warm_fetches_the_names_given_and_tells_progress(tmp_path, remote_url):
    told: list[tuple[int, int]] = []
    with TieredProgramCache(tmp_path / "node", remote=remote_url) as cache:
        report = cache.warm([entry_name(KEYS[1])], progress=lambda done, total: told.append((done, total)))
        assert report.entries == 1 and _local_names(cache) == {entry_name(KEYS[1])}
    assert told == [(0, 1), (1, 1)]


def test_warm_keeps_to_max_bytes(tmp_path, remote_url):
    with TieredProgramCache(tmp_path / "node", remote=remote_url) as cache:
        assert cache.warm(max_bytes=0).entries == 0 and _local_names(cache) == set()


def test_push_uploads_the_names_given_and_tells_progress(tmp_path):
    root = tmp_path / "remote"
    root.mkdir()
    told: list[tuple[int, int]] = []
    with TieredProgramCache(tmp_path / "node") as local_only:
        for n, key in enumerate(KEYS):
            local_only[key] = b"cubin-%d" % n
    with TieredProgramCache(tmp_path / "node", remote=root.as_uri()) as cache:
        report = cache.push([entry_name(KEYS[2])], progress=lambda done, total: told.append((done, total)))
        assert report.entries == 1
        assert [entry.name for entry in cache.shared_store.iter_entries()] == [entry_name(KEYS[2])]
    assert told == [(0, 1), (1, 1)]


@pytest.mark.parametrize("what", ["warm", "push"])
def test_warm_and_push_say_what_the_chain_lacks(what):
    with TieredProgramCache(tiers=[InMemoryProgramCache()]) as cache:
        with pytest.raises(ValueError) as info:
            getattr(cache, what)()
    assert str(info.value) == (f"{what} needs a remote (shared) tier and a local directory tier; "
                               "the chain is TieredProgramCache(memory:InMemoryProgramCache)")  # fmt: skip


def test_warm_loads_nvrtc_quietly_and_says_why_when_it_cannot(tmp_path, remote_url, caplog, monkeypatch):
    with caplog.at_level(logging.DEBUG, "tiered_progcache.chain.tiered"):
        with TieredProgramCache(tmp_path / "node", remote=remote_url) as cache:
            cache.warm()
        assert [r for r in caplog.records if "NVRTC" in r.getMessage()] == []  # loaded: nothing to say

        def no_nvrtc(**_: object) -> bytes:
            raise RuntimeError("no NVRTC here")

        monkeypatch.setattr(tiered, "make_program_cache_key", no_nvrtc)
        with TieredProgramCache(tmp_path / "node2", remote=remote_url) as cache:
            cache.warm()  # never raises: a missing NVRTC is the first compile's error to give
    assert [r.getMessage() for r in caplog.records if "NVRTC" in r.getMessage()] == [
        "could not load NVRTC at warm(): RuntimeError('no NVRTC here')"
    ]


@pytest.mark.parametrize("timeout", [None, 60.0])
def test_wait_uploaded_waits_for_a_write_under_way(tmp_path, timeout):
    gate = threading.Event()
    fs = SlowFileSystem(write_gate=gate)
    fs.mkdir("bucket")
    store = RemoteProgramCache(fs, "bucket/kernels")
    with TieredProgramCache(tiers=[InMemoryProgramCache(), store]) as cache:
        cache[KEYS[0]] = b"cubin"
        assert fs.writes_started.wait(60)  # the upload is held at the gate
        answers: list[bool] = []
        waiter = threading.Thread(target=lambda: answers.append(cache.wait_uploaded(KEYS[0], timeout)))
        waiter.start()
        gate.set()
        waiter.join(60)
        assert answers == [True] and store.read_key(KEYS[0]) == b"cubin"
