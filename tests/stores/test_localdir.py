"""The local directory as an EntryStore: cuda-core's layout, its stat guard on delete, code-object checks."""

from __future__ import annotations

import os

import pytest
from cuda.core.utils import FileStreamProgramCache

from tiered_progcache import _cudacore
from tiered_progcache.errors import EntryRejected
from tiered_progcache.stores.localdir import KEYED_READS, LocalDir, default_local_dir
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import EntryStoreTests

from support import FileBackDoor

ELF = b"\x7fELF\x02\x01" + bytes(46) + (64).to_bytes(2, "little") + bytes(10)  # an ELF64 header (e_ehsize 64), no tables


class TestLocalDirStore(EntryStoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalDir(tmp_path / "cache")

    @pytest.fixture
    def back_door(self, tmp_path):
        return FileBackDoor(tmp_path / "cache")


def test_a_local_directory_holds_no_cluster_leases(tmp_path):
    """Leases are for a store other nodes share; one node's directory single-flights with lock files (locks.py)."""
    assert LocalDir(tmp_path).leases() is None


def test_shares_cuda_cores_layout_both_ways(tmp_path):
    cache = FileStreamProgramCache(tmp_path)
    local = LocalDir.of(cache)
    assert local.root == tmp_path and local.locks_dir == tmp_path / "locks"
    assert (local.location, local.shared, local.read_only, local.atomic_create) == (str(tmp_path), False, False, True)
    cache[b"from cuda-core"] = b"one"
    local.write_entry(entry_name(b"from LocalDir"), b"two")
    assert local.read_entry(entry_name(b"from cuda-core")) == b"one"
    assert cache[b"from LocalDir"] == b"two"
    name = entry_name(b"from cuda-core")
    assert local.path_for(name) == tmp_path / "entries" / name[:2] / name[2:]


def test_iter_entries_carries_times_and_cuda_cores_stat_identity(tmp_path):
    local = LocalDir(tmp_path)
    name = entry_name(b"k")
    local.write_entry(name, b"payload")
    (entry,) = local.iter_entries()
    st = os.stat(local.path_for(name))
    assert (entry.name, entry.size, entry.mtime, entry.atime) == (name, 7, st.st_mtime, st.st_atime)
    assert entry.version == _cudacore.stat_identity(st) == (st.st_ino, 7, st.st_mtime_ns)


def test_delete_listed_refuses_an_entry_replaced_since_listed_even_with_same_size_and_mtime(tmp_path):
    """The old guard compared size and mtime only; a rewrite of equal size within one mtime tick slipped past it."""
    local = LocalDir(tmp_path)
    name = entry_name(b"k")
    local.write_entry(name, b"old bytes")
    (listed,) = local.iter_entries()
    before = os.stat(local.path_for(name))
    local.write_entry(name, b"new bytes")  # same size; staged and renamed: a new inode
    os.utime(local.path_for(name), ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same mtime
    after = os.stat(local.path_for(name))
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ino != before.st_ino
    assert local.delete_listed(listed) is False
    assert local.read_entry(name) == b"new bytes"
    (fresh,) = local.iter_entries()
    assert local.delete_listed(fresh) is True
    assert list(local.iter_entries()) == []


def test_delete_listed_refuses_an_entry_without_a_version(tmp_path):
    local = LocalDir(tmp_path)
    name = entry_name(b"k")
    local.write_entry(name, b"x")
    (listed,) = local.iter_entries()
    from dataclasses import replace

    assert local.delete_listed(replace(listed, version=None)) is False
    assert local.read_entry(name) == b"x"


def test_create_entry_is_exclusive_and_leaves_no_staged_files(tmp_path):
    local = LocalDir(tmp_path)
    name = entry_name(b"k")
    assert local.create_entry(name, b"first") is True
    assert local.create_entry(name, b"second") is False
    assert local.read_entry(name) == b"first"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_verify_entry_checks_code_object_framing(tmp_path):
    local = LocalDir(tmp_path)
    good, cut, foreign = entry_name(b"good"), entry_name(b"cut"), entry_name(b"foreign")
    local.write_entry(good, ELF)
    local.write_entry(cut, ELF[:20])
    local.write_entry(foreign, b"hello")
    assert local.verify_entry(good) is None
    assert "truncated" in local.verify_entry(cut)
    assert "unknown format" in local.verify_entry(foreign)
    assert local.verify_entry(entry_name(b"absent")) == "missing"


def test_read_refuses_an_entry_over_the_cap(tmp_path):
    local = LocalDir(tmp_path, max_entry_bytes=4)
    name = entry_name(b"k")
    local.write_entry(name, b"12345")
    with pytest.raises(EntryRejected):
        local.read_entry(name)
    assert "limit" in local.verify_entry(name)


def test_default_local_dir_is_cuda_cores():
    assert default_local_dir() == _cudacore.default_cache_dir()


# -- the chain's keyed read of a local hit -------------------------------------------------------


@pytest.mark.skipif(not KEYED_READS, reason="utime on a descriptor: Linux and macOS")
def test_read_key_is_cuda_cores_read_with_its_lru_effect(tmp_path):
    """Same bytes as FileStreamProgramCache[key]; atime set to now, mtime kept (what eviction sorts by)."""
    cache = FileStreamProgramCache(tmp_path)
    local = LocalDir.of(cache)
    cache[b"k"] = ELF
    path = local.path_for(entry_name(b"k"))
    old_ns = 1_000_000_000 * 1_000_000_000  # 2001
    os.utime(path, ns=(old_ns, old_ns))
    assert local.read_key(b"k") == cache[b"k"] == ELF
    os.utime(path, ns=(old_ns, old_ns))
    local.read_key(b"k")
    st = os.stat(path)
    assert st.st_mtime_ns == old_ns and st.st_atime_ns > old_ns
    with pytest.raises(KeyError):
        local.read_key(b"absent")


@pytest.mark.skipif(not KEYED_READS, reason="utime on a descriptor: Linux and macOS")
def test_read_key_refuses_a_link_a_non_file_and_an_entry_over_the_cap(tmp_path):
    local = LocalDir(tmp_path, max_entry_bytes=len(ELF))
    target = tmp_path / "elsewhere"
    target.write_bytes(ELF)
    linked = local.path_for(entry_name(b"link"))
    linked.parent.mkdir(parents=True)
    os.symlink(target, linked)
    with pytest.raises(EntryRejected, match="symbolic link"):
        local.read_key(b"link")
    directory = local.path_for(entry_name(b"dir"))
    directory.mkdir(parents=True)
    with pytest.raises(EntryRejected, match="regular file"):
        local.read_key(b"dir")
    local.write_entry(entry_name(b"big"), ELF + b"!")
    with pytest.raises(EntryRejected, match="limit"):
        local.read_key(b"big")
    local.write_entry(entry_name(b"fits"), ELF)
    assert local.read_key(b"fits") == ELF
