"""CacheConfig: the settings of one cache, resolved from arguments, ``TIERED_PROGCACHE_*`` variables and defaults, and the chain they describe.

Precedence: a keyword argument (``from_env(remote=...)``, a CLI flag) beats the
environment, which beats the config file (:mod:`tiered_progcache.configfile`), which beats the default; an empty variable counts as unset; a value that
does not parse is a ``ValueError`` naming the variable, raised before anything is
built (:class:`~tiered_progcache.configvalues.ConfigValues` holds the values).
What the settings are is :data:`tiered_progcache.settings.SETTINGS`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .configvalues import ConfigValues, read_key_file
from .redact import masked
from .settings import ENV_PREFIX
from .chain.stats import CacheStats, TierStats
from .chain.tiered import TieredProgramCache, require_chain, shared_chain

__all__ = ["ENV_PREFIX", "CacheConfig", "ProcessSharedChain", "masked", "read_key_file"]


class CacheConfig(ConfigValues):
    """Every setting's value, checked, where each came from, and the cache they describe. Immutable, so safe to share.

    >>> config = CacheConfig.from_env(remote="s3://ci-kernels/cuda13")
    >>> config.remote, config.sources()["remote"], config.sources()["local_dir"]
    ('s3://ci-kernels/cuda13', 'argument', 'default')
    >>> cache = config.build()

    Each setting is an attribute (``config.max_local_bytes``). ``CacheConfig(**values)``
    checks keyword values like the cache's constructor (unknown name: ``TypeError``; bad
    value: ``TypeError``/``ValueError`` naming it); ``build()`` makes a new cache each
    call. ``local_dir=None`` means cuda-core's default directory; ``remote_timeout=None``
    the remote tier's default; ``max_*_bytes=None`` no limit.
    """

    __slots__ = ()

    def build(self) -> TieredProgramCache:
        """A new cache as configured. A signing key file is read now (and only its bytes are kept)."""
        return TieredProgramCache.from_config(self)

    def build_shared(self, *, namespace: str = "entries") -> TieredProgramCache | None:
        """A chain of the shared tiers alone (no memory, no local directory) on ``namespace``, or None if no remote is set.

        What :mod:`tiered_progcache.triton` stands behind Triton's own local directory
        (``namespace="triton"``).
        """
        specs = shared_chain(self, namespace=namespace)
        if not specs:
            return None
        return TieredProgramCache.from_config(self, tiers=specs)


class ProcessSharedChain:
    """The one chain of shared tiers an integration (Triton's cache manager, CuPy's backend) sends its entries
    to in this process, on the integration's namespace.

    Built on first need from ``TIERED_PROGCACHE_*``; a bad setting is logged on the integration's
    logger and the integration runs on its own directory alone (a cache never fails a compile).
    :meth:`use` sets it in code instead. Thread-safe.
    """

    def __init__(self, namespace: str, *, log: logging.Logger, label: str, alone: str) -> None:
        self.namespace = namespace
        self._log, self._label, self._alone = log, label, alone
        self._lock = threading.Lock()
        self._chain: TieredProgramCache | None = None
        self.built = False

    def get(self) -> TieredProgramCache | None:
        """The chain (built now if it is not yet), or None where no remote is set or the settings are bad."""
        if self.built:
            return self._chain
        with self._lock:
            if not self.built:
                try:
                    self._chain = CacheConfig.from_env().build_shared(namespace=self.namespace)
                except Exception as exc:
                    self._log.warning("%s: shared tiers not built, running on %s alone: %s", self._label, self._alone,
                                      exc)  # fmt: skip
                    self._chain = None
                self.built = True
        return self._chain

    def use(self, cache: Any) -> None:
        """Make ``cache`` (a ``TieredProgramCache`` of shared tiers, or None) the chain; the previous one is not closed."""
        require_chain(cache, none_ok=True)
        with self._lock:
            self._chain, self.built = cache, True

    def if_built(self) -> TieredProgramCache | None:
        """The chain if it is built, else None (what reads counters at exit uses: it builds nothing)."""
        return self._chain if self.built else None

    def forget(self) -> None:
        """Drop the chain (it is not closed); the next :meth:`get` builds one again."""
        with self._lock:
            self._chain, self.built = None, False

    def stats(self, local_name: str, local: TierStats) -> CacheStats:
        """The integration's own directory's counters as ``local_name``, then each shared tier's."""
        chain = self.get()
        return CacheStats(((local_name, local),) + (tuple(chain.stats().items()) if chain is not None else ()))
