"""The contracts every ``ProgramCacheResource`` and every ``EntryStore`` pass, written once (zarr's ``StoreTests`` style).

Subclass :class:`ProgramCacheContract` in a pytest module and provide a ``cache``
fixture that yields a fresh, empty resource; an entry store is checked by key as
the one tier of a chain (:func:`keyed_chain`)::

    class TestMyTier(ProgramCacheContract):
        @pytest.fixture
        def cache(self, tmp_path):
            with keyed_chain(MyStore(tmp_path)) as c:
                yield c

Likewise :class:`EntryStoreTests` with a ``store`` fixture yielding a fresh, empty,
writable :class:`~tiered_progcache.stores.store.EntryStore`, and where the store has them a
``back_door`` fixture (a :class:`BackDoor`: the store's medium seen without the store,
so a check does not take the store's word for what it holds) and a ``read_only_store``
fixture (the same place opened read-only). Without them those checks skip, naming the
fixture. :class:`LeaseStoreTests` checks a shared store's lease namespace
(:meth:`~tiered_progcache.stores.store.EntryStore.leases`) with the same ``store`` and
``read_only_store`` fixtures.
"""

from __future__ import annotations

import abc
import hashlib
import threading

import pytest
from cuda.core import ObjectCode

from ..chain.policy import TierPolicy
from ..chain.tiered import TieredProgramCache
from ..errors import EntryRejected
from ..cluster.lease import LeaseInfo, RemoteLease
from ..stores.store import BatchWrite, EntryStore, LeaseStore, entry_name

__all__ = ["BackDoor", "EntryStoreTests", "LeaseStoreTests", "ProgramCacheContract", "keyed_chain"]


def _key(n: int) -> bytes:
    """A key shaped like ``make_program_cache_key``'s (32 bytes), distinct per ``n``."""
    return hashlib.sha256(f"contract-key-{n}".encode()).digest()


