"""The contracts every ``ProgramCacheResource`` and every ``EntryStore`` pass, written once (zarr's ``StoreTests`` style).

Subclass :class:`ProgramCacheContract` in a pytest module and provide a ``cache``
fixture that yields a fresh, empty resource::

    class TestMyTier(ProgramCacheContract):
        @pytest.fixture
        def cache(self, tmp_path):
            with MyTier(tmp_path) as c:
                yield c

Likewise :class:`EntryStoreTests` with a ``store`` fixture yielding a fresh, empty,
writable :class:`~tiered_progcache.store.EntryStore`.
"""

from __future__ import annotations

import hashlib

import pytest
from cuda.core import ObjectCode

from ..store import entry_name

__all__ = ["EntryStoreTests", "ProgramCacheContract"]


def _key(n: int) -> bytes:
    """A key shaped like ``make_program_cache_key``'s (32 bytes), distinct per ``n``."""
    return hashlib.sha256(f"contract-key-{n}".encode()).digest()


def _payload(n: int, size: int = 3000) -> bytes:
    block = hashlib.sha256(f"contract-payload-{n}".encode()).digest()
    return (block * (size // len(block) + 1))[:size]


class ProgramCacheContract:
    """Behaviour shared by every tier and by the chain. Needs a ``cache`` fixture."""

    def test_miss_returns_none(self, cache):
        assert cache.get(_key(0)) is None
        assert cache.get(_key(0), b"fallback") == b"fallback"

    def test_getitem_miss_raises_keyerror(self, cache):
        with pytest.raises(KeyError):
            cache[_key(0)]

    @pytest.mark.parametrize("form", ["bytes", "bytearray", "memoryview"])
    def test_roundtrip_bytes_like(self, cache, form):
        data = _payload(1)
        value = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}[form]
        cache[_key(1)] = value
        got = cache.get(_key(1))
        assert type(got) is bytes
        assert got == data

    def test_roundtrip_objectcode_bytes(self, cache):
        data = _payload(2)
        cache[_key(2)] = ObjectCode.from_cubin(data)
        assert cache.get(_key(2)) == data

    def test_roundtrip_objectcode_path(self, cache, tmp_path):
        data = _payload(3)
        cubin = tmp_path / "kernel.cubin"
        cubin.write_bytes(data)
        cache[_key(3)] = ObjectCode.from_cubin(str(cubin))
        cubin.unlink()  # the entry holds the bytes, not the path
        assert cache.get(_key(3)) == data

    def test_empty_payload_roundtrips(self, cache):
        cache[_key(4)] = b""
        assert cache.get(_key(4)) == b""

    def test_large_payload_roundtrips(self, cache):
        data = _payload(5, size=3 << 20)
        cache[_key(5)] = data
        assert cache.get(_key(5)) == data

    def test_str_and_bytes_keys_alias(self, cache):
        cache["kernel-α"] = b"one"
        assert cache.get("kernel-α".encode()) == b"one"
        cache["kernel-α".encode()] = b"two"
        assert cache.get("kernel-α") == b"two"

    def test_overwrite_replaces(self, cache):
        cache[_key(6)] = b"old"
        cache[_key(6)] = b"new"
        assert cache.get(_key(6)) == b"new"

    def test_keys_do_not_collide(self, cache):
        for n in range(10, 16):
            cache[_key(n)] = _payload(n, 100)
        for n in range(10, 16):
            assert cache.get(_key(n)) == _payload(n, 100)

    def test_delete(self, cache):
        cache[_key(7)] = b"x"
        del cache[_key(7)]
        assert cache.get(_key(7)) is None

    def test_delete_missing_raises_keyerror(self, cache):
        with pytest.raises(KeyError):
            del cache[_key(8)]

    def test_len_counts_entries(self, cache):
        assert len(cache) == 0
        for n in range(3):
            cache[_key(n)] = _payload(n, 50)
        cache[_key(0)] = b"overwritten"
        assert len(cache) == 3

    def test_clear(self, cache):
        for n in range(3):
            cache[_key(n)] = _payload(n, 50)
        cache.clear()
        assert len(cache) == 0
        assert all(cache.get(_key(n)) is None for n in range(3))
        cache[_key(0)] = b"after clear"
        assert cache.get(_key(0)) == b"after clear"

    def test_update_with_mapping(self, cache):
        cache.update({_key(20): b"a", "k21": bytearray(b"b")})
        assert cache.get(_key(20)) == b"a"
        assert cache.get(b"k21") == b"b"

    def test_update_with_pairs(self, cache):
        cache.update(iter([(_key(22), b"c"), ("k23", memoryview(b"d"))]))
        assert cache.get(_key(22)) == b"c"
        assert cache.get("k23") == b"d"

    @pytest.mark.parametrize("bad_key", [1, 2.5, None, ("k",), object()])
    def test_bad_key_type_raises_typeerror(self, cache, bad_key):
        with pytest.raises(TypeError):
            cache[bad_key] = b"x"
        with pytest.raises(TypeError):
            cache.get(bad_key)

    @pytest.mark.parametrize("bad_value", ["a string", 123, None, [1, 2], object()])
    def test_bad_value_type_raises_typeerror(self, cache, bad_value):
        with pytest.raises(TypeError):
            cache[_key(9)] = bad_value
        assert cache.get(_key(9)) is None

    def test_context_manager_returns_cache(self, cache):
        with cache as entered:
            assert entered is cache


class EntryStoreTests:
    """Behaviour shared by every :class:`~tiered_progcache.store.EntryStore`. Needs a ``store`` fixture (empty, writable)."""

    def test_describes_itself(self, store):
        assert isinstance(store.location, str) and store.location
        assert store.read_only is False
        assert isinstance(store.shared, bool) and isinstance(store.atomic_create, bool)
        assert store.available is True
        assert store.max_entry_bytes > 0

    def test_read_miss_is_keyerror(self, store):
        with pytest.raises(KeyError):
            store.read_entry(entry_name(_key(0)))

    def test_write_read_roundtrip(self, store):
        name = entry_name(_key(1))
        store.write_entry(name, _payload(1))
        assert store.read_entry(name) == _payload(1)
        store.write_entry(name, _payload(2, 100))
        assert store.read_entry(name) == _payload(2, 100)

    def test_create_entry_only_if_absent(self, store):
        name = entry_name(_key(2))
        assert store.create_entry(name, _payload(2)) is True
        assert store.create_entry(name, _payload(3)) is False
        assert store.read_entry(name) == _payload(2)

    def test_delete_entry(self, store):
        name = entry_name(_key(3))
        store.write_entry(name, b"x")
        store.delete_entry(name)
        with pytest.raises(KeyError):
            store.read_entry(name)
        with pytest.raises(KeyError):
            store.delete_entry(name)

    def test_iter_entries_lists_what_was_written_with_sizes(self, store):
        assert list(store.iter_entries()) == []
        written = {entry_name(_key(n)): _payload(n, 500 + n) for n in range(4)}
        for name, payload in written.items():
            store.write_entry(name, payload)
        listed = {entry.name: entry for entry in store.iter_entries()}
        assert set(listed) == set(written)
        for name, entry in listed.items():
            assert entry.size >= len(written[name])  # a shared store keeps an envelope around the payload
            if not store.shared:
                assert entry.size == len(written[name])

    def test_delete_listed(self, store):
        name = entry_name(_key(4))
        store.write_entry(name, _payload(4))
        (entry,) = store.iter_entries()
        assert store.delete_listed(entry) is True
        assert list(store.iter_entries()) == []
        assert store.delete_listed(entry) is False  # gone since listed

    def test_verify_entry(self, store):
        assert store.verify_entry(entry_name(_key(5))) == "missing"

    @pytest.mark.parametrize("bad", ["../../etc/passwd", "AB" * 32, "ab" * 31, "", "ab" * 32 + "/"])
    def test_names_are_validated(self, store, bad):
        for attempt in (
            lambda: store.read_entry(bad),
            lambda: store.write_entry(bad, b"x"),
            lambda: store.create_entry(bad, b"x"),
            lambda: store.delete_entry(bad),
            lambda: store.verify_entry(bad),
        ):
            with pytest.raises(ValueError):
                attempt()
        assert list(store.iter_entries()) == []
