"""The command on Triton's files (``--triton``): Triton's own cache directory and the remote's ``triton/`` namespace.

The directory is filled by Triton itself (a real kernel compiled on the CPU); the
command runs as a real subprocess; what lands is read back with Triton's own
``FileCacheManager``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("triton", exc_type=ImportError)

from triton.runtime.cache import FileCacheManager  # noqa: E402

import triton_support  # noqa: E402
from support import run_cli  # noqa: E402
from tiered_progcache.errors import EntryRejected  # noqa: E402
from tiered_progcache.stores.remote import RemoteProgramCache  # noqa: E402
from tiered_progcache.triton.tritondir import TritonDir  # noqa: E402
from tiered_progcache.triton.tritonnames import frame, group_record, name_of  # noqa: E402

META = triton_support.METADATA_FILE


@pytest.fixture(scope="module")
def triton_dir(tmp_path_factory) -> Path:
    """A Triton cache directory as Triton's own FileCacheManager left it after one compile."""
    directory = tmp_path_factory.mktemp("triton-cache")
    saved = {name: os.environ.pop(name, None) for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER")}
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    try:
        triton_support.compile_kernel()
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    return directory


def _copy(triton_dir: Path, to: Path) -> tuple[Path, str]:
    shutil.copytree(triton_dir, to)
    (key,) = [p.name for p in to.iterdir()]
    return to, key


def _members(directory: Path, key: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (directory / key).iterdir() if not p.name.startswith("__grp__")}


def _group(directory: Path, key: str) -> dict[str, str] | None:
    """The group as Triton's own FileCacheManager reads it from ``directory``."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    try:
        return FileCacheManager(key).get_group(META)
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR")
        else:
            os.environ["TRITON_CACHE_DIR"] = saved


def test_push_ls_warm_verify_move_a_triton_cache_through_the_remote_s_triton_namespace(triton_dir, tmp_path):
    a, key = _copy(triton_dir, tmp_path / "a")
    remote = tmp_path / "remote"
    remote.mkdir()
    url = f"file://{remote}"
    pushed = run_cli("push", "--triton", "--dir", str(a), "--remote", url)
    files = len(_members(a, key)) + 1  # the members and the group
    assert pushed.returncode == 0 and f"pushed {files} Triton files" in pushed.stdout, pushed.stderr
    assert {p.relative_to(remote).parts[0] for p in remote.rglob("*") if p.is_file()} == {"triton"}
    assert not list(RemoteProgramCache.from_url(url).iter_entries())  # the program cache sees none of them

    listed = run_cli("ls", "--triton", "--remote", url, "--long")
    rows = [line.split() for line in listed.stdout.splitlines() if len(line.split()[0]) == 64]
    # code, kind: the group record is the kernel, the rest its files (named from their frames)
    assert len(rows) == files and sorted((row[-3], row[-2]) for row in rows) == sorted(
        [("triton", "triton")] * (files - 1) + [("triton", "triton-kernel")])
    assert sorted(row[0] for row in rows) == sorted(e.name for e in TritonDir(a).iter_entries())

    b = tmp_path / "b"
    warmed = run_cli("warm", "--triton", "--dir", str(b), "--remote", url)
    assert warmed.returncode == 0 and f"warmed {files} Triton files" in warmed.stdout, warmed.stderr
    assert _members(b, key) == _members(a, key)
    group = _group(b, key)
    assert group is not None and all(Path(p).parent == b / key for p in group.values())
    assert sorted(p.name for p in (b / key).iterdir()) == sorted(p.name for p in (a / key).iterdir())

    stats = run_cli("stats", "--triton", "--dir", str(b), "--remote", url, "--json")
    held = json.loads(stats.stdout)
    assert held["local"]["entries"] == held["remote"]["entries"] == files
    verified = run_cli("verify", "--triton", "--dir", str(b))
    assert verified.returncode == 0 and f"checked {files} entries" in verified.stdout


def test_verify_finds_a_triton_group_whose_member_is_gone(triton_dir, tmp_path):
    a, key = _copy(triton_dir, tmp_path / "a")
    (a / key / "add_kernel.ptx").unlink()
    verified = run_cli("verify", "--triton", "--dir", str(a))
    assert verified.returncode == 1, verified.stdout
    assert "member add_kernel.ptx is not here" in verified.stdout + verified.stderr


def test_export_and_import_carry_a_triton_cache_whole(triton_dir, tmp_path):
    a, key = _copy(triton_dir, tmp_path / "a")
    bundle = tmp_path / "triton.tpcb"
    assert run_cli("export", "--triton", "--dir", str(a), str(bundle)).returncode == 0
    imported = run_cli("import", "--triton", "--dir", str(tmp_path / "b"), str(bundle))
    assert imported.returncode == 0, imported.stderr
    assert _members(tmp_path / "b", key) == _members(a, key)
    assert _group(tmp_path / "b", key) is not None


def test_prune_removes_triton_files_and_a_pruned_group_is_not_served(triton_dir, tmp_path):
    a, key = _copy(triton_dir, tmp_path / "a")
    for path in (a / key).iterdir():
        os.utime(path, (1_000_000, 1_000_000))  # 1970: older than any age
    names = sorted(p.name for p in (a / key).iterdir())  # listed, not read: a read is a use (atime)
    dry = run_cli("prune", "--triton", "--dir", str(a), "--older-than", "1d")
    assert dry.returncode == 0 and sorted(p.name for p in (a / key).iterdir()) == names  # a dry run removes nothing
    done = run_cli("prune", "--triton", "--dir", str(a), "--older-than", "1d", "--yes")
    assert done.returncode == 0, done.stderr
    assert _members(a, key) == {} and _group(a, key) is None
    assert (a / key / "lock").exists() is (triton_dir / key / "lock").exists()  # Triton's own files are not entries


# -- the directory store itself ---------------------------------------------------------------------


def test_a_group_record_that_lands_before_its_members_becomes_triton_s_index_only_when_they_match(triton_dir, tmp_path):
    source = TritonDir(triton_dir)
    entries = {e.name: source.read_entry(e.name) for e in source.iter_entries()}
    (key,) = [p.name for p in triton_dir.iterdir()]
    target_root = tmp_path / "b"
    target = TritonDir(target_root)
    record = name_of(key, "__grp__" + META)
    target.write_entry(record, entries.pop(record))  # the record first: kept aside
    assert _group(target_root, key) is None
    cubin = name_of(key, "add_kernel.cubin")
    target.write_entry(cubin, frame(key, "add_kernel.cubin", b"\x7fELF another compile's cubin"))
    for name, payload in entries.items():
        if name != cubin:
            target.write_entry(name, payload)
    assert _group(target_root, key) is None  # every member here, one with other bytes: still no index
    target.write_entry(cubin, entries[cubin])
    group = _group(target_root, key)
    assert group is not None and _members(target_root, key) == _members(triton_dir, key)
    assert {p.name for p in (target_root / key).iterdir()} == {p.name for p in (triton_dir / key).iterdir()} - {"lock"}


def test_a_triton_directory_refuses_what_is_not_the_file_its_name_says(triton_dir, tmp_path):
    target = TritonDir(tmp_path / "b")
    key = "K" * 52
    with pytest.raises(EntryRejected, match="no frame"):
        target.write_entry(name_of(key, "x.cubin"), b"\x7fELF bare")
    with pytest.raises(EntryRejected, match="named otherwise"):
        target.write_entry(name_of(key, "x.cubin"), frame(key, "y.cubin", b"\x7fELF"))
    with pytest.raises(EntryRejected, match="lists no members"):
        target.write_entry(name_of(key, "__grp__x.json"), frame(key, "__grp__x.json", group_record(key, "__grp__x.json", {})))
    with pytest.raises(KeyError):
        target.read_entry(hashlib.sha256(b"absent").hexdigest())
    assert list(target.iter_entries()) == []


# -- issue 28 item 3: Triton use is visible -------------------------------------------------------


def test_ls_and_stats_triton_name_the_files_and_count_one_kernel(triton_dir, tmp_path):
    directory, key = _copy(triton_dir, tmp_path / "t")
    files = sorted(p.name for p in (directory / key).iterdir())
    env = {"TRITON_CACHE_DIR": str(directory)}
    listed = run_cli("ls", "--triton", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].startswith(f"kernel {key}  add_kernel  {len(files)} files")
    assert sorted(line.split()[-1] for line in lines[1:]) == files  # every file by its name, under its kernel
    shown = json.loads(run_cli("stats", "--triton", "--json", env=env).stdout)["local"]
    assert (shown["kernels"], shown["metadata"], shown["entries"]) == (1, len(files) - 1, len(files))


def test_stats_run_and_stats_triton_count_a_triton_run(tmp_path):
    import sys

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    env = {"TRITON_CACHE_MANAGER": "tiered_progcache.triton:TieredCacheManager",
           "TIERED_PROGCACHE_REMOTE": f"file://{bucket}", "TRITON_CACHE_DIR": str(tmp_path / "a")}  # fmt: skip
    script = str(Path(triton_support.__file__))

    def run(directory: str) -> dict:
        proc = run_cli("stats", "--run", "--json", "--", sys.executable, script, env={**env, "TRITON_CACHE_DIR": directory})
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout[proc.stdout.index("{\n"):])  # after the node's own one-line report

    first = run(str(tmp_path / "a"))  # compiles, uploads
    assert (first["tiers"]["triton-local"]["misses"], first["tiers"]["triton-remote"]["misses"]) == (1, 1)
    (key_dir,) = [p for p in (tmp_path / "a").iterdir() if p.is_dir()]  # beside it: stats.jsonl
    assert first["tiers"]["triton-remote"]["writes"] == len(os.listdir(key_dir))  # each member and the group record
    second = run(str(tmp_path / "b"))  # a fresh node: the remote answers
    assert (second["hits"], second["misses"]) == (1, 0)
    assert (second["tiers"]["triton-local"]["misses"], second["tiers"]["triton-remote"]["hits"]) == (1, 1)
    counted = json.loads(run_cli("stats", "--triton", "--json", env={**env, "TRITON_CACHE_DIR": str(tmp_path / "b")}).stdout)
    assert counted["local"]["cumulative"]["hits"] == {"triton-local": 0, "triton-remote": 1}
    assert counted["local"]["cumulative"]["lookups"] == 1 and counted["local"]["cumulative"]["reports"] == 1


def test_ls_triton_on_the_remote_names_the_files_and_groups_them_by_kernel(triton_dir, tmp_path):
    """Issue 28 item 3: the remote's listing shows what the local one shows (each file by name, under its kernel)."""
    directory, key = _copy(triton_dir, tmp_path / "t")
    files = sorted(p.name for p in (directory / key).iterdir())
    remote = tmp_path / "remote"
    remote.mkdir()
    url = f"file://{remote}"
    assert run_cli("push", "--triton", "--dir", str(directory), "--remote", url).returncode == 0
    listed = run_cli("ls", "--triton", "--remote", url)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].startswith(f"kernel {key}  add_kernel  {len(files)} files"), listed.stdout
    assert sorted(line.split()[-1] for line in lines[1:]) == files


def test_ls_triton_on_the_remote_believes_no_frame_under_another_entry_s_name(triton_dir, tmp_path):
    """A file moved under another entry name keeps its frame: the listing names it as unknown ('-')."""
    directory, key = _copy(triton_dir, tmp_path / "t")
    remote = tmp_path / "remote"
    remote.mkdir()
    url = f"file://{remote}"
    assert run_cli("push", "--triton", "--dir", str(directory), "--remote", url).returncode == 0
    stored = sorted(p for p in remote.rglob("*") if p.is_file() and len(p.parent.name + p.name) == 64)
    moved = stored[0]
    forged = moved.parent / ("0" * (64 - len(moved.parent.name)))
    forged.write_bytes(moved.read_bytes())
    listed = run_cli("ls", "--triton", "--remote", url)
    assert listed.returncode == 0, listed.stderr
    (row,) = [line.split() for line in listed.stdout.splitlines() if line.split()[0] == moved.parent.name + forged.name]
    assert row[-1] == "-"
