"""read_in_batches: the one place bulk readers (ls's classify, manifests) split names into the store's batches."""

from __future__ import annotations

from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name, read_in_batches


def test_reads_in_batches_go_transfer_batch_names_at_a_time(tmp_path):
    """What ls and classify promise: one read_many per ``transfer_batch`` names, every name once, in order."""
    store = RemoteProgramCache.from_url((tmp_path / "r").as_uri(), strict=True, create_root=True, transfer_concurrency=3)
    names = [entry_name(b"k%d" % n) for n in range(7)]
    for name in names[:5]:
        store.write_entry(name, b"x")
    chunks = [(chunk, sorted(got.hits), sorted(got.missing)) for chunk, got in read_in_batches(store, names)]
    assert [len(c) for c, _, _ in chunks] == [3, 3, 1] and [n for c, _, _ in chunks for n in c] == names
    assert [h for _, h, _ in chunks] == [sorted(names[:3]), sorted(names[3:5]), []]
    assert [m for _, _, m in chunks] == [[], [names[5]], [names[6]]]
    store.close()
