"""What every shared tier has in common: its state, its verified reads and the declared capabilities.

The fsspec remote and the Redis tier differ in how they move bytes. They share how they
are configured (read-only, signing key, compression, the request deadline, the breaker,
the byte cap, the transfer batch, the namespace), the one request door, how fetched
envelopes are verified, how a read-only tier refuses, and how a URL is shown without
its password. Both subclass :class:`SharedEntryStore`, whose ``__init__`` holds all of that.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .. import settings
from .breaker import CircuitBreaker
from .envelope import MAX_ENTRY_BYTES, EnvelopeCodec, InvalidEnvelope
from ..redact import mask_url
from .runner import ClientFactory, RequestRunner
from .store import BatchRead, EntryStore, check_namespace

logger = logging.getLogger(__name__)

__all__ = ["MIN_LIST_TIMEOUT_S", "FetchedEnvelopes", "SharedEntryStore", "checked_seconds", "without_password"]

#: Threads a blocking filesystem's requests run on (file://, NFS, memory://): a remote that hangs holds at most these.
DEFAULT_REQUEST_THREADS = 8
#: A listing reads the whole prefix (or keyspace) page by page, so it gets at least this long.
MIN_LIST_TIMEOUT_S = 120.0

#: ``url`` with its passwords and secret query parameters masked (:func:`tiered_progcache.redact.mask_url`).
without_password = mask_url


def checked_seconds(setting: str, what: str, value: Any) -> float | None:
    """``value`` checked as the settings row ``setting`` checks it (errors name ``what``); None gives the row's default."""
    row = settings.by_name()[setting]
    try:
        checked = row.parse(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what} {exc}") from None
    return row.default if checked is None else checked


@dataclasses.dataclass(frozen=True)
class FetchedEnvelopes:
    """What one batch of envelope fetches got, per name: the raw envelope (not yet verified), absent, or why it failed.

    Every name asked for is in exactly one of ``envelopes``, ``missing`` and ``errors``;
    :meth:`SharedEntryStore.read_many` opens the envelopes into a :class:`~.store.BatchRead`.
    """

    envelopes: dict[str, bytes | memoryview] = dataclasses.field(default_factory=dict)
    missing: frozenset[str] = frozenset()
    errors: dict[str, Exception] = dataclasses.field(default_factory=dict)

    @classmethod
    def filed(cls, envelopes: Mapping[str, bytes | memoryview], failures: Mapping[str, Exception]) -> FetchedEnvelopes:
        """From the envelopes fetched and what each failed fetch raised: ``FileNotFoundError`` (fsspec's answer for
        an absent object) and a plain ``KeyError`` file the name as ``missing``, anything else in ``errors``."""
        missing = frozenset(
            name for name, exc in failures.items() if isinstance(exc, FileNotFoundError) or type(exc) is KeyError
        )
        return cls(dict(envelopes), missing, {name: exc for name, exc in failures.items() if name not in missing})


