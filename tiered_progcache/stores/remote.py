"""The remote tier: one shared store of cache entries on any fsspec URL (S3, GCS, NFS, memory://).

Entries live at ``<url>/entries/<2 hex>/<62 hex>``, the hex being ``sha256(key)``: the
naming of cuda-core's local file tier, so a bucket and a local cache directory list
the same names. Triton's files (``namespace="triton"``) live beside them, at
``<url>/triton/<2 hex>/<62 hex>``. Each object is an envelope (:mod:`tiered_progcache.stores.envelope`) that
carries the payload's digest and, with a signing key, an HMAC; every read is verified.
Cluster leases live beside them, at ``<url>/leases/<name>`` (:class:`RemoteLeases`).

This tier *raises* on every kind of trouble (``KeyError`` on a miss, ``EntryRejected``
for a bad entry, ``TimeoutError``, ``TierUnavailable`` while the breaker is open,
``OSError``); the chain (:mod:`tiered_progcache.chain.tier`) turns each into a counted miss.
Every request goes through the tier's one :class:`~tiered_progcache.stores.runner.RequestRunner`,
and each is written once, as a coroutine (:class:`_Objects`), whether the filesystem is
async (s3fs, gcsfs) or blocking (file://, memory://).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import posixpath
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

from . import fsutil
from ..errors import InterpreterExiting
from .envelope import (
    HEADER_SIZE,
    MAX_ENTRY_BYTES,
    InvalidEnvelope,
    first_read_bytes,
    joined_envelope,
    max_stored_bytes,
    rest_to_read,
    stored_length,
)
from .gcsjson import GcsJsonFactory
from .objectstore import BucketFactory, ObjectStoreFactory
from .runner import ClientFactory, DeferredFilesystemFactory, FilesystemFactory, RequestRunner, run_quietly_to_end
from .sharedstore import FetchedEnvelopes, SharedEntryStore
from ..urls import check_url
from .store import STALE_STAGED_AGE_S, BatchWrite, LeaseStore, StoredEntry, check_entry_name, is_entry_name

__all__ = [
    "MAX_LEASE_BYTES",
    "READ_CHUNK_BYTES",
    "RemoteLeases",
    "RemoteProgramCache",
    "check_url",
]

logger = logging.getLogger(__name__)

#: Bytes a blocking read takes at a time past its first request (and on a local path): the
#: step between deadline checks. A read holds at most the length the header states.
READ_CHUNK_BYTES = 1 << 20
#: Largest lease document read (they are a few hundred bytes of JSON).
MAX_LEASE_BYTES = 1 << 16

# Object stores whose put can be conditional (S3 ``If-None-Match: *``, GCS
# ``ifGenerationMatch=0``, memory:// in-process): ``pipe_file(mode="create")`` is atomic.
# fsspec's generic ``mode="create"`` elsewhere is check-then-write, so it is not.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
_CONDITIONAL_PUT_PROTOCOLS = _OBJECT_STORE_PROTOCOLS | {"memory"}
# Local and NFS paths: create-if-absent is stage-then-link(2) (fsutil.create_exclusive).
_LOCAL_PROTOCOLS = frozenset({"file", "local"})


class RemoteProgramCache(SharedEntryStore):
    """A cache tier on a shared fsspec filesystem, usually below memory and a local directory.

    >>> remote = RemoteProgramCache.from_url("s3://ci-kernels/cuda13", storage_options={"anon": False})
    >>> cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(), remote])

    Threads: every method is safe to call from many threads (the fsspec clients are;
    the breaker and the thread pool lock). Processes and nodes: an entry is one object
    written whole, by a single PUT on object stores and by stage-in-``tmp/``-then-rename
    on file systems, so a reader sees a whole envelope or none. Two writers of one key
    race harmlessly (same compile, last writer wins). Anything a reader finds is verified
    before it is returned.
    """

    _kind = "remote cache"

    def __init__(
        self,
        fs: Any | None,
        root: str,
        *,
        url: str | None = None,
        strict: bool = False,
        create_root: bool = True,
        factory: FilesystemFactory | DeferredFilesystemFactory | None = None,
        **shared: Any,
    ) -> None:
        """``shared`` goes to :class:`~tiered_progcache.stores.sharedstore.SharedEntryStore` (read-only, key, deadline, cap...).

        ``factory``: builds the filesystem on first use (with ``fs`` None); a deferred one needs ``url``."""
        if fs is None and factory is None:
            raise TypeError("RemoteProgramCache needs an fsspec filesystem (or a factory that builds one)")
        if isinstance(factory, DeferredFilesystemFactory):
            if url is None:
                raise TypeError("a RemoteProgramCache built by a DeferredFilesystemFactory needs its url")
            fs_class = None  # an object store: root_marker "" and paths "bucket/key", checked when it is built
        else:
            fs_class = type(fs) if fs is not None else factory.cls
        self.root = root.rstrip("/")
        self.url = url if url is not None else f"{_protocol(fs_class)}://{self.root}"
        super().__init__(fs, url=self.url, factory=factory, **shared)
        # Object stores (root_marker "") put whole objects atomically and have buckets.
        self._bucket_store = fs_class is None or not fs_class.root_marker
        base = (self.root if self.root or fs_class is None else fs_class._strip_protocol("")).rstrip("/")
        self._entries = f"{base}/{self._namespace}"
        self._objects = _Objects(self._runner, f"{base}/tmp", max_entry_bytes=self._max_entry_bytes)
        self._leases = None if self._read_only else RemoteLeases(self._objects, self._runner, f"{base}/leases", self._location)
        if self._bucket_store and not self.root:
            raise ValueError(f"remote URL {self.url!r} names no bucket")
        self._create_root = bool(create_root)
        self._on_this_host = self._objects.local and fsutil.on_local_disk(self.root or "/")
        self._endpoint = _endpoint_of(factory.storage_options if factory is not None
                                      else getattr(fs, "storage_options", {}))
        self._start_probe(strict)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> RemoteProgramCache:
        """Build the tier from a URL and fsspec ``storage_options``.

        >>> RemoteProgramCache.from_url("s3://bucket/kernels", storage_options={"endpoint_url": "http://127.0.0.1:9000"})

        An unknown scheme, options that are not a mapping, a bad timeout or compression
        raise ``ValueError``/``TypeError`` at once; a missing filesystem package (s3fs,
        gcsfs) raises ``ImportError``. An unreachable remote, a missing bucket or bad
        credentials raise only with ``strict=True``; otherwise the tier logs a warning
        and starts with its breaker open (the chain works local-only until a probe
        succeeds). A root that does not exist is created (``create_root``; never on a
        read-only tier), as code that builds a tier names its directory on purpose. With
        ``create_root=False`` a missing ``file://`` root counts as missing, like a bucket:
        what the ``create_remote_root`` setting (default off) passes, so a mistyped
        flag or an NFS mount that is not there never fills the local disk. A write never
        recreates a ``file://`` root that went away. ``options`` go to :class:`RemoteProgramCache`
        (``strict``, ``create_root``) and the shared store (``read_only``, ``signing_key``, ``compression``,
        ``timeout``, ``breaker``, ``transfer_concurrency``, ``max_entry_bytes``, ``namespace``).

        The filesystem is built through the tier's request runner, under ``timeout``:
        one whose constructor connects (ftp://, sftp) or looks for credentials (gs://)
        and hangs costs one deadline; with ``strict=False`` the tier then starts with
        its breaker open and builds it again at the next probe. A forked child builds
        its own (see :mod:`tiered_progcache.stores.runner`).
        """
        if storage_options is None:
            storage_options = {}
        if not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {type(storage_options).__name__}")
        check_url(url)
        fs, root, factory = _plan_filesystem(url, dict(storage_options))
        return cls(fs, root, factory=factory, url=url.rstrip("/"), **options)

    def _request_threads(self, factory: ClientFactory | None) -> int:
        """A blocking client (obstore's S3, GCS's JSON API) holds a thread per request: a batch of
        ``transfer_concurrency`` needs as many."""
        if isinstance(factory, BucketFactory):
            return self.transfer_concurrency
        return super()._request_threads(factory)

    def __repr__(self) -> str:
        return (
            f"RemoteProgramCache({self._location!r}, read_only={self._read_only}, signed={self._codec.signed}, "
            f"compression={self._codec.compression!r}, breaker={self._breaker.state})"
        )

    # -- what the store is -----------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The client (built on first use, and again in a forked child; see :mod:`.runner`): an fsspec filesystem,
        or obstore's on S3 and GCS's JSON API on GCS under fsspec's method names (:class:`~.objectstore.ObjectStoreCalls`,
        :class:`~.gcsjson.GcsJsonCalls`)."""
        return self._runner.fs

    @property
    def atomic_create(self) -> bool:
        return self._objects.atomic_create

    @property
    def round_trip_s(self) -> float | None:
        """0.0 for a directory on this host's own disk, else the measured median (``SharedEntryStore``).

        A request there is a system call, so no compile is worth racing it: what a loaded host's
        requests take is its load, not a distance, and the nodes sharing such a directory share its cores.
        """
        return 0.0 if self._on_this_host else super().round_trip_s

    def path_for(self, name: str) -> str:
        """The object path of entry ``name`` on the filesystem (``ValueError`` unless an entry name)."""
        check_entry_name(name)
        return f"{self._entries}/{name[:2]}/{name[2:]}"

    def clear(self) -> None:
        """Delete every entry under this URL's prefix, and stale staged files. Only ever called on purpose (the CLI)."""
        super().clear()
        self.sweep_staged()

    def delete_entries(self, entries: Iterable[StoredEntry]) -> int:
        """Delete listed entries in batches of 1000 paths per request; the count asked to delete."""
        self._require_writable("clear")
        paths = [self.path_for(entry.name) for entry in entries]
        for start in range(0, len(paths), 1000):
            batch = paths[start : start + 1000]
            self._runner.request("delete", self._objects.delete_many, batch, timeout=self._list_timeout)
        return len(paths)

    def close(self) -> None:
        """Stop the tier's idle threads. The fsspec filesystem is shared (fsspec caches instances), so it stays open."""
        self._runner.close()

    # -- by entry name (what listings, transfers and the CLI see) -----------------------

    def iter_entries(self) -> Iterator[StoredEntry]:
        """Every entry under ``entries/`` (or ``triton/``: one listing of the prefix; not kept in a cache)."""
        try:
            listing = self._runner.request("list", self._objects.find, self._entries, timeout=self._list_timeout)
        except FileNotFoundError:
            return
        prefix = self.fs._strip_protocol(self._entries).rstrip("/") + "/"
        for path, info in listing.items():
            if not path.startswith(prefix) or info.get("type", "file") != "file":
                continue
            shard, _, rest = path[len(prefix) :].partition("/")
            name = shard + rest
            if len(shard) != 2 or "/" in rest or not is_entry_name(name):
                continue
            yield StoredEntry(name, int(info.get("size") or 0), _mtime_of(info), version=_version_of(info))

    def write_entry(self, name: str, payload: bytes) -> None:
        """Seal ``payload`` and store it under ``name``, replacing whatever was there."""
        self._require_writable("write")
        path = self.path_for(name)
        blob = self._codec.seal(name, bytes(payload))
        self._runner.request("write", self._objects.put, path, blob)

    def create_entry(self, name: str, payload: bytes) -> bool:
        """Seal and store ``payload`` only if ``name`` is absent; False if it was there.

        One atomic request where the store has one (:attr:`atomic_create`); else a check
        then a write, which two writers can both pass (harmless: same compile, same bytes).
        """
        self._require_writable("create")
        path = self.path_for(name)
        blob = self._codec.seal(name, bytes(payload))
        return self._runner.request("create", self._objects.create, path, blob)

    def delete_entry(self, name: str) -> None:
        """Remove entry ``name``; ``KeyError`` if it is not there."""
        self._require_writable("delete")
        path = self.path_for(name)
        try:
            self._runner.request("delete", self._objects.delete, path)
        except FileNotFoundError:
            raise KeyError(name) from None

    def delete_listed(self, entry: StoredEntry) -> bool:
        """Remove ``entry`` unless it went, or (where the listing gave an ETag/generation) was replaced, since listed."""
        self._require_writable("delete")
        path = self.path_for(entry.name)
        try:
            return self._runner.request("delete", self._objects.delete_if_version, path, entry.version)
        except FileNotFoundError:
            return False

    def leases(self) -> RemoteLeases | None:
        """The lease namespace ``<url>/leases/``; None on a read-only tier (it would never upload)."""
        return self._leases

    def sweep_staged(self, older_than: float = STALE_STAGED_AGE_S, *, now: float | None = None) -> int:
        """Remove files left in ``<url>/tmp/`` by uploads that died over ``older_than`` seconds ago; the count.

        Only file systems stage (object stores put whole objects). Runs only when called:
        ``prune`` and ``clear`` call it, the write path never does (a younger staged file
        may be another node's upload in flight). One listing, through the runner.
        """
        if self._read_only or not self._objects.stages:
            return 0
        cutoff = (time.time() if now is None else now) - older_than
        return self._runner.request("sweep", self._objects.sweep_staged, cutoff, timeout=self._list_timeout)

    # -- raw envelopes in batches (what transfer.warm/push use) -------------------------

    def read_envelopes(self, names: list[str]) -> FetchedEnvelopes:
        """Raw envelopes of ``names``, fetched side by side under one deadline (absent ones in ``missing``,
        why each other failed in ``errors``); :meth:`read_many` verifies them."""
        calls = {name: (self.path_for(name),) for name in names}
        got = self._runner.request_many("batched read", self._objects.read_envelope, calls, stoppable=True)
        return FetchedEnvelopes.filed(got.results, got.errors)

    def write_envelopes(self, blobs: Mapping[str, bytes]) -> BatchWrite:
        """Store sealed envelopes side by side under one deadline: the names written, and why each other failed."""
        self._require_writable("write")
        calls = {name: (self.path_for(name), blob) for name, blob in blobs.items()}
        got = self._runner.request_many("batched write", self._objects.put, calls)
        return BatchWrite(frozenset(got.results), got.errors)

    def write_many(self, items: Mapping[str, bytes]) -> BatchWrite:
        """Seal and store payloads side by side under one deadline (:meth:`write_envelopes`)."""
        self._require_writable("write")
        blobs = {name: self._codec.seal(name, bytes(payload)) for name, payload in items.items()}
        return self.write_envelopes(blobs)

    # -- internals ---------------------------------------------------------------------

    def _fetch_envelope(self, name: str) -> bytes | memoryview | None:
        path = self.path_for(name)
        try:
            return self._runner.request("read", self._objects.read_envelope, path, stoppable=True)
        except FileNotFoundError:
            return None

    def _fetch_envelopes(self, names: list[str]) -> FetchedEnvelopes:
        return self.read_envelopes(names)

    def _check_reachable(self, strict: bool) -> None:
        """Build the filesystem and probe the bucket (object stores) or directory once, so a bad config shows up now."""
        if self._known_down():
            return
        deadline = self._runner.timeout  # given: the probe's request opens the connection, not a round-trip sample
        try:
            if self._bucket_store:
                bucket = self.root.split("/", 1)[0]
                self._runner.request("probe", self._objects.probe_bucket, bucket, timeout=deadline)
            elif self.root not in ("", "/"):
                if not self._runner.request("probe", self._objects.is_dir, self.root, timeout=deadline):
                    if self._read_only:
                        raise FileNotFoundError(f"{self.root} does not exist")
                    if self._objects.local and not self._create_root:
                        raise FileNotFoundError(
                            f"{self.root} does not exist (create it, or have it created: "
                            "TieredProgramCache(..., create_remote_root=True) or CacheConfig(create_remote_root=True) "
                            "in code, RemoteProgramCache.from_url(..., create_root=True) for the tier alone, "
                            "TIERED_PROGCACHE_CREATE_REMOTE_ROOT=1 for from_env() and the command, or the "
                            "command's --create-remote-root)"
                        )
                    self._runner.request("probe", self._objects.make_root, self.root, timeout=deadline)
        except InterpreterExiting as exc:  # no thread for the client: the store is not judged, nor remembered down
            logger.info("remote cache %s: probe not made: %s", self._location, exc)
        except TypeError as exc:
            # The filesystem rejected an argument (a misspelt storage option such as
            # ``endpoint_ur1``): a configuration error, not an outage, so never a silent local-only run.
            error = TypeError(f"remote cache {self._location}: the filesystem rejected its storage options: {exc} "
                              "(correct the storage options; strict=True raises this at construction)")
            if strict:
                raise error from exc
            logger.error("%s; continuing without it", error)
            self._breaker.trip(error)
        except Exception as exc:
            error, message = _probe_failure(self._location, exc, self.timeout, self._endpoint)
            if strict:
                raise error(message) from exc
            logger.warning("%s; continuing without it, probing again in %.0f s", message, self._breaker.cooldown_s)
            failure = error(message)  # what stats() counts it as (errors or timeouts) says what the message says
            failure.__cause__ = exc
            self._breaker.trip(failure)

    def _time_round_trip(self) -> None:
        if self._bucket_store:
            self._runner.request("round trip", self._objects.ask_bucket, self.root.split("/", 1)[0])
        elif self.root not in ("", "/"):
            self._runner.request("round trip", self._objects.is_dir, self.root)


class RemoteLeases(LeaseStore):
    """Lease objects at ``<url>/leases/<name>`` on a remote tier, every request through its runner.

    >>> leases = remote.leases()
    >>> if leases is not None and leases.atomic_create and leases.create(name, doc, ttl_s=60): ...

    Safe across threads, processes and hosts where :attr:`atomic_create` is True.
    """

    def __init__(self, objects: _Objects, runner: RequestRunner, directory: str, location: str) -> None:
        self._objects = objects
        self._runner = runner
        self._directory = directory
        self._location = f"{location}/leases"

    @property
    def location(self) -> str:
        return self._location

    @property
    def atomic_create(self) -> bool:
        return self._objects.atomic_create

    def create(self, name: str, document: bytes, ttl_s: float) -> bool:
        return self._runner.request("lease create", self._objects.create, self._path(name), document)

    def read(self, name: str) -> bytes | None:
        return self._runner.request("lease read", self._objects.read_or_none, self._path(name))

    def replace(self, name: str, document: bytes, ttl_s: float) -> None:
        self._runner.request("lease renew", self._objects.put, self._path(name), document)

    def delete(self, name: str) -> None:
        self._runner.request("lease delete", self._objects.delete_if_present, self._path(name))

    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"not a lease name (one path component): {name!r}")
        return f"{self._directory}/{name}"


