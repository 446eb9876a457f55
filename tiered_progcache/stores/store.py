"""The declared interface between the cache's parts: stores of entries addressed by name.

cuda-core's tiers are addressed by *key*; everything that works on a whole cache
(warm, push, prune, verify, ls, single-flight leases) sees entry *names* instead,
``sha256(key)`` as 64 lowercase hex digits, since that is all a directory or bucket
listing gives. :class:`EntryStore` is that view. The local directory
(:class:`~tiered_progcache.stores.localdir.LocalDir`) and every shared tier implement it;
callers ask a store what it can do through these members and never probe attributes.

:class:`LeaseStore` is the small-object namespace a shared store offers for the
cluster lease (``<root>/leases/<name>``), with a declared ``atomic_create``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _cudacore
from .envelope import MAX_ENTRY_BYTES
from ..errors import EntryRejected

__all__ = [
    "ENTRY_NAMESPACES",
    "ENTRY_NAME_LENGTH",
    "STALE_STAGED_AGE_S",
    "BatchRead",
    "BatchWrite",
    "EntryStore",
    "IndexedDirStore",
    "LeaseStore",
    "NodeDirStore",
    "StoredEntry",
    "check_entry_name",
    "check_namespace",
    "companion_keys",
    "companion_keys_of_name",
    "entry_name",
    "is_entry_name",
    "read_in_batches",
    "manifest_name",
]

ENTRY_NAME_LENGTH = 64
#: Where a shared store keeps entries: ``entries`` (the program cache's) or ``triton``
#: (Triton's files, :mod:`tiered_progcache.triton`) or ``cupy`` (CuPy's, :mod:`tiered_progcache.cupy`), side by side.
ENTRY_NAMESPACES = ("entries", "triton", "cupy")
#: Age after which a file staged for an upload is debris of a writer that died (cuda-core's own threshold).
STALE_STAGED_AGE_S = 3600.0
_HEX = frozenset("0123456789abcdef")


def entry_name(key: bytes | str) -> str:
    """The 64-hex name cuda-core's file tier (and every store here) keeps ``key`` under."""
    if isinstance(key, str):
        key = key.encode("utf-8")
    return hashlib.sha256(key, usedforsecurity=False).hexdigest()


def is_entry_name(name: object) -> bool:
    """True for 64 lowercase hex digits: the only names a store reads, writes or lists."""
    return isinstance(name, str) and len(name) == ENTRY_NAME_LENGTH and _HEX.issuperset(name)


def check_entry_name(name: object) -> str:
    """``name`` if it is an entry name, else ``ValueError`` saying what one looks like."""
    if not is_entry_name(name):
        raise ValueError(f"not an entry name (64 lowercase hex digits, as ls prints): {name!r}")
    assert isinstance(name, str)
    return name


def manifest_name(name: str) -> str:
    """The entry name of the manifest of entry ``name``: derived from the name alone, as a listing gives it.

    Pure; :mod:`tiered_progcache.compiling.manifest` (which writes manifests, and re-exports this) says what a
    manifest is. ``manifest_name(entry_name(key)) == entry_name(manifest.manifest_key(key))``.
    """
    if not is_entry_name(name):
        raise ValueError(f"not an entry name (64 lowercase hex digits, as ls prints): {name!r}")
    return entry_name(companion_keys_of_name(name)[0])


def companion_keys(key: bytes) -> tuple[bytes, bytes]:
    """The cache keys of entry ``key``'s manifest and symbol map: derived from its name, as they are stored.

    ``compile()`` stores the symbol map before the entry and the manifest right after it.
    """
    return companion_keys_of_name(entry_name(key))


def companion_keys_of_name(name: str) -> tuple[bytes, bytes]:
    """The cache keys of the manifest and the symbol map of the entry named ``name`` (the one place they are spelled)."""
    return (name + "#manifest").encode(), (name + "#symbols").encode()


def check_namespace(namespace: object) -> str:
    """``namespace`` if it is one of :data:`ENTRY_NAMESPACES`, else ``ValueError`` naming them."""
    if not isinstance(namespace, str) or namespace not in ENTRY_NAMESPACES:
        raise ValueError(f"namespace must be one of {', '.join(ENTRY_NAMESPACES)}, got {namespace!r}")
    return namespace