class SharedEntryStore(EntryStore):
    """A shared tier: an :class:`EntryStore` other nodes read and write too (the chain reads it by key through ``read_key``).

    ``__init__`` checks and keeps what every shared store is configured with, and builds
    its one :class:`~tiered_progcache.stores.runner.RequestRunner` over ``connection`` (an
    fsspec filesystem, a Redis client) or ``factory``. Subclasses name themselves in
    ``_kind`` for messages, fetch envelopes (:meth:`_fetch_envelope`,
    :meth:`_fetch_envelopes`) and implement the other ``EntryStore`` methods that move
    bytes, each request through :attr:`runner`. Thread safety is theirs.
    """

    _kind = "shared cache"

    def __init__(
        self,
        connection: Any | None,
        *,
        url: str,
        read_only: bool = False,
        signing_key: bytes | str | None = None,
        compression: str | None = None,
        timeout: float | None = None,
        breaker: CircuitBreaker | None = None,
        transfer_concurrency: int | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        namespace: str = "entries",
        factory: ClientFactory | None = None,
    ) -> None:
        """``timeout``: seconds per request, None for the ``remote_timeout`` setting's default; listings get
        at least ``MIN_LIST_TIMEOUT_S``. ``transfer_concurrency``: requests (Redis: entries per pipeline) in
        flight at once during a bulk transfer, None for the setting's default. ``breaker``: shared with
        other stores, or one of its own."""
        self._location = without_password(url)
        self._read_only = bool(read_only)
        self.timeout: float = checked_seconds("remote_timeout", "timeout", timeout)  # type: ignore[assignment]
        if transfer_concurrency is None:
            transfer_concurrency = settings.by_name()["transfer_concurrency"].default
        if isinstance(transfer_concurrency, bool) or not isinstance(transfer_concurrency, int) or transfer_concurrency < 1:
            raise ValueError(f"transfer_concurrency must be a positive int, got {transfer_concurrency!r}")
        self.transfer_concurrency = transfer_concurrency
        self._namespace = check_namespace(namespace)
        self._codec = EnvelopeCodec(signing_key, compression, max_entry_bytes=max_entry_bytes)
        self._max_entry_bytes = max_entry_bytes
        self._breaker = breaker if breaker is not None else CircuitBreaker(name=f"{self._kind} {self._location}")
        self._runner = RequestRunner(
            connection, timeout=self.timeout, breaker=self._breaker, name=self._location, factory=factory,
            max_threads=self._request_threads(factory),
        )

    def _request_threads(self, factory: ClientFactory | None) -> int:
        """How many of the runner's threads may run blocking requests at once (a blocking filesystem's)."""
        return DEFAULT_REQUEST_THREADS

    def _start_probe(self, strict: bool) -> None:
        """Probe the store (:meth:`_check_reachable`): now with ``strict`` (a bad config raises here), else on a
        thread of its own, which the store's requests wait for, so a process's first compile runs beside it."""
        if strict:
            self._check_reachable(True)
        else:
            self._runner.start_probe(functools.partial(self._check_reachable, False), self._time_round_trip)

    @abc.abstractmethod
    def _check_reachable(self, strict: bool) -> None:
        """One request that shows whether the store answers: raise what failed with ``strict``, else log it
        and trip the breaker. Not a round-trip sample (it opens the connection): pass the deadline explicitly."""

    @abc.abstractmethod
    def _time_round_trip(self) -> None:
        """The probe's request once more, on the connection it opened: the store's first round-trip sample where
        no request waited for the probe (one that did is the sample instead). Raises what the request raised (the breaker's refusal where the probe found the store down)."""

    def when_ready(self, then: Callable[[], None]) -> None:
        self._runner.when_probed(then)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._runner.wait_probed(timeout)

    def beside_probe(self) -> contextlib.AbstractContextManager[None]:
        return self._runner.beside_probe()

    def _known_down(self) -> bool:
        """True, with one WARNING line, when the breaker came in open (another process of this node found the
        store down): the probe is not made, and the line says what that process saw."""
        if self._breaker.state != "open" or self._breaker.tripped_by is None:
            return False
        logger.warning("%s is unreachable: %s; continuing without it, probing again in %.0f s",
                       self._breaker.name, self._breaker.tripped_by, self._breaker.cooldown_s)  # fmt: skip
        return True

    # -- what the store is -----------------------------------------------------------

    @property
    def namespace(self) -> str:
        """``entries`` or ``triton``: the folder (or key space) this store's entries live in."""
        return self._namespace

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
        """False while the breaker is open (the store failed repeatedly and is cooling down)."""
        return self._breaker.state != "open"

    @property
    def round_trip_s(self) -> float | None:
        """The median of this store's recent single requests (its runner times each), in seconds."""
        return self._runner.latency.median()

    def seed_round_trip(self, seconds: float) -> None:
        """One sample beside the live ones, so ``R`` is known and steady before the first kernel."""
        self._runner.latency.record(seconds)

    @property
    def startup_failure(self) -> BaseException | None:
        """The probe failure that opened the breaker at construction (see ``EntryStore.startup_failure``)."""
        return self._breaker.tripped_by

    @property
    def request_timeout_s(self) -> float:
        """The ``remote_timeout`` this store runs each request under."""
        return self.timeout

    @property
    def max_entry_bytes(self) -> int:
        return self._max_entry_bytes

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    @property
    def runner(self) -> RequestRunner:
        """The one door every request to this store goes through (deadline and breaker)."""
        return self._runner

    @property
    def transfer_batch(self) -> int:
        """Entries per bulk request batch (per pipeline on Redis): ``transfer_concurrency``."""
        return self.transfer_concurrency

    # -- reads ------------------------------------------------------------------------

    def read_entry(self, name: str) -> bytes:
        """The verified payload of entry ``name``: ``KeyError`` if absent, ``EntryRejected`` if bad."""
        envelope = self._fetch_envelope(name)
        if envelope is None:
            raise KeyError(name)
        return self._codec.open(name, envelope)

    def read_many(self, names: list[str]) -> BatchRead:
        """Verified payloads of ``names``, fetched in one batch under one deadline (absent ones in ``missing``,
        ``EntryRejected``/... per failed one in ``errors``)."""
        fetched = self._fetch_envelopes(list(names))
        envelopes = fetched.envelopes
        opened = BatchRead.reading(envelopes, lambda name: self._codec.open(name, envelopes[name]))
        return BatchRead(opened.hits, fetched.missing | opened.missing, {**fetched.errors, **opened.errors})

    def verify_entry(self, name: str) -> str | None:
        """``None`` if entry ``name`` verifies, else a one-line reason (``"missing"`` if absent)."""
        try:
            self.read_entry(name)
        except InvalidEnvelope as exc:
            return exc.reason
        except KeyError:
            return "missing"
        return None

    def seal_record(self, name: str, payload: bytes) -> bytes:
        """``payload`` in this store's envelope (its signing key and compression) for ``name``."""
        return self._codec.seal(name, payload)

    def open_record(self, name: str, blob: bytes) -> bytes:
        """The payload of a record sealed for ``name``; :class:`InvalidEnvelope` if forged, altered or unsigned."""
        return self._codec.open(name, blob)

    # -- what subclasses fetch -------------------------------------------------------

    @abc.abstractmethod
    def _fetch_envelope(self, name: str) -> bytes | memoryview | None:
        """Entry ``name``'s raw envelope in one request, None if absent; raises what failed, or
        ``EntryRejected`` for an object refused while read."""

    @abc.abstractmethod
    def _fetch_envelopes(self, names: list[str]) -> FetchedEnvelopes:
        """Raw envelopes of ``names`` in one batch under one deadline, filed by name; never raises an
        ``Exception`` for one entry's failure."""

    @property
    def _list_timeout(self) -> float:
        return max(self.timeout, MIN_LIST_TIMEOUT_S)

    def _require_writable(self, what: str) -> None:
        if self._read_only:
            raise PermissionError(f"{self._kind} {self._location} is read-only; refusing to {what}")