class _Objects:
    """Requests on one fsspec filesystem, each written once: the only place that decides how an object is put,
    created, read, listed or deleted.

    Each method is one request's worth of work, a coroutine over fsspec's coroutine
    methods (``self._fs``), run by the caller through the runner's :meth:`~.runner.RequestRunner.request`:
    on an async filesystem's loop, or on a blocking one over :class:`~.runner.BlockingCalls`.
    """

    def __init__(self, runner: RequestRunner, staging_dir: str, *, max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self._runner = runner
        self._async = is_async = runner.is_async
        self._max_entry_bytes = max_entry_bytes
        self._staging_dir = staging_dir
        protocols = runner.filesystem_protocols
        # Object stores (every async filesystem, memory://, obstore's S3) replace an object whole in one put.
        self._whole_puts = is_async or "memory" in protocols or bool(protocols & _OBJECT_STORE_PROTOCOLS)
        # An object store's envelope is read in at most two requests, a blocking client's too (obstore's S3).
        self._whole_reads = is_async or bool(protocols & _OBJECT_STORE_PROTOCOLS)
        self._local = bool(protocols & _LOCAL_PROTOCOLS)
        self._conditional_put = bool(protocols & _CONDITIONAL_PUT_PROTOCOLS)

    @property
    def _fs(self) -> Any:
        return self._runner.calls  # the current filesystem's (rebuilt after a fork)

    @property
    def atomic_create(self) -> bool:
        return self._local or self._conditional_put

    @property
    def local(self) -> bool:
        """True on a local or NFS path (``file://``), where a missing root is never created by a write."""
        return self._local

    @property
    def stages(self) -> bool:
        """True if writes stage a file in the staging directory first (file systems)."""
        return not self._whole_puts

    # -- the root and its listing --------------------------------------------------------

    async def probe_bucket(self, bucket: str) -> None:
        """Ask for the bucket; on an object store twice at once, so its pool keeps two connections: a fresh
        node's first hit makes two requests side by side (its entry read ahead while the boot fetch lists),
        and a connection opened then would cost the hit a round trip (TCP and TLS: two or three)."""
        if self._async:
            await asyncio.gather(self.ask_bucket(bucket), self.ask_bucket(bucket))
            return
        if not self._whole_reads:
            await self.ask_bucket(bucket)
            return
        # A blocking client (obstore's): the second ask on a thread of its own, waited for at most a request's
        # deadline (its outcome is the first's).
        beside = threading.Thread(target=run_quietly_to_end, args=(self.ask_bucket, bucket), daemon=True,
                                  name="tiered-progcache-probe-beside")
        beside.start()
        await self.ask_bucket(bucket)
        beside.join(min(self._runner.timeout, threading.TIMEOUT_MAX))

    async def ask_bucket(self, bucket: str) -> None:
        """One request for the bucket (a round trip once connected)."""
        await self._fs._info(bucket)

    async def is_dir(self, path: str) -> bool:
        return bool(await self._fs._isdir(path))

    async def make_root(self, root: str) -> None:
        """Create the remote's root directory (explicit modes on a local path)."""
        if self._local:
            fsutil.make_dirs(os.path.normpath(root))
        else:
            await self._fs._makedirs(root, exist_ok=True)

    async def _make_dirs(self, path: str, mode: int = fsutil.DIR_MODE) -> None:
        if self._local:  # explicit modes; no symbolic link under the root written through
            base = os.path.dirname(os.path.normpath(self._staging_dir))
            if not os.path.isdir(base):  # an unmounted NFS share: never recreated on the local disk
                raise FileNotFoundError(f"the remote root {base} does not exist")
            fsutil.make_dirs(os.path.normpath(path), mode, below=base)
        else:
            await self._fs._makedirs(path, exist_ok=True)

    async def find(self, directory: str) -> dict[str, Any]:
        """Every object under ``directory`` with its details (one listing; not kept in fsspec's cache)."""
        fs = self._fs
        with contextlib.suppress(Exception):
            fs.invalidate_cache(directory)
        return await fs._find(directory, detail=True)

    async def sweep_staged(self, cutoff: float) -> int:
        """Remove staged files last modified before ``cutoff`` (seconds since the epoch); the count removed."""
        fs = self._fs
        try:
            listing = await fs._ls(self._staging_dir, detail=True)
        except FileNotFoundError:
            return 0
        removed = 0
        for info in listing:
            mtime = _mtime_of(info)
            if info.get("type") == "directory" or mtime is None or mtime >= cutoff:
                continue
            with contextlib.suppress(FileNotFoundError):
                await fs._rm_file(info["name"])
                removed += 1
        return removed

    # -- put: replace whole ------------------------------------------------------------

    async def put(self, path: str, blob: bytes) -> None:
        fs = self._fs
        if self._whole_puts:
            await fs._pipe_file(path, blob)
            return
        # A file system (never async): stage next to the entries and rename, so readers never see a partial file.
        await self._make_dirs(self._staging_dir, fsutil.STAGING_DIR_MODE)
        staged = f"{self._staging_dir}/{uuid.uuid4().hex}"
        await fs._pipe_file(staged, blob)
        try:
            await self._make_dirs(posixpath.dirname(path))
            await fs._mv(staged, path)
        except BaseException:
            with contextlib.suppress(Exception):
                await fs._rm_file(staged)
            raise

    # -- create: only if absent --------------------------------------------------------

    async def create(self, path: str, blob: bytes) -> bool:
        if self._local:
            return fsutil.create_exclusive(os.path.normpath(path), blob, staging_dir=os.path.normpath(self._staging_dir))
        fs = self._fs
        if self._conditional_put:
            try:
                await fs._pipe_file(path, blob, mode="create")
            except FileExistsError:
                return False
            return True
        with contextlib.suppress(Exception):  # no atomic create here: check, then put
            fs.invalidate_cache(path)
        if await fs._exists(path):
            return False
        await self.put(path, blob)
        return True

    # -- read and delete ---------------------------------------------------------------

    async def read_envelope(self, stop: threading.Event, path: str) -> bytes | memoryview:
        """An entry's envelope, read up to the length its header states and never past the cap.

        One request for an envelope up to :func:`~tiered_progcache.stores.envelope.first_read_bytes`
        (a ranged read, so a miss is that same request answering "not found": no HEAD, no
        listing). A larger one reads the rest its header states: on an async filesystem in
        one more request (the deadline cancels the coroutine wherever it is), on a
        blocking one in steps of ``READ_CHUNK_BYTES``, stopping between them once ``stop``
        is set (the caller's deadline passed). A local path is opened without following a
        link and read in such steps. Raises ``InvalidEnvelope`` for an object that states
        (or has) more than the cap, and on a local path for a symbolic link or anything but
        a regular file, unread.
        """
        if self._local:
            fd, _ = fsutil.open_regular(os.path.normpath(path), max_stored_bytes(self._max_entry_bytes), refuse=InvalidEnvelope)
            with open(fd, "rb", buffering=0) as fh:
                return _read_capped(fh.read, stop, self._max_entry_bytes)
        fs = self._fs
        asked = first_read_bytes(self._max_entry_bytes)
        first = await _ranged_read(fs, path, 0, asked)
        rest = rest_to_read(first, asked, self._max_entry_bytes)
        if rest is None:
            return first
        start, end = rest
        step = end - start if self._whole_reads else READ_CHUNK_BYTES
        more = bytearray()
        while start < end:
            if stop.is_set():
                raise TimeoutError("read stopped at its deadline")
            chunk = await _ranged_read(fs, path, start, min(end, start + step))
            if not chunk:
                break
            more += chunk
            start += len(chunk)
        return joined_envelope(first, bytes(more), end)

    async def read_or_none(self, path: str) -> bytes | None:
        """A small object (a lease), at most ``MAX_LEASE_BYTES``; None if absent."""
        try:
            return bytes(await self._fs._cat_file(path, start=0, end=MAX_LEASE_BYTES))
        except FileNotFoundError:
            return None

    async def delete(self, path: str) -> None:
        """Remove ``path``; ``FileNotFoundError`` if absent (S3 deletes of a miss succeed, so ask first)."""
        fs = self._fs
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        await fs._info(path)
        await fs._rm_file(path)

    async def delete_if_present(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await self._fs._rm_file(path)

    async def delete_if_version(self, path: str, version: Any) -> bool:
        """Remove ``path`` unless its ETag/generation differs from ``version`` (None: no guard known)."""
        fs = self._fs
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        info = await fs._info(path)
        if version is not None and _version_of(info) != version:
            return False
        await fs._rm_file(path)
        return True

    async def delete_many(self, paths: list[str]) -> None:
        """Remove ``paths`` in one request (a batch delete on object stores)."""
        await self._fs._rm(paths)


def _read_capped(read: Callable[[int], bytes], stop: threading.Event, max_entry_bytes: int) -> memoryview:
    """Read an envelope through ``read(n)``: its header, then up to the length it states, checking ``stop`` per chunk."""
    head = b""
    while len(head) < HEADER_SIZE:
        chunk = read(HEADER_SIZE - len(head))
        if not chunk:
            return memoryview(head)  # truncated: the codec says so
        head += chunk
    limit = stored_length(head, max_entry_bytes) + 1  # one more byte shows trailing bytes
    buffer = bytearray(limit)
    view = memoryview(buffer)
    view[:HEADER_SIZE] = head
    filled = HEADER_SIZE
    while filled < limit:
        if stop.is_set():
            raise TimeoutError("read stopped at its deadline")
        chunk = read(min(READ_CHUNK_BYTES, limit - filled))
        if not chunk:
            break
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return joined_envelope(view[:filled], b"", limit)


async def _ranged_read(fs: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of ``path`` in one request: fewer at the object's end, ``b""`` for an empty object."""
    try:
        return bytes(await fs._cat_file(path, start=start, end=end))
    except FileNotFoundError:
        raise
    except Exception as exc:
        if _range_not_satisfiable(exc):
            return b""
        raise


def _range_not_satisfiable(exc: BaseException) -> bool:
    """True if ``exc`` (or what it was raised from) is an HTTP 416 answer to a range read.

    An object store answers a range starting at 0 of an *empty* object with 416: that
    is the store's answer (an object too short to be an envelope, rejected by the codec),
    not its failure, so it must not count against the breaker. Each client says 416 its
    own way: gcsfs ``HttpError.code``, aiohttp ``ClientResponseError.status``, s3fs an
    ``OSError`` raised from botocore's ``ClientError`` (``InvalidRange``).
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for field in ("code", "status", "status_code"):
            if getattr(exc, field, None) == 416:
                return True
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            error = response.get("Error") or {}
            metadata = response.get("ResponseMetadata") or {}
            if error.get("Code") == "InvalidRange" or metadata.get("HTTPStatusCode") == 416:
                return True
        exc = exc.__cause__ or exc.__context__
    return False


#: How long a failed probe's diagnosis waits to connect to the endpoint (failure path only).
DIAGNOSE_CONNECT_S = 1.0


def _endpoint_of(options: Mapping[str, Any]) -> tuple[str, int] | None:
    """``(host, port)`` of the ``endpoint_url`` in fsspec storage options (s3fs: also in ``client_kwargs``), or None."""
    url = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    if not isinstance(url, str):
        return None
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return None
    return (parsed.hostname, port) if parsed.hostname else None


def _refused(exc: BaseException | None, endpoint: tuple[str, int] | None, timeout: float) -> bool:
    """True if the endpoint refused the connection: said in ``exc``'s chain, or, where the probe ran out of
    time (the filesystem retrying), found by one connect to ``endpoint``."""
    seen: set[int] = set()
    failure = exc
    while failure is not None and id(failure) not in seen:
        if isinstance(failure, ConnectionRefusedError):
            return True
        seen.add(id(failure))
        failure = failure.__cause__ or failure.__context__
    if not isinstance(exc, TimeoutError) or endpoint is None:
        return False
    try:
        socket.create_connection(endpoint, timeout=min(DIAGNOSE_CONNECT_S, timeout)).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _probe_failure(location: str, exc: BaseException, timeout: float,
                   endpoint: tuple[str, int] | None = None) -> tuple[type[OSError], str]:
    """What a failed probe raises (strict) and says: one fault, one message, so a refused connection reads the
    same whether the filesystem's retries ended before the deadline or the deadline ended them."""
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError, f"remote cache {location}: the bucket or directory does not exist ({exc})"
    if isinstance(exc, PermissionError):
        return PermissionError, f"remote cache {location}: access denied, check the credentials ({exc})"
    if _refused(exc, endpoint, timeout):
        where = f"{endpoint[0]}:{endpoint[1]}" if endpoint is not None else "its endpoint"
        return ConnectionRefusedError, f"remote cache {location} is unreachable: {where} refused the connection"
    if isinstance(exc, TimeoutError):
        return TimeoutError, f"remote cache {location}: no answer within {timeout:g} s"
    return OSError, f"remote cache {location} is unreachable: {type(exc).__name__}: {exc}"


def _plan_filesystem(
    url: str, storage_options: dict[str, Any]
) -> tuple[Any | None, str, FilesystemFactory | DeferredFilesystemFactory | None]:
    """The filesystem of ``url`` as (instance or None, root path, factory or None), building nothing that may block.

    A plain URL gives a factory (the runner builds it under the deadline); one of an object store
    (s3://, gs://) a deferred one, which imports nothing until then; a chained one
    (``simplecache::s3://...``) is built here by fsspec, whose layers construct lazily.
    """
    deferred = DeferredFilesystemFactory.for_url(url, storage_options)  # None for a chained URL too
    if deferred is not None:
        return None, deferred.root, ObjectStoreFactory.serving(deferred) or GcsJsonFactory.serving(deferred) or deferred
    import fsspec
    from fsspec.core import split_protocol, url_to_fs

    if "::" in url:
        fs, root = url_to_fs(url, **storage_options)
        return fs, root, None
    protocol = split_protocol(url)[0] or "file"
    fs_class = fsspec.get_filesystem_class(protocol)
    kwargs = {**fs_class._get_kwargs_from_urls(url), **storage_options}
    return None, fs_class._strip_protocol(url), FilesystemFactory(fs_class, kwargs)


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]


def _version_of(info: Mapping[str, Any]) -> Any:
    """The object's identity from a listing or ``info`` (S3 ETag, GCS generation, inode+size+mtime on a
    file system); None where the store gives none."""
    for field in ("ETag", "etag", "generation"):
        value = info.get(field)
        if value:
            return str(value)
    if info.get("ino") is not None and info.get("mtime") is not None:  # a local or NFS path: cuda-core's guard
        return f"{info['ino']}:{info.get('size')}:{info['mtime']}"
    return None


def _mtime_of(info: Mapping[str, Any]) -> float | None:
    """Modification time from a listing entry; each fsspec backend names it differently."""
    for field in ("mtime", "LastModified", "updated", "created"):
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None
