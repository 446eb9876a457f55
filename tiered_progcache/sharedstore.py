"""What every shared tier has in common: the mapping API over entry names and the declared capabilities.

The fsspec remote and the Redis tier differ in how they move bytes. They share how a
cache key becomes an entry name, what ``cache[key]`` means, the capabilities they
declare, how a read-only tier refuses, and how a URL is shown without its password.
Both subclass :class:`SharedEntryStore`.
"""

from __future__ import annotations

from cuda.core import ObjectCode
from cuda.core.utils import ProgramCacheResource

from . import _cudacore
from .breaker import CircuitBreaker
from .envelope import EnvelopeCodec, InvalidEnvelope
from .redact import mask_url
from .runner import RequestRunner
from .store import EntryStore, entry_name

__all__ = ["SharedEntryStore", "without_password"]


#: ``url`` with its passwords and secret query parameters masked (:func:`tiered_progcache.redact.mask_url`).
without_password = mask_url


class SharedEntryStore(ProgramCacheResource, EntryStore):
    """A shared tier: a ``ProgramCacheResource`` by key and an :class:`EntryStore` by name.

    Subclasses set ``_location`` (no password), ``_read_only``, ``_breaker``, ``_runner``
    and ``_max_entry_bytes`` in ``__init__``, name themselves in ``_kind`` for messages,
    and implement the ``EntryStore`` methods that move bytes. Thread safety is theirs.
    """

    _kind = "shared cache"
    _location: str
    _read_only: bool
    _breaker: CircuitBreaker
    _runner: RequestRunner
    _max_entry_bytes: int
    _codec: EnvelopeCodec

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
        """False while the breaker is open (the store failed repeatedly and is cooling down)."""
        return self._breaker.state != "open"

    @property
    def round_trip_s(self) -> float | None:
        """The median of this store's recent single requests (its runner times each), in seconds."""
        return self._runner.latency.median()

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
        self.write_entry(name, _cudacore.extract_bytes(value))

    def __delitem__(self, key: bytes | str) -> None:
        name = entry_name(_cudacore.as_key_bytes(key))
        try:
            self.delete_entry(name)
        except KeyError:
            raise KeyError(key) from None

    def __len__(self) -> int:
        """Entries in the store: one whole listing (the chain never asks a shared tier)."""
        return sum(1 for _ in self.iter_entries())

    def clear(self) -> None:
        """Delete every entry. Only ever called on purpose (the CLI's ``clear --remote --yes``)."""
        self.delete_entries(list(self.iter_entries()))

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

    def _require_writable(self, what: str) -> None:
        if self._read_only:
            raise PermissionError(f"{self._kind} {self._location} is read-only; refusing to {what}")
