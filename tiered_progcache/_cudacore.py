"""Every private name of cuda-core this package relies on, imported in one place.

cuda-core's public API has no accessor for these; each is pinned by
``tests/compiling/test_cudacore_coupling.py``, which fails naming the symbol when a cuda-core
release moves it. Nothing else in the package imports from ``cuda.core`` privately.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache
from cuda.core.utils._program_cache._abc import _as_key_bytes, _extract_bytes
from cuda.core.utils._program_cache._file_stream import _default_cache_dir, _stat_key
from cuda.core.utils._program_cache._keys import _KEY_SCHEMA_VERSION

__all__ = [
    "ERROR_MODULE",
    "PRIVATE_SYMBOLS",
    "as_key_bytes",
    "default_cache_dir",
    "extract_bytes",
    "file_cache_root",
    "key_schema_version",
    "memory_cache_bytes",
    "memory_cache_reader",
    "stat_identity",
]

#: (module, name) of each private cuda-core symbol used, for the coupling test.
PRIVATE_SYMBOLS = (
    ("cuda.core.utils._program_cache._abc", "_as_key_bytes"),
    ("cuda.core.utils._program_cache._abc", "_extract_bytes"),
    ("cuda.core.utils._program_cache._file_stream", "_default_cache_dir"),
    ("cuda.core.utils._program_cache._file_stream", "_stat_key"),
    ("cuda.core.utils._program_cache._keys", "_KEY_SCHEMA_VERSION"),
    ("cuda.core._utils.cuda_utils", "NVRTCError"),
)

#: Where cuda-core's compile errors live (``NVRTCError`` and its kin): the failure records of
#: :mod:`tiered_progcache.cluster.flightfailure` rebuild exception classes from this module only (and builtins).
ERROR_MODULE = "cuda.core._utils.cuda_utils"

#: Key normalisation exactly as cuda-core's tiers do it: ``str`` is UTF-8, ``bytes`` as is, else TypeError.
as_key_bytes = _as_key_bytes
#: Value normalisation as cuda-core's tiers do it: bytes-like or ``ObjectCode`` -> bytes, else TypeError.
extract_bytes = _extract_bytes


def default_cache_dir() -> Path:
    """cuda-core's default program-cache directory (``<user cache>/cuda-python/program-cache``)."""
    return Path(_default_cache_dir())


def file_cache_root(cache: FileStreamProgramCache) -> Path:
    """The directory a ``FileStreamProgramCache`` was opened on (cuda-core keeps it only privately)."""
    return Path(cache._root)


def memory_cache_bytes(cache: InMemoryProgramCache) -> int:
    """Payload bytes an ``InMemoryProgramCache`` holds (its private running total)."""
    return int(cache._total_bytes)


def memory_cache_reader(cache: InMemoryProgramCache) -> Callable[[bytes], bytes]:
    """``cache[key]`` for a ``bytes`` key: its lock, its entry, its LRU touch, without the key coercion a
    caller that already holds bytes pays for (about 10% of a memory hit). ``cache.__getitem__`` itself
    for a subclass, which may read differently. A miss is a plain ``KeyError``."""
    if type(cache).__getitem__ is not InMemoryProgramCache.__getitem__:
        return cache.__getitem__
    lock = cache._lock
    entries = cache._entries
    touch = entries.move_to_end

    def read(key: bytes) -> bytes:
        with lock:
            data = entries[key][0]
            touch(key)
        return data

    return read


def memory_cache_recent_keys(cache: InMemoryProgramCache, n: int) -> list[bytes]:
    """The ``n`` keys an ``InMemoryProgramCache`` used last, oldest of them first (its private LRU order)."""
    with cache._lock:
        recent = []
        for key in reversed(cache._entries):
            if len(recent) >= n:
                break
            recent.append(key)
    return recent[::-1]


def stat_identity(st: os.stat_result) -> tuple[int, int, int]:
    """cuda-core's guard against deleting a file a writer just replaced: ``(st_ino, st_size, st_mtime_ns)``."""
    return _stat_key(st)



def key_schema_version() -> int:
    """The schema version of cuda-core's ``make_program_cache_key`` (bumped when its keys change meaning)."""
    return int(_KEY_SCHEMA_VERSION)
