"""The remote tier: a ``ProgramCacheResource`` over any fsspec URL (S3, GCS, NFS, memory://).

Entries live at ``<url>/entries/<2 hex>/<62 hex>``, the hex being ``sha256(key)``: the
naming of cuda-core's local file tier, so a bucket and a local cache directory list
the same names. Each object is an envelope (:mod:`tiered_progcache.envelope`) that
carries the payload's digest and, with a signing key, an HMAC; every read is verified.

This tier *raises* on every kind of trouble (``KeyError`` on a miss, ``EntryRejected``
for a bad entry, ``TimeoutError``, ``TierUnavailable`` while the breaker is open,
``OSError``); the chain (:mod:`tiered_progcache.tier`) turns each into a counted miss.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import logging
import math
import os
import posixpath
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

from cuda.core import ObjectCode
from cuda.core.utils import FileStreamProgramCache, ProgramCacheResource
from cuda.core.utils._program_cache._abc import _as_key_bytes, _extract_bytes

from .breaker import CircuitBreaker, DeadlineRunner
from .envelope import MAX_ENTRY_BYTES, EnvelopeCodec, InvalidEnvelope
from .localdir import LocalDir, _is_entry_name, entry_name

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RemoteEntry",
    "RemoteProgramCache",
    "TransferReport",
    "check_url",
]

logger = logging.getLogger(__name__)

#: Seconds one remote request may take before it counts as a failure.
DEFAULT_TIMEOUT_S = 5.0
#: A listing reads the whole prefix page by page, so it gets at least this long.
MIN_LIST_TIMEOUT_S = 120.0
#: Requests in flight at once during warm()/push().
DEFAULT_TRANSFER_CONCURRENCY = 64
#: Threads that verify and write fetched entries into the local directory during warm().
LOCAL_WRITERS = 8

Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class RemoteEntry:
    """One object under ``entries/``: its 64-hex name, stored (envelope) size, and mtime if the store says. Immutable."""

    name: str
    size: int
    mtime: float | None


@dataclasses.dataclass(frozen=True)
class TransferReport:
    """What one ``warm`` or ``push`` did: entries and payload bytes moved, failures, names already there. Immutable."""

    entries: int
    bytes: int
    seconds: float
    failures: int
    skipped: int


class RemoteProgramCache(ProgramCacheResource):
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
        from fsspec.asyn import AsyncFileSystem

        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url if url is not None else f"{_protocol(fs)}://{self.root}"
        self.read_only = bool(read_only)
        self.timeout = _check_timeout(timeout)
        if not isinstance(transfer_concurrency, int) or transfer_concurrency < 1:
            raise ValueError(f"transfer_concurrency must be a positive int, got {transfer_concurrency!r}")
        self.transfer_concurrency = transfer_concurrency
        self._codec = EnvelopeCodec(signing_key, compression, max_entry_bytes=max_entry_bytes)
        self._breaker = breaker if breaker is not None else CircuitBreaker(name=f"remote cache {self.url}")
        self._runner = DeadlineRunner(max_threads=8, name="remote")
        self._async = isinstance(fs, AsyncFileSystem)
        # Object stores (root_marker "") put whole objects atomically and have buckets.
        self._bucket_store = not getattr(fs, "root_marker", "/")
        self._atomic_put = self._async or _protocol(fs) == "memory"
        base = self.root if self.root else fs._strip_protocol("")
        self._entries = f"{base.rstrip('/')}/entries"
        self._tmp = f"{base.rstrip('/')}/tmp"
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
            f"RemoteProgramCache({self.url!r}, read_only={self.read_only}, signed={self._codec.signed}, "
            f"compression={self._codec.compression!r}, breaker={self._breaker.state})"
        )

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    # -- the mapping API -------------------------------------------------------------

    def __getitem__(self, key: bytes | str) -> bytes:
        name = entry_name(_as_key_bytes(key))
        try:
            return self.read_entry(name)
        except InvalidEnvelope:
            raise
        except KeyError:
            raise KeyError(key) from None

    def __setitem__(self, key: bytes | str, value: bytes | bytearray | memoryview | ObjectCode) -> None:
        name = entry_name(_as_key_bytes(key))
        data = _extract_bytes(value)
        self.write_entry(name, data)

    def __delitem__(self, key: bytes | str) -> None:
        name = entry_name(_as_key_bytes(key))
        try:
            self.delete_entry(name)
        except KeyError:
            raise KeyError(key) from None

    def __len__(self) -> int:
        """Entries under the prefix: lists the whole prefix (the chain never asks a shared tier)."""
        return sum(1 for _ in self.iter_entries())

    def clear(self) -> None:
        """Delete every entry under this URL's prefix. Only ever called on purpose (the CLI)."""
        self._require_writable("clear")
        paths = [self._path(entry.name) for entry in self.iter_entries()]
        for start in range(0, len(paths), 1000):
            batch = paths[start : start + 1000]
            self._run("delete", self.fs.rm, getattr(self.fs, "_rm", None), batch, timeout=self._list_timeout)

    def close(self) -> None:
        """Stop the tier's idle threads. The fsspec filesystem is shared (fsspec caches instances), so it stays open."""
        self._runner.close()

    # -- by entry name (what listings, warm, push and the CLI see) ---------------------

    def iter_entries(self) -> Iterator[RemoteEntry]:
        """Every entry under ``entries/`` (one listing of the prefix; not kept in a cache)."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self._entries)
        find = functools.partial(self.fs.find, detail=True)
        afind = functools.partial(self.fs._find, detail=True) if self._async else None
        try:
            listing = self._run("list", find, afind, self._entries, timeout=self._list_timeout)
        except FileNotFoundError:
            return
        prefix = self.fs._strip_protocol(self._entries).rstrip("/") + "/"
        for path, info in listing.items():
            if not path.startswith(prefix) or info.get("type", "file") != "file":
                continue
            shard, _, rest = path[len(prefix) :].partition("/")
            name = shard + rest
            if len(shard) != 2 or "/" in rest or not _is_entry_name(name):
                continue
            yield RemoteEntry(name, int(info.get("size") or 0), _mtime_of(info))

    def read_entry(self, name: str) -> bytes:
        """The verified payload of entry ``name``: ``KeyError`` if absent, ``EntryRejected`` if bad."""
        path = self._path(name)
        try:
            blob = self._run("read", self.fs.cat_file, getattr(self.fs, "_cat_file", None), path)
        except FileNotFoundError:
            raise KeyError(name) from None
        return self._codec.open(name, blob)

    def write_entry(self, name: str, payload: bytes) -> None:
        """Seal ``payload`` and store it under ``name``, replacing whatever was there."""
        self._require_writable("write")
        path = self._path(name)
        blob = self._codec.seal(name, bytes(payload))
        self._run("write", self._put_sync, self._put_async if self._async else None, path, blob)

    def delete_entry(self, name: str) -> None:
        """Remove entry ``name``; ``KeyError`` if it is not there."""
        self._require_writable("delete")
        path = self._path(name)
        try:
            self._run("delete", self._delete_sync, self._delete_async if self._async else None, path)
        except FileNotFoundError:
            raise KeyError(name) from None

    def verify_entry(self, name: str) -> str | None:
        """``None`` if entry ``name`` verifies, else a one-line reason (``"missing"`` if absent)."""
        try:
            self.read_entry(name)
        except InvalidEnvelope as exc:
            return exc.reason
        except KeyError:
            return "missing"
        return None

    # -- bulk transfer ---------------------------------------------------------------

    def warm(
        self,
        local: LocalDir | FileStreamProgramCache | str | os.PathLike[str],
        names: Iterable[str] | None = None,
        *,
        progress: Progress | None = None,
    ) -> TransferReport:
        """Copy remote entries the local directory lacks into it, verified, many requests at a time.

        >>> report = remote.warm(LocalDir("/var/cache/kernels"), progress=lambda done, total: ...)

        ``names`` limits it to those entries (default: everything listed). Async
        filesystems fetch with fsspec's batched ``cat`` (``transfer_concurrency``
        requests in flight); others use the tier's threads. A bad or unreadable
        entry is counted in ``failures`` and skipped; the rest still land.
        """
        local_dir = _as_local_dir(local)
        started = time.perf_counter()
        wanted = self._names_or_listing(names)
        have = local_dir.names()
        todo = [name for name in wanted if name not in have]
        done = moved = nbytes = failures = 0
        first_problem = ""
        _tell(progress, 0, len(todo))
        # Verify-and-write (hashing and fsync release the GIL) runs on threads, one batch behind
        # the fetches, so the disk and the network work at the same time.
        with concurrent.futures.ThreadPoolExecutor(LOCAL_WRITERS, thread_name_prefix="tiered-progcache-warm") as pool:
            landing: list[tuple[str, concurrent.futures.Future[int]]] = []
            for batch in [*_chunks(todo, self.transfer_concurrency), []]:
                fetched = self._fetch_many(batch) if batch else {}
                for name, future in landing:
                    try:
                        nbytes += future.result()
                        moved += 1
                    except Exception as exc:
                        failures += 1
                        first_problem = first_problem or f"{name[:12]}: {_describe(exc)}"
                if landing:
                    done += len(landing)
                    _tell(progress, done, len(todo))
                landing = [(name, pool.submit(self._land, local_dir, name, fetched[name])) for name in batch]
        if failures:
            logger.warning("warm from %s: %d of %d entries failed (first: %s)", self.url, failures, len(todo), first_problem)
        return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo))

    def push(
        self,
        local: LocalDir | FileStreamProgramCache | str | os.PathLike[str],
        names: Iterable[str] | None = None,
        *,
        progress: Progress | None = None,
    ) -> TransferReport:
        """Upload local entries the remote lacks, as envelopes, many requests at a time.

        >>> report = remote.push(FileStreamProgramCache("/ci/cache"), progress=bar.update_to)

        ``names`` limits it to those local entries (default: all). ``PermissionError``
        on a read-only tier.
        """
        self._require_writable("push")
        local_dir = _as_local_dir(local)
        started = time.perf_counter()
        wanted = list(dict.fromkeys(_check_name(n) for n in names)) if names is not None else sorted(local_dir.names())
        there = {entry.name for entry in self.iter_entries()}
        todo = [name for name in wanted if name not in there]
        done = moved = nbytes = failures = 0
        first_problem = ""
        _tell(progress, 0, len(todo))
        for batch in _chunks(todo, self.transfer_concurrency):
            blobs: dict[str, bytes] = {}
            sizes: dict[str, int] = {}
            for name in batch:
                payload = local_dir.read(name)
                if payload is None:  # pruned since it was listed
                    failures += 1
                    first_problem = first_problem or f"{name[:12]}: gone from the local directory"
                    continue
                blobs[name] = self._codec.seal(name, payload)
                sizes[name] = len(payload)
            for name, error in self._put_many(blobs).items():
                if error is None:
                    moved += 1
                    nbytes += sizes[name]
                else:
                    failures += 1
                    first_problem = first_problem or f"{name[:12]}: {_describe(error)}"
            done += len(batch)
            _tell(progress, done, len(todo))
        if failures:
            logger.warning("push to %s: %d of %d entries failed (first: %s)", self.url, failures, len(todo), first_problem)
        return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo))

    # -- internals: every request goes through _run -----------------------------------

    @property
    def _list_timeout(self) -> float:
        return max(self.timeout, MIN_LIST_TIMEOUT_S)

    def _run(
        self,
        what: str,
        sync_fn: Callable[..., Any],
        async_fn: Callable[..., Any] | None,
        *args: Any,
        timeout: float | None = None,
    ) -> Any:
        """One request under the failure policy: breaker check, deadline, breaker bookkeeping."""
        self._breaker.before_call()
        limit = self.timeout if timeout is None else timeout
        what = f"{what} on {self.url}"
        try:
            if self._async and async_fn is not None:
                result = self._runner.run_async(self.fs.loop, async_fn, *args, timeout=limit, what=what)
            else:
                result = self._runner.run_sync(sync_fn, *args, timeout=limit, what=what)
        except FileNotFoundError:
            self._breaker.record_success()  # an answer: the remote works
            raise
        except Exception as exc:
            self._breaker.record_failure(exc)
            raise
        self._breaker.record_success()
        return result

    def _path(self, name: str) -> str:
        _check_name(name)
        return f"{self._entries}/{name[:2]}/{name[2:]}"

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise PermissionError(f"remote cache {self.url} is read-only; refusing to {what}")

    def _put_sync(self, path: str, blob: bytes) -> None:
        fs = self.fs
        if self._atomic_put:
            fs.pipe_file(path, blob)
            return
        # A file system: stage next to the entries and rename, so readers never see a partial file.
        fs.makedirs(self._tmp, exist_ok=True)
        staged = f"{self._tmp}/{uuid.uuid4().hex}"
        fs.pipe_file(staged, blob)
        try:
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            fs.mv(staged, path)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(staged)
            raise

    async def _put_async(self, path: str, blob: bytes) -> None:
        await self.fs._pipe_file(path, blob)

    def _delete_sync(self, path: str) -> None:
        # S3 deletes of a missing object succeed, so ask first: delete of a miss is a KeyError.
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)
        self.fs.info(path)
        self.fs.rm_file(path)

    async def _delete_async(self, path: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)
        await self.fs._info(path)
        await self.fs._rm_file(path)

    def _fetch_many(self, names: list[str]) -> dict[str, bytes | BaseException]:
        """Raw envelopes for ``names`` (or the exception each failed with), one batch."""
        paths = {self._path(name): name for name in names}
        out: dict[str, bytes | BaseException] = {}
        try:
            if self._async:
                got = self._run(
                    "batched read",
                    self.fs.cat,
                    functools.partial(self.fs._cat, on_error="return", batch_size=len(paths)),
                    list(paths),
                    timeout=self._batch_timeout(len(paths)),
                )
                for path, name in paths.items():
                    out[name] = got.get(path, FileNotFoundError(path))
                broken = [r for r in out.values() if isinstance(r, Exception) and not isinstance(r, FileNotFoundError)]
                if broken and len(broken) == len(out):  # every request failed: the remote, not the entries
                    self._breaker.record_failure(broken[0])
                return out
            futures = {name: self._submit_checked(self.fs.cat_file, path) for path, name in paths.items()}
        except Exception as exc:  # the whole batch failed (breaker open, timeout)
            return {name: exc for name in names}
        return self._collect(futures)

    def _put_many(self, blobs: dict[str, bytes]) -> dict[str, BaseException | None]:
        """Store each sealed blob; ``None`` for a success, else the exception."""
        if not blobs:
            return {}
        items = [(self._path(name), blob) for name, blob in blobs.items()]
        try:
            if self._async:

                async def put_all() -> list[Any]:
                    return await asyncio.gather(*(self.fs._pipe_file(p, b) for p, b in items), return_exceptions=True)

                results = self._run(
                    "batched write", self._put_sync, put_all, timeout=self._batch_timeout(len(items))
                )
                return {name: (r if isinstance(r, BaseException) else None) for name, r in zip(blobs, results)}
            futures = {name: self._submit_checked(self._put_sync, path, blob) for name, (path, blob) in zip(blobs, items)}
        except Exception as exc:
            return {name: exc for name in blobs}
        return {name: (r if isinstance(r, BaseException) else None) for name, r in self._collect(futures).items()}

    def _batch_timeout(self, requests: int) -> float:
        # A batch's requests run side by side; allow for a connection pool smaller than the batch.
        return self.timeout * max(2, math.ceil(requests / 16))

    def _submit_checked(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._breaker.before_call()
        return self._runner.submit(fn, *args)

    def _collect(self, futures: dict[str, Any]) -> dict[str, Any]:
        """Wait for per-entry futures (blocking filesystems), the whole batch under one deadline."""
        deadline = time.monotonic() + self._batch_timeout(len(futures))
        out: dict[str, Any] = {}
        for name, future in futures.items():
            try:
                out[name] = future.result(max(0.0, deadline - time.monotonic()))
            except FileNotFoundError as exc:
                out[name] = exc
            except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                future.cancel()
                out[name] = TimeoutError(f"{self.url}: request took longer than {self.timeout:g} s")
                self._breaker.record_failure(out[name])
                continue
            except Exception as exc:
                out[name] = exc
                self._breaker.record_failure(exc)
                continue
            self._breaker.record_success()
        return out

    def _land(self, local_dir: LocalDir, name: str, fetched: bytes | BaseException) -> int:
        """Verify one fetched envelope and write its payload into the local directory; its size."""
        if isinstance(fetched, BaseException):
            raise fetched
        payload = self._codec.open(name, fetched)
        local_dir.write(name, payload)
        return len(payload)

    def _names_or_listing(self, names: Iterable[str] | None) -> list[str]:
        if names is not None:
            return list(dict.fromkeys(_check_name(n) for n in names))
        return [entry.name for entry in self.iter_entries()]

    def _check_reachable(self, strict: bool) -> None:
        """Probe the bucket (object stores) or directory once, so a bad config shows up now."""
        try:
            if self._bucket_store:
                bucket = self.root.split("/", 1)[0]
                self._run("probe", self.fs.info, getattr(self.fs, "_info", None), bucket)
            elif self.root not in ("", "/"):
                if not self._run("probe", self.fs.isdir, None, self.root):
                    if self.read_only:
                        raise FileNotFoundError(f"{self.root} does not exist")
                    self._run("probe", functools.partial(self.fs.makedirs, exist_ok=True), None, self.root)
        except Exception as exc:
            message = _unreachable_message(self.url, exc, self.timeout)
            if strict:
                error = type(exc) if type(exc) in (FileNotFoundError, PermissionError, TimeoutError) else OSError
                raise error(message) from exc
            logger.warning("%s; continuing without it, probing again in %.0f s", message, self._breaker.cooldown_s)
            self._breaker.trip(exc)


def _unreachable_message(url: str, exc: BaseException, timeout: float) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"remote cache {url}: the bucket or directory does not exist ({exc})"
    if isinstance(exc, PermissionError):
        return f"remote cache {url}: access denied, check the credentials ({exc})"
    if isinstance(exc, TimeoutError):
        return f"remote cache {url}: no answer within {timeout:g} s"
    return f"remote cache {url} is unreachable: {type(exc).__name__}: {exc}"


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


def _check_timeout(timeout: float | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return float(timeout)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _is_entry_name(name):
        raise ValueError(f"not an entry name (64 lowercase hex digits): {name!r}")
    return name


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]


def _as_local_dir(local: LocalDir | FileStreamProgramCache | str | os.PathLike[str]) -> LocalDir:
    if isinstance(local, LocalDir):
        return local
    if isinstance(local, FileStreamProgramCache):
        return LocalDir.of(local)
    if isinstance(local, (str, os.PathLike)):
        return LocalDir(local)
    raise TypeError(f"local must be a LocalDir, FileStreamProgramCache or path, got {type(local).__name__}")


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


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _tell(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, InvalidEnvelope) else f"{type(exc).__name__}: {exc}"
