"""S3 through obstore, a client a fresh process builds in milliseconds.

s3fs takes 0.3-0.5 s of the interpreter to import (botocore, aiohttp), on the clock of every
fresh process, and a first request sets up its session; obstore (Rust's ``object_store``)
imports in a few ms. :class:`ObjectStoreCalls` answers the blocking fsspec methods the remote
tier's requests call (through :class:`~.runner.BlockingCalls`), so each request
(:class:`~.remote._Objects`) is written once for both clients. :func:`obstore_config` says when
obstore can be used: when the storage options and the environment say nothing it cannot honour
(an AWS profile, a region it would have to discover, an option it has no word for); otherwise
s3fs is built as before. A forked child of a process that made an obstore request builds s3fs
too: the runtime that request started has no threads in the child.

Thread-safe; one instance per process (rebuilt in a forked child, as the runner does).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .. import forks
from ..redact import mask_url
from .runner import DeferredFilesystemFactory

logger = logging.getLogger(__name__)

__all__ = ["CACHE_ONLY_OPTIONS", "REQUEST_TIMEOUT", "BucketCalls", "BucketFactory", "ObjectStoreCalls", "ObjectStoreFactory", "obstore_config",
           "runtime_lost_in_this_process"]

#: s3fs storage options obstore is told, by the name it has for them; ``client_kwargs`` are read as below.
_S3_OPTIONS = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
_S3_CLIENT_KWARGS = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
                     "aws_session_token": "session_token", "region_name": "region"}  # fmt: skip
#: Options of s3fs and gcsfs that change how fsspec caches, never what a request is: a client that keeps no
#: listing and reads whole objects can ignore them (obstore's, and GCS's in :mod:`.gcsjson`).
CACHE_ONLY_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                                "default_block_size", "default_cache_type", "asynchronous", "loop",
                                "cache_timeout"})  # fmt: skip
#: botocore ``Config`` fields that size its pool or time its calls: the runner's threads bound how many requests
#: run at once and its deadlines end them, so obstore has nothing to be told of them.
_BOTOCORE_CONFIG_IGNORED = frozenset({"max_pool_connections", "connect_timeout", "read_timeout"})
#: Where botocore finds credentials and regions obstore does not read: with one of them present, s3fs is used.
_AWS_FILES = (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))

#: The longest one obstore request may take, retries aside: a listing of a large bucket, a 256 MiB entry on a
#: slow link. The runner's deadline ends the caller's wait long before; this frees the thread a hung server holds.
REQUEST_TIMEOUT = datetime.timedelta(minutes=10)
_CONNECT_TIMEOUT = datetime.timedelta(seconds=30)

_used = threading.Event()  # set once a request started on obstore's runtime in this process (which starts it)
_lost = threading.Event()  # set in a forked child of such a process


@forks.register
def _after_fork_in_child() -> None:
    if _used.is_set():
        _lost.set()


def runtime_lost_in_this_process() -> bool:
    """True in a forked child of a process that made obstore requests, failed ones too (the runtime's threads are
    gone: use fsspec)."""
    return _lost.is_set()


def obstore_config(scheme: str, storage_options: Mapping[str, Any],
                   environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The obstore store configuration that says what ``storage_options`` say for ``scheme``, or None.

    None where obstore is not installed, where an option has no obstore word, or where the
    environment holds configuration only botocore reads (an AWS profile or config file, or,
    for AWS itself, no region at all), so the fsspec client is used and behaves as it always has.
    """
    if environ is None:
        environ = os.environ
    if importlib.util.find_spec("obstore") is None:
        return None
    if scheme in ("s3", "s3a"):
        return _s3_config(storage_options, environ)
    return None  # gs://: object_store speaks GCS's XML API, which the emulator the tests run does not (.gcsjson)


