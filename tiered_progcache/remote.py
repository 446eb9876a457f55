"""The remote tier: one shared store of cache entries on any fsspec URL (S3, GCS, NFS, memory://).

Entries live at ``<url>/entries/<2 hex>/<62 hex>``, the hex being ``sha256(key)``: the
naming of cuda-core's local file tier, so a bucket and a local cache directory list
the same names. Each object is an envelope (:mod:`tiered_progcache.envelope`) that
carries the payload's digest and, with a signing key, an HMAC; every read is verified.
Cluster leases live beside them, at ``<url>/leases/<name>`` (:class:`RemoteLeases`).

This tier *raises* on every kind of trouble (``KeyError`` on a miss, ``EntryRejected``
for a bad entry, ``TimeoutError``, ``TierUnavailable`` while the breaker is open,
``OSError``); the chain (:mod:`tiered_progcache.tier`) turns each into a counted miss.
Every request goes through the tier's one :class:`~tiered_progcache.runner.RequestRunner`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import math
import os
import posixpath
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cuda.core import ObjectCode
from cuda.core.utils import ProgramCacheResource

from . import _cudacore, fsutil
from .breaker import CircuitBreaker
from .envelope import MAX_ENTRY_BYTES, EnvelopeCodec, InvalidEnvelope
from .runner import RequestRunner
from .store import EntryStore, LeaseStore, StoredEntry, check_entry_name, entry_name, is_entry_name

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_TRANSFER_CONCURRENCY",
    "RemoteLeases",
    "RemoteProgramCache",
    "check_url",
]

logger = logging.getLogger(__name__)

#: Seconds one remote request may take before it counts as a failure.
DEFAULT_TIMEOUT_S = 5.0
#: A listing reads the whole prefix page by page, so it gets at least this long.
MIN_LIST_TIMEOUT_S = 120.0
#: Requests in flight at once during a bulk transfer (:mod:`tiered_progcache.transfer`).
DEFAULT_TRANSFER_CONCURRENCY = 64

# Object stores whose put can be conditional (S3 ``If-None-Match: *``, GCS
# ``ifGenerationMatch=0``, memory:// in-process): ``pipe_file(mode="create")`` is atomic.
# fsspec's generic ``mode="create"`` elsewhere is check-then-write, so it is not.
_CONDITIONAL_PUT_PROTOCOLS = frozenset({"memory", "s3", "s3a", "gs", "gcs"})
# Local and NFS paths: create-if-absent is stage-then-link(2) (fsutil.create_exclusive).
_LOCAL_PROTOCOLS = frozenset({"file", "local"})


class RemoteProgramCache(ProgramCacheResource, EntryStore):
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

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        url: str | None = None,
        read_only: bool = False,
        signing_key: bytes | str | None = None,
        compression: str | None = None,
        timeout: float | None = None,
        strict: bool = False,
        breaker: CircuitBreaker | None = None,
        transfer_concurrency: int = DEFAULT_TRANSFER_CONCURRENCY,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url if url is not None else f"{_protocol(fs)}://{self.root}"
        self._location = _without_password(self.url)
        self._read_only = bool(read_only)
        self.timeout = _check_timeout(timeout)
        if not isinstance(transfer_concurrency, int) or transfer_concurrency < 1:
            raise ValueError(f"transfer_concurrency must be a positive int, got {transfer_concurrency!r}")
        self.transfer_concurrency = transfer_concurrency
        self._codec = EnvelopeCodec(signing_key, compression, max_entry_bytes=max_entry_bytes)
        self._max_entry_bytes = max_entry_bytes
        self._breaker = breaker if breaker is not None else CircuitBreaker(name=f"remote cache {self._location}")
        self._runner = RequestRunner(fs, timeout=self.timeout, breaker=self._breaker, name=self._location)
        # Object stores (root_marker "") put whole objects atomically and have buckets.
        self._bucket_store = not fs.root_marker
        base = (self.root if self.root else fs._strip_protocol("")).rstrip("/")
        self._entries = f"{base}/entries"
        self._objects = _Objects(fs, f"{base}/tmp", is_async=self._runner.is_async)
        self._leases = None if self._read_only else RemoteLeases(self._objects, self._runner, f"{base}/leases", self._location)
        if self._bucket_store and not self.root:
            raise ValueError(f"remote URL {self.url!r} names no bucket")
        self._check_reachable(strict)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        read_only: bool = False,
        signing_key: bytes | str | None = None,
        compression: str | None = None,
        timeout: float | None = None,
        strict: bool = False,
        **options: Any,
    ) -> RemoteProgramCache:
        """Build the tier from a URL and fsspec ``storage_options``.

        >>> RemoteProgramCache.from_url("s3://bucket/kernels", storage_options={"endpoint_url": "http://127.0.0.1:9000"})

        An unknown scheme, options that are not a mapping, a bad timeout or compression
        raise ``ValueError``/``TypeError`` at once; a missing filesystem package (s3fs,
        gcsfs) raises ``ImportError``. An unreachable remote, a missing bucket or bad
        credentials raise only with ``strict=True``; otherwise the tier logs a warning
        and starts with its breaker open (the chain works local-only until a probe
        succeeds). ``options`` go to :class:`RemoteProgramCache` (``breaker``,
        ``transfer_concurrency``, ``max_entry_bytes``).
        """
        from fsspec.core import url_to_fs

        if storage_options is None:
            storage_options = {}
        if not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {type(storage_options).__name__}")
        check_url(url)
        fs, root = url_to_fs(url, **dict(storage_options))
        return cls(
            fs,
            root,
            url=url.rstrip("/"),
            read_only=read_only,
            signing_key=signing_key,
            compression=compression,
            timeout=timeout,
            strict=strict,
            **options,
        )

    def __repr__(self) -> str:
        return (
            f"RemoteProgramCache({self._location!r}, read_only={self._read_only}, signed={self._codec.signed}, "
            f"compression={self._codec.compression!r}, breaker={self._breaker.state})"
        )

    # -- what the store is -----------------------------------------------------------

    @property
    def location(self) -> str:
        """The URL, with any password in it removed."""
        return self._location

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def shared(self) -> bool:
        return True

    @property
    def available(self) -> bool:
        """False while the breaker is open (the remote failed repeatedly and is cooling down)."""
        return self._breaker.state != "open"

    @property
    def atomic_create(self) -> bool:
        return self._objects.atomic_create

    @property
    def max_entry_bytes(self) -> int:
        return self._max_entry_bytes

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    @property
    def runner(self) -> RequestRunner:
        """The one door every request to this remote goes through (deadline and breaker)."""
        return self._runner

    def path_for(self, name: str) -> str:
        """The object path of entry ``name`` on the filesystem (``ValueError`` unless an entry name)."""
        check_entry_name(name)
        return f"{self._entries}/{name[:2]}/{name[2:]}"

    # -- the mapping API -------------------------------------------------------------

    def __getitem__(self, key: bytes | str) -> bytes:
        name = entry_name(_cudacore.as_key_bytes(key))
        try:
            return self.read_entry(name)
        except InvalidEnvelope:
            raise
        except KeyError:
            raise KeyError(key) from None

    def __setitem__(self, key: bytes | str, value: bytes | bytearray | memoryview | ObjectCode) -> None:
        name = entry_name(_cudacore.as_key_bytes(key))
        data = _cudacore.extract_bytes(value)
        self.write_entry(name, data)

    def __delitem__(self, key: bytes | str) -> None:
        name = entry_name(_cudacore.as_key_bytes(key))
        try:
            self.delete_entry(name)
        except KeyError:
            raise KeyError(key) from None

    def __len__(self) -> int:
        """Entries under the prefix: lists the whole prefix (the chain never asks a shared tier)."""
        return sum(1 for _ in self.iter_entries())

    def clear(self) -> None:
        """Delete every entry under this URL's prefix. Only ever called on purpose (the CLI)."""
        self.delete_entries(list(self.iter_entries()))

    def delete_entries(self, entries: Iterable[StoredEntry]) -> int:
        """Delete listed entries in batches of 1000 paths per request; the count asked to delete."""
        self._require_writable("clear")
        paths = [self.path_for(entry.name) for entry in entries]
        rm_async = self.fs._rm if self._runner.is_async else None
        for start in range(0, len(paths), 1000):
            batch = paths[start : start + 1000]
            self._runner.call("delete", self.fs.rm, rm_async, batch, timeout=self._list_timeout)
        return len(paths)

    def close(self) -> None:
        """Stop the tier's idle threads. The fsspec filesystem is shared (fsspec caches instances), so it stays open."""
        self._runner.close()

    # -- by entry name (what listings, transfers and the CLI see) -----------------------

    def iter_entries(self) -> Iterator[StoredEntry]:
        """Every entry under ``entries/`` (one listing of the prefix; not kept in a cache)."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self._entries)
        find = functools.partial(self.fs.find, detail=True)
        afind = functools.partial(self.fs._find, detail=True) if self._runner.is_async else None
        try:
            listing = self._runner.call("list", find, afind, self._entries, timeout=self._list_timeout)
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

    def read_entry(self, name: str) -> bytes:
        """The verified payload of entry ``name``: ``KeyError`` if absent, ``EntryRejected`` if bad."""
        return self._codec.open(name, self._read_envelope(name))

    def write_entry(self, name: str, payload: bytes) -> None:
        """Seal ``payload`` and store it under ``name``, replacing whatever was there."""
        self._require_writable("write")
        path = self.path_for(name)
        blob = self._codec.seal(name, bytes(payload))
        self._runner.call("write", self._objects.put, self._objects.put_async_or_none, path, blob)

    def create_entry(self, name: str, payload: bytes) -> bool:
        """Seal and store ``payload`` only if ``name`` is absent; False if it was there.

        One atomic request where the store has one (:attr:`atomic_create`); else a check
        then a write, which two writers can both pass (harmless: same compile, same bytes).
        """
        self._require_writable("create")
        path = self.path_for(name)
        blob = self._codec.seal(name, bytes(payload))
        return self._runner.call("create", self._objects.create, self._objects.create_async_or_none, path, blob)

    def delete_entry(self, name: str) -> None:
        """Remove entry ``name``; ``KeyError`` if it is not there."""
        self._require_writable("delete")
        path = self.path_for(name)
        try:
            self._runner.call("delete", self._objects.delete, self._objects.delete_async_or_none, path)
        except FileNotFoundError:
            raise KeyError(name) from None

    def delete_listed(self, entry: StoredEntry) -> bool:
        """Remove ``entry`` unless it went, or (where the listing gave an ETag/generation) was replaced, since listed."""
        self._require_writable("delete")
        path = self.path_for(entry.name)
        try:
            return self._runner.call("delete", self._objects.delete_if_version, None, path, entry.version)
        except FileNotFoundError:
            return False

    def verify_entry(self, name: str) -> str | None:
        """``None`` if entry ``name`` verifies, else a one-line reason (``"missing"`` if absent)."""
        try:
            self.read_entry(name)
        except InvalidEnvelope as exc:
            return exc.reason
        except KeyError:
            return "missing"
        return None

    def leases(self) -> RemoteLeases | None:
        """The lease namespace ``<url>/leases/``; None on a read-only tier (it would never upload)."""
        return self._leases

    # -- raw envelopes in batches (what transfer.warm/push use) -------------------------

    def seal_envelope(self, name: str, payload: bytes) -> bytes:
        """The envelope this tier would store for ``payload`` under ``name``."""
        return self._codec.seal(name, bytes(payload))

    def open_envelope(self, name: str, blob: bytes) -> bytes:
        """The payload of a fetched envelope, verified (``InvalidEnvelope`` if it fails)."""
        return self._codec.open(name, blob)

    def read_envelopes(self, names: list[str]) -> dict[str, bytes | BaseException]:
        """Raw envelopes of ``names`` (or the exception each failed with), fetched side by side, one deadline."""
        paths = [self.path_for(name) for name in names]
        cat_async = self.fs._cat_file if self._runner.is_async else None
        results = self._runner.call_many("batched read", self.fs.cat_file, cat_async, [(p,) for p in paths])
        return dict(zip(names, results))

    def write_envelopes(self, blobs: Mapping[str, bytes]) -> dict[str, BaseException | None]:
        """Store sealed envelopes side by side, one deadline: ``None`` per success, else the exception."""
        self._require_writable("write")
        calls = [(self.path_for(name), blob) for name, blob in blobs.items()]
        results = self._runner.call_many("batched write", self._objects.put, self._objects.put_async_or_none, calls)
        return {name: (r if isinstance(r, BaseException) else None) for name, r in zip(blobs, results)}

    @property
    def transfer_batch(self) -> int:
        """Entries per bulk request batch: ``transfer_concurrency``."""
        return self.transfer_concurrency

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        """Verified payloads of ``names``, fetched side by side under one deadline (``KeyError`` per absent one)."""
        results: dict[str, bytes | Exception] = {}
        for name, fetched in self.read_envelopes(list(names)).items():
            try:
                if isinstance(fetched, FileNotFoundError):
                    raise KeyError(name)
                if isinstance(fetched, BaseException):
                    raise fetched
                results[name] = self._codec.open(name, fetched)
            except Exception as exc:
                results[name] = exc
        return results

    def write_many(self, items: Mapping[str, bytes]) -> dict[str, Exception | None]:
        """Seal and store payloads side by side under one deadline: ``None`` per success, else the exception."""
        self._require_writable("write")
        blobs = {name: self._codec.seal(name, bytes(payload)) for name, payload in items.items()}
        return {name: error for name, error in self.write_envelopes(blobs).items()}  # type: ignore[misc]

    # -- internals ---------------------------------------------------------------------

    @property
    def _list_timeout(self) -> float:
        return max(self.timeout, MIN_LIST_TIMEOUT_S)

    def _read_envelope(self, name: str) -> bytes:
        path = self.path_for(name)
        cat_async = self.fs._cat_file if self._runner.is_async else None
        try:
            return self._runner.call("read", self.fs.cat_file, cat_async, path)
        except FileNotFoundError:
            raise KeyError(name) from None

    def _require_writable(self, what: str) -> None:
        if self._read_only:
            raise PermissionError(f"remote cache {self._location} is read-only; refusing to {what}")

    def _check_reachable(self, strict: bool) -> None:
        """Probe the bucket (object stores) or directory once, so a bad config shows up now."""
        info_async = self.fs._info if self._runner.is_async else None
        try:
            if self._bucket_store:
                bucket = self.root.split("/", 1)[0]
                self._runner.call("probe", self.fs.info, info_async, bucket)
            elif self.root not in ("", "/"):
                if not self._runner.call("probe", self.fs.isdir, None, self.root):
                    if self._read_only:
                        raise FileNotFoundError(f"{self.root} does not exist")
                    self._runner.call("probe", functools.partial(self.fs.makedirs, exist_ok=True), None, self.root)
        except Exception as exc:
            message = _unreachable_message(self._location, exc, self.timeout)
            if strict:
                error = type(exc) if type(exc) in (FileNotFoundError, PermissionError, TimeoutError) else OSError
                raise error(message) from exc
            logger.warning("%s; continuing without it, probing again in %.0f s", message, self._breaker.cooldown_s)
            self._breaker.trip(exc)


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
        objects = self._objects
        return self._runner.call("lease create", objects.create, objects.create_async_or_none, self._path(name), document)

    def read(self, name: str) -> bytes | None:
        objects = self._objects
        return self._runner.call("lease read", objects.read_or_none, objects.read_async_or_none, self._path(name))

    def replace(self, name: str, document: bytes, ttl_s: float) -> None:
        objects = self._objects
        self._runner.call("lease renew", objects.put, objects.put_async_or_none, self._path(name), document)

    def delete(self, name: str) -> None:
        objects = self._objects
        self._runner.call("lease delete", objects.delete_if_present, objects.delete_if_present_async_or_none, self._path(name))

    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"not a lease name (one path component): {name!r}")
        return f"{self._directory}/{name}"


class _Objects:
    """Whole-object requests on one fsspec filesystem: the only place that decides how an object is put or created.

    Each method is one request's worth of work, run by the caller through the runner.
    """

    def __init__(self, fs: Any, staging_dir: str, *, is_async: bool) -> None:
        self._fs = fs
        self._async = is_async
        self._staging_dir = staging_dir
        protocols = _protocols(fs)
        # Object stores (every async filesystem, memory://) replace an object whole in one put.
        self._whole_puts = is_async or "memory" in protocols
        self._local = bool(protocols & _LOCAL_PROTOCOLS)
        self._conditional_put = bool(protocols & _CONDITIONAL_PUT_PROTOCOLS)

    @property
    def atomic_create(self) -> bool:
        return self._local or self._conditional_put

    # -- put: replace whole ------------------------------------------------------------

    def put(self, path: str, blob: bytes) -> None:
        fs = self._fs
        if self._whole_puts:
            fs.pipe_file(path, blob)
            return
        # A file system: stage next to the entries and rename, so readers never see a partial file.
        fs.makedirs(self._staging_dir, exist_ok=True)
        staged = f"{self._staging_dir}/{uuid.uuid4().hex}"
        fs.pipe_file(staged, blob)
        try:
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            fs.mv(staged, path)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(staged)
            raise

    @property
    def put_async_or_none(self) -> Any:
        return self._put_async if self._async else None

    async def _put_async(self, path: str, blob: bytes) -> None:
        await self._fs._pipe_file(path, blob)

    # -- create: only if absent --------------------------------------------------------

    def create(self, path: str, blob: bytes) -> bool:
        if self._local:
            return fsutil.create_exclusive(os.path.normpath(path), blob, staging_dir=os.path.normpath(self._staging_dir))
        if self._conditional_put:
            try:
                self._fs.pipe_file(path, blob, mode="create")
            except FileExistsError:
                return False
            return True
        with contextlib.suppress(Exception):  # no atomic create here: check, then put
            self._fs.invalidate_cache(path)
        if self._fs.exists(path):
            return False
        self.put(path, blob)
        return True

    @property
    def create_async_or_none(self) -> Any:
        return self._create_async if self._async and self._conditional_put else None

    async def _create_async(self, path: str, blob: bytes) -> bool:
        try:
            await self._fs._pipe_file(path, blob, mode="create")
        except FileExistsError:
            return False
        return True

    # -- read and delete ---------------------------------------------------------------

    def read_or_none(self, path: str) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(path))
        except FileNotFoundError:
            return None

    @property
    def read_async_or_none(self) -> Any:
        return self._read_async if self._async else None

    async def _read_async(self, path: str) -> bytes | None:
        try:
            return bytes(await self._fs._cat_file(path))
        except FileNotFoundError:
            return None

    def delete(self, path: str) -> None:
        """Remove ``path``; ``FileNotFoundError`` if absent (S3 deletes of a miss succeed, so ask first)."""
        with contextlib.suppress(Exception):
            self._fs.invalidate_cache(path)
        self._fs.info(path)
        self._fs.rm_file(path)

    @property
    def delete_async_or_none(self) -> Any:
        return self._delete_async if self._async else None

    async def _delete_async(self, path: str) -> None:
        with contextlib.suppress(Exception):
            self._fs.invalidate_cache(path)
        await self._fs._info(path)
        await self._fs._rm_file(path)

    def delete_if_present(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(path)

    @property
    def delete_if_present_async_or_none(self) -> Any:
        return self._delete_if_present_async if self._async else None

    async def _delete_if_present_async(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await self._fs._rm_file(path)

    def delete_if_version(self, path: str, version: Any) -> bool:
        """Remove ``path`` unless its ETag/generation differs from ``version`` (None: no guard known)."""
        with contextlib.suppress(Exception):
            self._fs.invalidate_cache(path)
        info = self._fs.info(path)
        if version is not None and _version_of(info) != version:
            return False
        self._fs.rm_file(path)
        return True


def _unreachable_message(location: str, exc: BaseException, timeout: float) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"remote cache {location}: the bucket or directory does not exist ({exc})"
    if isinstance(exc, PermissionError):
        return f"remote cache {location}: access denied, check the credentials ({exc})"
    if isinstance(exc, TimeoutError):
        return f"remote cache {location}: no answer within {timeout:g} s"
    return f"remote cache {location} is unreachable: {type(exc).__name__}: {exc}"


def check_url(url: str) -> None:
    """``ValueError`` unless ``url`` is non-empty and each scheme in it is one fsspec knows."""
    import fsspec

    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"remote URL must be a non-empty str, got {url!r}")
    known = set(fsspec.available_protocols())
    for part in url.split("::"):
        scheme = part.split("://", 1)[0] if "://" in part else "file"
        if scheme not in known:
            raise ValueError(f"unknown URL scheme {scheme!r} in {url!r} (fsspec knows e.g. s3, gs, file, memory)")


def _without_password(url: str) -> str:
    """``url`` with the password of any ``user:password@`` removed (each part of a chained URL)."""
    parts = []
    for part in url.split("::"):
        scheme, sep, rest = part.partition("://")
        if sep:
            netloc, slash, path = rest.partition("/")
            userinfo, at, host = netloc.rpartition("@")
            if at:
                user = userinfo.split(":", 1)[0]
                netloc = f"{user}@{host}" if user else host
            part = f"{scheme}://{netloc}{slash}{path}"
        parts.append(part)
    return "::".join(parts)


def _check_timeout(timeout: float | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return float(timeout)


def _protocols(fs: Any) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]


def _version_of(info: Mapping[str, Any]) -> Any:
    """The object's identity from a listing or ``info`` (S3 ETag, GCS generation); None where the store gives none."""
    for field in ("ETag", "etag", "generation"):
        value = info.get(field)
        if value:
            return str(value)
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
