"""Storage promises under a hostile or careless environment: truncated local files are not pushed,
planted symlinks are not written or read through, and umask 000 does not make the cache world-writable."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import uuid

import pytest

from tiered_progcache.errors import EntryRejected
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.chain.transfer import push

ELF = b"\x7fELF\x02\x01" + bytes(46) + (64).to_bytes(2, "little") + bytes(10)  # an ELF64 header (e_ehsize 64), no tables


def test_push_never_signs_a_truncated_local_file(tmp_path):
    local = LocalDir(tmp_path / "ci")
    good, cut = entry_name(b"good"), entry_name(b"cut")
    local.write_entry(good, ELF)
    local.write_entry(cut, ELF[:20])  # a cubin cut short (a full disk, a killed copy)
    local.write_entry(entry_name(b"empty"), b"")
    remote = RemoteProgramCache.from_url(f"memory://push-{uuid.uuid4().hex}/k", signing_key=b"k" * 32)
    report = push(local, remote)
    assert (report.entries, report.failures) == (1, 2)
    assert [e.name for e in remote.iter_entries()] == [good]
    assert remote.read_entry(good) == ELF


def _plant_symlinked_shard(tmp_path, name: str):
    root = tmp_path / "cache"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "entries").mkdir(parents=True)
    os.symlink(elsewhere, root / "entries" / name[:2])
    return root, elsewhere


def test_local_dir_never_writes_through_a_symlinked_shard_directory(tmp_path):
    name = entry_name(b"k")
    root, elsewhere = _plant_symlinked_shard(tmp_path, name)
    local = LocalDir(root)
    with pytest.raises(OSError, match="symbolic link"):
        local.write_entry(name, ELF)
    with pytest.raises(OSError, match="symbolic link"):
        local.create_entry(name, ELF)
    assert list(elsewhere.iterdir()) == []


def test_local_dir_never_reads_through_a_symlinked_shard_or_entry(tmp_path):
    name = entry_name(b"k")
    root, elsewhere = _plant_symlinked_shard(tmp_path, name)
    (elsewhere / name[2:]).write_bytes(ELF)  # planted where the link points
    local = LocalDir(root)
    with pytest.raises(EntryRejected, match="symbolic link"):
        local.read_entry(name)
    other = entry_name(b"other")
    (root / "entries" / other[:2]).mkdir()
    os.symlink("/dev/zero", root / "entries" / other[:2] / other[2:])
    with pytest.raises(EntryRejected, match="symbolic link"):
        local.read_entry(other)
    assert local.verify_entry(other) is not None


_UMASK_000 = textwrap.dedent(
    """
    import json, os, sys
    os.umask(0)
    from tiered_progcache.stores.localdir import LocalDir
    from tiered_progcache.stores.remote import RemoteProgramCache
    local_root, remote_root = sys.argv[1], sys.argv[2]
    local = LocalDir(local_root)
    local.ensure_layout()
    local.write_entry("ab" * 32, b"x")
    local.create_entry("cd" * 32, b"y")
    remote = RemoteProgramCache.from_url("file://" + remote_root, strict=True)
    remote.write_entry("ab" * 32, b"x")
    remote.create_entry("cd" * 32, b"y")
    remote.leases().create("lease", b"doc", 10)
    from tiered_progcache.cluster.locks import node_lock
    with node_lock(os.path.join(local_root, "locks"), "ab" * 32, 1.0) as held:
        assert held
    modes = {}
    for top in (local_root, remote_root):
        for path, dirs, files in os.walk(top):
            modes[path] = os.lstat(path).st_mode & 0o7777
    print(json.dumps(modes))
    """
)


def test_umask_000_leaves_no_directory_world_writable_and_tmp_private(tmp_path):
    local_root, remote_root = tmp_path / "local", tmp_path / "remote"
    child = subprocess.run(
        [sys.executable, "-c", _UMASK_000, str(local_root), str(remote_root)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == 0, child.stderr
    modes = json.loads(child.stdout)
    assert len(modes) >= 10  # both roots, entries/, two shards each, tmp/, leases/
    wide = {path: oct(mode) for path, mode in modes.items() if mode & stat.S_IWOTH}
    assert wide == {}
    assert modes[str(local_root / "tmp")] == 0o700
    assert str(local_root / "locks") in modes  # the node-lock directory is checked too
    assert modes[str(remote_root / "tmp")] & 0o077 == 0
