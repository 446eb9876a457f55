"""The Redis tier: a shared store of cache entries on a Redis server, in front of (or instead of) a bucket.

An in-cluster Redis answers in well under a millisecond where an object-store GET takes
10-50 ms, so it sits between the node's local directory and the bucket
(memory -> local -> Redis -> S3). It keeps the fsspec remote's promises, through the
same parts:

- each value is an envelope (:mod:`tiered_progcache.stores.envelope`: digest, optional HMAC,
  optional zstd), verified on every read; a lookup is one ``GETRANGE`` bounded by the
  byte cap (a longer value is refused, never pulled past it; an empty answer is a miss),
  and a second only for the rest of an envelope over 8 MiB;
- every request goes through one :class:`~tiered_progcache.stores.runner.RequestRunner`
  (a deadline on each, one circuit breaker over all; the client blocks, so its thread
  path), and the client's own socket timeouts are the same deadline;
- it *raises* on trouble (``KeyError`` on a miss, ``EntryRejected``, ``TimeoutError``,
  ``ConnectionError``, ``TierUnavailable``) and the chain (:mod:`tiered_progcache.chain.tier`)
  turns each into a counted miss or a dropped write.

Keys are ``<prefix>:entries:<name>`` and ``<prefix>:leases:<name>`` (Triton's files,
``namespace="triton"``: ``<prefix>:triton:<name>``). URLs:
``redis://[:password@]host:port/<db>[/<prefix>]``, ``rediss://...`` (TLS) and
``unix:///path/to/redis.sock?db=0``; ``?prefix=NAME`` works on each (default
``tiered-progcache``). An optional per-entry expiry (``expire_s``, the
``redis_expire_s`` setting) is set with each write (``SET ... PX``).

The client: :mod:`.resp`'s for ``redis://`` and ``unix://`` URLs (a fresh process imports it in a
millisecond, where redis-py's import takes 100-170 ms of a core), redis-py's for any other URL
(``rediss://``, query options) and for a client handed in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import math
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, NamedTuple, TypeVar

from ..errors import InterpreterExiting
from . import resp
from .envelope import HEADER_SIZE, InvalidEnvelope, first_read_bytes, joined_envelope, rest_to_read
from .sharedstore import FetchedEnvelopes, SharedEntryStore, checked_seconds
from .store import BatchWrite, LeaseStore, StoredEntry, check_entry_name, is_entry_name
from ..urls import DEFAULT_REDIS_PREFIX, REDIS_SCHEMES, check_redis_url, is_redis_url, split_redis_url

__all__ = ["DEFAULT_PREFIX", "REDIS_SCHEMES", "RedisLeases", "RedisProgramCache", "check_redis_url", "is_redis_url"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Key prefix when the URL gives none.
DEFAULT_PREFIX = DEFAULT_REDIS_PREFIX
#: Keys per SCAN step, per STRLEN pipeline and per DEL.
_BATCH = 1000
# A signed envelope carries an HMAC-SHA256 between header and body; the body is never
# larger than the payload (zstd output is kept only when smaller).
_MAC_SIZE = hashlib.sha256().digest_size


_NEEDS_REDIS_PY = ("a rediss:// URL, a Redis URL with query options, or a client handed in needs redis-py: "
                   "pip install 'tiered-progcache[redis]'")


def _redis_installed(client_url: str) -> None:
    """``ImportError`` naming the extra where redis-py serves ``client_url`` and is not installed; imports nothing
    (see :class:`_RedisClients`)."""
    if resp.resp_config(client_url) is None and importlib.util.find_spec("redis") is None:
        raise ImportError(_NEEDS_REDIS_PY)


def _redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ImportError(_NEEDS_REDIS_PY) from None
    return redis


def _one_round_trip_handshake(redis_version: str) -> dict[str, Any]:
    """Client options for a connection that costs one round trip: RESP2 (no ``HELLO``; ``AUTH`` only with a
    password) and no ``CLIENT SETINFO``. redis-py's defaults add two (``HELLO 3``, then the ``SETINFO``
    tail), and a fresh node's first hit waits for a connection.
    """
    major_minor = tuple(int(part) for part in re.findall(r"\d+", redis_version)[:2])
    if major_minor >= (7, 2):  # driver_info replaced lib_name and lib_version
        return {"protocol": 2, "driver_info": None}
    return {"protocol": 2, "lib_name": None, "lib_version": None}


class _ErrorKinds(NamedTuple):
    """The exception classes a client raises, by what the tier makes of them."""

    timeout: type[Exception]
    auth: type[Exception]
    connection: type[Exception]
    response: type[Exception]


_RESP_ERRORS = _ErrorKinds(resp.TimedOut, resp.AuthenticationFailed, resp.ConnectionFailed, resp.ResponseError)


def _errors_of(client: Any) -> _ErrorKinds:
    """What ``client`` raises: :mod:`.resp`'s kinds, else redis-py's (imported: the client is one of its)."""
    return _RESP_ERRORS if isinstance(client, resp.RespClient) else _redis_py_errors()


@functools.cache
def _redis_py_errors() -> _ErrorKinds:
    """redis-py's kinds, made once (every request of a tier on redis-py asks)."""
    errors = _redis().exceptions
    return _ErrorKinds(errors.TimeoutError, errors.AuthenticationError, errors.ConnectionError, errors.ResponseError)