@dataclasses.dataclass(frozen=True)
class BatchRead:
    """What one :meth:`EntryStore.read_many` got, per name: its payload, absent, or why its read failed.

    Every name asked for is in exactly one of ``hits``, ``missing`` (not there: what a read
    raises as a plain ``KeyError``) and ``errors`` (anything else, ``EntryRejected``
    included), so a caller reads the field it needs. A store builds one with
    :meth:`reading` or :meth:`filed`, where each read's exception is caught.
    """

    hits: dict[str, bytes] = dataclasses.field(default_factory=dict)
    missing: frozenset[str] = frozenset()
    errors: dict[str, Exception] = dataclasses.field(default_factory=dict)

    @classmethod
    def reading(cls, names: Iterable[str], read: Callable[[str], bytes]) -> BatchRead:
        """Each of ``names`` read with ``read(name)``, one after another, and filed as :meth:`filed` files it."""
        hits: dict[str, bytes] = {}
        failures: dict[str, Exception] = {}
        for name in names:
            try:
                hits[name] = read(name)
            except Exception as exc:
                failures[name] = exc
        return cls.filed(hits, failures)

    @classmethod
    def filed(cls, hits: Mapping[str, bytes], failures: Mapping[str, Exception]) -> BatchRead:
        """From the payloads read and what each failed read raised: a plain ``KeyError`` files the name as
        ``missing`` (the store's miss), any other exception in ``errors``."""
        missing = frozenset(name for name, exc in failures.items() if type(exc) is KeyError)
        return cls(dict(hits), missing, {name: exc for name, exc in failures.items() if name not in missing})

    @property
    def failed(self) -> frozenset[str]:
        """Names whose read failed for a reason other than absence (the keys of ``errors``)."""
        return frozenset(self.errors)


@dataclasses.dataclass(frozen=True)
class BatchWrite:
    """What one :meth:`EntryStore.write_many` did, per name: stored (``written``), or why its write failed
    (``errors``). Every name given is in exactly one of them."""

    written: frozenset[str] = frozenset()
    errors: dict[str, Exception] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """One entry as a listing saw it. Immutable.

    ``size`` is the stored size (an envelope on a shared store), ``mtime``/``atime``
    are seconds since the epoch where the store says (``atime`` only locally).
    ``version`` is the store's opaque identity of exactly this object (cuda-core's
    ``(inode, size, mtime_ns)`` locally), so :meth:`EntryStore.delete_listed` can
    refuse to delete an entry a writer replaced since it was listed.
    """

    name: str
    size: int
    mtime: float | None
    atime: float | None = None
    version: Any = None

    @property
    def last_used(self) -> float | None:
        """The later of the last read and the last write, where the store knows either."""
        return max((t for t in (self.mtime, self.atime) if t is not None), default=None)


