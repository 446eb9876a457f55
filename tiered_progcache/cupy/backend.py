"""The kernel-cache backend CuPy calls: CuPy's own directory first, the shared tiers behind it.

CuPy calls ``load(name)`` before compiling and ``save(name, payload, source)`` after
(``cupy.cuda.compiler._compile_with_cache_cuda``); the payload is opaque (a cubin, or
with ``name_expressions`` the mangled names and the cubin, ``_cache_payload_magic``).

``load``: the local file first (CuPy's format, checked as CuPy checks it): a hit asks the
network nothing. A local miss asks the shared chain for ``cupy/<name>``; what it returns is
the envelope's verified (and, where a key is set, signature-checked) payload, whose frame
must name this entry; it is written into the local directory and returned. Anything the
chain or the local write raises is a logged miss: CuPy compiles.
``save``: the local file as CuPy writes it, then the upload queued (background, one worker
per tier; a full queue drops it, counted), with the seconds CuPy compiled for, so the
``min_upload_compile_s`` admission applies as for ``compile()``. A failing disk or tier never fails a compile.

Header keys: while :func:`compile_context` has set the compile's source and options (the
wrapper around ``_compile_with_cache_cuda`` does), an entry is kept under
:func:`~tiered_progcache.cupy.headerkeys.keyed_name`; a declined scan is neither loaded nor
saved (counted as ``skipped`` of ``cupy-local``). Threads: safe from many (each compile's
context is its own; files are staged and replaced; the chain is thread-safe).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from ..chain.stats import TierCounters
from ..stores.ratelimit import log_once
from ._cupyprivate import DiskKernelCacheBackend, KernelCacheBackend
from .cupydir import read_local, write_local
from .cupynames import cache_key, frame, is_name, opened
from .headerkeys import KeyedName, keyed_name

__all__ = ["TieredKernelCacheBackend", "compile_context"]

logger = logging.getLogger(__name__)


class _Compile:
    """The source and options of the compile in progress in this context, and the name its load used."""

    __slots__ = ("source", "options", "loaded_as", "missed_at", "uncached")

    def __init__(self, source: str, options: tuple[str, ...]) -> None:
        self.source = source
        self.options = options
        self.loaded_as: KeyedName | None = None
        self.missed_at: float | None = None  # perf_counter() when load missed: CuPy compiles from then to save
        self.uncached = False  # its load found it cannot be keyed: its save is skipped without a second word


_compiling: contextvars.ContextVar[_Compile | None] = contextvars.ContextVar("tiered_progcache_cupy", default=None)


def compile_context(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (CuPy's ``_compile_with_cache_cuda``) run with its ``source`` and ``options`` visible to the backend."""

    @functools.wraps(original)
    def with_context(source: Any, options: Any = (), *args: Any, **kwargs: Any) -> Any:
        given = _Compile(source, tuple(options)) if isinstance(source, str) else None
        token = _compiling.set(given)
        try:
            return original(source, options, *args, **kwargs)
        finally:
            _compiling.reset(token)

    return with_context


