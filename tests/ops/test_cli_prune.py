"""prune(): one code path over the EntryStore protocol, run in process on the local directory and on a file:// remote.

The command's output for the same runs is checked in test_cli.py (local) and test_cli_remote.py (S3).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.ops.prune import plan_prune, prune
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import EntryStore, StoredEntry, entry_name

DAY = 86400.0
AGES = {entry_name(b"old"): 40 * DAY, entry_name(b"mid"): 10 * DAY, entry_name(b"new"): 0.0}


def _local(root: Path) -> EntryStore:
    return LocalDir(root)


def _file_remote(root: Path) -> EntryStore:
    return RemoteProgramCache.from_url(root.as_uri(), strict=True)


@pytest.fixture(params=[_local, _file_remote], ids=["local", "file-remote"])
def store(request, tmp_path) -> Iterator[EntryStore]:
    """Three 1000-byte payloads, 40, 10 and 0 days old. Both stores keep entries at ``<root>/entries/xx/yy...``."""
    root = tmp_path / "store"
    root.mkdir()
    made = request.param(root)
    now = time.time()
    for name, age in AGES.items():
        made.write_entry(name, bytes(1000))
        os.utime(root / "entries" / name[:2] / name[2:], (now - age, now - age))
    yield made
    if isinstance(made, RemoteProgramCache):
        made.close()


def test_prune_plans_and_removes_the_same_way_on_every_store(store):
    names = {e.name for e in store.iter_entries()}
    assert names == set(AGES)

    dry = prune(store, older_than=30 * DAY)
    assert dry.dry_run and [c.entry.name for c in dry.doomed] == [entry_name(b"old")]
    assert dry.listed == 3 and dry.doomed[0].age == pytest.approx(40 * DAY, abs=60)
    assert {e.name for e in store.iter_entries()} == names  # a dry run deletes nothing

    # Room for one entry (of any stored size): the two oldest go, oldest first.
    one = max(e.size for e in store.iter_entries())
    capped = prune(store, max_bytes=one)
    assert [c.entry.name for c in capped.doomed] == [entry_name(b"old"), entry_name(b"mid")]
    assert capped.doomed_bytes == capped.listed_bytes - one

    done = prune(store, older_than=30 * DAY, dry_run=False)
    assert (done.removed, done.changed, done.failed) == (1, 0, ())
    assert {e.name for e in store.iter_entries()} == names - {entry_name(b"old")}


def test_prune_leaves_an_entry_that_went_since_it_was_listed(store, monkeypatch):
    listed = list(store.iter_entries())
    for entry in listed:  # someone else deletes every entry right after the listing
        store.delete_entry(entry.name)
    monkeypatch.setattr(store, "iter_entries", lambda: iter(listed))
    report = prune(store, older_than=0.0, now=time.time() + DAY, dry_run=False)
    assert (report.removed, report.changed, report.failed) == (0, 3, ())


def test_prune_leaves_an_entry_a_writer_replaced_since_it_was_listed(store, monkeypatch):
    """The stat guard: an entry rewritten after the listing (a fresh compile landed) is not pruned."""
    listed = list(store.iter_entries())
    for entry in listed:
        store.write_entry(entry.name, bytes(1000))  # replaced: staged and renamed, a new file
    monkeypatch.setattr(store, "iter_entries", lambda: iter(listed))
    report = prune(store, older_than=0.0, now=time.time() + DAY, dry_run=False)
    assert (report.removed, report.changed, report.failed) == (0, 3, ())
    monkeypatch.undo()
    assert {e.name for e in store.iter_entries()} == set(AGES)


def test_prune_reports_each_failed_delete_and_goes_on(store, monkeypatch):
    delete_listed = store.delete_listed

    def failing_for_old(entry: StoredEntry) -> bool:
        if entry.name == entry_name(b"old"):
            raise PermissionError("denied")
        return delete_listed(entry)

    monkeypatch.setattr(store, "delete_listed", failing_for_old)
    report = prune(store, max_bytes=1, dry_run=False)
    assert report.removed == 2 and report.failed == ((entry_name(b"old"), "denied"),)
    assert [e.name for e in store.iter_entries()] == [entry_name(b"old")]


def test_a_read_only_store_is_refused_before_anything_is_listed(tmp_path):
    (tmp_path / "ro").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "ro").as_uri(), read_only=True, strict=True)
    assert prune(remote, older_than=0.0).dry_run  # a dry run is fine
    with pytest.raises(PermissionError, match="read-only"):
        prune(remote, older_than=0.0, dry_run=False)
    remote.close()


def test_plan_prune_puts_entries_of_unknown_age_last():
    entries = [StoredEntry("a" * 64, 10, None), StoredEntry("b" * 64, 10, 100.0), StoredEntry("c" * 64, 10, 50.0)]
    doomed = plan_prune(entries, now=200.0, older_than=60.0, max_bytes=5)
    assert [(c.entry.name[0], c.age) for c in doomed] == [("c", 150.0), ("b", 100.0), ("a", None)]
    assert plan_prune(entries, now=200.0, older_than=1000.0) == []


def test_a_pruned_kernel_takes_its_manifest_and_a_kept_one_keeps_it(store, tmp_path):
    """Issue 28 item 7: a manifest read more recently than its kernel (or uploaded after it) goes with it."""
    from tiered_progcache.compiling.manifest import manifest_name

    root = tmp_path / "store"
    now = time.time()
    for name, age in AGES.items():
        manifest = manifest_name(name)
        store.write_entry(manifest, b"{}" * 50)
        os.utime(root / "entries" / manifest[:2] / manifest[2:], (now - 60, now - 60))  # read a minute ago
    old, mid, new = entry_name(b"old"), entry_name(b"mid"), entry_name(b"new")
    aged = prune(store, older_than=30 * DAY, dry_run=False)
    assert [c.entry.name for c in aged.doomed] == [old, manifest_name(old)] and aged.removed == 2
    sizes = {e.name: e.size for e in store.iter_entries()}
    capped = prune(store, max_bytes=sizes[new] + sizes[manifest_name(new)], dry_run=False)
    assert [c.entry.name for c in capped.doomed] == [mid, manifest_name(mid)] and capped.removed == 2
    assert {e.name for e in store.iter_entries()} == {new, manifest_name(new)}


def test_a_pruned_kernel_takes_its_symbol_map_and_manifest_and_the_cap_counts_all_three(store, tmp_path):
    """A name-expression kernel is three entries (binary, manifest, symbol map): one unit to plan and delete."""
    from tiered_progcache.compiling.manifest import manifest_name
    from tiered_progcache.compiling.symbols import symbols_name

    root = tmp_path / "store"
    now = time.time()
    old, mid, new = entry_name(b"old"), entry_name(b"mid"), entry_name(b"new")
    for name in (old, mid, new):
        for companion in (manifest_name(name), symbols_name(name)):
            store.write_entry(companion, b"{}" * 50)
            os.utime(root / "entries" / companion[:2] / companion[2:], (now - 60, now - 60))
    sizes = {e.name: e.size for e in store.iter_entries()}
    unit = {name: sizes[name] + sizes[manifest_name(name)] + sizes[symbols_name(name)] for name in (old, mid, new)}
    # Room for exactly the two youngest units: the oldest goes whole, though its map is a minute old.
    capped = prune(store, max_bytes=unit[mid] + unit[new], dry_run=False)
    assert [c.entry.name for c in capped.doomed] == [old, manifest_name(old), symbols_name(old)]
    assert capped.removed == 3
    # One byte less than two units: the next oldest goes too (the cap counts all three members).
    capped = prune(store, max_bytes=unit[mid] + unit[new] - 1, dry_run=False)
    assert [c.entry.name for c in capped.doomed] == [mid, manifest_name(mid), symbols_name(mid)]
    assert {e.name for e in store.iter_entries()} == {new, manifest_name(new), symbols_name(new)}


def test_a_symbol_map_is_named_from_its_kernels_name_alone():
    from tiered_progcache.compiling.symbols import symbols_key, symbols_name

    assert symbols_name(entry_name(b"k")) == entry_name(symbols_key(b"k"))
    assert symbols_name(entry_name(b"k")) != symbols_name(entry_name(b"j"))
    with pytest.raises(ValueError, match="not an entry name"):
        symbols_name("k")