class EntryStore(abc.ABC):
    """A store of cache entries addressed by entry name.

    Reads return the entry's verified payload (the bytes cuda-core would hold) or raise
    ``KeyError`` on a miss and :class:`~tiered_progcache.errors.EntryRejected` for an entry
    that fails its checks; a store never returns bytes it cannot vouch for. Other
    failures (``OSError``, ``TimeoutError``, ``TierUnavailable``) propagate: the chain's
    failure policy (:mod:`tiered_progcache.chain.tier`) decides what they mean.

    Implementations state their concurrency guarantees; every one shipped here is safe
    across threads, processes and hosts for whole-entry reads and writes.
    """

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the entries live, for messages (a URL or a directory); never holds credentials."""

    @property
    @abc.abstractmethod
    def read_only(self) -> bool:
        """True if this process must not write, create or delete here."""

    @property
    @abc.abstractmethod
    def shared(self) -> bool:
        """True if other nodes read and write this store too (never wiped by ``clear()``)."""

    @property
    def atomic_create(self) -> bool:
        """True if :meth:`create_entry` is one atomic create-if-absent (a real lock primitive)."""
        return False

    @property
    def namespace(self) -> str:
        """What the entries here are: ``"entries"`` (the program cache's) or ``"triton"`` (Triton's files)."""
        return "entries"

    @property
    def available(self) -> bool:
        """False while the store is known to be down (its circuit breaker is open)."""
        return True

    @property
    def round_trip_s(self) -> float | None:
        """The median time one request to this store took lately, in seconds; None where unknown (or local)."""
        return None

    def file_of(self, name: str) -> tuple[str, str] | None:
        """The (kernel key, file name) entry ``name`` holds where the store knows it from its last listing
        (Triton's directory: ``<key>/<file>``), else None. What ``ls`` and ``stats`` group files by."""
        return None

    @property
    def startup_failure(self) -> BaseException | None:
        """Why the store's first probe failed (it then opened its breaker), else None; read it once :meth:`when_ready`.

        The chain counts it as its tier's first error or timeout: a dead remote shows in ``stats()``.
        """
        return None

    def when_ready(self, then: Callable[[], None]) -> None:
        """Call ``then`` once the store's first probe has ended (now, where it has none or it has ended)."""
        then()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the first probe to end; True if it has."""
        return True

    def beside_probe(self) -> contextlib.AbstractContextManager[None]:
        """A block whose requests from this thread go out beside the store's first probe, not after it."""
        return contextlib.nullcontext()

    @property
    def request_timeout_s(self) -> float | None:
        """The deadline of one request to this store, in seconds; None where it has none (a local directory)."""
        return None

    def seed_round_trip(self, seconds: float) -> None:
        """Count ``seconds`` (what this node measured in an earlier process) as one round trip; nothing here."""

    @property
    @abc.abstractmethod
    def max_entry_bytes(self) -> int:
        """The largest payload this store reads or writes; larger objects are refused while read."""

    @abc.abstractmethod
    def read_entry(self, name: str) -> bytes:
        """The verified payload of ``name``; ``KeyError`` if absent, ``EntryRejected`` if bad."""

    @abc.abstractmethod
    def write_entry(self, name: str, payload: bytes) -> None:
        """Store ``payload`` under ``name`` whole (readers see all of it or none), replacing any."""

    @abc.abstractmethod
    def create_entry(self, name: str, payload: bytes) -> bool:
        """Store ``payload`` under ``name`` only if absent; False if something was there."""

    @abc.abstractmethod
    def delete_entry(self, name: str) -> None:
        """Remove ``name``; ``KeyError`` if it is not there."""

    @abc.abstractmethod
    def iter_entries(self) -> Iterator[StoredEntry]:
        """Every entry (one listing; nothing cached)."""

    def delete_listed(self, entry: StoredEntry) -> bool:
        """Remove ``entry`` unless it changed or went since it was listed; True if removed."""
        try:
            self.delete_entry(entry.name)
        except KeyError:
            return False
        return True

    def delete_entries(self, entries: Iterable[StoredEntry]) -> int:
        """Remove many listed entries (``clear``); the count removed. Stores batch this where they can."""
        return sum(1 for entry in entries if self.delete_listed(entry))

    def verify_entry(self, name: str) -> str | None:
        """None if ``name`` passes this store's checks, else a one-line reason (``"missing"`` if absent)."""
        try:
            self.read_entry(name)
        except EntryRejected as exc:
            return str(exc)
        except KeyError:
            return "missing"
        return None

    # -- bulk: what warm and push use (tiered_progcache.chain.transfer) --------------------------

    @property
    def transfer_batch(self) -> int:
        """Entries per :meth:`read_many`/:meth:`write_many` call in a bulk transfer."""
        return 64

    def read_many(self, names: list[str]) -> BatchRead:
        """Each name's verified payload (``hits``), absence (``missing``) or the exception its read raised (``errors``).

        Never raises an ``Exception`` for one entry's failure. This default reads one by
        one; a store with a batched read (fsspec's ``cat``, a Redis pipeline) overrides it.
        """
        return BatchRead.reading(names, self.read_entry)

    def write_many(self, items: Mapping[str, bytes]) -> BatchWrite:
        """Store each payload under its name: the names ``written``, and the exception each other raised (``errors``).

        ``PermissionError`` at once on a read-only store. This default writes one by one.
        """
        if self.read_only:
            raise PermissionError(f"{self.location} is read-only; refusing to write")
        written: set[str] = set()
        errors: dict[str, Exception] = {}
        for name, payload in items.items():
            try:
                self.write_entry(name, payload)
            except Exception as exc:
                errors[name] = exc
            else:
                written.add(name)
        return BatchWrite(frozenset(written), errors)

    def seal_record(self, name: str, payload: bytes) -> bytes:
        """``payload`` in this store's envelope for entry-like name ``name`` (signed when it has a key).

        For small records kept beside entries, such as a failed compile's (:mod:`.flightfailure`).
        The default (a store without an envelope, e.g. a local directory) refuses.
        """
        raise NotImplementedError(f"{type(self).__name__} has no envelope")

    def open_record(self, name: str, blob: bytes) -> bytes:
        """The verified payload of a record :meth:`seal_record` made for ``name``; raises on a bad one."""
        raise NotImplementedError(f"{type(self).__name__} has no envelope")

    def leases(self) -> LeaseStore | None:
        """The namespace for cluster leases on this store, or None if it cannot hold them."""
        return None

    def sweep_staged(self, older_than: float = STALE_STAGED_AGE_S, *, now: float | None = None) -> int:
        """Remove files staged by writers that died (killed, failed) over ``older_than`` seconds ago; the count.

        Runs only when called (``prune`` and ``clear`` call it), never on the write path:
        a younger staged file may be a live upload. Stores that stage nothing return 0.
        """
        return 0

    # -- by cache key: what the chain reads and writes -----------------------------------------------

    @property
    def by_name(self) -> bool:
        """True if entries here can be read, written and listed by entry name; False for a store the chain
        reads by cache key only (cuda-core's memory tier, a resource given bare: :mod:`.coretiers`)."""
        return True

    def read_key(self, key: bytes) -> bytes:
        """The entry of cache key ``key``, as :meth:`read_entry` reads it: where a key becomes a name.

        A store with a faster keyed read (the local directory's, the memory tier's) overrides it.
        """
        return self.read_entry(entry_name(key))

    def write_key(self, key: bytes, payload: bytes) -> None:
        """Store ``payload`` under cache key ``key`` (:meth:`write_entry` of its name)."""
        self.write_entry(entry_name(key), payload)

    def create_key(self, key: bytes, payload: bytes) -> bool:
        """Store ``payload`` under cache key ``key`` only if absent (:meth:`create_entry` of its name)."""
        return self.create_entry(entry_name(key), payload)

    def delete_key(self, key: bytes) -> None:
        """Remove cache key ``key``'s entry; ``KeyError`` if it is not there."""
        self.delete_entry(entry_name(key))

    def count(self) -> int:
        """Entries the store holds (one whole listing; the chain never counts a shared tier)."""
        return sum(1 for _ in self.iter_entries())

    def measure(self) -> tuple[int, int | None]:
        """Entries held and their bytes (None where unknown), from one listing."""
        sizes = [entry.size for entry in self.iter_entries()]
        return len(sizes), sum(sizes)

    def clear(self) -> None:
        """Delete every entry. The chain calls it on non-shared tiers only (a remote is never wiped from there)."""
        self.delete_entries(list(self.iter_entries()))

    def close(self) -> None:
        """Release what the store holds open (connections, threads); nothing here."""

    def __enter__(self) -> EntryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NodeDirStore(EntryStore):
    """An entry store in a directory on this node: its root is its location, it is never read-only
    nor shared, and it holds entries of at most ``max_entry_bytes``. Subclasses say how entries are laid out.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.root = Path(root)
        self._max_entry_bytes = max_entry_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def read_only(self) -> bool:
        return False

    @property
    def shared(self) -> bool:
        return False

    @property
    def max_entry_bytes(self) -> int:
        return self._max_entry_bytes

    @staticmethod
    def _unlink_if_listed_as(path: str | os.PathLike[str], version: Any) -> bool:
        """Unlink ``path`` unless a writer replaced it since it was listed with stat identity ``version``
        (cuda-core's guard; None: unguarded). False if it was replaced or is gone."""
        try:
            if version is not None and _cudacore.stat_identity(os.stat(path, follow_symlinks=False)) != version:
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True



class IndexedDirStore(NodeDirStore):
    """A node directory laid out by another program (Triton's cache, CuPy's): each of its files is one entry,
    found by name through an index that a listing fills and that a name not in it rebuilds.

    Subclasses say which files are entries (:meth:`_files`), what each is called and where it
    lies; the listing, the lookup, the capped read, creates and (stat-guarded) deletes are these.
    A file is told by its *place*: whatever the subclass keeps per file (a name, a key and a name).
    """

    #: Whose files these are, for messages ("not a CuPy entry").
    _FORMAT = "?"

    def __init__(self, root: str | os.PathLike[str], *, max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        super().__init__(root, max_entry_bytes=max_entry_bytes)
        self._index: dict[str, Any] = {}

    @abc.abstractmethod
    def _files(self) -> Iterator[tuple[Any, os.DirEntry[str]]]:
        """(place, directory entry) of each file that may be an entry (links and directories are passed over here)."""

    @abc.abstractmethod
    def _entry_name(self, place: Any) -> str:
        """The entry name of the file at ``place``."""

    @abc.abstractmethod
    def _path(self, place: Any) -> Path:
        """Where the file at ``place`` lies."""

    @abc.abstractmethod
    def _unframe(self, payload: bytes) -> tuple[Any, bytes] | None:
        """(place, file bytes) of a framed payload; None if it carries no frame."""

    @staticmethod
    def _sorted_dir(path: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
        """The entries of directory ``path`` by name; none if it is gone."""
        try:
            return sorted(os.scandir(path), key=lambda d: d.name)
        except FileNotFoundError:
            return []

    def iter_entries(self) -> Iterator[StoredEntry]:
        for place, item in self._files():
            if not item.is_file(follow_symlinks=False):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            name = self._entry_name(place)
            self._index[name] = place
            yield StoredEntry(name, st.st_size, st.st_mtime, st.st_atime, _cudacore.stat_identity(st))

    def _find(self, name: str) -> Any:
        """The place of entry ``name``: from the index, else from a fresh listing; ``KeyError`` if not here."""
        check_entry_name(name)
        place = self._index.get(name)
        if place is None:
            for _ in self.iter_entries():
                pass
            place = self._index.get(name)
        if place is None:
            raise KeyError(name)
        return place

    def _read_capped(self, path: Path) -> bytes:
        """``path``'s bytes; ``EntryRejected`` past ``max_entry_bytes`` (never more than one byte over is read)."""
        with open(path, "rb") as fh:
            data = fh.read(self._max_entry_bytes + 1)
        if len(data) > self._max_entry_bytes:
            raise EntryRejected(f"{path.name} is over the {self._max_entry_bytes}-byte entry limit")
        return data

    def _read_file(self, name: str) -> tuple[Any, bytes]:
        """(place, bytes) of entry ``name``'s file; ``KeyError`` if it is not here (or went since the listing)."""
        place = self._find(name)
        try:
            return place, self._read_capped(self._path(place))
        except FileNotFoundError:
            raise KeyError(name) from None

    def _landing(self, name: str, payload: bytes) -> tuple[Any, bytes]:
        """(place, file bytes) that ``payload`` lands as under ``name``; ``EntryRejected`` if it has no frame
        or its frame names another file than ``name`` does."""
        check_entry_name(name)
        parsed = self._unframe(bytes(payload))
        if parsed is None:
            raise EntryRejected(f"not a {self._FORMAT} entry (no frame)")
        place, data = parsed
        if self._entry_name(place) != name:
            relative = self._path(place).relative_to(self.root).as_posix()
            raise EntryRejected(f"entry {name[:12]} holds {self.namespace}/{relative}, named otherwise")
        return place, data

    def create_entry(self, name: str, payload: bytes) -> bool:
        try:
            self._find(name)
        except KeyError:
            self.write_entry(name, payload)
            return True
        return False

    def delete_entry(self, name: str) -> None:
        try:
            os.unlink(self._path(self._find(name)))
        except FileNotFoundError:
            raise KeyError(name) from None
        self._index.pop(name, None)

    def delete_listed(self, entry: StoredEntry) -> bool:
        """Unlink ``entry`` unless a writer replaced it since it was listed (the stat guard cuda-core uses)."""
        try:
            place = self._find(entry.name)
        except KeyError:
            return False
        return self._unlink_if_listed_as(self._path(place), entry.version)


class LeaseStore(abc.ABC):
    """Small lease objects by name (``<root>/leases/<name>``) in a shared store.

    Every request goes through the owning store's one request runner (deadline and
    circuit breaker). ``atomic_create`` says whether :meth:`create` is a real
    conditional create; a lease on a store without one would be a race, so callers
    fall back to node-level single-flight.
    """

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the leases live, for messages."""

    @property
    @abc.abstractmethod
    def atomic_create(self) -> bool:
        """True if :meth:`create` is one atomic create-if-absent."""

    @abc.abstractmethod
    def create(self, name: str, document: bytes, ttl_s: float) -> bool:
        """Create lease ``name`` holding ``document`` if absent; False if one exists.

        ``ttl_s`` lets a store that can expire objects (Redis ``PX``) do so; others ignore it.
        """

    @abc.abstractmethod
    def read(self, name: str) -> bytes | None:
        """The lease's bytes, or None if there is none."""

    @abc.abstractmethod
    def replace(self, name: str, document: bytes, ttl_s: float) -> None:
        """Overwrite lease ``name`` (a renewal)."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove lease ``name``; no error if it is already gone."""


def read_in_batches(store: EntryStore, names: list[str]) -> Iterator[tuple[list[str], BatchRead]]:
    """``names`` read ``store.transfer_batch`` at a time: each chunk with what :meth:`EntryStore.read_many` gave."""
    batch = max(1, store.transfer_batch)
    for start in range(0, len(names), batch):
        chunk = names[start : start + batch]
        yield chunk, store.read_many(chunk)