def _s3_config(options: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any] | None:
    config: dict[str, Any] = {}
    for name, value in options.items():
        if name in CACHE_ONLY_OPTIONS:
            continue
        if name in _S3_OPTIONS and isinstance(value, str):
            config[_S3_OPTIONS[name]] = value
        elif name == "endpoint_url" and isinstance(value, str):
            config["endpoint"] = value
        elif name == "anon" and isinstance(value, bool):
            config["skip_signature"] = value
        elif name == "config_kwargs" and isinstance(value, Mapping):
            if not _BOTOCORE_CONFIG_IGNORED.issuperset(value):
                return None
        elif name == "client_kwargs" and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                if inner == "endpoint_url" and isinstance(inner_value, str):
                    config["endpoint"] = inner_value
                elif inner in _S3_CLIENT_KWARGS and isinstance(inner_value, str):
                    config[_S3_CLIENT_KWARGS[inner]] = inner_value
                else:
                    return None
        else:
            return None
    explicit_keys = "access_key_id" in config or config.get("skip_signature") or "AWS_ACCESS_KEY_ID" in environ
    if not explicit_keys and (environ.get("AWS_PROFILE") or any(
            os.path.exists(os.path.expanduser(environ.get(var) or default)) for var, default in _AWS_FILES)):
        return None
    if "region" not in config and not (environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")):
        if "endpoint" not in config:
            return None  # AWS itself: botocore finds the bucket's region, object_store would not
        config["region"] = "us-east-1"  # an S3-compatible endpoint signs with any region
    if config.get("endpoint", "").startswith("http://"):
        config["client_options"] = {"allow_http": True}
    return config


@dataclasses.dataclass(frozen=True)
class BucketFactory(DeferredFilesystemFactory):
    """A bucket's blocking client (:class:`BucketCalls`), built on first use and run on the runner's threads.
    Immutable; ``config`` is what :meth:`config_for` made of the storage options."""

    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def config_for(cls, scheme: str, storage_options: Mapping[str, Any]) -> dict[str, Any] | None:
        """The client's configuration for ``storage_options``, or None where this client cannot serve them."""
        raise NotImplementedError

    @classmethod
    def serving(cls, deferred: DeferredFilesystemFactory) -> BucketFactory | None:
        """The factory for ``deferred``'s bucket where this client can serve it (:meth:`config_for`), else None."""
        config = cls.config_for(deferred.scheme, deferred.storage_options)
        if config is None:
            return None
        return cls(deferred.scheme, deferred.url, deferred.root, deferred.storage_options, config)

    @property
    def is_async(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class ObjectStoreFactory(BucketFactory):
    """An S3 bucket's client: obstore's (:class:`ObjectStoreCalls`), or in a forked child of a process that ran
    obstore requests the fsspec filesystem, driven the same way. Immutable."""

    @classmethod
    def config_for(cls, scheme: str, storage_options: Mapping[str, Any]) -> dict[str, Any] | None:
        return obstore_config(scheme, storage_options)

    def build(self, fresh: bool = False) -> Any:
        if runtime_lost_in_this_process():
            logger.info("s3://%s: obstore's threads did not survive the fork; this child uses s3fs", self.root)
            return super().build(fresh)
        return ObjectStoreCalls(self.root.split("/", 1)[0], self.config, self.storage_options)


class BucketCalls(abc.ABC):
    """One bucket under the blocking fsspec method names the remote tier's requests call (through
    :class:`~.runner.BlockingCalls`): obstore's S3 here, GCS's JSON API in :mod:`.gcsjson`.

    Paths are fsspec's (``bucket/key``); a path in another bucket is a ``ValueError``. Errors are
    raised as fsspec's clients raise them: ``FileNotFoundError`` for an absent object or bucket,
    ``FileExistsError`` for a refused create, ``PermissionError`` for refused credentials, else ``OSError``.
    """

    root_marker = ""

    def __init__(self, bucket: str, storage_options: Mapping[str, Any]) -> None:
        self._bucket = bucket
        self.storage_options = dict(storage_options)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path.partition("://")[2] if "://" in path else path

    def _key(self, path: str) -> str:
        bucket, _, key = self._strip_protocol(path).partition("/")
        if bucket != self._bucket:
            raise ValueError(f"{path!r} is not in bucket {self._bucket!r}")
        return key

    def invalidate_cache(self, path: str | None = None) -> None:
        """Nothing to forget: no listing is kept."""

    def exists(self, path: str) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    @abc.abstractmethod
    def info(self, path: str) -> dict[str, Any]:
        """The object's ``name``, ``type``, ``size``, modification time and version; the bucket's (a directory)."""

    @abc.abstractmethod
    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or those of ``[start, end)`` (b"" past its end)."""

    @abc.abstractmethod
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **_: Any) -> None:
        """Write the object whole; ``mode="create"``: only where none is there (else ``FileExistsError``)."""

    @abc.abstractmethod
    def find(self, path: str, detail: bool = False) -> Any:
        """Every object under ``path``: sorted paths, or ``{path: info}`` with ``detail``."""

    @abc.abstractmethod
    def rm_file(self, path: str) -> None:
        """Remove one object."""

    @abc.abstractmethod
    def rm(self, paths: list[str] | str) -> None:
        """Remove each of ``paths`` (an absent one too)."""


class ObjectStoreCalls(BucketCalls):
    """One bucket's obstore store under the blocking fsspec method names the remote tier's requests call.

    Blocking on purpose: obstore's coroutines hand their results back to Python from its own
    threads, which aborts a process whose interpreter is exiting while a request is still
    retrying; its blocking calls release the interpreter and return on the caller's thread
    (a runner thread, :class:`~.runner.BlockingCalls`), so a request left behind at exit ends
    with its daemon thread.
    """

    protocol = ("s3", "s3a")

    def __init__(self, bucket: str, config: Mapping[str, Any], storage_options: Mapping[str, Any], *,
                 request_timeout: datetime.timedelta = REQUEST_TIMEOUT) -> None:
        import obstore
        import obstore.store

        self._obstore = obstore
        config = dict(config)
        # No request outlives these (a server that accepts and never answers would hold a runner thread):
        # far past any deadline of the runner's, which end the caller's wait first.
        client_options = {**config.pop("client_options", {}), "connect_timeout": _CONNECT_TIMEOUT,
                          "timeout": request_timeout}
        # A request's deadline is the runner's; these keep obstore's own retries short within it.
        retry = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=30),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                             "max_backoff": datetime.timedelta(seconds=1), "base": 2.0}}  # fmt: skip
        self._store = obstore.store.S3Store(bucket, config=config, client_options=client_options, retry_config=retry)
        super().__init__(bucket, storage_options)

    def __repr__(self) -> str:
        return f"ObjectStoreCalls(s3://{self._bucket})"

    def info(self, path: str) -> dict[str, Any]:
        key = self._key(path)
        if not key:  # the bucket: one listing of a prefix nothing is stored under, which a missing bucket refuses
            with _request(path):
                next(iter(self._obstore.list(self._store, prefix="tiered-progcache-probe/", chunk_size=1)), None)
            return {"name": self._bucket, "type": "directory", "size": 0}
        with _request(path):
            meta = self._obstore.head(self._store, key)
        return _info_of(self._bucket, meta)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        key = self._key(path)
        with _request(path):
            if start is None and end is None:
                data = self._obstore.get(self._store, key).bytes()
            else:
                try:
                    data = self._obstore.get_range(self._store, key, start=start or 0, end=end)
                except self._obstore.exceptions.GenericError as exc:
                    if not _empty_range(exc):
                        raise
                    data = b""  # S3's 416: the object is there (an absent one is a 404) and ends before ``start``
        return bytes(data)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **_: Any) -> None:
        key = self._key(path)
        with _request(path):
            self._obstore.put(self._store, key, value, mode="create" if mode == "create" else "overwrite")

    def find(self, path: str, detail: bool = False) -> Any:
        key = self._key(path).rstrip("/")
        with _request(path):
            metas = self._obstore.list(self._store, prefix=key + "/" if key else None).collect()
        found = {f"{self._bucket}/{meta['path']}": _info_of(self._bucket, meta) for meta in metas}
        return found if detail else sorted(found)

    def rm_file(self, path: str) -> None:
        key = self._key(path)
        with _request(path):
            self._obstore.delete(self._store, key)

    def rm(self, paths: list[str] | str) -> None:
        keys = [self._key(path) for path in ([paths] if isinstance(paths, str) else paths)]
        with _request(self._bucket):
            self._obstore.delete(self._store, keys)


def _info_of(bucket: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": f"{bucket}/{meta['path']}", "type": "file", "size": meta["size"],
            "LastModified": meta["last_modified"], "ETag": meta.get("e_tag")}  # fmt: skip


def _empty_range(exc: BaseException) -> bool:
    """True for object_store's refusal of a range that starts at the object's end (an empty object)."""
    return "416 Range Not Satisfiable" in _first_line(exc)


def _first_line(exc: BaseException) -> str:
    """obstore's message without the debug dump it appends (the request's URL: credentials go in headers, and a
    password in the endpoint's URL is masked by the caller)."""
    return str(exc).split("\n", 1)[0].strip()


#: How object_store's generic errors say what fsspec's clients raise as a builtin, read from its message (it
#: keeps no status on the exception): the first match wins.
_SAID = ((("status: 404", "404 Not Found"), FileNotFoundError),
         (("status: 401", "status: 403", "401 Unauthorized", "403 Forbidden"), PermissionError),
         (("ConnectionRefused",), ConnectionRefusedError))  # fmt: skip


@contextlib.contextmanager
def _request(path: str) -> Iterator[None]:
    """One request on obstore's runtime: marks the runtime started (a failed request starts it too), and raises
    obstore's exceptions as fsspec's clients raise them, in one line, a URL's password masked."""
    _used.set()
    from obstore import exceptions

    try:
        yield
    except exceptions.BaseError as exc:
        if isinstance(exc, exceptions.NotFoundError):
            mapped: type[OSError] = FileNotFoundError
        elif isinstance(exc, (exceptions.AlreadyExistsError, exceptions.PreconditionError)):
            mapped = FileExistsError
        elif isinstance(exc, (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError)):
            mapped = PermissionError
        else:
            text = str(exc)
            mapped = next((error for words, error in _SAID if any(word in text for word in words)), OSError)
        # Not chained: obstore's own message repeats the URL unmasked, and a printed traceback shows causes.
        raise mapped(mask_url(f"{path}: {type(exc).__name__}: {_first_line(exc)}")) from None