class TieredKernelCacheBackend(KernelCacheBackend):
    """CuPy's ``KernelCacheBackend`` on CuPy's directory and the shared tiers (see the module docstring).

    ``shared`` is called on first need for the chain (a ``TieredProgramCache`` or None);
    ``local`` counts what the directory did; ``cupy_dirs`` are the ``-I`` directories CuPy adds itself;
    ``save_source``: write ``<name>.cu`` beside (``CUPY_CACHE_SAVE_CUDA_SOURCE``); ``clock`` times CuPy's compiles.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        *,
        shared: Callable[[], Any],
        local: TierCounters,
        cupy_dirs: Collection[str],
        save_source: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self._shared = shared
        self._local = local
        self._cupy_dirs = tuple(cupy_dirs)
        self._save_source = save_source
        self._clock = clock
        self._seconds_lock = threading.Lock()
        self._cupy_s_own = DiskKernelCacheBackend(self.cache_dir)  # for names of a form we do not know
        self._warned_unknown = False
        #: Seconds CuPy spent between a missed load and its save (its compiles), for the ledger.
        self.compile_seconds = 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cache_dir!r})"

    def _name(self, name: str, *, saving: bool) -> KeyedName | None:
        """The name the entry is kept under; None for a kernel whose headers cannot be keyed."""
        given = _compiling.get()
        if given is None:
            return KeyedName(name)
        if given.uncached:
            return None
        try:
            keyed = keyed_name(name, given.source, given.options, self._cupy_dirs)
        except Exception as exc:  # an unreadable include directory: not keyed, so not cached
            logger.warning("CuPy cache: headers of %s not scanned (compiled, not cached): %s", name, exc)
            self._local.add("skipped")
            given.uncached = True
            return None
        if keyed.declined is not None:
            log_once(logger, f"declined:{name}", logging.WARNING,
                     "CuPy cache: %s compiled, not cached: %s", name, keyed.declined)  # fmt: skip
            self._local.add("skipped")
            given.uncached = True
            return None
        if saving:
            if given.loaded_as is not None and given.loaded_as != keyed:
                logger.warning("CuPy cache: a header of %s changed while it compiled; not cached", name)
                self._local.add("skipped")
                return None
        else:
            given.loaded_as = keyed
        return keyed

    def _unknown(self, name: object) -> bool:
        """True (logged once) for a name not of CuPy's known form: CuPy's own backend serves it, locally only."""
        if is_name(name):
            return False
        if not self._warned_unknown:
            self._warned_unknown = True
            logger.warning("CuPy cache: %r is not a name of the form checked (<sha1>.cubin): such entries stay in "
                           "CuPy's own directory cache, unshared", name)  # fmt: skip
        return True

    def load(self, name: str) -> bytes | None:
        """CuPy's payload for ``name``: the local file's, else the shared tiers' (then written locally); None on a miss."""
        if self._unknown(name):
            return self._cupy_s_own.load(name)
        keyed = self._name(name, saving=False)
        if keyed is None:
            return None
        try:
            payload = read_local(self.cache_dir, keyed)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("CuPy cache: local %s unreadable (a miss): %s", keyed, exc)
            payload = None
        if payload is not None:
            self._local.count_hit(len(payload))
            return payload
        self._local.count_miss()
        try:
            chain = self._shared()
            stored = None if chain is None else chain.get(cache_key(keyed))
            if stored is None:
                self._compiling_from(self._clock())
                return None
            payload = opened(bytes(stored), keyed)
        except Exception as exc:  # a refused entry, a failing tier: a miss, never a failed compile
            logger.warning("CuPy cache: %s not fetched (a miss): %s", keyed, exc)
            self._compiling_from(self._clock())
            return None
        try:
            write_local(self.cache_dir, keyed, payload)
        except OSError as exc:  # served anyway: the payload is verified
            logger.warning("CuPy cache: %s fetched but not written locally: %s", keyed, exc)
        return payload

    @staticmethod
    def _compiling_from(now: float) -> None:
        given = _compiling.get()
        if given is not None:
            given.missed_at = now

    def save(self, name: str, cubin: bytes, source: str) -> None:
        """Write CuPy's file for ``name`` and queue its upload. Never raises."""
        if self._unknown(name):
            return self._cupy_s_own.save(name, cubin, source)
        keyed = self._name(name, saving=True)
        if keyed is None:
            return
        given = _compiling.get()
        took = None if given is None or given.missed_at is None else max(0.0, self._clock() - given.missed_at)
        if took is not None:
            with self._seconds_lock:
                self.compile_seconds += took
        payload = bytes(cubin)
        try:
            write_local(self.cache_dir, keyed, payload, source if self._save_source else None)
            self._local.count_write(len(payload))
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("CuPy cache: %s not written locally: %s", keyed, exc)
        try:
            chain = self._shared()
            if chain is not None:
                chain.put(cache_key(keyed), frame(keyed, payload), compile_seconds=took)  # admission as compile()'s
        except Exception as exc:  # a name no entry can have, a closed chain: the file stays local
            logger.warning("CuPy cache: %s not uploaded: %s", keyed, exc)
