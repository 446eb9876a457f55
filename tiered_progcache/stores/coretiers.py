"""cuda-core's keyed tiers seen as entry stores: the memory tier, and any ``ProgramCacheResource`` given bare.

The chain runs over :class:`~tiered_progcache.stores.store.EntryStore` alone. cuda-core's
file tier already is one (:class:`~tiered_progcache.stores.localdir.LocalDir` reads its
directory); the memory tier and a user's own resource are addressed by cache key only,
so their stores here answer the keyed half of the interface (``read_key``, ``write_key``,
``delete_key``, ``count``, ``measure``, ``clear``, ``close``) and declare ``by_name``
False: nothing lists, warms or prunes them by name.
"""

from __future__ import annotations

from collections.abc import Iterator

from cuda.core.utils import InMemoryProgramCache, ProgramCacheResource

from .. import _cudacore
from .envelope import MAX_ENTRY_BYTES
from .store import EntryStore, StoredEntry

__all__ = ["MemoryStore", "ResourceStore"]


class ResourceStore(EntryStore):
    """A ``ProgramCacheResource`` read and written by cache key. Thread-safe as far as the resource is.

    >>> store = ResourceStore(my_resource)      # what ``tiers=[my_resource]`` runs the chain over

    The by-name operations raise ``TypeError``: a key-addressed resource cannot be
    listed, and a name cannot be turned back into its key.
    """

    def __init__(self, resource: ProgramCacheResource) -> None:
        if not isinstance(resource, ProgramCacheResource):
            raise TypeError(f"ResourceStore wraps a cuda.core ProgramCacheResource, got {type(resource).__name__}")
        self.resource = resource
        self.read_key = resource.__getitem__  # type: ignore[method-assign]  # bound once: the chain's hot read

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.resource!r})"

    @property
    def location(self) -> str:
        return f"{type(self.resource).__name__}, this process"

    @property
    def read_only(self) -> bool:
        return False

    @property
    def shared(self) -> bool:
        return False

    @property
    def by_name(self) -> bool:
        return False

    @property
    def max_entry_bytes(self) -> int:
        return MAX_ENTRY_BYTES

    def write_key(self, key: bytes, payload: bytes) -> None:
        self.resource[key] = payload

    def create_key(self, key: bytes, payload: bytes) -> bool:
        raise TypeError(f"{self.location} has no conditional create")

    def delete_key(self, key: bytes) -> None:
        del self.resource[key]

    def count(self) -> int:
        return len(self.resource)

    def measure(self) -> tuple[int, int | None]:
        return len(self.resource), None

    def clear(self) -> None:
        self.resource.clear()

    def close(self) -> None:
        self.resource.close()

    def _by_name(self, what: str) -> TypeError:
        return TypeError(f"{self.location} is addressed by cache key only; it cannot {what} by entry name")

    def read_entry(self, name: str) -> bytes:
        raise self._by_name("read")

    def write_entry(self, name: str, payload: bytes) -> None:
        raise self._by_name("write")

    def create_entry(self, name: str, payload: bytes) -> bool:
        raise self._by_name("create")

    def delete_entry(self, name: str) -> None:
        raise self._by_name("delete")

    def iter_entries(self) -> Iterator[StoredEntry]:
        raise self._by_name("list")


class MemoryStore(ResourceStore):
    """cuda-core's ``InMemoryProgramCache``: read through :func:`~tiered_progcache._cudacore.memory_cache_reader`
    (its lock and LRU touch, without re-coercing a key that is bytes already), measured by its byte total."""

    def __init__(self, cache: InMemoryProgramCache) -> None:
        if not isinstance(cache, InMemoryProgramCache):
            raise TypeError(f"MemoryStore wraps a cuda.core InMemoryProgramCache, got {type(cache).__name__}")
        super().__init__(cache)
        self.cache = cache
        self.read_key = _cudacore.memory_cache_reader(cache)  # type: ignore[method-assign]

    def measure(self) -> tuple[int, int | None]:
        return len(self.cache), _cudacore.memory_cache_bytes(self.cache)

    def recent_keys(self, n: int) -> list[bytes]:
        """The ``n`` keys used last, oldest of them first (the chain refreshes their local files' atime)."""
        return _cudacore.memory_cache_recent_keys(self.cache, n)