def _payload(n: int, size: int = 3000) -> bytes:
    block = hashlib.sha256(f"contract-payload-{n}".encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def keyed_chain(store: EntryStore) -> TieredProgramCache:
    """``store`` as the one tier of a chain, written at once and not shared, so ``len()`` and ``clear()``
    reach it: how :class:`ProgramCacheContract` checks an entry store by key (the chain's door is the
    mapping API; the store sees ``read_key``, ``write_key``, ``delete_key``, ``count``, ``clear``)."""
    return TieredProgramCache(tiers=[(store, TierPolicy("store"))])


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


class BackDoor(abc.ABC):
    """A store's medium seen without the store: raw files, a raw fsspec filesystem, a raw Redis client.

    Each backend's contract test writes one from what the layout documents
    (docs/remote-format.md), not from the store's own helpers, so a store that lies
    about what it wrote, leaves debris, or caches a listing is caught.
    """

    @abc.abstractmethod
    def read(self, name: str) -> bytes | None:
        """The bytes the medium holds where entry ``name`` lives (an envelope on a shared store); None if none."""

    @abc.abstractmethod
    def write(self, name: str, raw: bytes) -> None:
        """Put ``raw`` where entry ``name`` lives, as another writer (or an attacker) would."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove what the medium holds for entry ``name``."""

    @abc.abstractmethod
    def objects(self) -> list[str]:
        """Every object under the store's root (entries, staged files, anything else), as paths or keys."""


class EntryStoreTests:
    """Behaviour shared by every :class:`~tiered_progcache.stores.store.EntryStore`.

    Needs a ``store`` fixture (empty, writable); ``back_door`` (a :class:`BackDoor` on
    the store's medium) and ``read_only_store`` (the same place opened read-only) where
    the store has them.
    """

    @pytest.fixture
    def back_door(self) -> BackDoor:
        pytest.skip("no back door: give the suite a `back_door` fixture (a BackDoor on the store's medium)")

    @pytest.fixture
    def read_only_store(self) -> EntryStore:
        pytest.skip("no read-only mode: give the suite a `read_only_store` fixture (the store's place, read-only)")

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

    # -- through the back door: what the medium really holds ---------------------------------

    def _payload_of(self, store, name: str, raw: bytes) -> bytes:
        """What ``raw`` (as the medium holds it) carries: itself on a local store, the opened envelope on a shared one."""
        return store.open_record(name, raw) if store.shared else raw

    def test_a_write_is_really_there(self, store, back_door):
        name = entry_name(_key(30))
        store.write_entry(name, _payload(30))
        raw = back_door.read(name)
        assert raw is not None and self._payload_of(store, name, raw) == _payload(30)
        (listed,) = store.iter_entries()
        assert listed.size == len(raw)  # the listing reports what is stored, envelope and all

    def test_a_refused_create_leaves_the_bytes_alone(self, store, back_door):
        name = entry_name(_key(31))
        assert store.create_entry(name, _payload(31)) is True
        before = back_door.read(name)
        assert before is not None and self._payload_of(store, name, before) == _payload(31)
        assert store.create_entry(name, _payload(32)) is False
        assert back_door.read(name) == before

    def test_a_delete_really_removes_the_bytes(self, store, back_door):
        gone, kept, listed_gone = (entry_name(_key(n)) for n in (33, 34, 35))
        for name in (gone, kept, listed_gone):
            store.write_entry(name, _payload(33, 200))
        store.delete_entry(gone)
        (entry,) = [e for e in store.iter_entries() if e.name == listed_gone]
        assert store.delete_listed(entry) is True
        assert back_door.read(gone) is None and back_door.read(listed_gone) is None
        assert back_door.read(kept) is not None

    def test_no_stray_objects_remain(self, store, back_door):
        """Writes, overwrites, refused creates and deletes leave exactly one object per live entry (no staged debris)."""
        names = [entry_name(_key(n)) for n in range(40, 46)]
        for n, name in enumerate(names):
            store.write_entry(name, _payload(n, 300))
        store.write_entry(names[0], _payload(99, 100))  # overwritten
        assert store.create_entry(names[1], b"refused") is False
        assert store.create_entry(entry_name(_key(46)), b"created") is True
        store.delete_entry(names[2])
        assert store.write_many({names[3]: b"again", entry_name(_key(47)): b"new"}) == BatchWrite(
            frozenset({names[3], entry_name(_key(47))}))
        live = {e.name for e in store.iter_entries()}
        assert len(live) == 7
        assert len(back_door.objects()) == len(live), back_door.objects()

    def test_the_listing_and_reads_take_nothing_from_a_cache(self, store, back_door):
        a, b, planted = (entry_name(_key(n)) for n in (50, 51, 52))
        store.write_entry(a, _payload(50))
        store.write_entry(b, _payload(51))
        assert {e.name for e in store.iter_entries()} == {a, b}
        back_door.delete(a)
        assert {e.name for e in store.iter_entries()} == {b}
        with pytest.raises(KeyError):
            store.read_entry(a)
        raw_b = back_door.read(b)
        assert raw_b is not None
        if store.shared:  # an envelope is bound to its name: planted under another, it is refused
            back_door.write(planted, raw_b)
            with pytest.raises(EntryRejected):
                store.read_entry(planted)
        else:  # a local store keeps raw payloads: what is planted is what is read, and listed
            back_door.write(planted, raw_b)
            assert store.read_entry(planted) == _payload(51)
        assert {e.name for e in store.iter_entries()} == {b, planted}

    def test_bytes_altered_behind_the_store_are_never_returned(self, store, back_door):
        if not store.shared:
            pytest.skip("a local store keeps cuda-core's raw payloads: no digest to check a changed byte against")
        name = entry_name(_key(53))
        store.write_entry(name, _payload(53))
        raw = back_door.read(name)
        assert raw is not None
        for altered in (raw[:-1] + bytes([raw[-1] ^ 1]), raw[: len(raw) // 2], raw + b"trailing"):
            back_door.write(name, altered)
            with pytest.raises(EntryRejected):
                store.read_entry(name)
            assert isinstance(store.verify_entry(name), str)
        back_door.write(name, raw)
        assert store.read_entry(name) == _payload(53)

    def test_a_batch_read_keeps_hits_misses_and_errors_apart(self, store, back_door):
        """``read_many`` files each name once: a payload in ``hits``, an absent name in ``missing``,
        any other failure (a refused envelope) in ``errors``; never an exception among the payloads."""
        hit, absent, bad = (entry_name(_key(n)) for n in (54, 55, 56))
        store.write_entry(hit, _payload(54))
        if store.shared:  # an envelope altered behind the store is refused
            store.write_entry(bad, _payload(56))
            raw = back_door.read(bad)
            assert raw is not None
            back_door.write(bad, raw[:-1] + bytes([raw[-1] ^ 1]))
            refused: type[Exception] = EntryRejected
        else:  # a store without an envelope reads back whatever is there; a name it refuses fails instead
            bad = "not-an-entry-name"
            refused = ValueError
        got = store.read_many([hit, absent, bad])
        assert got.hits == {hit: _payload(54)}
        assert got.missing == {absent}
        assert set(got.errors) == got.failed == {bad} and isinstance(got.errors[bad], refused)
        assert all(isinstance(payload, bytes) for payload in got.hits.values())

    # -- read-only: every write refused, nothing changed -------------------------------------

    def test_read_only_refuses_every_write_and_changes_nothing(self, store, read_only_store, request):
        try:
            back_door: BackDoor | None = request.getfixturevalue("back_door")
        except pytest.skip.Exception:
            back_door = None  # the store's own listing still shows nothing changed
        kept, new = entry_name(_key(60)), entry_name(_key(61))
        store.write_entry(kept, _payload(60))
        listed = list(store.iter_entries())
        if back_door is not None:
            objects, raw = sorted(back_door.objects()), back_door.read(kept)
        ro = read_only_store
        assert ro.read_only is True
        assert ro.read_entry(kept) == _payload(60)  # reads work
        (entry,) = ro.iter_entries()
        for attempt in (
            lambda: ro.write_entry(kept, b"over"),
            lambda: ro.write_entry(new, b"new"),
            lambda: ro.create_entry(new, b"new"),
            lambda: ro.create_entry(kept, b"over"),
            lambda: ro.delete_entry(kept),
            lambda: ro.delete_listed(entry),
            lambda: ro.delete_entries([entry]),
            lambda: ro.write_many({new: b"new"}),
        ):
            with pytest.raises(PermissionError, match="read-only"):
                attempt()
        assert ro.leases() is None  # no lease either: a read-only node never uploads
        assert ro.sweep_staged(older_than=0) == 0
        assert list(store.iter_entries()) == listed and store.read_entry(kept) == _payload(60)
        if back_door is not None:
            assert sorted(back_door.objects()) == objects and back_door.read(kept) == raw
            assert back_door.read(new) is None


class LeaseStoreTests:
    """Behaviour of the lease namespace every shared store with leases offers (:class:`~tiered_progcache.stores.store.LeaseStore`).

    Needs a ``store`` fixture (a fresh, writable store whose ``leases()`` is not None),
    and ``read_only_store`` (the same place, read-only) for the refusal. Leases here are
    checked both as objects (create-if-absent, read, replace, delete) and as what
    :class:`~tiered_progcache.cluster.lease.RemoteLease` builds on them, with a clock the test
    steps (a lease's expiry is judged by the holder's wall clock, never by waiting).
    """

    TTL_S = 600.0  # long enough that no store expires a lease by itself while a test runs

    @pytest.fixture
    def read_only_store(self) -> EntryStore:
        pytest.skip("no read-only mode: give the suite a `read_only_store` fixture (the store's place, read-only)")

    @pytest.fixture
    def leases(self, store) -> LeaseStore:
        leases = store.leases()
        assert isinstance(leases, LeaseStore), "a shared store with leases returns a LeaseStore from leases()"
        return leases

    def test_describes_itself(self, leases):
        assert isinstance(leases.location, str) and leases.location
        assert leases.atomic_create is True  # every lease store worth a cluster lease; False means none is taken

    def test_read_of_an_absent_lease_is_none(self, leases):
        assert leases.read("absent") is None

    def test_create_only_if_absent(self, leases):
        assert leases.create("L1", b"first", self.TTL_S) is True
        assert leases.create("L1", b"second", self.TTL_S) is False
        assert leases.read("L1") == b"first"

    def test_replace_is_a_renewal(self, leases):
        assert leases.create("L2", b"taken", self.TTL_S) is True
        leases.replace("L2", b"renewed", self.TTL_S)
        assert leases.read("L2") == b"renewed"
        assert leases.create("L2", b"other", self.TTL_S) is False  # still held

    def test_delete_releases_and_is_quiet_when_gone(self, leases):
        assert leases.create("L3", b"taken", self.TTL_S) is True
        assert leases.create("L4", b"kept", self.TTL_S) is True
        leases.delete("L3")
        leases.delete("L3")  # already gone: no error
        leases.delete("never-there")
        assert leases.read("L3") is None and leases.read("L4") == b"kept"
        assert leases.create("L3", b"again", self.TTL_S) is True

    def test_documents_are_opaque_bytes(self, leases):
        document = bytes(range(256)) * 16  # NULs, high bytes, 4 KiB: larger than any lease document
        assert leases.create("L5", document, self.TTL_S) is True
        assert leases.read("L5") == document

    @pytest.mark.parametrize("bad", ["", None, 7])
    def test_bad_names_are_a_valueerror(self, leases, bad):
        for attempt in (lambda: leases.create(bad, b"x", self.TTL_S), lambda: leases.read(bad),
                        lambda: leases.replace(bad, b"x", self.TTL_S), lambda: leases.delete(bad)):
            with pytest.raises(ValueError):
                attempt()

    def test_a_lease_is_not_an_entry(self, store, leases):
        name = entry_name(_key(70))  # a lease is named after the entry it guards
        assert leases.create(name, b"lease", self.TTL_S) is True
        assert list(store.iter_entries()) == []
        with pytest.raises(KeyError):
            store.read_entry(name)
        store.write_entry(name, _payload(70))
        assert leases.read(name) == b"lease"
        store.delete_entry(name)
        assert leases.read(name) == b"lease"

    def test_one_of_many_racing_creates_wins(self, leases):
        racers = 8
        barrier = threading.Barrier(racers)
        won: list[bytes] = []

        def race(n: int) -> None:
            document = f"racer-{n}".encode()
            barrier.wait(30)
            if leases.create("contended", document, self.TTL_S):
                won.append(document)

        threads = [threading.Thread(target=race, args=(n,)) for n in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(won) == 1, won
        assert leases.read("contended") == won[0]

    def test_a_read_only_store_offers_no_leases(self, read_only_store):
        assert read_only_store.read_only is True
        assert read_only_store.leases() is None

    # -- a RemoteLease on this store, on a clock the test steps ----------------------------------

    def test_a_held_lease_keeps_others_out_and_its_release_lets_them_in(self, leases):
        clock = _SteppedWallClock()
        name = entry_name(_key(71))
        holder, other = (RemoteLease(leases, name, self.TTL_S, clock=clock) for _ in range(2))
        try:
            assert holder.try_acquire() is True
            assert other.try_acquire() is False
            info = other.read()
            assert isinstance(info, LeaseInfo) and info.token == holder.token
            assert info.expires_at == clock.now + self.TTL_S and not info.expired(clock.now)
            holder.release()
            assert leases.read(name) is None
            assert other.try_acquire() is True
        finally:
            holder.release()
            other.release()
        assert leases.read(name) is None

    def test_renewal_moves_the_expiry_and_an_expired_lease_is_broken_once(self, leases):
        clock = _SteppedWallClock()
        name = entry_name(_key(72))
        holder = RemoteLease(leases, name, self.TTL_S, clock=clock)
        waiters = [RemoteLease(leases, name, self.TTL_S, clock=clock) for _ in range(2)]
        try:
            assert holder.try_acquire() is True
            clock.now += self.TTL_S * 0.9
            assert holder.renew() is True
            renewed = waiters[0].read()
            assert isinstance(renewed, LeaseInfo) and renewed.expires_at == clock.now + self.TTL_S
            clock.now += self.TTL_S * 0.9  # past the first expiry, within the renewed one
            assert not renewed.expired(clock.now)
            clock.now += self.TTL_S  # the holder stopped renewing: expired on the holder's clock
            assert renewed.expired(clock.now)
            assert waiters[0].break_if_unchanged(renewed.raw) is True
            assert waiters[1].break_if_unchanged(renewed.raw) is False  # already broken: nothing to do
            assert waiters[1].try_acquire() is True
            assert holder.renew() is False  # taken over: the old holder learns it
            holder.release()  # and never deletes the new holder's lease
            taken = waiters[0].read()
            assert isinstance(taken, LeaseInfo) and taken.token == waiters[1].token
        finally:
            for lease in (holder, *waiters):
                lease.release()
        assert leases.read(name) is None


class _SteppedWallClock:
    """A wall clock for :class:`RemoteLease` that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now