@dataclasses.dataclass(frozen=True)
class _RedisClients:
    """The client for ``url``, built on first use on the probe's thread, beside the process's first compile:
    :mod:`.resp`'s where it serves the URL, else redis-py's (its import, 100-170 ms, runs there then).
    Immutable; a :class:`~tiered_progcache.stores.runner.ClientFactory`."""

    url: str
    timeout: float

    @property
    def is_async(self) -> bool:
        return False  # both block: their requests run on the runner's threads

    def build(self, fresh: bool = False) -> Any:
        config = resp.resp_config(self.url)
        if config is not None:
            return resp.RespClient(config, self.timeout)
        redis = _redis()
        return redis.Redis.from_url(self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                                    **_one_round_trip_handshake(redis.__version__))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisProgramCache(SharedEntryStore):
    """A shared cache tier on one Redis server (or a Redis-protocol service), written whole per entry.

    >>> redis_tier = RedisProgramCache.from_url("redis://cache:6379/0/ci-kernels", expire_s=7 * 86400)
    >>> cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(), redis_tier, s3])

    Threads: every method is safe from many threads (the client keeps a
    connection pool; the breaker locks). Processes and nodes: an entry is one ``SET``
    of a whole envelope, so a reader sees all of it or none; two writers of one key race
    harmlessly (same compile, last writer wins); everything read is verified.
    ``create_entry`` and the lease's ``create`` are ``SET NX`` (atomic).
    """

    _kind = "redis cache"

    def __init__(
        self,
        client: Any | None,
        *,
        url: str,
        prefix: str = DEFAULT_PREFIX,
        strict: bool = False,
        expire_s: float | None = None,
        **shared: Any,
    ) -> None:
        """See :meth:`from_url`; the shared store's options (``shared``) are :class:`~.sharedstore.SharedEntryStore`'s.

        ``client``: a redis-py client, or None with a ``factory`` in ``shared`` that builds one on first use
        (:class:`_RedisClients`: :mod:`.resp`'s, or redis-py's)."""
        self._prefix = prefix
        self.expire_s = checked_seconds("redis_expire_s", "expire_s", expire_s)
        self._px = None if self.expire_s is None else max(1, math.ceil(self.expire_s * 1000))
        super().__init__(client, url=url, **shared)
        # The largest value a reader pulls (a bigger one is refused, unread past it), and
        # how much a lookup's one GETRANGE asks for.
        self._max_value_bytes = HEADER_SIZE + _MAC_SIZE + self._max_entry_bytes
        self._first_read = first_read_bytes(self._max_entry_bytes)
        self._leases = None if self._read_only else RedisLeases(self, f"{prefix}:leases:")
        self._start_probe(strict)

    @classmethod
    def from_url(cls, url: str, *, timeout: float | None = None, **options: Any) -> RedisProgramCache:
        """Build the tier from a ``redis://``, ``rediss://`` or ``unix://`` URL.

        ``timeout`` (default: the ``remote_timeout`` setting's, 5 s) bounds every request, and
        is the client's socket and connect timeout too. A bad URL, timeout or expiry raises ``ValueError``/``TypeError``
        at once; a URL only redis-py serves (``rediss://``, query options) without redis-py installed raises
        ``ImportError`` naming the extra. An unreachable
        server raises only with ``strict=True``; otherwise a warning and an open breaker
        (the chain runs without this tier until a probe succeeds). ``options`` go to
        :class:`RedisProgramCache` (``prefix`` comes from the URL; ``strict``, ``expire_s``) and the shared store
        (``read_only``, ``signing_key``, ``compression``, ``breaker``, ``transfer_concurrency``,
        ``max_entry_bytes``, ``namespace``).
        """
        if not isinstance(url, str):
            raise TypeError(f"Redis URL must be a str, got {type(url).__name__}")
        client_url, prefix = split_redis_url(url)
        _redis_installed(client_url)
        limit = checked_seconds("remote_timeout", "timeout", timeout)
        return cls(None, url=url, prefix=prefix, timeout=limit, factory=_RedisClients(client_url, limit), **options)

    def __repr__(self) -> str:
        return (
            f"RedisProgramCache({self._location!r}, prefix={self._prefix!r}, read_only={self._read_only}, "
            f"signed={self._codec.signed}, compression={self._codec.compression!r}, expire_s={self.expire_s}, "
            f"breaker={self._breaker.state})"
        )

    # -- what the store is -----------------------------------------------------------

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def client(self) -> Any:
        """The client (:mod:`.resp`'s or redis-py's), built on first use (by the probe, on its thread); raises as
        the runner's ``fs``."""
        return self._runner.fs

    @property
    def _errors(self) -> _ErrorKinds:
        """What the client raises (asked once it is built: every request builds it first)."""
        return _errors_of(self._runner.built)

    @property
    def atomic_create(self) -> bool:
        return True  # SET NX

    def key_for(self, name: str) -> str:
        """The Redis key of entry ``name`` (``ValueError`` unless an entry name)."""
        return f"{self._prefix}:{self._namespace}:{check_entry_name(name)}"

    def close(self) -> None:
        """Close the idle pooled connections and the runner's idle threads; a later call reconnects.

        A request in flight on another thread (a lease release finishing after its cache
        was closed) keeps its connection and completes: only idle connections are closed.
        """
        self._runner.close()
        client = self._runner.built
        if client is not None:  # never built: nothing to close, and nothing to import for it
            client.connection_pool.disconnect(inuse_connections=False)

    # -- by entry name ---------------------------------------------------------------

    def verify_entry(self, name: str) -> str | None:
        """``None`` if entry ``name`` verifies, else a one-line reason; an empty value or one over the cap is named as such.

        (A lookup reads both as what they are to it, a miss and a rejected entry, in one command.)
        """
        key = self.key_for(name)
        try:
            value = self._call("verify", self._inspect_value, key)
            if value is None:
                return "missing"
            self._codec.open(name, value)
        except InvalidEnvelope as exc:
            return exc.reason
        return None

    def write_entry(self, name: str, payload: bytes) -> None:
        """Seal ``payload`` and ``SET`` it under ``name`` (with the expiry, if one is set)."""
        self._require_writable("write")
        key = self.key_for(name)
        blob = self._codec.seal(name, bytes(payload))
        self._call("write", self._set, key, blob, False)

    def create_entry(self, name: str, payload: bytes) -> bool:
        """``SET NX``: store ``payload`` only if ``name`` is absent; False if it was there."""
        self._require_writable("create")
        key = self.key_for(name)
        blob = self._codec.seal(name, bytes(payload))
        return bool(self._call("create", self._set, key, blob, True))

    def delete_entry(self, name: str) -> None:
        """Remove entry ``name``; ``KeyError`` if it is not there."""
        self._require_writable("delete")
        key = self.key_for(name)
        if not self._call("delete", self.client.delete, key):
            raise KeyError(name)

    def delete_entries(self, entries: Iterable[StoredEntry]) -> int:
        """Delete listed entries, 1000 keys per ``DEL``; the count removed."""
        self._require_writable("clear")
        keys = [self.key_for(entry.name) for entry in entries]
        removed = 0
        for start in range(0, len(keys), _BATCH):
            removed += int(self._call("delete", self.client.delete, *keys[start : start + _BATCH]))
        return removed

    def iter_entries(self) -> Iterator[StoredEntry]:
        """Every entry under the prefix: ``SCAN`` step by step, sizes by ``STRLEN`` in a pipeline per step.

        Redis keeps no modification time, so ``mtime`` is None (prune by age leaves
        Redis entries alone: give them an expiry, or a ``maxmemory-policy``).
        """
        match = f"{_glob_escape(self._prefix)}:{self._namespace}:*"
        skip = len(self._prefix) + len(f":{self._namespace}:")
        cursor = 0
        while True:
            cursor, keys, sizes = self._call("list", self._scan_step, cursor, match, timeout=self._list_timeout)
            for key, size in zip(keys, sizes):
                name = key[skip:].decode("ascii", "replace")
                if is_entry_name(name):  # an empty or odd value is listed too, so verify reports it
                    yield StoredEntry(name, int(size), None)
            if cursor == 0:
                return

    def write_many(self, items: Mapping[str, bytes]) -> BatchWrite:
        """Seal and ``SET`` many payloads in one pipeline: all written, or all failed with the pipeline's exception."""
        self._require_writable("write")
        if not items:
            return BatchWrite()
        pairs = [(self.key_for(name), self._codec.seal(name, bytes(payload))) for name, payload in items.items()]
        try:
            self._call("batched write", self._set_many, pairs, timeout=self._runner.batch_timeout(len(pairs)))
        except Exception as exc:
            return BatchWrite(errors=dict.fromkeys(items, exc))
        return BatchWrite(frozenset(items))

    def leases(self) -> RedisLeases | None:
        """Leases at ``<prefix>:leases:<name>`` (``SET NX PX``); None on a read-only tier."""
        return self._leases

    # -- internals: one request each, run through the runner --------------------------------

    def _fetch_envelope(self, name: str) -> bytes | None:
        return self._call("read", self._read_value, self.key_for(name))

    def _fetch_envelopes(self, names: list[str]) -> FetchedEnvelopes:
        """One pipeline (a whole failed batch gives every name its exception)."""
        if not names:
            return FetchedEnvelopes()
        keys = {name: self.key_for(name) for name in names}
        try:
            return self._call("batched read", self._read_values, keys, timeout=self._runner.batch_timeout(len(keys)))
        except Exception as exc:
            return FetchedEnvelopes.filed({}, dict.fromkeys(names, exc))

    def _call(self, what: str, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """``fn(*args)`` through the runner, with the client's errors as the builtin ones the chain counts."""
        return self._runner.call(what, self._translated, None, fn, args, timeout=timeout)

    def _translated(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        errors = self._errors
        try:
            return fn(*args)
        except errors.timeout as exc:
            raise TimeoutError(f"no answer from {self._location} within {self.timeout:g} s ({exc})") from None
        except errors.auth as exc:  # a connection error too: caught first
            raise PermissionError(f"{self._location}: access denied, check the password ({exc})") from None
        except errors.connection as exc:
            raise ConnectionError(f"{self._location}: {exc}") from None

    def _read_value(self, key: str) -> bytes | None:
        """One ``GETRANGE`` bounded by the cap (a huge value is never pulled); a second only past the first read.

        An empty answer is a miss: ``GETRANGE`` cannot tell an empty value from an absent
        key, and neither is an envelope (``verify`` names an empty one, :meth:`_inspect_value`).
        """
        try:
            first = self.client.getrange(key, 0, self._first_read - 1)
        except self._errors.response as exc:
            first = exc
        return self._completed(key, first)

    def _read_values(self, keys: Mapping[str, str]) -> FetchedEnvelopes:
        """One pipeline of one ``GETRANGE`` per key (by entry name); the rest of an envelope larger than the first
        read one by one. A value refused is that name's error; any other failure fails the batch."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys.values():
            pipe.getrange(key, 0, self._first_read - 1)
        envelopes: dict[str, bytes | memoryview] = {}
        missing: set[str] = set()
        refused: dict[str, Exception] = {}
        for (name, key), first in zip(keys.items(), pipe.execute(raise_on_error=False)):
            try:
                envelope = self._completed(key, first)
            except InvalidEnvelope as exc:
                refused[name] = exc
                continue
            if envelope is None:
                missing.add(name)
            else:
                envelopes[name] = envelope
        return FetchedEnvelopes(envelopes, frozenset(missing), refused)

    def _completed(self, key: str, first: Any) -> bytes | None:
        """The value from its first ``GETRANGE`` answer: None if empty, else the envelope, its rest read with
        one more ``GETRANGE`` where the header says so; ``InvalidEnvelope`` if it is refused (an answer, to the breaker)."""
        first = self._string(first)
        if not first:
            return None
        rest = rest_to_read(first, self._first_read, self._max_entry_bytes)
        if rest is None:
            return bytes(first)
        start, end = rest
        try:
            more = self.client.getrange(key, start, end - 1)
        except self._errors.response as exc:
            more = exc
        return bytes(joined_envelope(first, self._string(more), end))

    def _string(self, answer: Any) -> bytes:
        """A string command's answer, where the client hands errors back as values (a pipeline with
        ``raise_on_error=False``): ``InvalidEnvelope`` for a key of another type, the error itself raised for any other."""
        if isinstance(answer, self._errors.response) and "WRONGTYPE" in str(answer):
            raise InvalidEnvelope("not a string value (planted by something else)")
        if isinstance(answer, Exception):
            raise answer
        return bytes(answer)

    def _inspect_value(self, key: str) -> bytes | None:
        """For ``verify``, not lookups: ``EXISTS``, ``STRLEN`` and a bounded ``GETRANGE`` in one round trip, so an
        empty value is told from an absent key and a value over the cap is named by its length, unread
        (``InvalidEnvelope``)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(key)
        pipe.strlen(key)
        pipe.getrange(key, 0, self._max_value_bytes)
        exists, length, value = pipe.execute(raise_on_error=False)
        value = self._string(value)  # a key of another type: refused
        for answer in (exists, length):
            if isinstance(answer, Exception):
                raise answer
        if not exists:
            return None
        if length > self._max_value_bytes:
            raise InvalidEnvelope(f"{length} bytes stored, more than the {self._max_value_bytes}-byte cap; not read")
        return value

    def _set(self, key: str, blob: bytes, only_if_absent: bool) -> bool:
        return bool(self.client.set(key, blob, px=self._px, nx=only_if_absent))

    def _set_many(self, pairs: list[tuple[str, bytes]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, blob in pairs:
            pipe.set(key, blob, px=self._px)
        pipe.execute()

    def _scan_step(self, cursor: int, match: str) -> tuple[int, list[bytes], list[int]]:
        cursor, keys = self.client.scan(cursor, match=match, count=_BATCH)
        if not keys:
            return int(cursor), [], []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        sizes = pipe.execute(raise_on_error=False)  # a failed STRLEN comes back as a value: listed with size 0
        return int(cursor), list(keys), [0 if isinstance(s, Exception) else int(s) for s in sizes]

    def _check_reachable(self, strict: bool) -> None:
        """``PING`` once, so a wrong host or password shows up now."""
        if self._known_down():
            return
        try:
            self._call("probe", self._ping_on_two_connections, timeout=self._runner.timeout)  # no sample: it connects
        except InterpreterExiting as exc:  # no thread for the client: the store is not judged, nor remembered down
            logger.info("redis cache %s: probe not made: %s", self._location, exc)
        except Exception as exc:
            message = f"redis cache {self._location} is unreachable: {type(exc).__name__}: {exc}"
            if strict:
                error = type(exc) if type(exc) in (PermissionError, TimeoutError, ConnectionError) else OSError
                raise error(message) from None
            logger.warning("%s; continuing without it, probing again in %.0f s", message, self._breaker.cooldown_s)
            self._breaker.trip(exc)

    def _ping_on_two_connections(self) -> None:
        """``PING`` on two connections at once, so the pool keeps both: a fresh node's first hit makes two
        requests side by side (its entry read ahead while the boot fetch lists), and a connection opened
        then would cost the hit a round trip. This thread's ``PING`` is the probe's answer."""
        spare = threading.Thread(target=self._spare_ping, name="tiered-progcache-redis-spare", daemon=True)
        spare.start()
        self.client.ping()
        spare.join(min(self.timeout, threading.TIMEOUT_MAX))

    def _spare_ping(self) -> None:
        with contextlib.suppress(Exception):  # the probe's own PING says whether the server answers
            self.client.ping()

    def _time_round_trip(self) -> None:
        self._call("round trip", self.client.ping)


class RedisLeases(LeaseStore):
    """Lease keys ``<prefix>:leases:<name>`` on a Redis tier: ``SET NX PX`` to take one, every request through its runner.

    Atomic across threads, processes and hosts; Redis expires a lease its holder
    abandoned (``PX`` = the lease's TTL), and the lease document's own expiry still
    decides for waiters (:mod:`tiered_progcache.cluster.lease`).
    """

    def __init__(self, store: RedisProgramCache, key_prefix: str) -> None:
        self._store = store
        self._key_prefix = key_prefix

    @property
    def location(self) -> str:
        return f"{self._store.location} ({self._key_prefix}*)"

    @property
    def atomic_create(self) -> bool:
        return True

    def create(self, name: str, document: bytes, ttl_s: float) -> bool:
        client = self._store.client
        return bool(self._store._call("lease create", client.set, self._key(name), document, None, _px(ttl_s), True))

    def read(self, name: str) -> bytes | None:
        value = self._store._call("lease read", self._store.client.get, self._key(name))
        return None if value is None else bytes(value)

    def replace(self, name: str, document: bytes, ttl_s: float) -> None:
        self._store._call("lease renew", self._store.client.set, self._key(name), document, None, _px(ttl_s))

    def delete(self, name: str) -> None:
        self._store._call("lease delete", self._store.client.delete, self._key(name))

    def _key(self, name: str) -> str:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"not a lease name: {name!r}")
        return self._key_prefix + name


def _px(ttl_s: float) -> int:
    """Milliseconds for ``PX``: at least 1, so a tiny TTL still expires rather than erroring."""
    if not ttl_s > 0 or not math.isfinite(ttl_s):
        raise ValueError(f"lease ttl_s must be a positive, finite number of seconds, got {ttl_s!r}")
    return max(1, math.ceil(ttl_s * 1000))
